"""The runtime's dispatcher: the scheduler (``timeshare.scheduler``) driven by real
threads and the monotonic clock. Runs in the controller (the caller's process).

Every call that needs the runtime (an inference, a profile, statistics, an eviction)
and every training job is a scheduler task. A caller submits its task and waits until
the scheduler's decision runs it; a training job asks at each preemption point whether
it must stop (NOTE [Preemption points]); Preempt decisions for a job in a worker
process are sent at once (NOTE [Switch protocol]). Policies, by name: "priority"
(default: latency-critical calls preempt best-effort training at its next iteration
boundary), "fifo" with ``time_slice_s`` (FIFO time-slicing: a call waits until the
training job's slice ends), "fair", "srtf", "edf", "pack".
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from timeshare.errors import ConfigError
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.task import Finished, Kind, Preempt, Priority, Progress, State, Stopped, Task

log = logging.getLogger(__name__)

_POLL_S = 0.05  # a waiter re-runs the step at least this often (a slice may end meanwhile)


@dataclass
class Turn:
    """What a call learns when it is given the device: how long it waited, and which
    task used the device before it (None: nothing since start; control calls such as
    statistics do not count). A call on another model than ``previous`` is a switch."""

    waited_s: float = 0.0
    previous: tuple[Kind, str] | None = None


class Dispatcher:
    def __init__(self, policy: str = "priority", *, time_slice_s: float | None = None, clock=time.monotonic):
        if policy == "pack":
            raise ConfigError("the runtime runs one task at a time; 'pack' is for the simulator")
        self.scheduler = Scheduler(policy, quantum_s=time_slice_s, slots=1)
        self.clock = clock
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._jobs: dict[int, object] = {}  # task id -> TrainingJob
        self._user: tuple[Kind, str] | None = None  # the last non-control task given the device
        self._previous: dict[int, tuple[Kind, str] | None] = {}  # task id -> the user before it

    # ------------------------------------------------------------------ calls
    @contextmanager
    def priority(self, model: str = "", kind: Kind = Kind.CONTROL, *, priority: Priority = Priority.LATENCY_CRITICAL,
                 unit_s: float = 0.0, deadline_s: float | None = None, arrived_at: float | None = None):
        """Hold the runtime for one call; yields its :class:`Turn`. Re-entrant in a
        thread (a call inside a call). ``deadline_s`` (an SLO) counts from ``arrived_at``
        (on this dispatcher's clock) when given, else from now."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield Turn()
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            now = self.clock()
            start = now if arrived_at is None else min(arrived_at, now)
            task = Task(next(self._ids), kind, model, now, 1.0, unit_s, priority,
                        None if deadline_s is None else start + deadline_s)
            self.scheduler.submit(task, now)
            self._step()
            try:
                while task.state is not State.RUNNING:
                    self._cond.wait(self._timeout())
                    self._step()
            except BaseException:  # interrupted while queued: leave no task behind
                self._previous.pop(task.id, None)
                if task.state is State.WAITING:
                    self.scheduler.withdraw(task.id)
                elif task.state is State.RUNNING:
                    self.scheduler.update(Finished(task.id, self.clock()))
                self._step()
                raise
            turn = Turn(self.clock() - now, self._previous.pop(task.id, None))
        self._local.depth = 1
        try:
            yield turn
        finally:
            self._local.depth = 0
            with self._cond:
                self.scheduler.update(Finished(task.id, self.clock()))
                self._step()

    # ------------------------------------------------------------------ training jobs
    def job_task(self, job) -> Task:
        """The job's task, created (queued) on first use."""
        task = getattr(job, "_sched_task", None)
        if task is None:
            with self._cond:
                now = self.clock()
                task = Task(next(self._ids), Kind.TRAINING, job.name, now,
                            float(job.iterations) if job.iterations else float("inf"), 0.0, Priority.BEST_EFFORT)
                job._sched_task = task
                self._jobs[task.id] = job
                self.scheduler.submit(task, now)
        return task

    def must_yield(self, job) -> bool:
        """At a preemption point: must the job stop now? Reports its progress."""
        task = self.job_task(job)
        with self._cond:
            if task.state is State.RUNNING:
                stats = job.stats
                unit = stats.step_seconds / stats.iterations if stats.iterations else None
                self.scheduler.update(Progress(task.id, self.clock(), float(stats.iterations), unit))
            self._step()
            return task.state is not State.RUNNING

    def wait_for_training_turn(self, job, poll_s: float = _POLL_S) -> None:
        """Stop the job's segment in the scheduler's books and wait until it runs again
        (or is cancelled). A paused job is held out of the queue until resumed."""
        task = self.job_task(job)
        with self._cond:
            if task.state in (State.RUNNING, State.STOPPING):
                self.scheduler.update(Stopped(task.id, self.clock(), float(job.stats.iterations)))
            while not job._cancel.is_set():
                if job._pause.is_set():
                    if task.state in (State.RUNNING, State.STOPPING):  # given the device, then paused: hand it back
                        self.scheduler.update(Stopped(task.id, self.clock(), float(job.stats.iterations)))
                    if task.state is State.WAITING:
                        self.scheduler.hold(task.id)
                elif task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self._step()
                # Given the device, even if already told to stop again: the job runs one
                # iteration first, so back-to-back calls cannot starve it.
                if task.state in (State.RUNNING, State.STOPPING) and not job._pause.is_set():
                    return
                self._cond.wait(min(poll_s, self._timeout()))

    def holds_turn(self, job) -> bool:
        """Whether the scheduler gave the job the device (it may already be told to stop:
        it still runs one iteration, see ``wait_for_training_turn``)."""
        task = getattr(job, "_sched_task", None)
        return task is not None and task.state in (State.RUNNING, State.STOPPING)

    def job_ended(self, job) -> None:
        task = getattr(job, "_sched_task", None)
        if task is None:
            return
        with self._cond:
            self._jobs.pop(task.id, None)
            if task.state in (State.RUNNING, State.STOPPING):
                self.scheduler.update(Finished(task.id, self.clock()))
            elif task.id in self.scheduler.tasks:
                if task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self.scheduler.withdraw(task.id)
            self._step()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the step
    def _step(self) -> None:
        """With the condition held: one scheduler step; carry out its decisions."""
        decisions = self.scheduler.schedule(self.clock())
        for d in decisions:
            if not isinstance(d, Preempt):
                for t in (d.task, *d.task.batch):
                    if t.kind is not Kind.CONTROL:
                        if t.kind is Kind.INFERENCE:  # read back by the waiting call
                            self._previous[t.id] = self._user
                        self._user = (t.kind, t.model)
                continue
            job = self._jobs.get(d.task.id)
            if job is not None:
                # Lock order: dispatcher, then pool; the pool never calls the
                # dispatcher while it holds its own lock.
                # A worker segment: Preempt goes out now (NOTE [Switch protocol]), and the
                # switch is recorded for the inference it makes way for.
                by = d.by
                job._interrupt(by.model if by is not None and by.kind is Kind.INFERENCE else "")
        if decisions:
            self._cond.notify_all()

    def _timeout(self) -> float:
        wake = self.scheduler.next_wakeup(self.clock())
        if wake is None:
            return _POLL_S
        return max(0.001, min(_POLL_S, wake - self.clock()))
