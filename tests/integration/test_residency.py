"""The runtime's residency runs the simulator's make-room loop with the eviction policy
fed real, measured reload times (NOTE [Measured reload times]) and, when asked, the
thrashing detector."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import timeshare
from timeshare.scheduler.eviction import LRUPolicy
from timeshare.scheduler.thrashing import NothingToEvict, ThrashingDetector, make_room

BIG = 8 * 1024 * 1024 + 4096  # nn.Linear(2048, 1024) in fp32, each tensor 512-byte aligned
SMALL = 16640 + 256  # nn.Linear(64, 64)


def big() -> nn.Module:
    return nn.Linear(2048, 1024)


def small() -> nn.Module:
    return nn.Linear(64, 64)


def _resident_after_pressure(policy: str) -> set[str]:
    """``big`` (slow to reload) is used, then ``s1`` (fast); ``s2`` then needs room for one
    of them. LRU evicts ``big``, the least recently used; cost-aware evicts ``s1``."""
    xb, xs = torch.randn(2, 2048), torch.randn(2, 64)
    with timeshare.Runtime(device="cpu", memory=BIG + SMALL + 4096, eviction=policy, profile_repeats=1) as rt:
        rt.register("big", big, None, (xb,))
        rt.register("s1", small, None, (xs,))
        rt.register("s2", small, None, (xs,))
        for name, x in (("big", xb), ("s1", xs), ("s2", xs)):
            rt.infer(name, x)  # first load: traced and profiled
            rt.evict(name)
            rt.infer(name, x)  # a pipelined load: its copies are timed
            rt.evict(name)
        rt.infer("big", xb)
        rt.infer("s1", xs)
        assert set(rt.resident()) == {"big", "s1"}
        assert rt.is_resident("big") and not rt.is_resident("s2") and not rt.is_resident("nope")
        rt.infer("s2", xs)
        return set(rt.resident())


def test_cost_aware_eviction_keeps_the_model_dearest_to_reload_where_lru_would_not():
    assert _resident_after_pressure("lru") == {"s1", "s2"}
    assert _resident_after_pressure("cost") == {"big", "s2"}


def test_thrashing_control_asks_for_longer_batches_while_loads_dominate():
    x = torch.randn(2, 64)
    for thrashing, expect_more in ((True, True), (False, False)):
        with timeshare.Runtime(device="cpu", memory="8MiB", profile_repeats=1, thrashing=thrashing,
                               copy_delay_s=0.005) as rt:  # loads that take a while
            rt.register("m", small, None, (x,))
            rt.infer("m", x)
            assert rt.thrashing_factor() >= 1.0
            for _ in range(5):
                rt.evict("m")
                rt.infer("m", x)  # every call loads: loads dominate the device's time
            assert (rt.thrashing_factor() > 1.0) is expect_more


def test_make_room_evicts_in_victim_order_until_the_placement_fits_and_says_when_it_cannot():
    policy = LRUPolicy()
    for i, m in enumerate("abc"):
        policy.admitted(m, float(i))
    free = {"room": 0}
    evicted_here = []

    def evict(name):
        policy.removed(name)
        evicted_here.append(name)
        free["room"] += 1

    placed, evicted = make_room(policy, None, 10.0, {"a"}, lambda: "spot" if free["room"] >= 2 else None, evict)
    assert placed == "spot" and evicted == evicted_here == ["b", "c"]  # a is protected
    with pytest.raises(NothingToEvict, match="every resident model is protected"):
        make_room(policy, None, 10.0, {"a"}, lambda: None, evict)


def test_make_room_spares_hot_models_while_thrashing():
    policy, detector = LRUPolicy(), ThrashingDetector(window_s=10.0, threshold=0.5)
    policy.admitted("cold", 0.0)
    policy.admitted("hot", 1.0)
    detector.loaded("hot", 5.0, 4.0)  # mostly loading lately: thrashing, and "hot" was used
    assert detector.thrashing(5.0)
    policy.touched("cold", 5.0)  # LRU alone would now evict "hot"
    _, evicted = make_room(policy, detector, 5.0, set(), iter([None, "ok"]).__next__, policy.removed)
    assert evicted == ["cold"]
