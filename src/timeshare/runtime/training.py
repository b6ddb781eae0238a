"""Training jobs that time-share the device with inference: the handle and the
controller's thread per job. The iterations run in that thread (in-process runtime) or
in a worker process (``Runtime(workers=N)``).

# NOTE [Preemption points]
A training job owns the device one iteration at a time. Between iterations it yields
to any waiting inference (inference has priority) and honours pause and cancel; an
inference that arrives mid-iteration waits for that iteration to end, never longer.
Preemption keeps the job's whole state: parameters, optimizer state, the position in
its data, and its random-number state, which is swapped in around each step so that
other tasks on the device cannot change the job's results. (PyTorch's default
generator is process-wide: a thread drawing random numbers outside the runtime while
a step runs still perturbs it.) A run preempted any number
of times ends with exactly the parameters of an uninterrupted run (tested). With
``offload=True`` parameters and optimizer state move to host memory while the job is
preempted or paused and come back before its next step.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from timeshare import protocol as P
from timeshare.errors import ConfigError, TimeshareError
from timeshare.executor.segments import HomeBusy
from timeshare.memory.ephemeral import LaneBound, in_lane
from timeshare.runtime.dispatch import Dispatcher  # noqa: F401 (annotations)
from timeshare.runtime.events import RuntimeLock
from timeshare.worker.trainer import TrainingStats, TrainingTask, TrainSpec

if TYPE_CHECKING:
    from timeshare.executor.interface import SegmentHost

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # reported while parked with pause() set
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TrainingJob:
    """A handle on one training job: status, pause, resume, cancel, wait, result.

    The job's iterations run in a thread of the controller (``Runtime(workers=0)``,
    :class:`LocalTrainingJob`) or in a worker process (:class:`WorkerTrainingJob`);
    the handle is the same."""

    def __init__(self, name: str, iterations: int | None, *, dispatcher: Dispatcher, offload: bool):
        self.name = name
        self.iterations = iterations
        self.offload = offload
        self.stats = TrainingStats()
        self._dispatcher = dispatcher
        self._state = JobState.QUEUED
        self._error: BaseException | None = None
        self._pause = threading.Event()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._parked = False  # waiting at a preemption point
        self._thread = threading.Thread(target=self._main, name=f"timeshare-train-{name}", daemon=True)

    # ------------------------------------------------------------------ handle
    @property
    def status(self) -> str:
        """queued, running, paused (parked at a preemption point by ``pause()``),
        finished, failed or cancelled."""
        if self._state is JobState.RUNNING and self._parked and self._pause.is_set():
            return JobState.PAUSED.value
        return self._state.value

    @property
    def error(self) -> BaseException | None:
        return self._error

    # What the dispatcher may ask of a job (``dispatch.Preemptible``).
    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def paused(self) -> bool:
        return self._pause.is_set()

    def stop(self) -> None:
        """Make a running segment stop at its next preemption point. In this process the
        job looks at its preemption points itself: nothing to send."""

    def pause(self) -> None:
        """Stop at the next preemption point and stay stopped until ``resume()``."""
        self._pause.set()
        self.stop()
        self._dispatcher.notify()  # a job waiting for its turn is held out of the queue now

    def hold(self) -> None:
        """Stay stopped once stopped, without stopping now: the job runs on until the
        scheduler next preempts it (an inference takes the device, say), then waits for
        ``resume()``. A benchmark's way to start an inference turn with a real switch."""
        self._pause.set()
        self._dispatcher.notify()

    def resume(self) -> None:
        self._pause.clear()
        self._dispatcher.notify()

    def cancel(self) -> None:
        """Stop at the next preemption point for good."""
        self._cancel.set()
        self.stop()
        self._dispatcher.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the job ends; True if it did within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> TrainingStats:
        """Wait for the job and return its statistics; re-raise its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeshareError(f"training job {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the model's parameters and buffers (between iterations)."""
        raise NotImplementedError

    def checkpoint(self) -> dict:
        """The job's full state, to resume it here or elsewhere (``Runtime.train(...,
        resume=...)``, NOTE [Checkpoints]); only while it is paused or has ended."""
        raise NotImplementedError

    def _check_at_rest(self) -> None:
        if self.status not in (JobState.PAUSED.value, JobState.FINISHED.value, JobState.CANCELLED.value):
            raise ConfigError(f"training job {self.name!r} is {self.status}: pause it (and wait until it is "
                              "paused) before taking a checkpoint")

    # ------------------------------------------------------------------ loop
    def start(self) -> TrainingJob:
        self._thread.start()
        return self

    def _main(self) -> None:
        self._state = JobState.RUNNING
        try:
            self._state = self._run()
        except BaseException as exc:  # reported through the handle
            log.warning("training job %s failed: %s", self.name, exc)
            self._error = exc
            self._state = JobState.FAILED
        finally:
            self._finish()
            self._dispatcher.job_ended(self)
            self._done.set()
            self._dispatcher.notify()

    def _run(self) -> JobState:
        raise NotImplementedError

    def _finish(self) -> None:
        pass

    def _park(self) -> None:
        """Wait at a preemption point until inference is served and the job not paused."""
        t0 = time.perf_counter()
        self._parked = True
        try:
            self._dispatcher.wait_for_training_turn(self)
        finally:
            self._parked = False
        self.stats.preempted_seconds += time.perf_counter() - t0


