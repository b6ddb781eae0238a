"""What the scheduler schedules: tasks, the decisions it hands out and the results it
takes back. Plain data; runs wherever the scheduler runs (the controller, the simulator).

A task is one training job (``work`` iterations) or one inference request (``work``
1), or a control call of the runtime (statistics, eviction: no device work). Times are
seconds on the scheduler's injected clock; memory is bytes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Kind(str, enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"
    CONTROL = "control"


class Priority(enum.IntEnum):
    """Smaller runs first under the priority policy."""

    LATENCY_CRITICAL = 0
    BEST_EFFORT = 1

    @classmethod
    def parse(cls, value: Priority | int | str) -> Priority:
        if isinstance(value, str):
            names = {"lc": cls.LATENCY_CRITICAL, "latency_critical": cls.LATENCY_CRITICAL,
                     "latency-critical": cls.LATENCY_CRITICAL, "high": cls.LATENCY_CRITICAL,
                     "be": cls.BEST_EFFORT, "best_effort": cls.BEST_EFFORT,
                     "best-effort": cls.BEST_EFFORT, "low": cls.BEST_EFFORT}
            try:
                return names[value.lower()]
            except KeyError:
                raise ValueError(f"unknown priority {value!r}; known: {sorted(names)}") from None
        return cls(int(value))


class State(enum.Enum):
    WAITING = "waiting"  # queued: not started, or stopped at a preemption point
    RUNNING = "running"
    STOPPING = "stopping"  # told to stop at its next preemption point
    HELD = "held"  # withdrawn from the queue (a paused job); keeps its progress
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False, slots=True, repr=False)
class Task:
    """One unit of scheduling. ``unit_s`` estimates the seconds of one iteration or
    request running alone (profiled); ``startup_s`` the one-off cost of its first
    start. ``persistent`` and ``ephemeral`` are Salus's memory classes: weights and
    optimizer state, kept while the task lives; the peak of one iteration's
    activations, needed only while it runs (NOTE [Salus lanes])."""

    id: int
    kind: Kind
    model: str
    arrival: float
    work: float = 1.0  # iterations or requests; math.inf: until stopped
    unit_s: float = 0.0
    priority: Priority = Priority.BEST_EFFORT
    deadline: float | None = None  # absolute time by which it should finish (SLO)
    persistent: int = 0
    ephemeral: int = 0
    startup_s: float = 0.0
    # Bookkeeping, written by the scheduler only.
    state: State = State.WAITING
    done: float = 0.0  # units finished so far
    service: float = 0.0  # device seconds received so far
    ready_at: float = 0.0  # when it last joined the queue
    started_at: float | None = None  # first start
    segment_start: float | None = None  # when the current segment (time slice) began
    mark: float | None = None  # running: when ``done`` and ``service`` were last brought up to date
    finished_at: float | None = None
    preemptions: int = 0
    lane: int | None = None
    seq: int = 0
    qver: int = 0  # which queue entry is current (stale heap entries are skipped)
    batch: tuple = field(default=())  # inference tasks of the same model started with it

    def __repr__(self) -> str:
        return (f"Task({self.id}, {self.kind.value}, {self.model!r}, {self.state.value}, "
                f"done={self.done:g}/{self.work:g})")

    @property
    def preemptible(self) -> bool:
        """Only training stops halfway, at an iteration boundary; requests run to the end."""
        return self.kind is Kind.TRAINING

    def remaining_s(self, now: float | None = None) -> float:
        """Estimated device seconds left; for a running task, minus the time it has run
        in this segment."""
        left = (self.work - self.done) * self.unit_s
        if self.started_at is None:
            left += self.startup_s
        if now is not None and self.mark is not None:
            left -= now - self.mark
        return max(0.0, left) if not math.isnan(left) else math.inf


@dataclass(frozen=True, slots=True)
class Run:
    """Start or resume ``task`` (and, for inference, the requests batched with it, which
    share its model). ``lane``: its Salus lane, None without a memory model."""

    task: Task
    lane: int | None = None

    @property
    def tasks(self) -> tuple[Task, ...]:
        return (self.task, *self.task.batch)


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop ``task`` at its next preemption point and report :class:`Stopped`. ``by`` is
    the waiting task the device goes to, when one does (a time slice may end with none)."""

    task: Task
    by: Task | None = None


Decision = Run | Preempt


@dataclass(frozen=True, slots=True)
class Finished:
    task_id: int
    at: float


@dataclass(frozen=True, slots=True)
class Stopped:
    """A preempted (or paused) task stopped after ``done`` units in all."""

    task_id: int
    at: float
    done: float


@dataclass(frozen=True, slots=True)
class Progress:
    """A running task finished ``done`` units in all; ``unit_s``: a new estimate."""

    task_id: int
    at: float
    done: float
    unit_s: float | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    task_id: int
    at: float
    error: str = ""


Result = Finished | Stopped | Progress | Failed
