"""A lane's bound from the allocator's pool (NOTE [Lane pools]) with fake pools that
implement ``LanePool``, and how a call in a lane is guarded: metered per operator, in a
pool, or (a measured shape on the CPU) by admission alone."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from timeshare.errors import LaneExceededError
from timeshare.memory.ephemeral import EphemeralMeter, LaneBound, in_lane, pooled
from timeshare.memory.lane_pool import POOL_SLACK, LanePools, Once, pool_allowance

MIB = 1 << 20
_active = threading.local()  # the fake pool this thread allocates from


class FakePool:
    """A pool whose segments are whatever ``alloc`` asked for while it was active."""

    def __init__(self, held: int = 0):
        self.held = held
        self.activations = 0

    @contextmanager
    def activate(self):
        self.activations += 1
        _active.pool = self
        try:
            yield
        finally:
            _active.pool = None

    def held_bytes(self) -> int:
        return self.held


def alloc(nbytes: int) -> None:
    """An allocation on the fake device: it lands in the active pool, if any."""
    pool = getattr(_active, "pool", None)
    if pool is not None:
        pool.held += nbytes


def test_the_allowance_is_the_lane_rounded_to_the_allocators_granule_plus_one_large_segment():
    assert pool_allowance(1) == 2 * MIB + POOL_SLACK
    assert pool_allowance(2 * MIB) == 2 * MIB + POOL_SLACK
    assert pool_allowance(2 * MIB + 1) == 4 * MIB + POOL_SLACK


def test_a_call_within_its_lane_gives_its_pool_back_and_the_next_call_reuses_it():
    made: list[FakePool] = []
    pools = LanePools(lambda: made.append(FakePool()) or made[-1])
    lane = LaneBound("m", 3, 4 * MIB, metered=False)
    with pooled(pools, lane):
        alloc(3 * MIB)
    with pooled(pools, lane):
        alloc(1 * MIB)  # cached already: a real pool would not grow; the fake counts it anyway
    assert len(made) == 1 and made[0].activations == 2 and pools.idle == 1 and pools.dropped == 0


def test_a_call_that_takes_its_pool_beyond_the_lane_fails_alone_and_the_pool_is_dropped():
    made: list[FakePool] = []
    pools = LanePools(lambda: made.append(FakePool()) or made[-1])
    lane = LaneBound("greedy", 7, 4 * MIB, metered=False)
    with pytest.raises(LaneExceededError) as info, pooled(pools, lane):
        alloc(pool_allowance(4 * MIB) + 1)
    err = info.value
    assert err.task == "greedy" and err.lane == 7 and err.lane_bytes == 4 * MIB
    assert err.asked == pool_allowance(4 * MIB) + 1
    assert pools.idle == 0 and pools.dropped == 1  # never lent again: its memory goes back
    with pooled(pools, lane):  # the next call gets a fresh pool and runs
        alloc(MIB)
    assert len(made) == 2 and pools.idle == 1


def test_an_error_of_the_calls_own_gives_the_pool_back():
    pools = LanePools(FakePool)
    with pytest.raises(ValueError), pooled(pools, LaneBound("m", 0, 4 * MIB, metered=False)):
        alloc(MIB)
        raise ValueError("the model's own")
    assert pools.idle == 1 and pools.dropped == 0


def test_a_call_takes_the_fullest_idle_pool_within_its_allowance_else_a_new_one():
    small, full, huge = FakePool(MIB), FakePool(8 * MIB), FakePool(pool_allowance(4 * MIB) + MIB)
    pools = LanePools(FakePool)
    for p in (small, huge, full):
        pools.give_back(p, p.held)
    assert pools.acquire(4 * MIB) is full  # has the room cached already
    assert pools.acquire(4 * MIB) is small
    fresh = pools.acquire(4 * MIB)  # ``huge`` would fail the lane at once
    assert fresh not in (small, full, huge) and pools.made == 1
    assert pools.acquire(pool_allowance(4 * MIB) + MIB) is huge  # a larger lane may have it


def test_idle_pools_beyond_the_maximum_drop_the_fullest():
    pools = LanePools(FakePool, idle_max=2)
    a, b, c = FakePool(MIB), FakePool(30 * MIB), FakePool(2 * MIB)
    for p in (a, b, c):
        pools.give_back(p, p.held)
    assert pools.idle == 2 and pools.dropped == 1
    assert {pools.acquire(pool_allowance(64 * MIB)), pools.acquire(pool_allowance(64 * MIB))} == {a, c}


def test_on_the_cpu_a_measured_shape_runs_unmetered_and_an_unmeasured_one_metered_and_bounded():
    cpu = torch.device("cpu")
    with in_lane(LaneBound("m", 0, 1024, metered=False), cpu) as meter:
        assert meter is None and _get_current_dispatch_mode() is None
        torch.ones(1 << 16)  # beyond the lane: admission alone bounds a measured shape
    with pytest.raises(LaneExceededError), in_lane(LaneBound("m", 0, 1024), cpu) as meter:
        assert isinstance(meter, EphemeralMeter) and _get_current_dispatch_mode() is meter
        torch.ones(1 << 16)


def test_library_state_is_made_once_per_key_and_the_memory_of_keys_is_bounded():
    # NOTE [Library workspaces outside pools]: the warm-up runs the first time a (thread,
    # stream) is seen, never again for it; past its limit the set starts over (a repeat).
    made = []
    once = Once(lambda: made.append(1), limit=3)
    for key in ["a", "b", "a", "a", "b", "c"]:
        once(key)
    assert len(made) == once.runs == 3
    once("d")  # a fourth key: the remembered ones are forgotten first
    once("a")
    assert len(made) == 5 and once.runs == 5


def test_a_failed_warm_up_is_tried_again():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no device")

    once = Once(flaky)
    with pytest.raises(RuntimeError):
        once("k")
    once("k")
    once("k")
    assert len(calls) == 2 and once.runs == 1
