"""Salus's Table 1: the trace family, the multi-device dispatcher, the calibration
against Salus's FIFO row and the claims of the table that hold here
(NOTE [Salus arrival calibration], NOTE [Device dispatch])."""

import json
import math

import numpy as np
import pytest

from timeshare.errors import ConfigError, TimeshareError
from timeshare.scheduler import Kind, Preempt, Run, Scheduler
from timeshare.sim.calibrate import SearchGrid, calibrate, evaluate
from timeshare.sim.cluster import Cluster
from timeshare.sim.costs import ModelCosts, WorkloadCosts
from timeshare.sim.engine import Simulator
from timeshare.sim.table1 import (
    CALIBRATED,
    CALIBRATION_SEEDS,
    SALUS_TABLE1,
    SalusPool,
    fifo_figures,
    relative_errors,
    run_policy,
    salus,
)
from timeshare.sim.trace import Arrival, SalusArrivals, exact_counts, length_tiers

TRAIN = Kind.TRAINING


@pytest.fixture(scope="module")
def pool() -> SalusPool:
    return SalusPool.load()


# ---------------------------------------------------------------- the trace family
def test_counts_are_exact_and_sum_to_n():
    assert exact_counts((0.76, 0.12, 0.12), 100) == [76, 12, 12]
    assert exact_counts((1, 1, 1), 100) == [34, 33, 33]
    assert exact_counts((0.29, 0.355, 0.355), 100) == [29, 36, 35]  # largest remainder, ties to the first
    assert sum(exact_counts((0.2, 0.3, 0.5), 7)) == 7


def test_trace_has_the_mix_the_order_and_the_gaps_asked_for(pool):
    tiers = length_tiers(sorted(pool.costs.models), pool.iterations)
    tier_of = {j: k for k, t in enumerate(tiers) for j in t}
    arr = SalusArrivals.one_knob_mix(mean_interarrival_s=0.0, not_short=0.3, order_correlation=1.0)
    trace = pool.trace(arr, seed=3)
    assert np.bincount([tier_of[a.model] for a in trace], minlength=3).tolist() == [70, 15, 15]
    assert all(a.time == 0.0 and a.kind is TRAIN and a.work == pool.iterations[a.model] for a in trace)
    solo = [pool.solo_s[a.model] for a in trace]
    assert solo == sorted(solo, reverse=True)  # correlation 1: longest first

    gaps = np.diff([a.time for a in pool.trace(SalusArrivals(45.0, (1.0, 0, 0)), jobs=2000, seed=1)])
    assert gaps.min() >= 0 and gaps.mean() == pytest.approx(45.0, rel=0.06)
    assert gaps.std() == pytest.approx(45.0, rel=0.1)  # exponential: the spread equals the mean


def test_order_correlation_moves_long_jobs_forward(pool):
    def mean_position_of_long(rho: float) -> float:
        trace = pool.trace(SalusArrivals.one_knob_mix(0.0, 0.3, rho), seed=0)
        solo = np.array([pool.solo_s[a.model] for a in trace])
        return float(np.mean(np.flatnonzero(solo > 480)))

    positions = [mean_position_of_long(rho) for rho in (0.0, 0.55, 0.9)]
    assert positions[0] > positions[1] > positions[2]


@pytest.mark.parametrize("bad", [
    dict(mean_interarrival_s=-1.0, length_mix=(1, 1, 1)),
    dict(mean_interarrival_s=math.inf, length_mix=(1, 1, 1)),
    dict(mean_interarrival_s=1.0, length_mix=(1, 1)),
    dict(mean_interarrival_s=1.0, length_mix=(0, 0, 0)),
    dict(mean_interarrival_s=1.0, length_mix=(1, 1, 1), order_correlation=1.5),
])
def test_bad_arrival_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        SalusArrivals(**bad)


def test_trace_is_deterministic_for_a_seed(pool):
    arr = CALIBRATED[1]
    assert pool.trace(arr, seed=4) == pool.trace(arr, seed=4)
    assert pool.trace(arr, seed=4) != pool.trace(arr, seed=5)


# ---------------------------------------------------------------- several devices
def _costs(*models: ModelCosts) -> WorkloadCosts:
    return WorkloadCosts({m.name: m for m in models}, "by hand")