class LocalTrainingJob(TrainingJob):
    """Iterations in a thread of this process, one at a time under the runtime's lock,
    or with lanes in the job's lane."""

    def __init__(self, task: TrainingTask, name: str, *, lock: RuntimeLock, dispatcher: Dispatcher):
        super().__init__(name, task.iterations, dispatcher=dispatcher, offload=task.offload)
        self.task = task
        self.stats = task.stats
        self._lock = lock

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock.records_after(), self._dispatcher.hold(), self._lock:
            return self.task.state_dict()

    def checkpoint(self) -> dict:
        self._check_at_rest()
        with self._lock.records_after(), self._dispatcher.hold(), self._lock:
            return self.task.checkpoint()

    def _run(self) -> JobState:
        while not self.task.finished:
            if self._dispatcher.must_yield(self) or self._pause.is_set():
                with self._lock:
                    self.task.preempted()
                self._park()
            if self._cancel.is_set():
                return JobState.CANCELLED
            lane = self._dispatcher.lane_bound(self)
            # Time-shared, an iteration holds the runtime; in a lane, it runs beside the
            # other lanes, metered and bounded (NOTE [Lanes in the runtime]).
            with self._lock if lane is None else in_lane(lane, self.task.device):
                t0 = time.perf_counter()
                try:
                    self.task.step_once()
                except StopIteration:
                    break
                finally:
                    self.stats.step_seconds += time.perf_counter() - t0
        return JobState.FINISHED

    def _finish(self) -> None:
        if self.task.offloaded:
            with self._lock:
                self.task.restore()


