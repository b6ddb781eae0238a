"""The dispatcher's side of training jobs (runs in the controller): a job's scheduler task,
its progress at each preemption point, its wait for its next turn, its lane's size once its
iterations have measured it (Salus's resize at iteration boundaries), and its end.

``JobTurns`` is a part of :class:`~timeshare.runtime.dispatch.Dispatcher` (its base class),
kept apart because a job's life in the scheduler is one concern and a call's hand-off
another: it shares the dispatcher's one lock and state, declared below, and runs the
dispatcher's step (NOTE [Hand-offs]) after every change it makes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from timeshare.memory.ephemeral import LaneBound, job_lane_sizes
from timeshare.runtime.turns import Preemptible
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.task import Finished, Kind, Priority, Progress, State, Stopped, Task

if TYPE_CHECKING:
    from timeshare.runtime.dispatch import _Waiter


class JobTurns:
    if TYPE_CHECKING:  # the dispatcher's state and steps that a job's turns use (``Dispatcher``'s)
        scheduler: Scheduler
        clock: Callable[[], float]
        packs: bool
        lane_threads: int
        _lock: threading.Lock
        _ids: itertools.count
        _jobs: dict[int, Preemptible]
        _job_tasks: dict[Preemptible, Task]
        _sized: set[Preemptible]
        _resizing: dict[Preemptible, tuple[int, int]]
        _wakers: dict[int, _Waiter]

        def _step(self) -> None: ...
        def _timeout(self) -> float: ...
        def _free_lane_bytes(self) -> int: ...
        def _lane_size(self, lane: int | None) -> int | None: ...
        def _new_waiter(self) -> _Waiter: ...

        @property
        def lane_capacity(self) -> int | None: ...

    def job_task(self, job: Preemptible) -> Task:
        """The job's task, created (queued) on first use."""
        with self._lock:
            task = self._job_tasks.get(job)
            if task is None:
                now = self.clock()
                task = Task(next(self._ids), Kind.TRAINING, job.name, now,
                            float(job.iterations) if job.iterations else float("inf"), 0.0, Priority.BEST_EFFORT)
                # With lanes, a job's memory is unknown until its iterations measure it:
                # it asks for what is free now, then is re-admitted (``_resize``).
                task.ephemeral = self._free_lane_bytes()
                self._job_tasks[job] = task
                self._jobs[task.id] = job
                self.scheduler.submit(task, now)
            return task

    def lane_bound(self, job: Preemptible) -> LaneBound | None:
        """With lanes: what the job's next iteration runs with (its lane, the lane's size,
        the cores); None without lanes."""
        with self._lock:
            task = self._job_tasks.get(job)
            if not self.packs or task is None:
                return None
            return LaneBound(job.name, task.lane, self._lane_size(task.lane), self.lane_threads)

    def _resize(self, job: Preemptible) -> None:
        """With the condition held, at a preemption point: once the job has measured its
        memory, it is to be re-admitted with it (persistent state, and one iteration's
        peak with headroom where it fits) in place of the whole budget, as Salus resizes
        lanes at iteration boundaries. The job stops first; its admission is swapped for
        the new one once it has (``_swap``), so that its memory is counted until its
        segment has stopped. Sizes that can never fit are refused here, while the job
        still holds its admission."""
        stats = job.stats
        if not self.packs or stats.ephemeral_bytes is None or job in self._sized:
            return
        sizes = job_lane_sizes(job.name, stats.persistent_bytes or 0, stats.ephemeral_bytes, self.lane_capacity or 0)
        self._sized.add(job)
        self._resizing[job] = sizes

    def _swap(self, job: Preemptible, task: Task) -> Task:
        """With the condition held and the job stopped (its task waiting): the resize
        ``_resize`` decided. The old task leaves its lane and the new one is queued in
        the same step, keeping its progress."""
        sizes = self._resizing.pop(job, None)
        if sizes is None:
            return task
        assert task.state is State.WAITING, task.state
        self.scheduler.withdraw(task.id)
        new = Task(next(self._ids), Kind.TRAINING, job.name, task.arrival, task.work, task.unit_s, task.priority,
                   persistent=sizes[0], ephemeral=sizes[1])
        new.done, new.service = task.done, task.service
        self._jobs.pop(task.id, None)
        self._job_tasks[job] = new
        self._jobs[new.id] = job
        self.scheduler.submit(new, self.clock())
        return new

    def must_yield(self, job: Preemptible) -> bool:
        """At a preemption point: must the job stop now? Reports its progress."""
        task = self.job_task(job)
        with self._lock:
            self._resize(job)
            if job in self._resizing:  # it stops, and is re-admitted with its sizes once it has
                return True
            if task.state is State.RUNNING:
                stats = job.stats
                unit = stats.step_seconds / stats.iterations if stats.iterations else None
                self.scheduler.update(Progress(task.id, self.clock(), float(stats.iterations), unit))
            self._step()
            return task.state is not State.RUNNING

    def wait_for_training_turn(self, job: Preemptible) -> None:
        """Stop the job's segment in the scheduler's books and wait until it runs again
        (or is cancelled). A paused job is held out of the queue until resumed. The job's
        thread sleeps on its waker (NOTE [Hand-offs]); ``notify`` wakes it for a pause,
        a resume or a cancel."""
        task = self.job_task(job)
        with self._lock:
            if task.state in (State.RUNNING, State.STOPPING):
                self.scheduler.update(Stopped(task.id, self.clock(), float(job.stats.iterations)))
            if task.state is State.WAITING:
                task = self._swap(job, task)
        while True:
            with self._lock:
                if job.cancelled:
                    self._wakers.pop(task.id, None)
                    return
                if job.paused:
                    if task.state in (State.RUNNING, State.STOPPING):  # given the device, then paused: hand it back
                        self.scheduler.update(Stopped(task.id, self.clock(), float(job.stats.iterations)))
                    if task.state is State.WAITING:
                        self.scheduler.hold(task.id)
                elif task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self._step()
                # Given the device, even if already told to stop again: the job runs one
                # iteration first, so back-to-back calls cannot starve it.
                if task.state in (State.RUNNING, State.STOPPING) and not job.paused:
                    self._wakers.pop(task.id, None)
                    return
                waiter = self._wakers.get(task.id)
                if waiter is None:
                    waiter = self._wakers[task.id] = self._new_waiter()
                timeout = self._timeout()
            waiter.lock.acquire(timeout=timeout)

    def holds_turn(self, job: Preemptible) -> bool:
        """Whether the scheduler gave the job the device (it may already be told to stop:
        it still runs one iteration, see ``wait_for_training_turn``)."""
        with self._lock:
            task = self._job_tasks.get(job)
            return task is not None and task.state in (State.RUNNING, State.STOPPING)

    def job_ended(self, job: Preemptible) -> None:
        with self._lock:
            task = self._job_tasks.pop(job, None)
            self._sized.discard(job)
            self._resizing.pop(job, None)
            if task is None:
                return
            self._jobs.pop(task.id, None)
            if task.state in (State.RUNNING, State.STOPPING):
                self.scheduler.update(Finished(task.id, self.clock()))
            elif task.id in self.scheduler.tasks:
                if task.state is State.HELD:
                    self.scheduler.release(task.id, self.clock())
                self.scheduler.withdraw(task.id)
            self._step()
