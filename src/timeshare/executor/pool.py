"""The controller's pool of worker processes (``ProcessPool``, runs in the controller, the
caller's process): model registration on every worker, task dispatch with deadlines, the
profiles any worker measured, and training segments on the jobs' homes, with the switch
between a segment and a task (NOTE [Switch protocol], :mod:`timeshare.executor.segments`).
Which thread may talk to which worker: NOTE [One owner per pipe]. Starting the workers
and replacing the ones that fail is :mod:`timeshare.executor.workers`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from timeshare import protocol as P
from timeshare.decode.step import Step
from timeshare.device import BackendFlags, leaves_a_core
from timeshare.errors import WorkerError, WorkerTimeoutError
from timeshare.executor.deadline import Deadlines
from timeshare.executor.handle import SPIN_S, Inputs, WorkerHandle
from timeshare.executor.interface import PoolHealth, Ran, WorkerFailure, WorkerRow
from timeshare.executor.pool_training import SegmentRunner
from timeshare.executor.segments import Segments, Switch
from timeshare.executor.workers import FAILURE_KINDS, WorkerSet
from timeshare.memory.ephemeral import LaneBound
from timeshare.options import RuntimeOptions
from timeshare.transfer.disk import FillSpec
from timeshare.tree import shape_key
from timeshare.units import parse_bytes

if TYPE_CHECKING:
    from timeshare.transfer.profiler import ModelProfile

__all__ = ["FAILURE_KINDS", "ProcessPool", "Switch"]

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
        self._cv = threading.Condition(threading.RLock())  # guards the worker list and the segments
        self._segments = Segments()
        start = partial(P.Start, device=device, arena_capacity=arena_capacity, profile_repeats=opts.profile_repeats,
                        fixed_group_bytes=parse_bytes(opts.fixed_group_bytes, what="fixed_group_bytes"),
                        load_timeout_s=opts.load_timeout_s, copy_delay_s=opts.copy_delay_s,
                        backend_flags=BackendFlags.capture(), direct_host_access=opts.direct_host_access,
                        leave_a_core=leaves_a_core())
        # NOTE [One step, two places]: each language model -> the worker its steps run in.
        self._step_homes: dict[str, WorkerHandle] = {}
        self._set = WorkerSet(opts.workers, start=start, share_arena=share_arena, startup_timeout_s=startup_timeout_s,
                              cv=self._cv, on_lost=self._worker_lost)
        # Training segments on the jobs' homes, and the claim of a worker's pipe from them.
        self.training = SegmentRunner(self._set, self._cv, self._segments, self.deadlines, task_timeout_s,
                                      startup_timeout_s)

    @property
    def workers(self) -> list[WorkerHandle]:
        """The workers, the active one first (read under the pool's lock to iterate)."""
        return self._set.workers

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

    @property
    def switches(self) -> list[Switch]:
        """The latest switch records, oldest first (NOTE [Switch records])."""
        return self._segments.switches

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
                with self.training.claim(w, what):
                    if w in self.workers:
                        w.request(P.UnpinStore(self._set.next_seq(), model), self.startup_timeout_s, what)
            except Exception as exc:  # a worker's own error (a failed copy, a broken device) too
                log.warning("%s: %s", what, exc)
                self._set.replace(w, exc)

    def _teach_all(self, what: str, knows: Callable[[WorkerHandle], bool],
                   teach: Callable[[WorkerHandle], None]) -> None:
        for w in list(self.workers):
            with self.training.claim(w, f"adding {what}"):
                if not w.ready:
                    self._set.ready(w)  # boots and learns everything registered, this included
                elif not knows(w):  # a replacement may have learned it while booting
                    teach(w)

    def _unteach_all(self, what: str, forget: Callable[[WorkerHandle], bool], message: Callable[[], object]) -> None:
        """Tell every worker that ``forget`` says knew ``what`` to drop it; a worker that
        fails to is replaced."""
        for w in list(self.workers):
            try:
                with self.training.claim(w, f"removing {what}"):
                    if w in self.workers and forget(w):  # one still booting will never be taught it
                        w.request(message(), self.startup_timeout_s, f"removing {what}")
            except WorkerError as exc:
                log.warning("removing %s: %s", what, exc)
                self._set.replace(w, exc)

    # ------------------------------------------------------------------ tasks
    def run(self, model: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            lane: LaneBound | None = None, fill: FillSpec | None = None,
            shared: Mapping[str, tuple[int, bool]] | None = None, host_keys: tuple[str, ...] | None = None,
            step: Step | None = None, switch: Switch | None = None):
        """Run ``model`` on a standby (a language model's step: on its home, NOTE [One step,
        two places]); ``switch``: the record of the switch the dispatcher decided for this call."""
        shared = dict(shared) if shared is not None else None

        def make(inputs: Inputs, profiles: tuple) -> P.RunModel:
            return P.RunModel(self._set.next_seq(), model, offset, resident, inputs.args, inputs.kwargs, strategy,
                              profiles, lane=lane, fill=fill, shared=shared, host_keys=host_keys, step=step,
                              refs=inputs.refs, channel=inputs.channel)

        # A step's time grows with its tokens: prompts and batches by powers of two.
        shape = shape_key(args, kwargs) if step is None else \
            f"{step.kind.value}-{max(1, sum(len(t) for t in step.tokens)).bit_length()}"
        kind = (model, "resident" if resident else "disk" if fill is not None else "load", shape)
        call = _Call(model, make, args, kwargs, run=True, switch=switch)
        reply, value = self._task(call, f"running {model}", kind) if step is None else \
            self._home_task(call, f"running {model}", kind)
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

        return self._task(_Call(model, make, args, kwargs, run=False), f"profiling {model}")[1]

    def release(self, model: str) -> None:
        """Nothing to wait for: a worker finishes every copy before it answers a task."""
        return None

    def _task(self, call: _Call, what: str, kind=None):
        requested = time.perf_counter()
        with self._cv:  # NOTE [Switch protocol]: the stop goes out as the task goes to a standby
            own = self._segments.preempt(requested, for_model=call.model if call.run else "")
            w = self._take_standby(what)
        switch = own or call.switch  # NOTE [Switch records]
        try:
            return self._task_on(w, call, what, requested, switch, kind)
        finally:
            w.unlease()

    def _home_task(self, call: _Call, what: str, kind):
        """A language model's step, on the worker its steps run in (its decode graphs are
        there: NOTE [Decode graphs]); it waits for that worker's pipe."""
        requested = time.perf_counter()
        with self._cv:  # a time-shared segment stops, as for any task
            own = self._segments.preempt(requested, for_model=call.model)
            home = self._step_home(call.model)
        switch = own or call.switch
        with self.training.claim(home, what):
            return self._task_on(home, call, what, requested, switch, kind)

    def _step_home(self, model: str) -> WorkerHandle:
        """With the cv held: where ``model``'s steps run; a new one the first time and after
        its home failed (its pages are in the arena: nothing is lost with it), the least
        used, not the first worker while there are others (inference goes there)."""
        home = self._step_homes.get(model)
        if home is not None and home in self.workers:
            return home
        workers = self.workers[1:] or self.workers
        used = {id(w): 0 for w in workers}
        for w in list(self._step_homes.values()) + self._segments.home_workers():
            if id(w) in used:
                used[id(w)] += 1
        home = min(workers, key=lambda w: used[id(w)])
        self._step_homes[model] = home
        return home

    def _worker_lost(self, w: WorkerHandle) -> None:
        """``w`` failed (with the cv held): the jobs it was home to lose their state; the
        language models whose steps ran there get a new home at their next step."""
        self._segments.worker_lost(w)
        for model, home in list(self._step_homes.items()):
            if home is w:
                del self._step_homes[model]

    def _take_standby(self, what: str) -> WorkerHandle:
        """The first worker that no segment runs on, leased to this thread (under the cv).
        A ready one first: a replacement still booting serves only when nothing else can."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            busy = self._segments.training_workers()
            for w in sorted(self.workers, key=lambda w: not (w.ready and w.alive())):  # stable: ready, in order
                if w not in busy and w.try_lease():
                    return w
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(f"no worker was free within {self.startup_timeout_s:g} s", where=what)
            self._cv.wait(min(left, 0.05))

    def _task_on(self, w: WorkerHandle, call: _Call, what: str, requested: float, switch: Switch | None,
                 kind=None) -> tuple[P.Result, Any]:
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
            reply, value = w.call(msg, inputs, timeout, what, spin)
        except WorkerError as exc:
            if not w.alive() or isinstance(exc, WorkerTimeoutError):
                self._set.replace(w, exc)
            raise
        replied = time.perf_counter()
        if kind is not None:
            self.deadlines.observe(kind, replied - sent)
        timings = reply.timings  # the whole round trip, and the worker's own share of it
        if timings is not None:
            timings.round_trip_s = replied - sent
            timings.worker_s = reply.seconds
        if reply.profiles:
            self.profilings += len(reply.profiles)
            for p in reply.profiles:
                self._profiles.setdefault(model, {})[p.shape_key] = p
                w.profiles.add((model, p.shape_key))
        if switch is not None:
            switch.task_done(sent, timings)
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
    switch: Switch | None = None  # the dispatcher's record of the switch it makes (NOTE [Switch records])


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
