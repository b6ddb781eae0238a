"""What a call or a training job holds and sees of the dispatcher (runs in the controller):
``Turn``, what a call learns when it is given the device; ``Ticket``, a waiting task as
another thread sees it; ``Preemptible``, all the dispatcher may ask of a training job."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from timeshare.scheduler.task import Kind

if TYPE_CHECKING:
    from timeshare.runtime.dispatch import Dispatcher


class Preemptible(Protocol):
    """What the dispatcher may ask of a training job, and all it may ask: its name,
    length and progress, whether it was cancelled or paused, and to stop its running
    segment at the next preemption point (``for_model``: the inference it makes way
    for, "" for none). The dispatcher is the one owner of the decision to stop it."""

    name: str
    iterations: int | None

    @property
    def stats(self) -> _Progressing: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def interrupt(self, for_model: str = "") -> None: ...


class _Progressing(Protocol):
    iterations: int
    step_seconds: float
    ephemeral_bytes: int | None  # measured once (Salus's memory classes), None until then
    persistent_bytes: int | None


@dataclass(slots=True)
class Turn:
    """What a call learns when it is given the device: how long it waited, and which
    task used the device before it (None: nothing since start; control calls such as
    statistics do not count). A call on another model than ``previous`` is a switch."""

    waited_s: float = 0.0
    previous: tuple[Kind, str] | None = None
    nested: bool = False  # a call inside a call: the outer one holds the runtime
    lane: int | None = None  # with lanes (PACK): the lane it runs in and its size
    lane_bytes: int | None = None


class Ticket:
    """A task waiting for its turn, as another thread sees it (``Dispatcher.priority``'s
    ``ticket``): it can bring the task's deadline forward while it waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gate: Dispatcher | None = None
        self._task: int | None = None

    def bind(self, gate: Dispatcher | None, task_id: int | None) -> None:
        with self._lock:
            self._gate, self._task = gate, task_id

    def expedite(self, since: float) -> None:
        """The task is due since ``since``; nothing if it no longer waits."""
        with self._lock:
            gate, task = self._gate, self._task
        if gate is not None and task is not None:
            gate.expedite(task, since)
