"""NOTE [Fleet routing]: each policy's decision on hand-built fleet states, and ``place``'s
evictions and owed reloads, worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from timeshare.errors import ConfigError
from timeshare.scheduler.routing import NO_DEVICE, Fleet, Router, choose, place, queued

MB = 1_000_000
U = np.zeros(4)


def fleet(sizes=(100 * MB, 100 * MB, 100 * MB), devices=3, capacity=250 * MB, **kw) -> Fleet:
    m = len(sizes)
    compute = np.full(m, 0.010)
    cold = np.full(m, 0.015)
    load = np.array(sizes, dtype=float) / 10e9
    return Fleet.create(sizes, compute, cold, load, np.full(devices, capacity), **kw)


def route(f: Fleet, policy: int, model: int, now: float, u=U) -> int:
    return int(choose(policy, model, now, np.asarray(u, float), f.params(), f.arrays()))


def put(f: Fleet, model: int, device: int, now: float, until: float) -> None:
    place(model, device, now, f.params(), f.arrays())
    queued(device, model, until, f.arrays())


def test_random_follows_the_numbers_it_is_given_and_skips_devices_too_small():
    f = fleet()
    assert [route(f, 0, 0, 0.0, [x, 0, 0, 0]) for x in (0.0, 0.4, 0.9)] == [0, 1, 2]
    small = Fleet.create([300 * MB], [0.01], [0.02], [0.03], [250 * MB, 400 * MB, 250 * MB])
    assert route(small, 0, 0, 0.0, [0.0, 0, 0, 0]) == 1  # device 0 is too small: the next that fits


def test_least_loaded_is_the_device_whose_queue_drains_first_through_any_updates():
    f = fleet(devices=7)
    rng = np.random.default_rng(3)
    for step in range(200):
        d = int(rng.integers(7))
        put(f, 0, d, 0.0, float(rng.random() * 10))
        assert route(f, 1, 0, 0.0) == int(np.argmin(f.free_at)), step


def test_least_loaded_passes_over_a_device_too_small_for_the_model():
    # Device 0 drains first (idle) but cannot hold model 0: of the others, the one that drains first.
    f = Fleet.create([300 * MB, 100 * MB], [0.01] * 2, [0.02] * 2, [0.03] * 2, [250 * MB, 400 * MB, 400 * MB])
    put(f, 1, 1, 0.0, 5.0)
    put(f, 1, 2, 0.0, 1.0)
    assert route(f, 1, 0, 0.0) == 2


def test_ray_prefers_a_holder_until_it_has_max_ongoing_requests_then_the_replica_with_fewest_models():
    f = fleet(max_models=2, max_ongoing=3)
    put(f, 0, 1, 0.0, 0.02)  # model 0 on device 1, two requests' work queued (compute 10 ms)
    put(f, 1, 2, 0.0, 0.0)
    put(f, 2, 2, 0.0, 0.0)
    assert route(f, 2, 0, 0.0, [0.5, 0.5, 0.0, 0.99]) == 1  # the holder, 2 < 3 outstanding
    queued(1, 0, 0.05, f.arrays())  # now 5 requests' work
    # Past max_ongoing: two random replicas (u[2] -> 0, u[3] -> 2); device 0 holds no model, 2 holds two.
    assert route(f, 2, 0, 0.0, [0.5, 0.5, 0.0, 0.99]) == 0
    # Count limit: device 2 is full by count (2 models) although bytes would fit a third.
    assert place(0, 2, 0.1, f.params(), f.arrays()) == (False, 0.0, 0)
    assert f.nmodels[2] == 2 and f.slot_of[1, 2] == -1  # model 1, least recently routed, went


def test_timeshare_stays_on_the_holder_until_the_wait_is_a_burst():
    f = fleet(replicate_margin=16.0)  # model 0's cold time: 15 ms -> a burst is a wait over 240 ms
    put(f, 0, 1, 0.0, 0.1)
    assert route(f, 3, 0, 0.0) == 1  # 100 ms of wait: stays
    queued(1, 0, 0.5, f.arrays())
    # 500 ms: a burst. A new replica on the least loaded device (0 or 2, both idle) ends at
    # 15 ms, far sooner than the holder's 510 ms.
    assert route(f, 3, 0, 0.0) in (0, 2)


def test_timeshare_replicates_a_model_whose_demand_needs_more_replicas():
    f = fleet(replicate_margin=1000.0)  # no bursts: only demand adds replicas
    put(f, 0, 1, 0.0, 0.001)
    for i in range(1, 2001):  # 100 requests per second for 20 s: 1 device's worth at 10 ms each
        place(0, 1, i * 0.01, f.params(), f.arrays())
    now = 20.0
    queued(1, 0, now + 0.05, f.arrays())  # the holder is 50 ms from drained
    assert route(f, 3, 0, now) != 1  # demand wants ceil(1.0 / 0.3) = 4 replicas and a new one is sooner


def test_place_evicts_the_least_recently_routed_idle_model_first_and_charges_busy_evictions():
    f = fleet(sizes=(100 * MB, 100 * MB, 100 * MB, 100 * MB), devices=1, capacity=250 * MB)
    put(f, 0, 0, 0.0, 5.0)  # busy until 5 s
    put(f, 1, 0, 1.0, 1.5)
    assert place(1, 0, 2.0, f.params(), f.arrays()) == (True, 0.0, 0)  # resident: no load
    # Model 2 needs room: model 0 is older but busy, model 1 is idle -> 1 goes, nothing owed.
    assert place(2, 0, 3.0, f.params(), f.arrays()) == (False, 0.0, 0)
    assert f.slot_of[1, 0] == -1 and f.slot_of[0, 0] >= 0 and f.used[0] == 200 * MB
    queued(0, 2, 6.0, f.arrays())
    # Model 3 at 4 s: both residents are busy; the least recently routed (0) goes and owes its load.
    resident, owed_s, owed_n = place(3, 0, 4.0, f.params(), f.arrays())
    assert not resident and owed_n == 1 and owed_s == pytest.approx(100 * MB / 10e9)
    assert f.nholders[0] == 0 and list(f.holders[3, :1]) == [0]


def test_a_model_larger_than_every_device_is_refused_clearly():
    f = fleet(sizes=(100 * MB, 300 * MB))
    assert route(f, 3, 1, 0.0) == NO_DEVICE
    with pytest.raises(ConfigError, match="fits on no device"):
        Router(f, "timeshare").route(1, 0.0)
    with pytest.raises(ConfigError, match="unknown routing policy"):
        Router(f, "round-robin")


def test_the_router_from_python_makes_the_same_decisions_as_the_compiled_steps():
    a, b = fleet(devices=4), fleet(devices=4)
    router = Router(a, "ray", seed=7)
    rng = np.random.default_rng(7)
    for i in range(50):
        model, now = i % 3, i * 0.004
        placed = router.route(model, now)
        router.queued(placed.device, model, now + 0.01)
        u = rng.random(4)
        d = route(b, 2, model, now, u)
        resident, _, _ = place(model, d, now, b.params(), b.arrays())
        queued(d, model, now + 0.01, b.arrays())
        assert (placed.device, placed.loads) == (d, not resident)


@pytest.mark.parametrize("policy", [0, 1, 2, 3])
def test_the_fleets_books_stay_consistent_through_many_random_requests(policy):
    sizes = [60 * MB, 100 * MB, 140 * MB, 80 * MB, 120 * MB, 90 * MB]
    f = fleet(sizes=sizes, devices=4, capacity=260 * MB, max_models=2 if policy == 2 else 0)
    rng = np.random.default_rng(policy)
    now = 0.0
    for _ in range(3000):
        now += float(rng.exponential(0.004))
        model = int(rng.integers(len(sizes)))
        d = route(f, policy, model, now, rng.random(4))
        resident, _, _ = place(model, d, now, f.params(), f.arrays())
        queued(d, model, max(now, f.free_at[d]) + (0.01 if resident else 0.015), f.arrays())
    for d in range(4):
        here = [m for m in range(len(sizes)) if f.slot_of[m, d] >= 0]
        assert f.used[d] == sum(sizes[m] for m in here) <= 260 * MB and f.nmodels[d] == len(here)
        order, k = [], f.ends[d, 0]
        while k >= 0:  # the recency list holds exactly the resident models' slots
            order.append(int(f.slot_model[d, k]))
            k = f.links[d, k, 1]
        assert sorted(order) == here
    for m in range(len(sizes)):
        n = f.nholders[m]
        held = sorted(int(x) for x in f.holders[m, :n])
        assert held == [d for d in range(4) if f.slot_of[m, d] >= 0]
        assert all(f.holder_pos[m, f.holders[m, k]] == k for k in range(n))
    assert sorted(f.heap) == list(range(4)) and all(f.heap_pos[f.heap[i]] == i for i in range(4))


def test_a_retired_device_is_never_chosen_and_an_admitted_one_starts_empty():
    f = fleet(devices=3)
    router = Router(f, "timeshare")
    put(f, 0, 1, 0.0, 0.001)
    router.retire(1)
    assert f.nholders[0] == 0 and f.used[1] == 0 and f.capacity[1] == 0
    for policy in (0, 1, 2, 3):
        assert all(route(f, policy, 0, 1.0, u) != 1 for u in np.random.default_rng(policy).random((50, 4)))
    router.admit(1, 250 * MB, now=2.0)
    assert f.capacity[1] == 250 * MB and f.nmodels[1] == 0 and f.free_at[1] == 2.0
    with pytest.raises(ConfigError, match="one device must have memory"):
        Fleet.create([MB], [0.01], [0.02], [0.001], [0, 0])


def test_drained_drops_the_estimates_and_admit_refuses_a_device_larger_than_the_fleet_was_sized_for():
    f = fleet(devices=2)
    router = Router(f, "timeshare")
    put(f, 0, 0, 0.0, 5.0)
    put(f, 1, 0, 0.0, 6.0)
    router.drained(0, 1.0)  # everything finished early
    assert f.free_at[0] == 1.0 and f.slot_busy[0].max() <= 1.0
    # Nothing is busy now: room for model 2 evicts the least recent (model 0) and owes nothing.
    assert place(2, 0, 1.5, f.params(), f.arrays()) == (False, 0.0, 0)
    with pytest.raises(ConfigError, match="larger than this fleet was sized for"):
        router.admit(1, 10**12, now=2.0)


def test_cpu_fallback_when_it_ends_sooner_than_the_device_queue():
    from timeshare.scheduler.routing import cpu_sooner

    # An idle device beats a slower CPU, and even a faster one; a device busy for 1 s loses to it.
    assert not cpu_sooner(10.0, device_free_at=9.0, device_s=0.01, cpu_free_at=0.0, cpu_s=0.05)
    assert not cpu_sooner(10.0, device_free_at=10.0, device_s=0.05, cpu_free_at=0.0, cpu_s=0.01)
    assert cpu_sooner(10.0, device_free_at=11.0, device_s=0.01, cpu_free_at=0.0, cpu_s=0.05)
    # The CPU's own queue counts; a tie stays on the device.
    assert not cpu_sooner(10.0, device_free_at=11.0, device_s=0.01, cpu_free_at=11.0, cpu_s=0.05)
    assert not cpu_sooner(10.0, device_free_at=10.5, device_s=0.05, cpu_free_at=10.5, cpu_s=0.05)


def test_route_is_choose_then_place():
    sizes, ready, cold = [10, 20, 30], [0.01, 0.02, 0.03], [0.1, 0.2, 0.3]
    one = Router(Fleet.create(sizes, ready, cold, cold, [40, 40]), "timeshare", seed=1)
    two = Router(Fleet.create(sizes, ready, cold, cold, [40, 40]), "timeshare", seed=1)
    for t, m in enumerate([0, 1, 2, 0, 2, 1, 1, 0]):
        a = one.route(m, float(t))
        d = two.choose(m, float(t))
        assert two.cost_s(m, d) == (cold[m] if a.loads else ready[m])
        assert two.place(m, d, float(t)) == a
