"""A training job re-admitted with its measured memory (``Dispatcher._resize``, NOTE
[Lanes in the runtime]): sizes that fit replace the first admission once the job has
stopped (until then its iteration may use the whole first lane); sizes that can never
fit are refused before the job's admission is given up."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from timeshare.errors import MemoryBudgetError
from timeshare.runtime.dispatch import Dispatcher


@dataclass
class _Stats:
    iterations: int = 2
    step_seconds: float = 0.01
    ephemeral_bytes: int | None = None
    persistent_bytes: int | None = None


class _Job:
    def __init__(self, name: str):
        self.name, self.iterations, self.stats = name, None, _Stats()
        self.cancelled = self.paused = False

    def stop(self, switch=None) -> None:
        pass


def _running(gate: Dispatcher, job: _Job):
    task = gate.job_task(job)
    assert not gate.must_yield(job)  # admitted with all that is free, and running
    return task


def test_measured_sizes_that_fit_replace_the_first_admission():
    gate = Dispatcher("pack", lane_memory=1000)
    job = _Job("j")
    first = _running(gate, job)
    lanes = gate.scheduler.lanes
    assert lanes.admitted(first.id) and lanes.lane_total == 1000
    job.stats.persistent_bytes, job.stats.ephemeral_bytes = 400, 300
    assert gate.must_yield(job)  # it stops first: its iteration may still use the whole lane
    assert lanes.admitted(first.id) and lanes.lane_total == 1000
    gate.wait_for_training_turn(job)  # stopped: re-admitted with its sizes, and running again
    assert not lanes.admitted(first.id) and lanes.persistent == 400
    assert lanes.lane_total == 375 and lanes.safe()  # 300 with headroom (1.25x)
    assert gate.holds_turn(job) and not gate.must_yield(job)


def test_measured_sizes_that_can_never_fit_are_refused_and_the_admission_stays():
    gate = Dispatcher("pack", lane_memory=1000)
    job = _Job("j")
    first = _running(gate, job)
    job.stats.persistent_bytes, job.stats.ephemeral_bytes = 800, 300
    with pytest.raises(MemoryBudgetError, match="raise lane_memory"):
        gate.must_yield(job)
    lanes = gate.scheduler.lanes
    assert lanes.admitted(first.id) and lanes.used == 1000 and lanes.safe()


def test_headroom_is_clipped_to_what_the_lanes_hold():
    gate = Dispatcher("pack", lane_memory=1000)
    job = _Job("j")
    _running(gate, job)
    job.stats.persistent_bytes, job.stats.ephemeral_bytes = 700, 290  # 290 * 1.25 > 300 free
    assert gate.must_yield(job)
    gate.wait_for_training_turn(job)
    lanes = gate.scheduler.lanes
    assert lanes.persistent == 700 and lanes.lane_total == 300 and lanes.safe()