def test_two_devices_under_fifo_are_one_central_queue_worked_out_by_hand():
    costs = _costs(ModelCosts("a", unit_s=1.0), ModelCosts("b", unit_s=1.0, startup_s=2.0))
    trace = [Arrival(0.0, TRAIN, "a", 10), Arrival(0.0, TRAIN, "a", 3), Arrival(1.0, TRAIN, "b", 4),
             Arrival(2.0, TRAIN, "a", 1), Arrival(4.0, TRAIN, "a", 2)]
    cluster = Cluster([Scheduler("fifo"), Scheduler("fifo")], costs)
    res = cluster.run(trace)
    # Device 0: job 0 (0 -> 10). Device 1: job 1 (0 -> 3), then job 2 waits for the first
    # free device: device 1 at 3, start-up 2 + 4 -> 9. Job 3 arrives at 2: device 1 has
    # 1 s + job 2's 6 s left, device 0 8 s: device 1, 9 -> 10. Job 4 at 4: device 0 has
    # 6 s left, device 1 5 + 1 = 6 s: a tie, the lower index, 10 -> 12.
    assert cluster.placement == {0: 0, 1: 1, 2: 1, 3: 1, 4: 0}
    got = sorted(zip(res.arrivals, res.starts, res.finishes))
    assert [x for row in got for x in row] == pytest.approx(
        [0.0, 0.0, 3.0, 0.0, 0.0, 10.0, 1.0, 3.0, 9.0, 2.0, 9.0, 10.0, 4.0, 10.0, 12.0])
    r = res.report()
    assert r["devices"] == 2 and r["makespan_s"] == pytest.approx(12.0)
    assert r["utilization"] == pytest.approx((10 + 2 + 3 + 6 + 1) / (2 * 12.0))


def test_fifo_on_two_devices_matches_a_central_queue_on_a_real_trace(pool):
    trace = pool.trace(CALIBRATED[2], seed=0)
    res = Cluster([Scheduler("fifo"), Scheduler("fifo")], pool.costs).run(trace)
    free = [0.0, 0.0]
    starts = []
    for a in trace:
        k = int(np.argmin(free))
        starts.append(max(free[k], a.time))
        free[k] = starts[-1] + pool.solo_s[a.model]
    assert sorted(res.starts) == pytest.approx(sorted(starts), abs=1e-6)


@pytest.mark.parametrize("policy", ["fifo", "srtf", "pack", "fair"])
def test_one_device_cluster_replays_exactly_like_the_simulator(pool, policy):
    trace = pool.trace(CALIBRATED[1], jobs=40, seed=2)

    def sched():
        return Scheduler(policy, capacity=int(16e9), quantum_s=2.0 if policy == "fair" else None)

    assert Cluster([sched()], pool.costs).run(trace).report() == Simulator(sched(), pool.costs).run(trace).report()


def test_cluster_needs_its_own_scheduler_per_device():
    s = Scheduler("fifo")
    with pytest.raises(ConfigError, match="its own scheduler"):
        Cluster([s, s], _costs(ModelCosts("a", unit_s=1.0)))
    with pytest.raises(ConfigError, match="at least one"):
        Cluster([], _costs(ModelCosts("a", unit_s=1.0)))


# ---------------------------------------------------------------- the calibration
@pytest.mark.parametrize("devices", [1, 2])
def test_calibrated_fifo_is_within_10_percent_of_salus(pool, devices):
    errors = relative_errors(fifo_figures(pool, CALIBRATED[devices], devices=devices))
    assert abs(errors["makespan_min"]) <= 0.10 and abs(errors["avg_queuing_min"]) <= 0.10
    # The fit used all four FIFO figures and came within 2% of each (docs/table1.md).
    assert max(abs(e) for e in errors.values()) <= 0.02, errors


@pytest.mark.parametrize("devices", [1, 2])
def test_calibrated_values_are_the_best_point_of_the_fine_grid_around_them(pool, devices):
    """The defaults are what the search finds, not numbers typed in: one fine step
    either way in each parameter is worse."""
    c = CALIBRATED[devices]
    q = 1.0 - c.length_mix[0]
    q = round(q, 4)
    grid = SearchGrid([round(q - 0.01, 4), q, round(q + 0.01, 4)],
                      [round(c.order_correlation + d, 4) for d in (-0.05, 0.0, 0.05)],
                      [max(0.0, c.mean_interarrival_s + d) for d in (-3.0, 0.0, 3.0)])
    best = evaluate(pool, grid, devices=devices, seeds=CALIBRATION_SEEDS, jobs=100)[0]
    assert (best["not_short"], best["order_correlation"], best["mean_interarrival_s"]) == (
        q, c.order_correlation, c.mean_interarrival_s)


