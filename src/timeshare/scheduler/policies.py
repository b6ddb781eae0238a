"""Scheduling policies: the order of waiting tasks and when a running one is preempted.
Pure logic; runs in the controller and in the simulator.

A policy gives each waiting task a sort key (smaller runs first), fixed while the task
waits, so the scheduler keeps the queue in a heap. Preemption happens only at a task's
preemption points (a training iteration boundary) and in two cases:
  * the policy is ``preemptive`` and a waiting task's ``rank`` is strictly better than
    the running task's (SRTF: less remaining time; priority: a higher class; EDF: an
    earlier deadline);
  * the running task has used its time slice (``quantum_s``) and a waiting task would
    come before it if it rejoined the queue now (FIFO time-slicing: anyone waiting;
    FAIR: anyone who has had less device time).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from timeshare.errors import ConfigError
from timeshare.scheduler.task import Task

_INF = math.inf


class Policy:
    """Interface. ``packs``: start as many tasks at once as memory allows (Salus's
    PACK); otherwise one task runs at a time unless the scheduler is told otherwise."""

    name = "base"
    preemptive = False
    packs = False
    default_quantum_s: float | None = None

    def key(self, t: Task) -> tuple:
        """Sort key of a waiting task."""
        raise NotImplementedError

    def requeue_key(self, t: Task, now: float) -> tuple:
        """The key a running task would have if it stopped now and rejoined the queue."""
        raise NotImplementedError

    def rank(self, t: Task, now: float) -> tuple:
        """What a preemptive policy compares (smaller wins); only used if preemptive."""
        return ()


class FIFO(Policy):
    """First come, first served; with a time slice, round robin in arrival order."""

    name = "fifo"

    def key(self, t: Task) -> tuple:
        return (t.ready_at, t.seq)

    def requeue_key(self, t: Task, now: float) -> tuple:
        return (now, t.seq)


class Pack(FIFO):
    """Salus's PACK: admit tasks in arrival order and run as many at once as the memory
    lanes allow, skipping those that do not fit yet; minimises makespan."""

    name = "pack"
    packs = True


class SRTF(Policy):
    """Preemptive shortest remaining time first; remaining = units left x profiled unit
    time (plus start-up if never started)."""

    name = "srtf"
    preemptive = True

    def key(self, t: Task) -> tuple:
        return (t.remaining_s(), t.seq)

    def requeue_key(self, t: Task, now: float) -> tuple:
        return (t.remaining_s(now), t.seq)

    def rank(self, t: Task, now: float) -> tuple:
        return (t.remaining_s(now),)


class Fair(Policy):
    """Equal device time: every task gets the device for one time slice in turn (round
    robin in the order they joined the queue), so n waiting tasks each get 1/n of it.
    Salus's FAIR runs one job at a time, as here: its makespan matches FIFO's."""

    name = "fair"
    default_quantum_s = 1.0

    def key(self, t: Task) -> tuple:
        return (t.ready_at, t.seq)

    def requeue_key(self, t: Task, now: float) -> tuple:
        return (now, t.seq)


class PriorityClasses(Policy):
    """Latency-critical before best-effort; inside a class, earliest deadline first,
    then arrival. A latency-critical arrival preempts best-effort training at its next
    iteration boundary (SwitchFlow, DART)."""

    name = "priority"
    preemptive = True

    def key(self, t: Task) -> tuple:
        return (t.priority, _INF if t.deadline is None else t.deadline, t.ready_at, t.seq)

    def requeue_key(self, t: Task, now: float) -> tuple:
        return (t.priority, _INF if t.deadline is None else t.deadline, now, t.seq)

    def rank(self, t: Task, now: float) -> tuple:
        return (t.priority,)


class EDF(Policy):
    """Earliest deadline first (an SLO-aware order for inference); tasks without a
    deadline come after, in arrival order. Preempts training for an earlier deadline."""

    name = "edf"
    preemptive = True

    def key(self, t: Task) -> tuple:
        return (_INF if t.deadline is None else t.deadline, t.ready_at, t.seq)

    def requeue_key(self, t: Task, now: float) -> tuple:
        return (_INF if t.deadline is None else t.deadline, now, t.seq)

    def rank(self, t: Task, now: float) -> tuple:
        return (_INF if t.deadline is None else t.deadline,)


POLICIES: dict[str, Callable[[], Policy]] = {
    p.name: p for p in (FIFO, SRTF, Pack, Fair, PriorityClasses, EDF)
}


def make_policy(name: str | Policy) -> Policy:
    """A policy by name; unknown names are refused with the list of known ones."""
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[str(name).lower()]()
    except KeyError:
        raise ConfigError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
