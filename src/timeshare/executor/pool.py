"""The controller's pool of worker processes (``ProcessPool``, runs in the controller, the
caller's process): model registration on every worker, task dispatch with deadlines, the
profiles any worker measured, and training segments on the jobs' homes: each started,
followed until it stops, its state read or dropped there, and stopped when the
dispatcher decides (NOTE [Switch protocol], :mod:`timeshare.executor.segments`). Which
thread may talk to which worker: NOTE [One owner per pipe]. Starting the workers and
replacing the ones that fail is :mod:`timeshare.executor.workers`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from timeshare import protocol as P
from timeshare.decode.lora import SlotWrite
from timeshare.decode.step import LoadFollows, MasksFollow, Step
from timeshare.device import BackendFlags, leaves_a_core
from timeshare.errors import TimeshareError, WorkerError, WorkerTimeoutError
from timeshare.executor.deadline import Deadlines
from timeshare.executor.handle import SPIN_S, Inputs, WorkerHandle
from timeshare.executor.interface import PoolHealth, Ran, WorkerFailure, WorkerRow
from timeshare.executor.segments import HomeBusy, Segment, Segments
from timeshare.executor.workers import FAILURE_KINDS, WorkerSet
from timeshare.memory.ephemeral import LaneBound
from timeshare.options import RuntimeOptions
from timeshare.transfer.disk import FillSpec
from timeshare.tree import shape_key
from timeshare.units import parse_bytes

if TYPE_CHECKING:
    from timeshare.transfer.profiler import ModelProfile
    from timeshare.worker.trainer import TrainSpec

__all__ = ["FAILURE_KINDS", "ProcessPool"]

log = logging.getLogger(__name__)


class ProcessPool:
    """Worker processes: one active, the others standbys (NOTE [Switch protocol])."""

    def __init__(self, opts: RuntimeOptions, *, device: str, share_arena: Callable[[], object], arena_capacity: int):
        """``opts.workers`` workers on ``device``, over the arena that ``share_arena`` shares."""
        task_timeout_s = opts.task_deadline_s
        self.task_timeout_s = task_timeout_s
        self.startup_timeout_s = startup_timeout_s = opts.startup_timeout_s
        self.deadlines = Deadlines(task_timeout_s, factor=opts.task_deadline_factor, min_s=opts.task_deadline_min_s)
        self._profiles: dict[str, dict[str, ModelProfile]] = {}  # model -> shape key -> its profile
        self.profilings = 0  # profiles measured by any worker
        self._retired: list[WorkerHandle] = []  # started for one task (benchmarks), to stop
        self._cv = threading.Condition(threading.RLock())  # guards the segments and the steps' homes
        self._segments = Segments()
        start = partial(P.Start, device=device, arena_capacity=arena_capacity, profile_repeats=opts.profile_repeats,
                        fixed_group_bytes=parse_bytes(opts.fixed_group_bytes, what="fixed_group_bytes"),
                        load_timeout_s=opts.load_timeout_s, copy_delay_s=opts.copy_delay_s,
                        backend_flags=BackendFlags.capture(), direct_host_access=opts.direct_host_access,
                        leave_a_core=leaves_a_core())
        # NOTE [One step, two places]: each language model -> the worker its steps run in.
        self._step_homes: dict[str, WorkerHandle] = {}
        self._set = WorkerSet(opts.workers, start=start, share_arena=share_arena, startup_timeout_s=startup_timeout_s,
                              on_lost=self._worker_lost)

    @property
    def workers(self) -> list[WorkerHandle]:
        """The workers, the active one first: a copy, taken under the set's lock (a
        replacement may swap one in at any time)."""
        return self._set.snapshot()

    @property
    def replacements(self) -> int:
        return self._set.replacements

    @property
    def failures(self) -> dict[str, int]:
        """Replaced workers, by what went wrong (``FAILURE_KINDS``)."""
        return self._set.failures

    @property
    def last_failure(self) -> dict | None:
        return self._set.last_failure

    # ------------------------------------------------------------------ models
    def add(self, msg: P.AddModel) -> None:
        """Teach every worker the model; a failure on any is a registration error."""
        self._set.register(msg)
        try:
            self._teach_all(msg.model, lambda w: msg.model in w.taught, lambda w: self._set.teach(w, msg))
        except BaseException:
            self.remove(msg.model)
            raise

    def remove(self, model: str) -> None:
        self._profiles.pop(model, None)
        with self._cv:
            self._step_homes.pop(model, None)
        self.deadlines.forget(model)
        if not self._set.unregister(model):
            return
        for w in list(self.workers):
            w.profiles = {x for x in w.profiles if x[0] != model}
        self._unteach_all(model, lambda w: _forget(w.taught, model),
                          lambda: P.RemoveModel(self._set.next_seq(), model))

    def add_shared(self, msg: P.AddShared) -> None:
        """Teach every worker a shared set (NOTE [Shared tensors]); before its models."""
        self._set.register_shared(msg)
        try:
            self._teach_all(msg.sid, lambda w: msg.sid in w.taught_sets, lambda w: self._set.teach_shared(w, msg))
        except BaseException:
            self.remove_shared(msg.sid)
            raise

    def remove_shared(self, sid: str) -> None:
        """Every worker forgets a set no model uses any more."""
        if self._set.unregister_shared(sid):
            self._unteach_all(sid, lambda w: _forget(w.taught_sets, sid),
                              lambda: P.RemoveShared(self._set.next_seq(), sid))

    def unpin_store(self, model: str, workers: set[int]) -> None:
        """The workers of ids ``workers`` unlock ``model``'s host store (NOTE [Locked host
        tier]); one no longer in the pool took its locks with it, and one that fails to
        unlock, however it fails, is replaced, which does the same: the store's pages can
        go once this returns. Only those workers are claimed."""
        what = f"unlocking the host store of {model}"
        for w in [w for w in list(self.workers) if w.id in workers]:
            try:
                with self.claim(w, what):
                    if w in self.workers:
                        w.request(P.UnpinStore(self._set.next_seq(), model), self.startup_timeout_s, what)
            except Exception as exc:  # a worker's own error (a failed copy, a broken device) too
                log.warning("%s: %s", what, exc)
                self._set.replace(w, exc)

    def _teach_all(self, what: str, knows: Callable[[WorkerHandle], bool],
                   teach: Callable[[WorkerHandle], None]) -> None:
        for w in list(self.workers):
            with self.claim(w, f"adding {what}"):
                if not w.ready:
                    self._set.ready(w)  # boots and learns everything registered, this included
                elif not knows(w):  # a replacement may have learned it while booting
                    teach(w)

    def _unteach_all(self, what: str, forget: Callable[[WorkerHandle], bool], message: Callable[[], object]) -> None:
        """Tell every worker that ``forget`` says knew ``what`` to drop it; a worker that
        fails to is replaced."""
        for w in list(self.workers):
            try:
                with self.claim(w, f"removing {what}"):
                    if w in self.workers and forget(w):  # one still booting will never be taught it
                        w.request(message(), self.startup_timeout_s, f"removing {what}")
            except WorkerError as exc:
                log.warning("removing %s: %s", what, exc)
                self._set.replace(w, exc)

    # ------------------------------------------------------------------ tasks
    def run(self, model: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            lane: LaneBound | None = None, fill: FillSpec | None = None,
            shared: Mapping[str, tuple[int, bool]] | None = None, host_keys: tuple[str, ...] | None = None,
            step: Step | None = None):
        """Run ``model`` on a standby (a language model's step: on its home, NOTE [One step,
        two places])."""
        shared = dict(shared) if shared is not None else None
        # NOTE [Masks while the device runs]: a step's late masks follow it on the pipe, and
        # before them, NOTE [Adapters streamed in]: its cold adapter slot, written here as it runs.
        late = step.masks if step is not None else None
        load = step.load if step is not None and isinstance(step.load, SlotWrite) and not step.load.done else None
        sent_step = step
        if step is not None and (late is not None or step.load is not None):
            sent_step = replace(step, masks=MasksFollow() if late is not None else None,
                                load=LoadFollows(load.count) if load is not None else None)

        def make(inputs: Inputs, profiles: tuple) -> P.RunModel:
            return P.RunModel(self._set.next_seq(), model, offset, resident, inputs.args, inputs.kwargs, strategy,
                              profiles, lane=lane, fill=fill, shared=shared, host_keys=host_keys, step=sent_step,
                              refs=inputs.refs, channel=inputs.channel)

        # A step's time grows with its tokens: prompts and batches by powers of two.
        shape = shape_key(args, kwargs) if step is None else \
            f"{step.kind.value}-{max(1, sum(len(t) for t in step.tokens)).bit_length()}"
        kind = (model, "resident" if resident else "disk" if fill is not None else "load", shape)
        what = f"running {model}"
        # A language model's step waits for its home's pipe (its decode graphs are there:
        # NOTE [Decode graphs]); anything else takes a free standby.
        with self._standby(what) if step is None else self.claim(self._step_home(model), what) as w:
            reply, value = self._task_on(w, _Call(model, make, args, kwargs, run=True, then=late,
                                                  writes=load.run if load is not None else None), what, kind)
        t = reply.timings
        if t is None:
            return Ran(value)
        return Ran(value, t, t.load_s, t.ephemeral_peak, t.read_s, t.moved_bytes)

    def profile(self, model: str, offset: int, args: tuple, kwargs: dict,
                shared: Mapping[str, tuple[int, bool]] | None = None, host_keys: tuple[str, ...] | None = None):
        shared = dict(shared) if shared is not None else None

        def make(inputs: Inputs, profiles: tuple) -> P.Profile:
            return P.Profile(self._set.next_seq(), model, offset, inputs.args, inputs.kwargs, shared=shared,
                             host_keys=host_keys, refs=inputs.refs, channel=inputs.channel)

        what = f"profiling {model}"
        with self._standby(what) as w:
            return self._task_on(w, _Call(model, make, args, kwargs, run=False), what)[1]

    def release(self, model: str) -> None:
        """Nothing to wait for: a worker finishes every copy before it answers a task."""
        return None

    def _step_home(self, model: str) -> WorkerHandle:
        """Where ``model``'s steps run; a new one the first time and after
        its home failed (its pages are in the arena: nothing is lost with it), the least
        used, not the first worker while there are others (inference goes there)."""
        with self._cv:
            home = self._step_homes.get(model)
            everyone = self.workers
            if home is not None and home in everyone:
                return home
            workers = everyone[1:] or everyone
            used = {id(w): 0 for w in workers}
            for w in list(self._step_homes.values()) + self._segments.home_workers():
                if id(w) in used:
                    used[id(w)] += 1
            home = min(workers, key=lambda w: used[id(w)])
            self._step_homes[model] = home
            return home

    def _worker_lost(self, w: WorkerHandle) -> None:
        """``w`` failed and was replaced: the jobs it was home to lose their state; the
        language models whose steps ran there get a new home at their next step."""
        with self._cv:
            self._segments.worker_lost(w)
            for model, home in list(self._step_homes.items()):
                if home is w:
                    del self._step_homes[model]
            self._cv.notify_all()

    @contextmanager
    def _standby(self, what: str) -> Iterator[WorkerHandle]:
        """The first worker that no segment runs on, leased to this thread until the block
        ends. A ready one first: a replacement still booting serves only when nothing else
        can."""
        deadline = time.monotonic() + self.startup_timeout_s
        with self._cv:
            while True:
                busy = self._segments.training_workers()
                w = next((w for w in sorted(self.workers, key=lambda w: not (w.ready and w.alive()))  # stable
                          if w not in busy and w.try_lease()), None)
                if w is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerTimeoutError(f"no worker was free within {self.startup_timeout_s:g} s", where=what)
                self._cv.wait(min(left, 0.05))
        try:
            yield w
        finally:
            w.unlease()

    def _task_on(self, w: WorkerHandle, call: _Call, what: str, kind=None) -> tuple[P.Result, Any]:
        """Run ``call`` on ``w``, whose lease this thread holds: its reply, and the reply's
        value with its tensors copied out of the worker's channel (NOTE [Tensor channel])."""
        self._set.ready(w)
        model = call.model
        known = self._profiles.get(model)
        missing: tuple = ()
        if call.run and known:  # profiles measured elsewhere: no profiling here
            missing = tuple(p for k, p in known.items() if (model, k) not in w.profiles)
            if missing:
                w.profiles.update((model, p.shape_key) for p in missing)
        sent = time.perf_counter()
        try:  # NOTE [Call deadlines]
            inputs = w.encode_inputs(call.args, call.kwargs)
            msg = call.make(inputs, missing)
            timeout, last = (self.task_timeout_s, None) if kind is None else \
                (self.deadlines.of(kind), self.deadlines.last(kind))
            spin = SPIN_S if last is not None and last < SPIN_S else 0.0  # NOTE [Spin before sleeping]
            reply, value = w.call(msg, inputs, timeout, what, spin, then=call.then, writes=call.writes)
        except WorkerError as exc:
            if not w.alive() or isinstance(exc, WorkerTimeoutError):
                self._set.replace(w, exc)
            raise
        replied = time.perf_counter()
        if kind is not None:
            self.deadlines.observe(kind, replied - sent)
        timings = reply.timings  # the whole round trip, and the worker's own share of it
        if timings is not None:
            timings.sent_at = sent
            timings.round_trip_s = replied - sent
            timings.worker_s = reply.seconds
        if reply.profiles:
            self.profilings += len(reply.profiles)
            for p in reply.profiles:
                self._profiles.setdefault(model, {})[p.shape_key] = p
                w.profiles.add((model, p.shape_key))
        return reply, value

    def run_in_new_worker(self, model: str, offset: int, args: tuple, kwargs: dict, strategy: str,
                          shared: Mapping[str, tuple[int, bool]] | None = None):
        """PipeSwitch's "two processes, no standby" baseline (benchmarks only): start a
        worker now, teach it ``model`` and the profiles known for it, load and run, stop it.
        The weights still come from the shared host store: no file is read."""
        self.stop_retired()
        w = self._set.spawn()
        self._retired.append(w)  # stopped later, off the timed path
        with w.leased(self.startup_timeout_s, f"running {model}"):
            w.wait_ready(self.startup_timeout_s)
            self._set.teach(w, self._set.registration(model))
            profiles = tuple(self._profiles.get(model, {}).values())
            inputs = w.encode_inputs(args, kwargs)
            msg = P.RunModel(self._set.next_seq(), model, offset, False, inputs.args, inputs.kwargs, strategy,
                             profiles, shared=dict(shared) if shared is not None else None, refs=inputs.refs,
                             channel=inputs.channel)
            return w.call(msg, inputs, self.task_timeout_s, f"running {model}")[1]

    def stop_retired(self) -> None:
        """Stop the workers ``run_in_new_worker`` started: they may hold a store page-locked
        that no record names (NOTE [Locked host tier])."""
        retired, self._retired = self._retired, []
        for w in retired:
            w.stop()

    # ------------------------------------------------------------------ training segments
    def begin_segment(self, job: str, spec: TrainSpec | None, lane: LaneBound | None) -> Segment | HomeBusy | None:
        """Start (``spec`` given) or resume a training job in its home worker, which the
        scheduler runs now, in ``lane`` if it runs with lanes. ``HomeBusy`` when another
        job's segment holds a shared home (the dispatcher decides whether it stops), None
        when the segment may not start yet for another reason (``Segments.may_start``, a
        task on the pipe): the job parks and retries."""
        home = self._home(job, spec is not None)
        self._set.ready(home)
        with self._cv:
            if not self._segments.may_start(home, lane, job):
                other = self._segments.on(home)
                busy = None
                if lane is not None and other is not None and other.lane is not None:
                    self._segments.yield_to(home, job)  # a shared home: turns (NOTE [Switch protocol])
                    busy = HomeBusy(other.job, time.perf_counter() - other.started_at)
                self._cv.wait(0.05)
                return busy
            if home not in self.workers:
                return None  # replaced meanwhile; _home reports it next time
            if not home.try_lease():  # a task or a control request has its pipe
                self._cv.wait(0.05)
                return None
            try:
                seq = self._set.next_seq()
                data = P.dumps(P.Train(seq, job, spec, lane))
            except BaseException:
                home.unlease()  # a spec that cannot be sent must not keep the worker's pipe
                raise
            home.post_bytes(data)  # if the process is gone, run_segment reports it
            return self._segments.start(job, home, seq, lane)

    def run_segment(self, seg: Segment, on_progress: Callable[[P.Progress], None]) -> P.SegmentStopped:
        """Follow a segment until it stops (``Segment.follow``); a worker that failed or
        hung is replaced, a step that raised has dropped the job's state there."""
        try:
            return seg.follow(self.deadlines, self.task_timeout_s, on_progress)
        except TimeshareError as exc:
            if not seg.worker.alive() or isinstance(exc, WorkerTimeoutError):
                self._set.replace(seg.worker, exc)
            else:  # the step raised: the worker dropped the job's state
                with self._cv:
                    self._segments.state_dropped(seg.job)
            raise
        finally:
            seg.worker.unlease()  # taken in begin_segment
            with self._cv:
                self._segments.end(seg)
                self._cv.notify_all()

    def stop_segment(self, job: str) -> None:
        """Stop the job's running segment, if any, at its next preemption point: the
        dispatcher's decision, carried out."""
        with self._cv:
            self._segments.stop(time.perf_counter(), job=job)

    def job_state(self, job: str, *, full: bool = False) -> dict:
        """The job's parameters and buffers, or with ``full`` its checkpoint (NOTE
        [Checkpoints]), from its home worker (between segments)."""
        home = self._home(job, False)
        with self.claim(home, f"state of {job}"):
            return home.request(P.GetJobState(self._set.next_seq(), job, full), self.task_timeout_s,
                                f"state of {job}").value

    def drop_job(self, job: str) -> None:
        self.deadlines.forget(job)
        with self._cv:
            home = self._segments.forget(job)
        if home is not None and home.alive():
            try:
                with self.claim(home, f"dropping {job}"):
                    home.request(P.DropJob(self._set.next_seq(), job), self.task_timeout_s, f"dropping {job}")
            except WorkerError as exc:
                log.warning("dropping training job %s: %s", job, exc)

    def _home(self, job: str, new: bool) -> WorkerHandle:
        with self._cv:
            workers = self.workers
            return self._segments.new_home(job, workers) if new else self._segments.home(job, workers)

    @contextmanager
    def claim(self, w: WorkerHandle, what: str) -> Iterator[WorkerHandle]:
        """Hold ``w``'s pipe until the block ends, for a control request or a language
        model's step: lease it before another segment can start there. A segment running
        there is stopped for it: the one stop the pool makes by itself, to reach the
        worker, not to give the device to anyone (NOTE [One owner per pipe])."""
        deadline = time.monotonic() + max(self.task_timeout_s, self.startup_timeout_s) + 5
        while True:
            self._quiesce(w)
            if w.try_lease(0.05):
                break
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"worker {w.id} stayed busy", where=f"worker {w.id}, {what}")
        try:
            yield w
        finally:
            w.unlease()

    def _quiesce(self, w: WorkerHandle) -> None:
        """Wait until ``w`` runs no training segment, stopping it if it does."""
        deadline = time.monotonic() + self.task_timeout_s + 5
        with self._cv:
            while w in self._segments.training_workers():
                self._segments.stop(time.perf_counter(), worker=w)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerTimeoutError(f"worker {w.id} did not stop training within {self.task_timeout_s:g} s",
                                             where=f"worker {w.id}")
                self._cv.wait(min(left, 0.5))

    # ------------------------------------------------------------------ health
    def health(self) -> PoolHealth:
        """The pool's size, how many of its workers have started and learned every model,
        the replacements it made and why, each worker's process, state (starting, idle,
        busy with a task, training, dead), and the profiles it holds, which worker is
        each training job's home, and how many profiles were measured in all. Read
        without waiting for any worker."""
        with self._cv:
            workers = list(self.workers)
            training = self._segments.training_workers()
            last = self.last_failure
            return PoolHealth(
                size=len(workers), ready=sum(1 for w in workers if w.ready and w.alive()),
                replacements=self.replacements, failures=dict(self.failures),
                last_failure=None if last is None else WorkerFailure(last["worker"], last["kind"], last["cause"],
                                                                     last["at"]),
                failing_to_start=self._set.failing_to_start, profilings=self.profilings,
                homes=self._segments.homes(), step_homes={m: w.id for m, w in self._step_homes.items()},
                workers=[WorkerRow(w.id, w.os_pid, _state_of(w, training), len(w.profiles)) for w in workers])

    def pids(self) -> list[int]:
        return [w.os_pid for w in self.workers]

    def close(self) -> None:
        self._set.close()
        self.stop_retired()


@dataclass(frozen=True)
class _Call:
    """A task for a worker: the model, its inputs, and how to make its message once the
    inputs are in the chosen worker's channel (NOTE [Tensor channel]) and the profiles it
    lacks are known. ``run``: a RunModel (else a Profile)."""

    model: str
    make: Callable[[Inputs, tuple], P.RunModel | P.Profile]
    args: tuple
    kwargs: dict
    run: bool
    then: Callable[[], tuple[bytes, ...]] | None = None  # a step's late masks, sent after it
    writes: Callable[[Callable[[int], None]], None] | None = None  # its cold adapter slot's write, told after it


def _state_of(w: WorkerHandle, training: set[WorkerHandle]) -> str:
    if not w.alive():
        return "dead"
    if not w.ready:
        return "starting"
    return "training" if w in training else "busy" if w.leased_now else "idle"


def _forget(known: set[str], name: str) -> bool:
    """Whether ``name`` was in ``known``; it is not any more."""
    if name in known:
        known.discard(name)
        return True
    return False
