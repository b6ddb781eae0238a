"""Several simulated devices behind one dispatcher. Runs in the simulator's process (the CLI).

# NOTE [Device dispatch]
Each device has its own scheduler (its own queue, memory lanes and policy) and its own
simulator, as Salus runs one server per GPU. The dispatcher binds every arriving job
to one device for good: the one with the least backlog, the device seconds its tasks
still need alone (``Simulator.backlog_s``: what the device has left of its running
tasks, the profiled estimate of its waiting ones; ties to the lowest index). Why:
  * Under FIFO it is one central first-come-first-served queue in front of all the
    devices. With one job at a time per device, the device with the least backlog is
    the one that frees first, so each job starts when the earliest device is free
    after everything that arrived before it (tests/sim/test_table1.py checks the start
    times against that queue worked out by hand).
  * It uses only what an executor knows (profiled iteration times and progress
    reports) and never moves a running job: Salus neither migrates jobs between GPUs
    nor preempts across them.
  * For the other policies it is the per-device counterpart: each device applies its
    own policy (SRTF, PACK, FAIR) to the jobs it was given. Under PACK the backlog
    counts solo seconds, so a device whose jobs share it looks as loaded as their
    total work, not as their shared wall time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from timeshare.errors import ConfigError
from timeshare.scheduler.core import Scheduler
from timeshare.sim.costs import WorkloadCosts
from timeshare.sim.engine import SimResult, Simulator
from timeshare.sim.trace import Arrival


class Cluster:
    """``schedulers``, one per device, replaying one trace under NOTE [Device dispatch].
    With one scheduler it replays exactly as ``Simulator`` does."""

    def __init__(self, schedulers: Sequence[Scheduler], costs: WorkloadCosts, *, resume_s: float = 0.0):
        if not schedulers:
            raise ConfigError("a cluster needs at least one device (scheduler)")
        if len({id(s) for s in schedulers}) != len(schedulers):
            raise ConfigError("each device needs its own scheduler object")
        self.devices = [Simulator(s, costs, resume_s=resume_s) for s in schedulers]
        self.placement: dict[int, int] = {}  # task id -> device index

    def run(self, trace: list[Arrival], *, horizon_s: float = math.inf) -> SimResult:
        devices = self.devices
        self.placement.clear()
        for d in devices:
            d.begin()
        for i, a in enumerate(trace):
            if a.time > horizon_s:
                break
            for d in devices:
                d.step_until(a.time, horizon_s=horizon_s)
            k = 0 if len(devices) == 1 else min(range(len(devices)), key=lambda k: (devices[k].backlog_s(a.time), k))
            self.placement[i] = k
            devices[k].arrive(i, a)
        return SimResult.merge([d.finish(horizon_s=horizon_s) for d in devices])
