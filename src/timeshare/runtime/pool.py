"""The controller's pool of worker processes: start-up, model registration on every
worker, task dispatch with deadlines, training segments, the switch between them, and
replacement of failed workers. Runs in the controller (the caller's process).

# NOTE [Switch protocol]
One worker is active at a time; the others are standbys, fully initialized. A training
job lives in one worker (its home), which holds the job's parameters and optimizer
state between segments. When an inference arrives while a training segment runs:
  1. stop: the controller sends Preempt to the training worker, which stops at its
     next preemption point (between iterations; never a per-layer synchronize);
  2. start: at the same moment, the inference goes to a standby (never the training
     worker), which starts its pipelined load at once: nothing waits for step 1;
  3. clean: the training worker, once stopped, cleans up in parallel (offloads the
     job's state if it asked for that) and is a standby again;
  4. the job's thread parks until the runtime is free and starts a new segment.
Weights go to the arena and training memory is the job's own, so the new task never
waits for the old one's memory. Each switch records stop, start, load, clean and total
times (``Switch``). A worker that fails is replaced: a standby becomes active at once
and a new one boots behind it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from timeshare import protocol as P
from timeshare.device import BackendFlags
from timeshare.errors import TimeshareError, WorkerCrashedError, WorkerError, WorkerTimeoutError
from timeshare.runtime.calls import Ran
from timeshare.runtime.deadline import Deadlines
from timeshare.tree import shape_key
from timeshare.worker.proc import WorkerHandle, spawn_context

if TYPE_CHECKING:
    from timeshare.runtime.dispatch import Dispatcher, Preemptible
    from timeshare.worker.trainer import TrainSpec

log = logging.getLogger(__name__)


# What went wrong with a replaced worker: it died before it was ready, stopped answering
# within its deadline, died, or broke the protocol (answered something unexpected).
FAILURE_KINDS = ("starting", "hung", "crashed", "protocol")


@dataclass
class Switch:
    """One switch from a training segment to an inference (seconds; None: not known yet
    or not applicable). The clock is the monotonic one all processes share."""

    job: str
    model: str
    requested_at: float
    stop_s: float | None = None  # Preempt sent -> the job stopped at its preemption point
    clean_s: float | None = None  # stopped -> cleaned (offload), in parallel with the new task
    start_s: float | None = None  # Run sent -> the standby began it
    load_s: float | None = None  # first copy queued -> last group arrived (None: resident)
    total_s: float | None = None  # request -> result back in the controller

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Segment:
    job: str
    worker: WorkerHandle
    seq: int
    preempted_at: float | None = None
    switch: Switch | None = None


class ProcessPool:
    def __init__(
        self,
        n: int,
        *,
        device: str,
        share_arena: Callable[[], object],
        arena_capacity: int,
        profile_repeats: int,
        fixed_group_bytes: int,
        load_timeout_s: float,
        task_timeout_s: float,
        startup_timeout_s: float,
        task_deadline_factor: float = 10.0,
        task_deadline_min_s: float = 5.0,
        copy_delay_s: float = 0.0,
        backend_flags: BackendFlags | None = None,
    ):
        self._ctx = spawn_context()
        # A fresh handle per spawned worker: a CUDA IPC handle carries a reference count
        # that each receiving process consumes once, so one handle must not serve two.
        self._share_arena = share_arena
        self._template = dict(device=device, arena_capacity=arena_capacity,
                              profile_repeats=profile_repeats, fixed_group_bytes=fixed_group_bytes,
                              load_timeout_s=load_timeout_s, copy_delay_s=copy_delay_s,
                              backend_flags=backend_flags or BackendFlags.capture())
        self.task_timeout_s = task_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.deadlines = Deadlines(task_timeout_s, factor=task_deadline_factor, min_s=task_deadline_min_s)
        self._next_id = 0
        self._seq = 0
        self._models: dict[str, P.AddModel] = {}  # replayed on every new worker
        self.replacements = 0
        self.failures = {kind: 0 for kind in FAILURE_KINDS}  # replaced workers, by what went wrong
        self.last_failure: dict | None = None  # the latest replaced worker: which, why, when
        self._boot_failures = 0  # replacements in a row that died before they were ready (back-off)
        self._closed = False
        self._cv = threading.Condition(threading.RLock())  # guards the fields below and the worker list
        self._segment: _Segment | None = None  # the training segment running, if any
        self._homes: dict[str, WorkerHandle] = {}  # job -> the worker holding its state
        self._lost: dict[str, str] = {}  # job -> why its state is gone
        self.switches: list[Switch] = []
        self._unclaimed: dict[str, Switch] = {}  # model -> its switch, until its task takes it (NOTE [Switch records])
        self._profiles: dict[str, dict[str, object]] = {}  # model -> shape key -> ModelProfile
        self.profilings = 0  # profiles measured by any worker
        self._retired: list[WorkerHandle] = []  # started for one task (benchmarks), to stop
        self.workers: list[WorkerHandle] = [self._spawn() for _ in range(n)]  # they boot in parallel
        try:
            for w in self.workers:
                self._ready(w)
        except BaseException:
            self.close()
            raise
        # A worker that dies while idle is noticed here, not at its next task.
        self._watcher = threading.Thread(target=self._watch, name="timeshare-pool-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ models
    def add(self, msg: P.AddModel) -> None:
        """Teach every worker the model; a failure on any is a registration error."""
        self._models[msg.model] = msg
        try:
            for w in list(self.workers):
                with self._claim(w, f"adding {msg.model}"):
                    if not w.ready:
                        self._ready(w)  # boots and learns every model, this one included
                    elif msg.model not in w.taught:  # a replacement may have learned it while booting
                        w.request(self._renumber(msg), self.startup_timeout_s, f"adding {msg.model}")
                        w.taught.add(msg.model)
        except BaseException:
            self.remove(msg.model)
            raise

    def remove(self, model: str) -> None:
        self._profiles.pop(model, None)
        self.deadlines.forget(model)
        if self._models.pop(model, None) is None:
            return
        for w in list(self.workers):
            w.profiles = {x for x in w.profiles if x[0] != model}
            try:
                with self._claim(w, f"removing {model}"):
                    if model in w.taught and w in self.workers:  # one still booting will never be taught it
                        w.taught.discard(model)
                        w.request(P.RemoveModel(self._next_seq(), model), self.startup_timeout_s, f"removing {model}")
            except WorkerError as exc:
                log.warning("removing %s: %s", model, exc)
                self._replace(w, exc)

    # ------------------------------------------------------------------ tasks
    def run(self, model: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str):
        msg = P.RunModel(self._next_seq(), model, offset, resident, args, kwargs, strategy)
        kind = (model, "resident" if resident else "load", shape_key(args, kwargs))
        reply = self._task(msg, f"running {model}", kind)
        return Ran(reply.value, dict(reply.timings), reply.timings.get("load_s"))

    def profile(self, model: str, offset: int, args: tuple, kwargs: dict):
        msg = P.Profile(self._next_seq(), model, offset, args, kwargs)
        return self._task(msg, f"profiling {model}").value

    def release(self, model: str) -> None:
        """Nothing to wait for: a worker finishes every copy before it answers a task."""
        return None

    def _task(self, msg, what: str, kind=None):
        requested = time.perf_counter()
        model = getattr(msg, "model", "")
        with self._cv:
            self._preempt_segment(model, requested)
            switch = self._claim_switch(model, requested) if isinstance(msg, P.RunModel) else None
            w = self._take_standby(what)
        try:
            return self._task_on(w, msg, what, requested, switch, kind)
        finally:
            w.unlease()

    def _take_standby(self, what: str) -> WorkerHandle:
        """The first worker that no segment runs on, leased to this thread (under the cv).
        A ready one first: a replacement still booting serves only when nothing else can."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            busy = self._segment.worker if self._segment is not None else None
            for w in sorted(self.workers, key=lambda w: not (w.ready and w.alive())):  # stable: ready, in order
                if w is not busy and w.try_lease():
                    return w
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(f"no worker was free within {self.startup_timeout_s:g} s", where=what)
            self._cv.wait(min(left, 0.05))

    def _task_on(self, w: WorkerHandle, msg, what: str, requested: float, switch, kind=None):
        self._ready(w)
        model = getattr(msg, "model", "")
        known = self._profiles.get(model, {})
        if isinstance(msg, P.RunModel) and known:  # profiles measured elsewhere: no profiling here
            missing = tuple(p for k, p in known.items() if (model, k) not in w.profiles)
            if missing:
                msg = replace(msg, profiles=missing)
                w.profiles.update((model, p.shape_key) for p in missing)
        sent = time.perf_counter()
        try:  # NOTE [Call deadlines]
            reply = w.request(msg, self.task_timeout_s if kind is None else self.deadlines.of(kind), what)
        except WorkerError as exc:
            if not w.alive() or isinstance(exc, WorkerTimeoutError):
                self._replace(w, exc)
            raise
        replied = time.perf_counter()
        if kind is not None:
            self.deadlines.observe(kind, replied - sent)
        if isinstance(reply, P.Result):  # the whole round trip, and the worker's own share of it
            reply = replace(reply, timings={**reply.timings, "round_trip_s": replied - sent, "worker_s": reply.seconds})
        self.profilings += len(reply.profiles)
        for p in reply.profiles:
            self._profiles.setdefault(model, {})[p.shape_key] = p
            w.profiles.add((model, p.shape_key))
        if switch is not None:
            switch.total_s = time.perf_counter() - switch.requested_at
            received = reply.timings.get("received_at")
            switch.start_s = received - sent if received is not None else None
            switch.load_s = reply.timings.get("load_s")
        return reply

    def run_in_new_worker(self, model: str, offset: int, args: tuple, kwargs: dict, strategy: str):
        """PipeSwitch's "two processes, no standby" baseline (benchmarks only): start a
        worker now, teach it ``model`` and the profiles known for it, load and run, stop it.
        The weights still come from the shared host store: no file is read."""
        self._stop_retired()
        w = self._spawn()
        self._retired.append(w)  # stopped later, off the timed path
        with w.leased(self.startup_timeout_s, f"running {model}"):
            w.wait_ready(self.startup_timeout_s)
            w.request(self._renumber(self._models[model]), self.startup_timeout_s, f"adding {model}")
            profiles = tuple(self._profiles.get(model, {}).values())
            msg = P.RunModel(self._next_seq(), model, offset, False, args, kwargs, strategy, profiles)
            return w.request(msg, self.task_timeout_s, f"running {model}").value

    def _stop_retired(self) -> None:
        retired, self._retired = self._retired, []
        for w in retired:
            w.stop()

    # ------------------------------------------------------------------ training
    def begin_segment(self, job: str, spec: TrainSpec | None, gate: Dispatcher,
                      job_handle: Preemptible) -> _Segment | None:
        """Start (``spec`` given) or resume a training job in its home worker. None when the
        scheduler no longer runs the job or another segment runs: the job parks and retries."""
        home = self._home(job, spec is not None)
        self._ready(home)
        with self._cv:
            if not gate.holds_turn(job_handle) or self._segment is not None:
                self._cv.wait(0.05)
                return None
            if home not in self.workers:
                return None  # replaced meanwhile; _home reports it next time
            if not home.try_lease():  # a task or a control request has its pipe
                self._cv.wait(0.05)
                return None
            try:
                seq = self._next_seq()
                data = P.dumps(P.Train(seq, job, spec))
            except BaseException:
                home.unlease()  # a spec that cannot be sent must not keep the worker's pipe
                raise
            home.post_bytes(data)  # if the process is gone, run_segment reports it
            self._segment = _Segment(job, home, seq)
            return self._segment

    def run_segment(self, seg: _Segment, on_progress) -> P.SegmentStopped:
        """Follow a segment until it stops. Progress after each iteration is the
        heartbeat: a worker silent for ``task_timeout_s`` is killed as hung."""
        what = f"training {seg.job}"
        kind = (seg.job, "iteration")
        last: float | None = None  # when the segment's latest Progress arrived
        try:
            while True:
                # NOTE [Call deadlines]: the first iteration of a segment may rebuild or
                # reload the job's state, and after a Preempt the worker cleans up (offload)
                # before it answers: those waits get the cap.
                timeout = self.task_timeout_s if last is None or seg.preempted_at is not None \
                    else self.deadlines.of(kind)
                reply = seg.worker.receive(timeout, what, seg.seq)
                if isinstance(reply, P.Progress):
                    now = time.perf_counter()
                    if last is not None:
                        self.deadlines.observe(kind, now - last)
                    last = now
                    on_progress(reply)
                    continue
                if not isinstance(reply, P.SegmentStopped):
                    raise WorkerError(f"worker {seg.worker.id} answered a training segment with "
                                      f"{type(reply).__name__}", where=f"worker {seg.worker.id}, {what}")
                if seg.switch is not None and seg.preempted_at is not None:
                    seg.switch.stop_s = max(0.0, reply.stopped_at - seg.preempted_at)
                    seg.switch.clean_s = reply.cleaned_at - reply.stopped_at
                return reply
        except TimeshareError as exc:
            with self._cv:
                if not seg.worker.alive() or isinstance(exc, WorkerTimeoutError):
                    self._replace(seg.worker, exc)
                else:  # the step raised: the worker dropped the job's state
                    self._homes.pop(seg.job, None)
            raise
        finally:
            seg.worker.unlease()  # taken in begin_segment
            with self._cv:
                if self._segment is seg:
                    self._segment = None
                self._cv.notify_all()

    def preempt(self, job: str, for_model: str = "") -> None:
        """Ask the job's running segment, if any, to stop at its next preemption point;
        ``for_model``: the inference it makes way for, which the switch is recorded for."""
        with self._cv:
            if self._segment is not None and self._segment.job == job:
                self._preempt_segment(for_model, time.perf_counter())

    def job_state(self, job: str) -> dict:
        """The job's parameters and buffers, from its home worker (between segments)."""
        home = self._home(job, False)
        with self._claim(home, f"state of {job}"):
            return home.request(P.GetJobState(self._next_seq(), job), self.task_timeout_s, f"state of {job}").value

    def drop_job(self, job: str) -> None:
        self.deadlines.forget(job)
        with self._cv:
            home = self._homes.pop(job, None)
            self._lost.pop(job, None)
        if home is not None and home.alive():
            try:
                with self._claim(home, f"dropping {job}"):
                    home.request(P.DropJob(self._next_seq(), job), self.task_timeout_s, f"dropping {job}")
            except WorkerError as exc:
                log.warning("dropping training job %s: %s", job, exc)

    def _home(self, job: str, new: bool) -> WorkerHandle:
        with self._cv:
            if new:
                if len(self.workers) < 2:
                    raise WorkerError("training with workers needs at least 2 workers (one stays free for inference)")
                # Not the first worker: inference goes there while the job runs.
                counts = {id(w): 0 for w in self.workers}
                for h in self._homes.values():
                    counts[id(h)] = counts.get(id(h), 0) + 1
                home = min(self.workers[1:], key=lambda w: counts[id(w)])
                self._homes[job] = home
                self._lost.pop(job, None)
                return home
            home = self._homes.get(job)
            if home is None or home not in self.workers:
                why = self._lost.get(job, "its worker is gone")
                raise WorkerCrashedError(f"training job {job!r} lost its state: {why}", where=f"training {job}")
            return home

    def _preempt_segment(self, model: str, now: float) -> Switch | None:
        """With the lock held: send Preempt to the running segment (once)."""
        seg = self._segment
        if seg is None:
            return None
        if seg.preempted_at is None:
            seg.preempted_at = now
            seg.worker.post(P.PreemptSegment(seg.seq))  # if already dead, the segment's reader reports it
        if model and seg.switch is None:
            seg.switch = self._unclaimed[model] = Switch(seg.job, model, now)
            self.switches.append(seg.switch)
            del self.switches[:-1000]
            return seg.switch
        return None

    # NOTE [Switch records]
    # A switch is recorded where the stop is decided: by the scheduler's Preempt for an
    # inference (through ``preempt(job, for_model)``), or by the inference's own task
    # finding a segment still running. The segment may have stopped and gone by the time
    # the inference's task reaches the pool, so the record waits, unclaimed, for the next
    # task of its model, which fills in its start, load and total times. A record that no
    # task claims within the task deadline belongs to a request that never came through.
    def _claim_switch(self, model: str, now: float) -> Switch | None:
        switch = self._unclaimed.pop(model, None)
        if switch is not None and now - switch.requested_at > self.task_timeout_s:
            return None
        return switch

    def _quiesce(self, w: WorkerHandle) -> None:
        """Wait until ``w`` runs no training segment, preempting it if it does."""
        deadline = time.monotonic() + self.task_timeout_s + 5
        with self._cv:
            while self._segment is not None and self._segment.worker is w:
                self._preempt_segment("", time.perf_counter())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerTimeoutError(f"worker {w.id} did not stop training within {self.task_timeout_s:g} s",
                                             where=f"worker {w.id}")
                self._cv.wait(min(left, 0.5))

    @contextmanager
    def _claim(self, w: WorkerHandle, what: str):
        """Hold ``w``'s pipe for a control request: stop its training segment, if any, and
        lease it before another segment can start (NOTE [One owner per pipe])."""
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

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> WorkerHandle:
        start = P.Start(worker=self._next_id, parent_pid=os.getpid(), arena=self._share_arena(), **self._template)
        self._next_id += 1
        return WorkerHandle(self._ctx, start)

    def _ready(self, w: WorkerHandle) -> None:
        """Finish a worker's start-up and teach it every model (new workers only)."""
        if w.ready:
            return
        with w.leased(self.startup_timeout_s, "starting"):  # the lease also serializes teaching
            if w.ready:
                return
            try:
                w.wait_ready(self.startup_timeout_s)  # a worker that dies before its Hello is replaced too
                for msg in list(self._models.values()):
                    w.request(self._renumber(msg), self.startup_timeout_s, f"adding {msg.model}")
                    w.taught.add(msg.model)
            except BaseException as exc:
                self._replace(w, exc)  # half taught: start over with a fresh one
                raise
            w.ready = True

    def _replace(self, w: WorkerHandle, cause: BaseException | str) -> None:
        """Drop a failed worker: a standby becomes active; a new one boots behind it. The
        training jobs it held lose their state. ``cause`` (what its user saw) is kept
        for ``health()``."""
        with self._cv:
            if self._closed:
                return  # close() stops every worker
            hung = isinstance(cause, WorkerTimeoutError)  # its reader killed it already
            w.kill()
            if w not in self.workers:
                return  # replaced already
            if not w.ready:
                self._boot_failures += 1
            kind = "starting" if not w.ready else "hung" if hung else "crashed" if not w.alive() or \
                isinstance(cause, WorkerCrashedError) else "protocol"
            self.failures[kind] += 1
            self.last_failure = {"worker": w.id, "kind": kind, "cause": str(cause), "at": time.time()}
            new = self._spawn()
            self.workers[self.workers.index(w)] = new  # in place: homes are never the first worker
            self.replacements += 1
            for job, home in list(self._homes.items()):
                if home is w:
                    del self._homes[job]
                    self._lost[job] = f"worker {w.id} held it and failed"
            self._cv.notify_all()
            delay = min(30.0, 0.25 * (2 ** self._boot_failures - 1))
        log.warning("worker %d replaced by worker %d%s", w.id, new.id,
                    f" ({self._boot_failures} in a row died starting; teaching it in {delay:g} s)" if delay else "")
        # The pool heals by itself: the new worker learns every model now, not at its first task.
        threading.Thread(target=self._teach, args=(new, delay), name=f"timeshare-teach-{new.id}", daemon=True).start()

    def _watch(self) -> None:
        """Replace workers that die while nobody talks to them. One that a thread holds the
        lease of is left to that thread, which sees the death on its pipe."""
        while True:
            with self._cv:
                if self._closed:
                    return
                workers = [w for w in self.workers if w.alive()]
                dead = [w for w in self.workers if w not in workers]
            sentinels = {}
            for w in workers:
                try:
                    sentinels[w.proc.sentinel] = w
                except ValueError:  # released meanwhile
                    continue
            if not sentinels:
                time.sleep(0.5)
                continue
            try:
                ended = wait(list(sentinels), timeout=0.5)
            except (OSError, ValueError):  # a sentinel was closed meanwhile (a replacement): look again
                continue
            for w in dead + [sentinels[x] for x in ended]:
                if w.try_lease():
                    w.unlease()
                    self._replace(w, f"worker {w.id} {w.exit_description()} while idle")

    def _teach(self, w: WorkerHandle, delay_s: float) -> None:
        if delay_s:
            time.sleep(delay_s)  # back off from replacements that keep dying
        try:
            self._ready(w)
        except Exception as exc:  # _ready replaced it already; that replacement teaches itself
            log.warning("worker %d failed while starting: %s", w.id, exc)
            return
        with self._cv:
            self._boot_failures = 0

    def _renumber(self, msg: P.AddModel) -> P.AddModel:
        return P.AddModel(self._next_seq(), msg.model, msg.builder, msg.entries, msg.store_name,
                          msg.store_nbytes, msg.order)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def health(self) -> dict:
        """The pool's size, how many of its workers have started and learned every model,
        the replacements it made and why, each worker's process, state (starting, idle,
        busy with a task, training, dead), and the profiles it holds, which worker is
        each training job's home, and how many profiles were measured in all. Read
        without waiting for any worker."""
        with self._cv:
            workers = list(self.workers)
            training = self._segment.worker if self._segment is not None else None
            return {"size": len(workers), "ready": sum(1 for w in workers if w.ready and w.alive()),
                    "replacements": self.replacements, "failures": dict(self.failures),
                    "last_failure": None if self.last_failure is None else dict(self.last_failure),
                    "failing_to_start": self._boot_failures, "profilings": self.profilings,
                    "homes": {job: w.id for job, w in self._homes.items()},
                    "workers": [{"id": w.id, "pid": w.os_pid, "state": _state_of(w, training),
                                 "profiles": len(w.profiles)} for w in workers]}

    def pids(self) -> list[int]:
        return [w.os_pid for w in self.workers]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            workers, self.workers = self.workers, []
        for w in workers:
            w.stop()
        self._stop_retired()


def _state_of(w: WorkerHandle, training: WorkerHandle | None) -> str:
    if not w.alive():
        return "dead"
    if not w.ready:
        return "starting"
    return "training" if w is training else "busy" if w.leased_now else "idle"