class WorkerTrainingJob(TrainingJob):
    """Iterations in a worker process that holds the job's state; the controller's
    thread runs segments there and parks between them (NOTE [Switch protocol])."""

    def __init__(self, spec: TrainSpec, *, runner: SegmentHost, lock: RuntimeLock, dispatcher: Dispatcher):
        super().__init__(spec.name, spec.iterations, dispatcher=dispatcher, offload=spec.offload)
        self.spec = spec
        self._runner = runner
        self._lock = lock

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock.records_after(), self._dispatcher.hold(), self._lock:
            return self._runner.job_state(self.name)

    def checkpoint(self) -> dict:
        """From the worker that holds the job's state (between segments)."""
        self._check_at_rest()
        with self._lock.records_after(), self._dispatcher.hold(), self._lock:
            return self._runner.job_state(self.name, full=True)

    def stop(self) -> None:
        self._runner.stop_segment(self.name)

    def _progress(self, p: P.Progress, lane: LaneBound | None) -> None:
        self.stats.iterations = p.iterations
        self.stats.step_seconds += p.seconds
        if p.loss is not None:
            self.stats.losses.append(p.loss)
        if p.ephemeral_bytes is not None:
            self.stats.ephemeral_bytes = p.ephemeral_bytes
            self.stats.persistent_bytes = p.persistent_bytes
        # Runs the step (a time slice may be over). A stop the scheduler decided while this
        # segment was starting found no segment to stop: pass it on now. With lanes, a
        # job re-admitted with its measured memory (``Dispatcher._resize``) may hold another
        # lane now: its segment stops, and the next one runs bounded by the new lane.
        if self._dispatcher.must_yield(self) or _lane_changed(lane, self._dispatcher.lane_bound(self)):
            self._runner.stop_segment(self.name)

    def _run(self) -> JobState:
        spec: TrainSpec | None = self.spec  # sent with the first segment only
        while True:
            self._park()  # returns once the scheduler runs the job
            if self._cancel.is_set():
                return JobState.CANCELLED
            if not self._dispatcher.holds_turn(self):
                continue
            # Only this thread gives the job's turn back (``_park``): it holds it until then.
            segment = self._runner.begin_segment(self.name, spec, self._dispatcher.lane_bound(self))
            if isinstance(segment, HomeBusy):  # another job's segment holds our home: whose turn is it?
                self._dispatcher.share_home(self, segment.holder, segment.held_s)
                continue
            if segment is None:
                continue  # inference (or another job) got there first
            spec = None
            stopped = self._runner.run_segment(segment, partial(self._progress, lane=segment.lane))
            if segment.preempted_at is not None:  # told to stop, whether it stopped or finished first
                self._dispatcher.job_stopped(self, segment.preempted_at, stopped.stopped_at, stopped.cleaned_at)
            self.stats.offloads = stopped.stats.offloads
            self.stats.ephemeral_bytes = stopped.stats.ephemeral_bytes
            self.stats.persistent_bytes = stopped.stats.persistent_bytes
            if stopped.reason == "finished":
                return JobState.FINISHED
            self.stats.preemptions += 1


def new_job(spec: TrainSpec, runs_on: TrainingTask | SegmentHost, *, lock: RuntimeLock,
            dispatcher: Dispatcher) -> TrainingJob:
    """A job's handle (not started) around where its executor runs it (``start_job``):
    a task built in this process, or the pool's segments on a home worker."""
    if isinstance(runs_on, TrainingTask):
        return LocalTrainingJob(runs_on, spec.name, lock=lock, dispatcher=dispatcher)
    return WorkerTrainingJob(spec, runner=runs_on, lock=lock, dispatcher=dispatcher)


def _lane_changed(running, now) -> bool:
    """Whether a segment bound by ``running`` must restart to be bound by ``now``: another
    lane, or a smaller one (a larger one only loosens what the worker already enforces)."""
    if running is None or now is None:
        return running is not now
    return now.lane != running.lane or (now.limit or 0) < (running.limit or 0)


def validate_training_args(name, model, optimizer, data, step, iterations) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"training job name must be a non-empty string, got {name!r}")
    if not callable(model) and not isinstance(model, (nn.Module, str)):
        raise ConfigError("model must be an nn.Module, a callable returning one, or a 'module:function' string")
    if not callable(optimizer):
        raise ConfigError("optimizer must be a callable taking the model's parameters, e.g. "
                          "lambda params: torch.optim.SGD(params, lr=0.1)")
    if not callable(step):
        raise ConfigError("step must be a callable (model, optimizer, batch) -> loss")
    if iterations is not None and (not isinstance(iterations, int) or iterations < 1):
        raise ConfigError(f"iterations must be a positive integer or None, got {iterations!r}")
    if callable(data):
        return
    try:
        iter(data)
    except TypeError:
        raise ConfigError(f"data must be iterable or a callable returning one, got {type(data).__name__}") from None
