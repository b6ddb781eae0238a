"""Scheduling logic. Runs in the controller's process (the runtime's dispatcher) and in
the simulator: pure logic with an injected clock, no torch, no I/O.

- ``core``: the :class:`Scheduler` step function (NOTE [Scheduler slots]);
- ``preemption``: which running task to stop for a waiting one (pure reads of its state);
- ``policies``: FIFO, SRTF, PACK, FAIR, priority classes, EDF, by name;
- ``lanes``: Salus's persistent/ephemeral memory model and Algorithm 1
  (NOTE [Salus lanes]);
- ``eviction``: which resident model leaves device memory when another needs room, and
  the thrashing detector that protects the hot ones;
- ``routing`` and ``routing_steps``: routing over a fleet of replicas, its steps compiled
  with numba (NOTE [Fleet routing]).
"""

from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.lanes import LaneManager
from timeshare.scheduler.policies import POLICIES, Policy, make_policy
from timeshare.scheduler.task import (
    Failed,
    Finished,
    Kind,
    Preempt,
    Priority,
    Progress,
    Run,
    State,
    Stopped,
    Task,
)

__all__ = [
    "POLICIES", "Failed", "Finished", "Kind", "LaneManager", "Policy", "Preempt", "Priority", "Progress",
    "Run", "Scheduler", "State", "Stopped", "Task", "make_policy",
]
