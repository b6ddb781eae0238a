"""One training job's state and iterations, in whichever process runs it: a thread of
the controller (``Runtime(workers=0)``) or a worker process. The task knows nothing of
who preempts it; the callers decide when to step and when to offload (NOTE [Preemption
points] in ``runtime/training.py``). In a worker process its caller is ``run_segment``:
a segment's iterations until the job ends or the controller's stop arrives, read from
the pipe at each iteration boundary, with a ``Progress`` after each (the controller's
end of a segment is ``executor/segments.py``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
from torch import nn

from timeshare import protocol as P
from timeshare.errors import ConfigError
from timeshare.memory.ephemeral import in_lane
from timeshare.models.spec import resolve_builder
from timeshare.seeding import JobRandomState, seeded
from timeshare.tree import map_tensors
from timeshare.worker.profiling import measure_ephemeral


@dataclass
class TrainingStats:
    iterations: int = 0
    preemptions: int = 0
    offloads: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    preempted_seconds: float = 0.0
    # Salus's memory classes, measured once at the second iteration (the optimizer's
    # state exists by then): the bytes one iteration holds at its peak beyond the job's
    # state, and the state itself (parameters, buffers, gradients kept, optimizer state).
    ephemeral_bytes: int | None = None
    persistent_bytes: int | None = None


@dataclass(frozen=True)
class TrainSpec:
    """A training job as data, for a worker process to build. Every callable must be
    importable there (a top-level function, a ``functools.partial`` of one, or a class)."""

    name: str
    model: Any  # an nn.Module or a callable returning one
    optimizer: Callable  # parameters -> optimizer
    data: Any  # an iterable of batches, or a callable returning one
    step: Callable  # (model, optimizer, batch) -> loss
    iterations: int | None
    offload: bool
    seed: int
    resume: dict | None = None  # a checkpoint (TrainingTask.checkpoint) to go on from

    def check_shippable(self) -> None:
        for what in ("model", "optimizer", "data", "step"):
            try:
                pickle.dumps(getattr(self, what))
            except Exception as exc:
                raise ConfigError(
                    f"training job {self.name!r}: with workers, {what} must be picklable so that a worker "
                    f"process can rebuild it (a top-level function, a functools.partial of one, or plain "
                    f"data), not {getattr(self, what)!r} ({exc})"
                ) from None


CHECKPOINT_VERSION = 1

# NOTE [Checkpoints]
# A training job's checkpoint is everything that decides its next iterations: parameters
# and buffers, the optimizer's state, its own random state, and how many iterations it has
# done. Its data is not copied: the job that resumes builds the same data from the same
# spec and skips the batches already done, so data must replay the same batches in the
# same order (a seeded loader, a file read in order). A job resumed from a checkpoint on
# another runtime (another replica) then ends bitwise equal to one never interrupted.
# A job in a worker process is checkpointed there, by the worker that holds its state
# (``GetJobState`` with ``full``), once its segment has stopped (the job paused or ended).


class TrainingTask:
    """A model, its optimizer, the position in its data and its random state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Iterable, step: Callable,
                 iterations: int | None, *, device: torch.device, offload: bool, seed: int):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.iterations = iterations
        self.offload = offload
        self.stats = TrainingStats()
        self.offloaded = False
        self._offloaded_state: list[tuple[dict, str]] = []  # optimizer state moved off the device
        self._data = iter(data)
        self._step = step
        self.random = JobRandomState(seed, device)

    @classmethod
    def build(cls, spec: TrainSpec, device: torch.device) -> TrainingTask:
        if isinstance(spec.model, nn.Module):
            module = spec.model
        else:
            build = resolve_builder(spec.model) if isinstance(spec.model, str) else spec.model
            with seeded(spec.seed):  # the job's seed makes its initial weights too
                module = build()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"model for training job {spec.name!r} is {type(module).__name__}, not an nn.Module")
        module.to(device).train()
        optimizer = spec.optimizer(module.parameters())
        data = spec.data() if callable(spec.data) else spec.data
        task = cls(module, optimizer, data, spec.step, spec.iterations, device=device, offload=spec.offload,
                   seed=spec.seed)
        if spec.resume is not None:
            task.resume_from(spec.resume)
        return task

    def checkpoint(self) -> dict:
        """Everything the job needs to go on elsewhere exactly as it would have here, taken
        between iterations: the model's parameters and buffers, the optimizer's state, the
        job's random state, and its position (iterations done; NOTE [Checkpoints])."""
        return {"version": CHECKPOINT_VERSION, "model": self.state_dict(),
                "optimizer": map_tensors(self.optimizer.state_dict(), lambda t: t.detach().to("cpu", copy=True)),
                "random": self.random.export(), "iterations": self.stats.iterations,
                "losses": list(self.stats.losses)}

    def resume_from(self, checkpoint: dict) -> None:
        """Go on from ``checkpoint`` (NOTE [Checkpoints]): the same model, optimizer and data
        as the job that took it, built from the same spec."""
        if not isinstance(checkpoint, dict) or checkpoint.get("version") != CHECKPOINT_VERSION:
            raise ConfigError(f"not a training checkpoint of version {CHECKPOINT_VERSION}")
        try:
            self.model.load_state_dict(checkpoint["model"], strict=True)
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(f"the checkpoint does not fit this job's model or optimizer: {exc}") from None
        self.random.load(checkpoint["random"])
        done = int(checkpoint["iterations"])
        try:
            for _ in range(done):  # the data's position: the same data, replayed to where the job was
                next(self._data)
        except StopIteration:
            raise ConfigError(f"the job's data ends before the checkpoint's {done} iterations") from None
        self.stats.iterations = done
        self.stats.losses = list(checkpoint["losses"])

    @property
    def finished(self) -> bool:
        return self.iterations is not None and self.stats.iterations >= self.iterations

    def step_once(self) -> float | None:
        """One iteration; returns its loss (None if the step returned none). Raises
        StopIteration when the data has ended."""
        self.restore()
        batch = next(self._data)
        loss = None

        def iteration() -> None:
            nonlocal loss
            moved = map_tensors(batch, lambda t: t.to(self.device))
            with self.random.active():
                loss = self._step(self.model, self.optimizer, moved)

        if self.stats.iterations == 1:  # NOTE [Counting ephemeral bytes]: once, off the steady state
            self.stats.ephemeral_bytes = measure_ephemeral(iteration, self.device)
            self.stats.persistent_bytes = self.state_bytes()
        else:
            iteration()
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        if loss is not None:
            loss = float(loss)
            self.stats.losses.append(loss)
        self.stats.iterations += 1
        return loss

    def state_bytes(self) -> int:
        """Bytes of the job's state on its device: parameters, buffers, gradients and
        optimizer state, each storage once."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if t.device.type == self.device.type}
        return sum(storages.values())

    def preempted(self) -> None:
        """At a preemption point: offload the state if the job asked for it."""
        self.stats.preemptions += 1
        if self.offload and not self.offloaded:
            self.move_off()
            self.stats.offloads += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def move_off(self) -> None:
        """Offload: the job's device memory to host memory (see ``_move``)."""
        if not self.offloaded:
            self._move(offloading=True)

    def restore(self) -> None:
        """Bring an offloaded job back to its device (see ``_move``)."""
        if self.offloaded:
            self._move(offloading=False)

    def _move(self, *, offloading: bool) -> None:
        """Parameters (and gradients), buffers and optimizer state to host memory
        (offloading) or back to ``self.device``. Always copies, so the values are
        unchanged and the optimizer keeps its references (``p.data`` is replaced in
        place). The CPU backend exercises the same path, copying host to host.

        Offloading takes exactly the tensors that are on the job's device, 0-dim ones
        included (Adam's ``step`` with ``capturable=True``), and remembers them; coming
        back moves exactly those, so a 0-dim state that lived on the host (Adam's default
        ``step``) stays there and one that lived on the device returns to it. Each tensor
        is copied once each way: into page-locked memory allocated for it, non-blocking,
        with one synchronize at the end."""
        device = torch.device("cpu") if offloading else self.device
        pin = offloading and self.device.type == "cuda"

        def to(t: torch.Tensor) -> torch.Tensor:
            if pin:
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                return host
            return t.to(device, copy=True, non_blocking=self.device.type == "cuda")

        for module in self.model.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = to(p.data)
                    if p.grad is not None:
                        p.grad = to(p.grad)
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = to(b)
        if offloading:
            self._offloaded_state = [
                (state, key) for state in self.optimizer.state.values() for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.device == _canonical(self.device)
            ]
        for state, key in self._offloaded_state:
            state[key] = to(state[key])
        if not offloading:
            self._offloaded_state = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host copies are complete before anyone reads them
        self.offloaded = offloading


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` its tensors report (tensors always carry an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# ---------------------------------------------------------------------- a segment in a worker process
class SegmentShutdown(Exception):
    """Shutdown arrived in the middle of a training segment."""


class TaskFlag(Protocol):
    """Who reports a failure: ``in_task`` is set while the task's own code runs (a training
    step), so that its errors are told apart as the task's."""

    in_task: bool


def run_segment(conn: Connection, msg: P.Train, task: TrainingTask, device: torch.device,
                flag: TaskFlag) -> P.SegmentStopped:
    """Run a training segment: iterations until the job ends or a Preempt for this
    segment arrives (NOTE [Preemption points]). Progress after every iteration is
    also the controller's heartbeat. Raises :class:`SegmentShutdown` on a Shutdown."""
    reason = "finished"
    while not task.finished:
        if conn.poll(0):  # a preemption point: what the controller said meanwhile
            ctl = P.loads(conn.recv_bytes())
            if isinstance(ctl, P.Shutdown):
                raise SegmentShutdown
            if isinstance(ctl, P.PreemptSegment) and ctl.seq == msg.seq:
                reason = "preempted"
                break
            if not isinstance(ctl, P.PreemptSegment):
                raise TypeError(f"{type(ctl).__name__} arrived while training {msg.job}")
        t0 = time.perf_counter()
        flag.in_task = True
        try:
            with in_lane(msg.lane, device):  # NOTE [Lanes in the runtime]: no lane, no meter
                loss = task.step_once()
        except StopIteration:
            break
        flag.in_task = False
        seconds = time.perf_counter() - t0
        task.stats.step_seconds += seconds
        conn.send_bytes(P.dumps(P.Progress(msg.seq, task.stats.iterations, loss, seconds,
                                           task.stats.ephemeral_bytes, task.stats.persistent_bytes)))
    stopped = time.perf_counter()
    if reason == "preempted":
        task.preempted()  # cleaning: offload if the job asked for it
    return P.SegmentStopped(msg.seq, reason, task.stats, stopped, time.perf_counter())
