import random

import pytest

from timeshare.errors import ConfigError
from timeshare.transfer import planner
from timeshare.transfer.planner import CostModel


def test_cost_model_by_hand():
    # 3 layers; t = (2, 1, 1), c = (1, 1, 1), alpha = 0.5, beta = 0.25
    cost = CostModel((2.0, 1.0, 1.0), (1.0, 1.0, 1.0), 0.5, 0.25)
    # one group: T = 0.5 + 4 = 4.5; E = 4.5 + 0.25 + 3 = 7.75
    assert planner.first_inference_time(cost, (3,)) == pytest.approx(7.75)
    # per layer: T = 2.5, 4.0, 5.5; E = 3.75, max(3.75, 4.0) + 1.25 = 5.25, max(5.25, 5.5) + 1.25 = 6.75
    assert planner.first_inference_time(cost, (1, 2, 3)) == pytest.approx(6.75)
    # (1)(2,3): T = 2.5, 5.0; E = 3.75, max(3.75, 5.0) + 2.25 = 7.25
    assert planner.first_inference_time(cost, (1, 3)) == pytest.approx(7.25)
    assert planner.optimal(cost).ends == (1, 2, 3)


def _random_cost(rng: random.Random, n: int) -> CostModel:
    scale = rng.choice([0.01, 1.0, 100.0])
    return CostModel(
        tuple(rng.random() * scale for _ in range(n)),
        tuple(rng.random() * rng.choice([0.01, 1.0, 100.0]) for _ in range(n)),
        alpha=rng.choice([0.0, rng.random(), rng.random() * 10]),
        beta=rng.choice([0.0, rng.random(), rng.random() * 10]),
        latency=rng.choice([0.0, 0.0, rng.random(), rng.random() * 10]),
        queue=rng.choice([0.0, 0.0, rng.random() * 0.1, rng.random(), rng.random() * 10]),
    )


@pytest.mark.parametrize("seed", range(300))
def test_optimal_matches_brute_force(seed):
    rng = random.Random(seed)
    cost = _random_cost(rng, rng.randint(1, 10))
    best = planner.brute_force(cost)
    got = planner.optimal(cost)
    assert got.predicted_s == pytest.approx(best.predicted_s, rel=1e-9, abs=1e-12)
    assert planner.first_inference_time(cost, got.ends) == pytest.approx(got.predicted_s)


