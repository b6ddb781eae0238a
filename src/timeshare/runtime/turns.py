"""What a call or a training job holds and sees of the dispatcher (runs in the controller):
``Grant``, what a call learns when it is given the device; ``Switch``, the record of a
switch from a training job to an inference; ``Ticket``, a waiting task as another
thread sees it; ``Preemptible``, all the dispatcher may ask of a training job;
``ModelTurn``, a series of one model's calls in one turn (``Runtime.turn``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from timeshare.decode.step import Step, StepOutcome
from timeshare.scheduler.task import Kind, Priority

if TYPE_CHECKING:
    from timeshare.runtime.calls import Call
    from timeshare.runtime.dispatch import Dispatcher


class Preemptible(Protocol):
    """What the dispatcher may ask of a training job, and all it may ask: its name,
    length and progress, whether it was cancelled or paused, and to stop its running
    segment at the next preemption point (``stop``). The dispatcher is the one owner of the decision
    to stop it; the job's running segment, of the stop itself."""

    name: str
    iterations: int | None

    @property
    def stats(self) -> _Progressing: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def stop(self) -> None: ...


class _Progressing(Protocol):
    iterations: int
    step_seconds: float
    ephemeral_bytes: int | None  # measured once (Salus's memory classes), None until then
    persistent_bytes: int | None


@dataclass
class Switch:
    """One switch from a training job to an inference (seconds; None: not known yet or not
    applicable). Made and filled in by the dispatcher alone (NOTE [Switch records]); the
    clock is the monotonic one all processes share."""

    job: str
    model: str
    requested_at: float
    stop_s: float | None = None  # stop sent -> the job stopped at its preemption point (workers)
    clean_s: float | None = None  # stopped -> cleaned (offload), in parallel with the inference (workers)
    start_s: float | None = None  # the inference's message sent -> a standby began it (workers)
    load_s: float | None = None  # first copy queued -> last group arrived (None: resident; workers)
    total_s: float | None = None  # requested -> the inference's result back in the controller

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Grant:
    """What a call learns as its turn (the device, given to its task) starts: how long it
    waited, and which task used the device before it (None: nothing since start; control calls such as
    statistics do not count). A call on another model than ``previous`` is a switch."""

    waited_s: float = 0.0
    previous: tuple[Kind, str] | None = None
    nested: bool = False  # a call inside a call: the outer one holds the runtime
    lane: int | None = None  # with lanes (PACK): the lane it runs in and its size
    lane_bytes: int | None = None
    switch: Switch | None = None  # the switch it was given the device by (NOTE [Switch records])


class Ticket:
    """A task waiting for its turn, as another thread sees it (``Dispatcher.hold``'s
    ``ticket``): it can bring the task's deadline forward while it waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dispatcher: Dispatcher | None = None
        self._task: int | None = None

    def bind(self, dispatcher: Dispatcher | None, task_id: int | None) -> None:
        with self._lock:
            self._dispatcher, self._task = dispatcher, task_id

    def expedite(self, since: float) -> None:
        """The task is due since ``since``; nothing if it no longer waits."""
        with self._lock:
            dispatcher, task = self._dispatcher, self._task
        if dispatcher is not None and task is not None:
            dispatcher.expedite(task, since)


class ModelTurn:
    """A turn of the device for one model's calls (``Runtime.turn``)."""

    # A turn that had to load its model lasts at least this many times the load: the
    # switch then costs at most a fifth of the turn, however short ``quantum_s`` is.
    LOAD_FACTOR = 4.0

    def __init__(self, name: str, priority: Priority, dispatcher: Dispatcher, run: Callable[..., Call],
                 lane_bytes: int | None = None, switch: Switch | None = None):
        """``run(args, kwargs, step=...)``: one call of the turn, the runtime's; ``lane_bytes``:
        with lanes, the size of the turn's lane (NOTE [Turns in lanes]); ``switch``: the
        switch that gave the turn the device, which its first call completes."""
        self.name = name
        self.started = time.monotonic()
        self.load_s = 0.0  # of this turn's calls that loaded the model
        self.lane_bytes = lane_bytes
        self._priority, self._dispatcher, self._run = priority, dispatcher, run
        self._switch = switch

    def call(self, args: tuple = (), kwargs: dict | None = None) -> Call:
        """``Runtime.call`` inside the turn: no wait for the scheduler; with lanes, bounded
        by the turn's lane."""
        return self._counted(self._run(args, kwargs, step=None))

    def step(self, step: Step) -> StepOutcome:
        """A language model's step inside the turn (NOTE [One step, two places]): run
        where the model runs as a call is, loading it first if need be; its outcome."""
        return self._counted(self._run((), None, step=step)).output

    def _counted(self, call: Call) -> Call:
        if call.record.loaded:
            self.load_s += call.record.seconds
        if self._switch is not None:
            self._dispatcher.served(self._switch, call.record.timings)
            self._switch = None
        return call

    def contended(self, quantum_s: float) -> bool:
        """Whether to give the device back now: a task of a more urgent class waits, or
        one of this class that is due (a deadline: a request waiting for its first token,
        an inference with an SLO), or any task waits and the turn has lasted ``quantum_s``
        (and ``LOAD_FACTOR`` times its loads). Asked between steps, when this turn's own
        prefills are done."""
        waiting = self._dispatcher.most_urgent_waiting()
        if waiting is None:
            return False
        priority, deadline = waiting
        if priority < self._priority or (priority == self._priority and deadline is not None):
            return True
        return time.monotonic() - self.started >= max(quantum_s, self.LOAD_FACTOR * self.load_s)