def test_calibration_finds_the_best_point_of_a_grid_and_checks_held_out_seeds(pool):
    grid = SearchGrid([0.2, 0.24], [0.0, 0.55], [0.0, 30.0])
    result = calibrate(pool=pool, devices=1, seeds=range(3), coarse=grid, refine=False)
    best = result["best"]
    assert (best["not_short"], best["order_correlation"], best["mean_interarrival_s"]) == (0.24, 0.55, 30.0)
    assert best["held_out"]["seeds"] == list(range(10, 20))
    assert result["search"]["coarse"]["points"] == 8
    assert [r["score"] for r in result["search"]["coarse"]["best"]] == sorted(
        r["score"] for r in result["search"]["coarse"]["best"])


def test_in_random_order_fifo_rarely_queues_as_long_as_salus(pool):
    """Why the family has an order parameter: Salus's FIFO queues 55% of its makespan;
    jobs in random order average under half even when all arrive at once, and few
    traces reach Salus's ratio (NOTE [Salus arrival calibration])."""
    salus_ratio = SALUS_TABLE1["fifo"]["avg_queuing_min"] / SALUS_TABLE1["fifo"]["makespan_min"]

    def ratios(arrivals: SalusArrivals, seeds) -> np.ndarray:
        runs = [run_policy(pool, "fifo", pool.trace(arrivals, seed=s)) for s in seeds]
        return np.array([r["avg_queuing_min"] / r["makespan_min"] for r in runs])

    random_order = ratios(SalusArrivals.one_knob_mix(0.0, 0.26, 0.0), range(100))
    assert random_order.mean() < 0.5 < salus_ratio and (random_order >= salus_ratio).mean() < 0.06
    assert ratios(CALIBRATED[1], CALIBRATION_SEEDS).mean() == pytest.approx(salus_ratio, abs=0.02)


# ---------------------------------------------------------------- the table
@pytest.fixture(scope="module")
def table_1dev(pool) -> dict:
    return salus(pool=pool, seeds=3)


def test_table_reports_every_policy_beside_salus(table_1dev):
    r = table_1dev
    assert r["config"]["devices"] == 1 and r["config"]["seeds"] == [0, 1, 2]
    assert r["config"]["arrivals"]["calibrated"] is True
    for p, row in r["table"].items():
        assert row["unfinished"] == 0
        assert set(SALUS_TABLE1[p]) <= set(row)
        assert r["spread"][p]["makespan_min"]["min"] <= row["makespan_min"] <= r["spread"][p]["makespan_min"]["max"]
        assert len(r["per_seed"][p]) == 3


def test_table_orderings_that_hold(table_1dev):
    """PACK has the best makespan and SRTF the best average JCT, as in Salus's table;
    FIFO's mean run (avg JCT - avg queuing) is Salus's 3.0 min on one device."""
    t, c = table_1dev["table"], table_1dev["criteria"]
    assert c["fifo_within_10pct"]["holds"]
    assert c["pack_best_makespan"]["holds"] and c["pack_best_makespan"]["share_of_seeds"] == 1.0
    assert min(t, key=lambda p: t[p]["avg_jct_min"]) == "srtf"
    assert c["fifo_mean_run_min"]["ours"] == pytest.approx(3.0, abs=0.2)


def _avg_jct(pool, policy: str, capacity_gb, seeds=range(3)) -> float:
    return float(np.mean([run_policy(pool, policy, pool.trace(CALIBRATED[1], seed=s), capacity_gb=capacity_gb)
                          ["avg_jct_min"] for s in seeds]))


def test_srtf_is_not_a_third_of_fifo_and_memory_is_not_why(pool, table_1dev):
    """A documented difference from Salus (docs/table1.md): SRTF's avg JCT is about 0.36
    of FIFO's on the FIFO-calibrated traces, not <= 1/3; the same traces without the
    memory model give the same SRTF."""
    c = table_1dev["criteria"]["srtf_avg_jct_at_most_a_third_of_fifo"]
    assert 1 / 3 < c["ratio"] < 0.45 and c["holds"] is False
    assert _avg_jct(pool, "srtf", None) == pytest.approx(table_1dev["table"]["srtf"]["avg_jct_min"], rel=0.01)


