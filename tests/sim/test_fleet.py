"""``timeshare sim cluster`` (NOTE [Cluster simulation]): the routing policies on a fleet,
the claims the command is for, its determinism, its output files and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from timeshare import cli
from timeshare.errors import ConfigError
from timeshare.sim.fleet import ClusterSimConfig, Workload, run, run_policy, workload

# Memory is scarce here (2 GB a device: about 8 models of 10 on each of 20 devices, for 200
# models), so where a model lives matters.
SMALL = dict(devices=20, models=200, requests=60_000, memory_bytes=2_000_000_000)


@pytest.fixture(scope="module")
def result():
    return run(ClusterSimConfig(**SMALL))


def test_affinity_routing_loads_far_less_than_random_and_no_more_than_rays_rule(result):
    by = {r["policy"]: r for r in result["rows"]}
    ours, ray, rnd = by["timeshare"], by["ray"], by["random"]
    assert ours["loads_per_request"] <= 0.5 * rnd["loads_per_request"]
    assert ours["loads_per_request"] <= ray["loads_per_request"]
    assert ours["latency_p99_s"] < ray["latency_p99_s"] and ours["latency_p50_s"] < ray["latency_p50_s"]
    # Least-loaded ignores where models live: as many loads as random, far better balance.
    assert by["least-loaded"]["loads_per_request"] > 0.5 * rnd["loads_per_request"]
    assert by["least-loaded"]["latency_p99_s"] < rnd["latency_p99_s"]


def test_the_accounting_adds_up(result):
    w = workload(ClusterSimConfig(**SMALL))
    ready = float(np.mean(w.compute_s[w.models]))
    for r in result["rows"]:
        assert r["loads"] + r["reloads_owed"] == pytest.approx(r["loads_per_request"] * SMALL["requests"])
        assert r["latency_p50_s"] <= r["latency_p99_s"] <= r["latency_p999_s"]
        # Every request takes at least its model's ready time; utilisation is at least the
        # offered load (loads only add work) and at most 1.
        assert r["latency_mean_s"] >= ready * 0.99
        assert 0.7 * 0.95 <= r["utilisation"] <= 1.0
    assert len(np.unique(w.models)) <= min(r["loads"] for r in result["rows"])


def test_the_same_seed_gives_the_same_answer_and_another_seed_another():
    config = ClusterSimConfig(**{**SMALL, "requests": 5000, "policies": ("ray", "timeshare")})
    a, b = run(config), run(config)
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in a["rows"]]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in b["rows"]]
    c = run(ClusterSimConfig(**{**SMALL, "requests": 5000, "policies": ("ray", "timeshare"), "seed": 1}))
    assert [r["latency_mean_s"] for r in c["rows"]] != [r["latency_mean_s"] for r in a["rows"]]


def test_sim_cluster_writes_json_and_a_plot_and_sweeps_the_margin(tmp_path, capsys):
    path, png = tmp_path / "cluster.json", tmp_path / "cluster.png"
    code = cli.main(["sim", "cluster", "--devices", "10", "--models", "50", "--requests", "20000", "--memory", "2GB",
                     "--margins", "1,16", "--json", str(path), "--plot", str(png)])
    assert code == 0 and "sim cluster" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert [r["policy"] for r in data["rows"]] == ["random", "least-loaded", "ray", "timeshare"]
    sweep = {r["replicate_margin"]: r for r in data["margin_sweep"]}
    assert set(sweep) == {1.0, 16.0}
    # A smaller margin replicates sooner: more loads, shorter tails.
    assert sweep[1.0]["loads_per_request"] > sweep[16.0]["loads_per_request"]
    assert sweep[1.0]["latency_p99_s"] < sweep[16.0]["latency_p99_s"]
    assert png.stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--load", "1.5"], "load must be between 0 and 1"),
    (["--policies", "random,round-robin"], "unknown routing policy"),
    (["--memory", "100MB"], "holds no model"),
    (["--margins", "2,x"], "--margins must be"),
    (["--devices", "0"], "at least 1"),
])
def test_bad_options_are_refused_clearly(args, message, capsys):
    assert cli.main(["sim", "cluster", "--requests", "10", *args]) != 0
    assert message in capsys.readouterr().err


def test_a_config_is_checked_before_any_work():
    with pytest.raises(ConfigError, match="zipf"):
        run(ClusterSimConfig(**{**SMALL, "zipf": -1.0}))


@pytest.mark.parametrize("policy", ["random", "least-loaded", "ray", "timeshare"])
def test_a_hand_worked_trace_one_device(policy):
    """One device; two models alternating, far apart (no queueing). Room for one: every
    request loads and takes the cold time. Room for both: two loads, then ready times."""
    w = Workload(size=np.array([100, 100], np.int64), compute_s=np.array([0.010, 0.020]),
                 cold_s=np.array([0.015, 0.030]), load_s=np.array([0.008, 0.008]),
                 arrivals=np.array([0.0, 10.0, 20.0, 30.0]), models=np.array([0, 1, 0, 1], np.int32))
    tight = run_policy(ClusterSimConfig(devices=1, models=2, requests=4, memory_bytes=150), w, policy)
    assert tight["loads"] == 4 and tight["reloads_owed"] == 0
    assert tight["latency_mean_s"] == pytest.approx((0.015 + 0.030) / 2)
    roomy = run_policy(ClusterSimConfig(devices=1, models=2, requests=4, memory_bytes=200), w, policy)
    assert roomy["loads"] == 2
    assert roomy["latency_mean_s"] == pytest.approx((0.015 + 0.030 + 0.010 + 0.020) / 4)
    # Back to back instead: the second request queues behind the first.
    w.arrivals = np.array([0.0, 0.0, 10.0, 10.0])
    queued = run_policy(ClusterSimConfig(devices=1, models=2, requests=4, memory_bytes=200), w, policy)
    assert queued["latency_p999_s"] == pytest.approx(0.015 + 0.030, rel=1e-3)
