"""The discrete-event simulator on traces small enough to work out by hand, with a
hand-made cost model; determinism of the two studies; Salus's pool; trace files."""

import pytest

from timeshare.errors import ConfigError
from timeshare.scheduler import Finished, Kind, Priority, Scheduler, Stopped
from timeshare.sim.cache import ModelCache
from timeshare.sim.costs import ModelCosts, WorkloadCosts
from timeshare.sim.engine import Simulator
from timeshare.sim.experiments import serving
from timeshare.sim.table1 import SALUS_POLICIES, find_salus_pool, salus
from timeshare.sim.trace import Arrival, read_trace, write_trace

TRAIN, INFER = Kind.TRAINING, Kind.INFERENCE


class RecordingScheduler(Scheduler):
    """The real scheduler, keeping the results the simulator reports to it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list = []

    def update(self, results) -> None:
        self.log.extend(results if isinstance(results, (list, tuple)) else (results,))
        super().update(results)


def _costs(*models: ModelCosts) -> WorkloadCosts:
    return WorkloadCosts({m.name: m for m in models}, "by hand")


def _events(sched: RecordingScheduler) -> list:
    out = []
    for r in sched.log:
        if isinstance(r, Stopped):
            out.append(("stopped", r.task_id, pytest.approx(r.at), r.done))
        else:
            assert isinstance(r, Finished)
            out.append(("finished", r.task_id, pytest.approx(r.at)))
    return out


def test_fifo_two_jobs_exact_times():
    costs = _costs(ModelCosts("a", unit_s=1.0), ModelCosts("b", unit_s=2.0, startup_s=0.5))
    sched = RecordingScheduler("fifo")
    res = Simulator(sched, costs).run([Arrival(0.0, TRAIN, "a", 3), Arrival(1.0, TRAIN, "b", 2)])
    # Job 0: 0 -> 3. Job 1 waits until 3, then 0.5 s start-up + 2 x 2 s: 3 -> 7.5.
    assert _events(sched) == [("finished", 0, 3.0), ("finished", 1, 7.5)]
    assert res.starts == [0.0, 3.0]
    r = res.report()
    assert r["makespan_s"] == pytest.approx(7.5)
    assert r["training"]["avg_jct_s"] == pytest.approx((3.0 + 6.5) / 2)
    assert r["training"]["avg_queuing_s"] == pytest.approx(1.0)
    assert r["utilization"] == pytest.approx(1.0)
    assert r["useful_utilization"] == pytest.approx(7.0 / 7.5)  # start-up is not useful work
    assert (r["preemptions"], r["unfinished"], r["tasks"]) == (0, 0, 2)


@pytest.mark.parametrize(("u", "stop", "short_end", "long_end"), [
    (0.5, 3.0, 3.5, 10.5),  # the stopping job and the new one share the device at full speed
    (1.0, 3.5, 4.0, 11.0),  # both at half speed until the stop (NOTE [Device sharing model])
])
def test_srtf_preempts_at_the_next_iteration_boundary(u, stop, short_end, long_end):
    costs = _costs(ModelCosts("long", unit_s=1.0, utilization=u), ModelCosts("short", unit_s=1.0, utilization=u))
    sched = RecordingScheduler("srtf")
    res = Simulator(sched, costs).run([Arrival(0.0, TRAIN, "long", 10), Arrival(2.5, TRAIN, "short", 1)])
    # At 2.5 job 0 is halfway through its third iteration: it stops after 3 of them.
    assert _events(sched) == [("stopped", 0, stop, 3), ("finished", 1, short_end), ("finished", 0, long_end)]
    r = res.report()
    assert r["preemptions"] == 1
    assert r["useful_utilization"] == pytest.approx(11.0 / long_end)


@pytest.mark.parametrize(("u", "ends"), [(0.5, [4.0, 4.0]), (1.0, [8.0, 8.0])])
def test_packed_jobs_share_the_device_by_utilization(u, ends):
    costs = _costs(ModelCosts("a", unit_s=1.0, persistent=10, ephemeral=10, utilization=u))
    sched = RecordingScheduler("pack", capacity=100)
    res = Simulator(sched, costs).run([Arrival(0.0, TRAIN, "a", 4), Arrival(0.0, TRAIN, "a", 4)])
    assert res.starts == [0.0, 0.0]
    assert res.finishes == pytest.approx(ends)
    assert res.busy_s == pytest.approx(ends[0])


def test_packed_jobs_speed_up_when_one_leaves():
    costs = _costs(ModelCosts("a", unit_s=1.0, persistent=10, ephemeral=10))
    sched = RecordingScheduler("pack", capacity=100)
    res = Simulator(sched, costs).run([Arrival(0.0, TRAIN, "a", 2), Arrival(0.0, TRAIN, "a", 4)])
    # Half speed each: job 0's 2 s end at 4; job 1 has 2 s left, alone: 6.
    assert _events(sched) == [("finished", 0, 4.0), ("finished", 1, 6.0)]
    assert res.busy_s == pytest.approx(6.0) and res.useful_s == pytest.approx(6.0)


def test_packing_waits_for_memory():
    costs = _costs(ModelCosts("a", unit_s=1.0, persistent=40, ephemeral=40, utilization=0.5))
    sched = RecordingScheduler("pack", capacity=100)
    res = Simulator(sched, costs).run([Arrival(0.0, TRAIN, "a", 2), Arrival(0.0, TRAIN, "a", 2)])
    assert res.starts == [0.0, 2.0] and res.finishes == pytest.approx([2.0, 4.0])


def _serving_costs(restart_s=None) -> WorkloadCosts:
    return _costs(*(ModelCosts(m, unit_s=1.0, load_s=0.5, nbytes=100, restart_s=restart_s) for m in "xy"))


def _requests(models: str, gap: float = 10.0, slo_s: float | None = None) -> list[Arrival]:
    return [Arrival(i * gap, INFER, m, 1.0, Priority.LATENCY_CRITICAL, slo_s) for i, m in enumerate(models)]


def test_serving_cache_of_one_model_loads_and_evicts_exactly():
    cache = ModelCache(capacity=150, policy="lru")  # room for one 100-byte model
    res = Simulator(Scheduler("fifo"), _serving_costs(), cache=cache).run(_requests("xyxyxx", slo_s=1.2))
    # Five misses (0.5 s load + 1 s), then a hit (1 s).
    assert res.finishes == pytest.approx([1.5, 11.5, 21.5, 31.5, 41.5, 51.0])
    r = res.report()
    assert (r["loads"], r["evictions"], r["switches"]) == (5, 4, 5)
    assert r["load_s"] == pytest.approx(2.5)
    assert r["inference"]["slo_attainment"] == pytest.approx(1 / 6)
    assert r["inference"]["mean_ms"] == pytest.approx((5 * 1500 + 1000) / 6)
    assert list(cache.sizes) == ["x"]


def test_serving_queues_behind_a_load_and_restart_costs_the_whole_swap():
    cache = ModelCache(max_models=1, policy="lru")
    res = Simulator(Scheduler("fifo"), _serving_costs(), cache=cache).run(_requests("xy", gap=0.2))
    assert res.finishes == pytest.approx([1.5, 3.0])  # y waits for x, then loads
    cache = ModelCache(max_models=1, policy="lru")
    res = Simulator(Scheduler("fifo"), _serving_costs(restart_s=3.0), cache=cache, restart=True).run(
        _requests("xyy"))
    # A swap costs the whole restart (3 s, the first request included); a hit 1 s.
    assert res.finishes == pytest.approx([3.0, 13.0, 21.0])
    assert (cache.loads, cache.evictions, res.load_s) == (2, 1, pytest.approx(4.0))


def test_serving_batches_waiting_requests_of_one_model():
    costs = _costs(ModelCosts("x", unit_s=1.0, batch8_s=4.5, nbytes=100))  # batch of b: 1 + 0.5 (b - 1)
    trace = [Arrival(t, INFER, "x") for t in (0.0, 0.1, 0.2, 0.3)]
    res = Simulator(Scheduler("fifo", max_batch=8), costs).run(trace)
    # The first runs alone (0 -> 1); the other three together: 1 + 1.0 = 2 s, 1 -> 3.
    assert res.finishes == pytest.approx([1.0, 3.0, 3.0, 3.0])


def _hand_serving_costs() -> WorkloadCosts:
    return _costs(
        ModelCosts("small", unit_s=0.004, batch8_s=0.010, load_s=0.02, nbytes=40_000_000, restart_s=0.5),
        ModelCosts("mid", unit_s=0.008, batch8_s=0.020, load_s=0.05, nbytes=100_000_000, restart_s=1.0),
        ModelCosts("big", unit_s=0.015, batch8_s=0.040, load_s=0.12, nbytes=250_000_000, restart_s=2.0),
    )


def _without_wall_time(result: dict) -> dict:
    return {**result, "results": {m: {k: v for k, v in r.items() if k != "wall_s"}
                                  for m, r in result["results"].items()}}


def test_studies_are_deterministic_for_a_seed():
    a, b, c = (salus(jobs=20, seeds=1, seed=s) for s in (0, 0, 1))
    assert a == b and a["table"] != c["table"]
    costs = _hand_serving_costs()
    a, b, c = (_without_wall_time(serving(costs=costs, models=6, requests=2000, fit_models=2, seed=s))
               for s in (0, 0, 1))
    assert a == b and a["results"] != c["results"]
    assert all(r["tasks"] == 2000 and r["unfinished"] == 0 for r in a["results"].values())


def test_salus_pool_srtf_beats_fifo_on_jct_and_pack_has_the_shortest_makespan():
    assert find_salus_pool().name == "salus-workloads.csv"
    table = salus(seeds=1)["table"]
    assert set(table) == set(SALUS_POLICIES)
    assert all(row["unfinished"] == 0 for row in table.values())
    assert table["srtf"]["avg_jct_min"] < table["fifo"]["avg_jct_min"]
    assert min(table, key=lambda p: table[p]["makespan_min"]) == "pack"


def test_trace_round_trip(tmp_path):
    trace = [
        Arrival(0.0, TRAIN, "resnet50_25_5min", 1234567.0),
        Arrival(0.1, INFER, "m00", 1.0, Priority.LATENCY_CRITICAL, 0.25),
        Arrival(1 / 3, TRAIN, "vgg", 2.5, Priority.BEST_EFFORT, None),
    ]
    path = tmp_path / "trace.csv"
    write_trace(path, trace)
    assert read_trace(path) == trace
    assert path.read_text().splitlines()[0] == "time,kind,model,work,priority,slo_s"


def test_trace_optional_columns_default_and_rows_sort_by_time(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("time,kind,model\n2.0,Inference,b\n1.0,training, a \n")
    assert read_trace(path) == [Arrival(1.0, TRAIN, "a"), Arrival(2.0, INFER, "b")]


@pytest.mark.parametrize(("row", "what"), [
    ("1.0,bogus,m,1,be,", "bogus"),
    ("soon,training,m,1,be,", "soon"),
    ("1.0,training,m,1,urgent,", "urgent"),
    ("1.0,training,m,1,be,fast", "fast"),
    ("1.0", "no kind, model"),  # a short row
    ("1.0,training, ,1,be,", "no model"),
    ("-1.0,training,m,1,be,", ">= 0"),
    ("1.0,training,m,0,be,", "work > 0"),
    ("1.0,training,m,nan,be,", "work > 0"),
])
def test_malformed_trace_names_the_line(tmp_path, row, what):
    path = tmp_path / "bad.csv"
    path.write_text(f"time,kind,model,work,priority,slo_s\n0.5,inference,m,1,lc,0.1\n{row}\n")
    with pytest.raises(ConfigError, match="line 3") as info:
        read_trace(path)
    assert what in str(info.value)


def test_trace_without_columns_or_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("when,what\n1,2\n")
    with pytest.raises(ConfigError, match="missing columns"):
        read_trace(path)
    with pytest.raises(ConfigError, match="cannot read trace"):
        read_trace(tmp_path / "absent.csv")