def test_fair_is_fifo_like_because_admitted_jobs_keep_their_memory(pool, table_1dev):
    """A documented difference from Salus: FAIR's avg JCT is FIFO's (Salus: 0.37 of the
    way from SRTF to FIFO). Preempted jobs keep their memory, so few jobs share the
    device and the rest wait in arrival order; without the memory model FAIR moves
    clearly between SRTF and FIFO."""
    t = table_1dev["table"]
    assert table_1dev["criteria"]["fair_between_srtf_and_fifo"]["position"] > 0.9
    assert t["fair"]["avg_queuing_min"] > 0.8 * t["fifo"]["avg_queuing_min"]
    free = _avg_jct(pool, "fair", None)
    assert (free - t["srtf"]["avg_jct_min"]) / (t["fifo"]["avg_jct_min"] - t["srtf"]["avg_jct_min"]) < 0.8


def test_two_devices_fifo_runs_twice_as_long_per_job_as_salus(pool):
    """NOTE [Salus devices]: fitted on two devices, FIFO's mean run is about 6 min, twice
    what Salus's FIFO row implies."""
    trace = pool.trace(CALIBRATED[2], seed=0)
    r = run_policy(pool, "fifo", trace, devices=2)
    assert r["avg_jct_min"] - r["avg_queuing_min"] == pytest.approx(6.0, abs=0.5)


# ---------------------------------------------------------------- guards and the CLI
def test_pool_names_every_job_once(pool):
    """Upstream names the 10-minute vgg16_100 job vgg16_100_1min, like the 1-minute one."""
    assert len(pool.iterations) == len(pool.costs.models) == 99
    assert [pool.iterations[f"vgg16_100_{m}"] for m in ("1min", "5min", "10min")] == [90, 455, 912]
    assert pool.solo_s["vgg16_100_10min"] == pytest.approx(617.567, rel=1e-3)


class _Flapping:
    """A scheduler that starts its task and stops it again at the same instant, forever."""

    policy = type("P", (), {"name": "flapping"})()
    quantum_s = None
    preemptions = 0

    def __init__(self):
        self.tasks = {}

    def submit(self, task, now):
        self.tasks[task.id] = task

    def schedule(self, now):
        return [Run(t) for t in self.tasks.values()] + [Preempt(t) for t in self.tasks.values()]

    def update(self, result):
        pass


def test_a_scheduler_that_never_lets_time_move_is_reported_not_looped_on():
    costs = _costs(ModelCosts("a", unit_s=1.0))
    with pytest.raises(TimeshareError, match="stuck at t=0.5"):
        Simulator(_Flapping(), costs).run([Arrival(0.5, TRAIN, "a", 3)])


def test_cli_writes_the_table_with_its_command(tmp_path):
    from timeshare.cli import main

    out = tmp_path / "t1.json"
    assert main(["sim", "salus", "--seeds", "2", "--jobs", "30", "--devices", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["command"].startswith("timeshare sim salus --seeds 2") and "--devices 2" in r["command"]
    assert r["config"]["devices"] == 2 and r["config"]["seeds"] == [0, 1]
    assert r["config"]["arrivals"]["calibrated"] is True
    assert set(r["spread"]["fifo"]["avg_jct_min"]) == {"mean", "std", "min", "max"}


def test_targeted_simulations_measure_on_a_small_grid(pool):
    from timeshare.sim.table1_checks import fifo_consistent_region, random_order_queuing

    c = CALIBRATED[1]
    q = round(1.0 - c.length_mix[0], 4)
    region = fifo_consistent_region(pool, devices=1, seeds=range(3),
                                    grid=SearchGrid([q], [c.order_correlation], [c.mean_interarrival_s, 240.0]))
    assert (region["grid_points"], region["fifo_consistent_points"]) == (2, 1)  # 240 s apart: FIFO queues too little
    assert region["points"][0]["mean_interarrival_s"] == c.mean_interarrival_s
    assert region["pack_best_share"] == 1.0 and 1 / 3 < region["srtf_over_fifo"]["min"] < 0.45
    r = random_order_queuing(pool, not_short=q, mean_interarrival_s=0.0, seeds=range(30))
    assert r["traces"] == 30 and 0.45 < r["mean"] < 0.52 and r["salus"] > r["mean"]