@pytest.mark.parametrize("seed", range(20))
def test_optimal_is_never_worse_than_the_baselines(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(20, 200)
    cost = _random_cost(rng, n)
    layer_bytes = [rng.randint(1, 1 << 22) for _ in range(n)]
    opt = planner.optimal(cost).predicted_s
    for other in (planner.whole(cost), planner.per_layer(cost), planner.fixed(cost, layer_bytes, 2 << 20)):
        assert opt <= other.predicted_s * (1 + 1e-12)


def test_queueing_cost_by_hand():
    # the same layers as above, queued at q = 0.75 per group (q > alpha)
    cost = CostModel((2.0, 1.0, 1.0), (1.0, 1.0, 1.0), 0.5, 0.25, queue=0.75)
    # one group: E_0 = 0.75; T = max(0.75 + 0.5, 0.75 + 0.5) + 4 = 5.25; E = 5.25 + 3.25 = 8.5
    assert planner.first_inference_time(cost, (3,)) == pytest.approx(8.5)
    # per layer: E_0 = 2.25; T = 1.25 + 2, max(1.75, 2.0) + 3, max(2.25, 2.75) + 4 = 3.25, 5.0, 6.75
    # E = max(2.25, 3.25) + 1.25 = 4.5, max(4.5, 5.0) + 1.25 = 6.25, max(6.25, 6.75) + 1.25 = 8.0
    assert planner.first_inference_time(cost, (1, 2, 3)) == pytest.approx(8.0)
    # (1, 2)(3): E_0 = 1.5; T = 1.25 + 3, 2.0 + 4 = 4.25, 6.0; E = 4.25 + 2.25 = 6.5, max(6.5, 6.0) + 1.25
    assert planner.first_inference_time(cost, (2, 3)) == pytest.approx(7.75)
    # per layer was optimal without queueing (above); charging it makes two groups better
    assert planner.optimal(cost).ends == (2, 3)


def _pipeline(cost: CostModel, ends) -> float:
    """E_m by the exact recurrences of the three stages (queue, copy, compute), which the
    cost model bounds (NOTE [Pipeline cost model])."""
    t_done, e_done, start = 0.0, len(ends) * cost.queue, 0
    for k, end in enumerate(ends, 1):
        t_done = max(t_done, k * cost.queue) + cost.alpha + sum(cost.transfer[start:end])
        e_done = max(e_done, t_done + cost.latency) + cost.beta + sum(cost.compute[start:end])
        start = end
    return e_done


@pytest.mark.parametrize("seed", range(100))
def test_the_model_is_exact_when_the_host_keeps_ahead_and_a_bound_otherwise(seed):
    rng = random.Random(5000 + seed)
    n = rng.randint(1, 12)
    base = _random_cost(rng, n)
    # half the cases with a host slower than the copy engine, some with cheap copies
    queue = base.alpha * rng.choice([0.0, 0.5, 1.0, 2.0, 10.0]) + rng.choice([0.0, rng.random()])
    cost = CostModel(tuple(t * rng.choice([0.01, 1.0]) for t in base.transfer), base.compute, base.alpha,
                     base.beta, base.latency, queue)
    ends = tuple(sorted(set(rng.sample(range(1, n), rng.randint(0, n - 1))) | {n}))
    model, exact = planner.first_inference_time(cost, ends), _pipeline(cost, ends)
    if cost.queue <= cost.alpha:
        assert model == pytest.approx(exact, rel=1e-9, abs=1e-12)
    else:
        slack = (len(ends) - 1) * (cost.queue - cost.alpha)
        assert exact * (1 - 1e-9) <= model <= (exact + slack) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("seed", range(100))
def test_optimal_matches_brute_force_when_queueing_dominates(seed):
    # the host is slower than the copies, and groups are cheap to copy: q > alpha + t
    rng = random.Random(7000 + seed)
    n = rng.randint(1, 10)
    cost = CostModel(
        tuple(rng.random() * 0.1 for _ in range(n)),
        tuple(rng.random() * rng.choice([0.1, 1.0, 10.0]) for _ in range(n)),
        alpha=rng.random() * 0.1,
        beta=rng.choice([0.0, rng.random()]),
        latency=rng.choice([0.0, rng.random()]),
        queue=rng.choice([0.5, 1.0, 5.0]) * rng.random(),
    )
    best, got = planner.brute_force(cost), planner.optimal(cost)
    assert got.predicted_s == pytest.approx(best.predicted_s, rel=1e-9, abs=1e-12)
    assert planner.first_inference_time(cost, got.ends) == pytest.approx(got.predicted_s)


def test_queueing_delays_the_forward_by_a_group_count():
    # Free copies: without queueing per layer is optimal (each layer computes as soon as
    # the one before it); each group's queueing delays the forward, so one group wins.
    free = CostModel((0.0,) * 6, (1.0,) * 6)
    queued = CostModel((0.0,) * 6, (1.0,) * 6, queue=0.5)
    assert planner.first_inference_time(queued, tuple(range(1, 7))) == pytest.approx(3.0 + 6.0)
    assert planner.optimal(queued).ends == (6,)
    assert planner.optimal(queued).predicted_s == pytest.approx(planner.optimal(free).predicted_s + 0.5)


def test_latency_is_paid_only_when_the_compute_waits():
    # transfer-bound: every group's arrival is waited for, so each pays L
    cost = CostModel((2.0, 2.0), (1.0, 1.0), latency=0.5)
    # T = 2, 4; E = 2.5 + 1 = 3.5, max(3.5, 4.5) + 1 = 5.5
    assert planner.first_inference_time(cost, (1, 2)) == pytest.approx(5.5)
    # compute-bound after the first group: the second arrival is not waited for
    cost = CostModel((1.0, 0.1), (5.0, 1.0), latency=0.5)
    # T = 1, 1.1; E = 1.5 + 5 = 6.5, max(6.5, 1.6) + 1 = 7.5
    assert planner.first_inference_time(cost, (1, 2)) == pytest.approx(7.5)
    # balanced layers: only the first arrival is waited for, so L is paid once
    balanced = CostModel((1.0,) * 6, (1.0,) * 6)
    slow = CostModel((1.0,) * 6, (1.0,) * 6, latency=100.0)
    assert planner.optimal(slow).predicted_s == pytest.approx(planner.optimal(balanced).predicted_s + 100.0)


def test_extremes_choose_the_obvious_grouping():
    # Huge per-group overheads: one group. Free groups and transfer-bound: per layer is optimal.
    n = 8
    assert planner.optimal(CostModel((1.0,) * n, (1.0,) * n, 1e6, 1e6)).ends == (n,)
    free = CostModel((1.0,) * n, (1.0,) * n, 0.0, 0.0)
    assert planner.optimal(free).predicted_s == pytest.approx(planner.per_layer(free).predicted_s)


def test_fixed_groups_pack_bytes_greedily():
    cost = CostModel((1.0,) * 5, (1.0,) * 5)
    assert planner.fixed(cost, [3, 3, 3, 10, 1], 6).ends == (2, 3, 4, 5)
    with pytest.raises(ConfigError, match="2 layer sizes for 5 layers"):
        planner.fixed(cost, [1, 2], 6)


def test_invalid_inputs_are_rejected():
    with pytest.raises(ConfigError, match="at least one layer"):
        CostModel((), ())
    with pytest.raises(ConfigError, match="non-negative"):
        CostModel((1.0,), (-1.0,))
    with pytest.raises(ConfigError, match="non-negative"):
        CostModel((1.0,), (1.0,), latency=-1.0)
    with pytest.raises(ConfigError, match="non-negative"):
        CostModel((1.0,), (1.0,), queue=-1.0)
    with pytest.raises(ConfigError, match="3 transfer times but 2"):
        CostModel((1.0,) * 3, (1.0,) * 2)
    cost = CostModel((1.0,) * 3, (1.0,) * 3)
    with pytest.raises(ConfigError, match="do not cut"):
        planner.first_inference_time(cost, (2, 2, 3))
    with pytest.raises(ConfigError, match="unknown grouping strategy 'nope'"):
        planner.make_plan("nope", cost, [1, 1, 1])
    with pytest.raises(ConfigError, match="brute force"):
        planner.brute_force(CostModel((1.0,) * 20, (1.0,) * 20))


def test_large_instance_is_fast_enough():
    import time

    rng = random.Random(7)
    cost = _random_cost(rng, 500)  # ResNet-152 has about 470 layers
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        plan = planner.optimal(cost)
        seconds.append(time.perf_counter() - start)
    assert plan.ends[-1] == 500
    # About 0.1 s here: a planner run at every first load must stay far below a second.
    assert min(seconds) < 2.0, seconds
