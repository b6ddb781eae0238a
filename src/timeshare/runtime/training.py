"""Training jobs that time-share the device with inference. Runs in the controller
(the caller's process), one thread per job.

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
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from timeshare.errors import ConfigError, TimeshareError
from timeshare.runtime.tree import map_tensors

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # reported while parked with pause() set
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class DeviceGate:
    """Who gets the runtime next: any caller that waits (inference, eviction, stats...)
    before a training job's next iteration. The runtime's lock is not fair, so a job
    that released it between iterations would otherwise take it straight back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting = 0

    @contextmanager
    def priority(self):
        with self._cond:
            self._waiting += 1
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()

    def inference_waiting(self) -> bool:
        return self._waiting > 0

    def wait_for_training_turn(self, job: "TrainingJob", poll_s: float = 0.05) -> None:
        """Block while inference waits or the job is paused; return at once if it was cancelled."""
        with self._cond:
            while not job._cancel.is_set() and (self._waiting > 0 or job._pause.is_set()):
                self._cond.wait(poll_s)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class TrainingStats:
    iterations: int = 0
    preemptions: int = 0
    offloads: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    preempted_seconds: float = 0.0


class TrainingJob:
    """A handle on one training job: status, pause, resume, cancel, wait."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Iterable,
        step: Callable,
        iterations: int | None,
        *,
        device: torch.device,
        lock: threading.RLock,
        gate: DeviceGate,
        offload: bool,
        seed: int | None,
    ):
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.iterations = iterations
        self.offload = offload
        self.stats = TrainingStats()
        self._data = iter(data)
        self._step = step
        self._lock = lock
        self._gate = gate
        self._state = JobState.QUEUED
        self._error: BaseException | None = None
        self._pause = threading.Event()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._offloaded = False
        self._parked = False  # waiting at a preemption point
        gen = torch.Generator()
        gen.manual_seed(torch.initial_seed() if seed is None else seed)
        self._rng_cpu = gen.get_state()
        self._rng_cuda = None
        if device.type == "cuda":
            with torch.random.fork_rng(devices=[device]):
                if seed is not None:
                    torch.cuda.manual_seed(seed)
                self._rng_cuda = torch.cuda.get_rng_state(device)
        self._thread = threading.Thread(target=self._run, name=f"timeshare-train-{name}", daemon=True)

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

    def pause(self) -> None:
        """Stop at the next preemption point and stay stopped until ``resume()``."""
        self._pause.set()

    def resume(self) -> None:
        self._pause.clear()
        self._gate.notify()

    def cancel(self) -> None:
        """Stop at the next preemption point for good."""
        self._cancel.set()
        self._gate.notify()

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
        with self._gate.priority(), self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    # ------------------------------------------------------------------ loop
    def start(self) -> "TrainingJob":
        self._thread.start()
        return self

    def _run(self) -> None:
        self._state = JobState.RUNNING
        try:
            while self.iterations is None or self.stats.iterations < self.iterations:
                if self._gate.inference_waiting() or self._pause.is_set():
                    self._yield()
                if self._cancel.is_set():
                    self._state = JobState.CANCELLED
                    return
                try:
                    batch = next(self._data)
                except StopIteration:
                    break
                self._one_step(batch)
            self._state = JobState.FINISHED
        except BaseException as exc:  # reported through the handle
            log.exception("training job %s failed", self.name)
            self._error = exc
            self._state = JobState.FAILED
        finally:
            if self._offloaded:
                with self._lock:
                    self._move(self.device)
            self._done.set()
            self._gate.notify()

    def _yield(self) -> None:
        """A preemption point: give the device away until it is our turn again."""
        t0 = time.perf_counter()
        self.stats.preemptions += 1
        if self.offload and not self._offloaded:
            with self._lock:
                self._move(torch.device("cpu"))
            self.stats.offloads += 1
        self._parked = True
        try:
            self._gate.wait_for_training_turn(self)
        finally:
            self._parked = False
        self.stats.preempted_seconds += time.perf_counter() - t0

    def _one_step(self, batch) -> None:
        with self._lock:
            t0 = time.perf_counter()
            if self._offloaded:
                self._move(self.device)
            batch = map_tensors(batch, lambda t: t.to(self.device))
            with _swapped_rng(self):
                loss = self._step(self.model, self.optimizer, batch)
            if isinstance(loss, torch.Tensor):
                loss = float(loss.detach())
            if loss is not None:
                self.stats.losses.append(float(loss))
            self.stats.iterations += 1
            self.stats.step_seconds += time.perf_counter() - t0

    def _move(self, device: torch.device) -> None:
        """Parameters (and gradients), buffers and optimizer state to ``device``: host
        memory to offload, ``self.device`` to come back. Always copies, so the values
        are unchanged and the optimizer keeps its references (``p.data`` is replaced in
        place). The CPU backend exercises the same path."""
        offloading = device != self.device
        pin = offloading and self.device.type == "cuda"

        def to(t: torch.Tensor) -> torch.Tensor:
            moved = t.to(device, copy=True)
            return moved.pin_memory() if pin else moved

        for module in self.model.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = to(p.data)
                    if p.grad is not None:
                        p.grad = to(p.grad)
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = to(b)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = to(value) if value.device.type != "cpu" or value.dim() else value
        self._offloaded = offloading


@contextmanager
def _swapped_rng(job: TrainingJob):
    """Run with the job's own random state; put everyone else's back afterwards."""
    outer_cpu = torch.get_rng_state()
    outer_cuda = torch.cuda.get_rng_state(job.device) if job._rng_cuda is not None else None
    torch.set_rng_state(job._rng_cpu)
    if job._rng_cuda is not None:
        torch.cuda.set_rng_state(job._rng_cuda, job.device)
    try:
        yield
    finally:
        job._rng_cpu = torch.get_rng_state()
        torch.set_rng_state(outer_cpu)
        if outer_cuda is not None:
            job._rng_cuda = torch.cuda.get_rng_state(job.device)
            torch.cuda.set_rng_state(outer_cuda, job.device)


def validate_training_args(name, model, optimizer, data, step, iterations) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"training job name must be a non-empty string, got {name!r}")
    if not callable(model) and not isinstance(model, nn.Module):
        raise ConfigError("model must be an nn.Module or a callable returning one")
    if not callable(optimizer):
        raise ConfigError("optimizer must be a callable taking the model's parameters, e.g. "
                          "lambda params: torch.optim.SGD(params, lr=0.1)")
    if not callable(step):
        raise ConfigError("step must be a callable (model, optimizer, batch) -> loss")
    if iterations is not None and (not isinstance(iterations, int) or iterations < 1):
        raise ConfigError(f"iterations must be a positive integer or None, got {iterations!r}")
    try:
        iter(data)
    except TypeError:
        raise ConfigError(f"data must be iterable, got {type(data).__name__}") from None
