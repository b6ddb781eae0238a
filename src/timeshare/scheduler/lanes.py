"""Salus's memory model: persistent memory per task, ephemeral memory in lanes. Pure
integer logic; runs in the controller and in the simulator.

# NOTE [Salus lanes]
Device memory of capacity C holds each admitted task's persistent memory P (weights,
optimizer state) for as long as the task lives, and a set of lanes for ephemeral memory
(one iteration's activations, E). A lane is as large as the largest E among its tasks;
one task at a time runs in a lane, and different lanes run at the same time. The
safety condition, kept at every admission and resize:

    sum of P over admitted tasks + sum of lane sizes <= C

so that no combination of running tasks can run out of memory. A new task is placed
by Salus's Algorithm 1:
  1. a new lane of size E_new, if sum P + P_new + sum lanes + E_new <= C;
  2. else the best-fitting existing lane (the smallest of size >= E_new), if
     sum P + P_new + sum lanes <= C;
  3. else the smallest lane that can grow to E_new with the condition still true
     (lanes tried in ascending order of size);
  4. else the task waits.
A lane shrinks to its largest remaining E when a task leaves it, and disappears when
empty (Salus resizes lanes at iteration boundaries; here that is when tasks leave) —
but not while another task runs in it: that task was given the lane's size as its
bound when it started, so the lane shrinks once it stops (``idle``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from timeshare.scheduler.task import State, Task


@dataclass
class Lane:
    id: int
    size: int
    tasks: dict[int, int] = field(default_factory=dict)  # task id -> its ephemeral bytes
    busy: int | None = None  # the task running in it


@dataclass(frozen=True, slots=True)
class LaneRow:
    """One lane as operators see it: its size, how many tasks it holds, and the model
    of the one running in it (None when idle)."""

    id: int
    size: int
    tasks: int
    running: str | None


@dataclass(frozen=True, slots=True)
class LanesView:
    """The lanes as operators see them (``LaneManager.view``): the bytes for lanes, the
    bytes held persistent and in lanes, how many tasks wait for admission, each lane."""

    capacity: int
    persistent: int
    in_lanes: int
    waiting_admission: int
    lanes: list[LaneRow]


class LaneManager:
    """Admission and lane assignment for one device of ``capacity`` bytes."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.persistent = 0  # sum of P over admitted tasks
        self.lanes: dict[int, Lane] = {}
        self._lane_total = 0
        self._next = 0
        self._where: dict[int, tuple[int, int]] = {}  # task id -> (lane id, its P)

    # ------------------------------------------------------------------ queries
    @property
    def lane_total(self) -> int:
        return self._lane_total

    @property
    def used(self) -> int:
        return self.persistent + self._lane_total

    def safe(self) -> bool:
        """The safety condition (always true unless the bookkeeping is broken)."""
        return self.persistent + self._lane_total <= self.capacity

    def fits_alone(self, persistent: int, ephemeral: int) -> bool:
        return persistent + ephemeral <= self.capacity

    def view(self, tasks: Mapping[int, Task]) -> LanesView:
        """The lanes for operators: capacity, bytes held persistent and in lanes, each lane's
        size, tasks and the one running (among ``tasks``, the scheduler's), and how many
        tasks wait for admission."""
        return LanesView(
            capacity=self.capacity,
            persistent=self.persistent,
            in_lanes=self.lane_total,
            waiting_admission=sum(1 for t in tasks.values() if t.state is State.WAITING and not self.admitted(t.id)),
            lanes=[LaneRow(lane.id, lane.size, len(lane.tasks),
                           tasks[lane.busy].model if lane.busy is not None and lane.busy in tasks else None)
                   for lane in self.lanes.values()],
        )

    def lane_of(self, task_id: int) -> int | None:
        where = self._where.get(task_id)
        return where[0] if where is not None else None

    def admitted(self, task_id: int) -> bool:
        return task_id in self._where

    # ------------------------------------------------------------------ Algorithm 1
    def choose(self, persistent: int, ephemeral: int) -> tuple[str, int | None] | None:
        """Where Algorithm 1 would put a task: ("new", None), ("join", lane) or
        ("grow", lane); None when it must wait. Changes nothing."""
        base = self.persistent + persistent
        if base + self._lane_total + ephemeral <= self.capacity:
            return ("new", None)
        if base + self._lane_total <= self.capacity:
            fitting = [lane for lane in self.lanes.values() if lane.size >= ephemeral]
            if fitting:
                best = min(fitting, key=lambda lane: (lane.size, lane.id))
                return ("join", best.id)
        for lane in sorted(self.lanes.values(), key=lambda lane: (lane.size, lane.id)):
            if lane.size < ephemeral and base + self._lane_total - lane.size + ephemeral <= self.capacity:
                return ("grow", lane.id)
        return None

    def admit(self, task_id: int, persistent: int, ephemeral: int) -> int | None:
        """Place a task by Algorithm 1; its lane id, or None if it must wait."""
        if task_id in self._where:
            raise ValueError(f"task {task_id} is already admitted")
        choice = self.choose(persistent, ephemeral)
        if choice is None:
            return None
        how, lane_id = choice
        if how == "new":
            lane = Lane(self._next, ephemeral)
            self._next += 1
            self.lanes[lane.id] = lane
            self._lane_total += ephemeral
        else:
            assert lane_id is not None
            lane = self.lanes[lane_id]
            if how == "grow":
                self._lane_total += ephemeral - lane.size
                lane.size = ephemeral
        lane.tasks[task_id] = ephemeral
        self.persistent += persistent
        self._where[task_id] = (lane.id, persistent)
        assert self.safe()
        return lane.id

    def release(self, task_id: int) -> None:
        """The task ended: its persistent memory goes, its lane shrinks or goes (once no
        other task runs in it)."""
        lane_id, persistent = self._where.pop(task_id)
        self.persistent -= persistent
        lane = self.lanes[lane_id]
        del lane.tasks[task_id]
        if lane.busy == task_id:
            lane.busy = None
        self._refit(lane)

    def idle(self, lane_id: int) -> None:
        """The task running in the lane stopped: the lane fits its tasks again."""
        lane = self.lanes.get(lane_id)
        if lane is not None:
            lane.busy = None
            self._refit(lane)

    def _refit(self, lane: Lane) -> None:
        if lane.busy is not None:  # its running task's bound is the lane's size now
            return
        if not lane.tasks:
            self._lane_total -= lane.size
            del self.lanes[lane.id]
        else:
            new = max(lane.tasks.values())
            self._lane_total -= lane.size - new
            lane.size = new
