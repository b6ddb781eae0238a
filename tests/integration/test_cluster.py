"""timeshare on a real local Ray cluster (NOTE [Cluster deployment]): routing by model
affinity against random routing and Ray Serve's rule on the same replicas, a replica
killed and one added while requests flow, and the refusals."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

from timeshare import cli
from timeshare.bench.cluster import model_defs, references
from timeshare.bench.common import outputs_equal
from timeshare.cluster.cluster import Cluster, ReplicaLostError, import_ray, start_local_ray
from timeshare.errors import ConfigError, ModelTooLargeError, UnknownModelError

# Ray is imported by the fixture, after timeshare has set it up for the loopback interface.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray")


@pytest.fixture(scope="module")
def local_ray():
    ray = start_local_ray(6)
    yield ray
    ray.shutdown()


def test_the_local_cluster_listens_on_the_loopback_interface_only(local_ray):
    ss = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=False)
    if ss.returncode != 0:
        pytest.skip("no ss here")
    ray_lines = [ln for ln in ss.stdout.splitlines() if any(k in ln for k in ("raylet", "gcs_server", "ray::"))]
    local = [ln.split()[3] for ln in ray_lines]  # the local address column: 127.0.0.1 (or IPv4-mapped)
    assert local and all("127.0.0.1" in a or a.startswith("[::1]") for a in local), ray_lines


def test_an_unreachable_ray_address_is_a_clear_error_at_once():
    with pytest.raises(ConfigError, match="cannot be reached"):
        Cluster(model_defs(1), address="127.0.0.1:9")


def test_affinity_routing_on_three_replicas_and_a_replica_killed_loses_nothing(local_ray, tmp_path, capsys):
    """The must-show: 3 CPU replicas, 12 small models, Zipf requests. One client, so that
    the loads are those of the routing alone (no timing), on replicas too small to hold
    every model at once (2.5 MiB each, 8.6 MB of models). Run as ``timeshare bench
    cluster`` (its JSON and plot are the results read here): one cluster for both."""
    path, png = tmp_path / "cluster.json", tmp_path / "cluster.png"
    code = cli.main(["bench", "cluster", "--replicas", "3", "--models", "12", "--requests", "240", "--clients", "1",
                     "--memory", "2.5MiB", "--policies", "timeshare,random,ray", "--json", str(path),
                     "--plot", str(png)])
    assert code == 0 and "bench cluster" in capsys.readouterr().out
    result = json.loads(path.read_text())
    assert [r["policy"] for r in result["rows"]] == ["timeshare", "random", "ray"]  # as asked, in that order
    assert result["ray"] == import_ray().__version__ and png.stat().st_size > 0
    by = {r["policy"]: r for r in result["rows"]}
    ours, ray_rule, rnd = by["timeshare"], by["ray"], by["random"]
    assert ours["loads_per_request"] <= 0.5 * rnd["loads_per_request"]
    assert ours["loads_per_request"] <= ray_rule["loads_per_request"]
    assert ours["loads_per_request"] >= result["floor_loads_per_request"]
    assert result["outputs_exact"] and all(r["lost"] == 0 and r["answered"] == 240 for r in result["rows"])
    drill = result["drill"]
    assert drill["killed"] and drill["added"] and drill["killed"] != drill["added"]
    assert drill["lost"] == 0 and drill["inexact"] == 0 and drill["answered"] == 240
    assert drill["added_served"] > 0  # the replica added at run time took load
    assert drill["replicas_lost"] == 1


def test_a_cluster_refuses_clearly_and_the_rest_serves(local_ray):
    models = model_defs(4)
    refs = references(models)
    # A replica that cannot start: the other serves.
    with Cluster(models, replicas=2, memory="3MiB", failing=[1]) as cluster:
        status = cluster.status()["replicas"]
        assert [r["alive"] for r in status] == [True, False]
        assert "told not to start" in status[1]["error"]
        for m in models:
            reply = cluster.infer(m.name, *m.example_inputs())
            assert reply.replica == "replica-0" and outputs_equal(reply.outputs, refs[m.name])
        with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
            cluster.infer("nope")
        # Every replica gone: requests fail clearly, nothing hangs.
        for r in [r for r in status if r["alive"]]:
            cluster.kill_replica(r["replica"])
        with pytest.raises(ReplicaLostError, match="died"):
            cluster.infer(models[0].name, *models[0].example_inputs())
        with pytest.raises(ReplicaLostError, match="no replica is alive"):
            cluster.infer(models[0].name, *models[0].example_inputs())
    # A model larger than the replica: refused by name; the others serve.
    with Cluster(models, replicas=1, memory="1MiB") as cluster:
        big = models[2]  # small_resnet, 2.3 MB
        with pytest.raises(ModelTooLargeError, match=big.name):
            cluster.infer(big.name, *big.example_inputs())
        assert outputs_equal(cluster.infer(models[0].name, *models[0].example_inputs()).outputs, refs[models[0].name])
    with pytest.raises(ConfigError, match="no replica started"):
        Cluster(models, replicas=1, memory="3MiB", failing=[0])


def test_a_training_job_migrated_between_replicas_ends_bitwise_equal_and_a_move_that_fails_leaves_it_where_it_was(
        local_ray):
    import time

    import torch

    with Cluster(model_defs(1), replicas=2, memory="3MiB") as cluster:
        # A move: the job goes on where it was stopped and ends as if never moved.
        assert cluster.train("whole", "tiny_cnn:4", 500, seed=5, replica="replica-0") == "replica-0"
        want = cluster.job_weights("whole", timeout_s=120)
        assert cluster.train("moved", "tiny_cnn:4", 500, seed=5, replica="replica-0") == "replica-0"
        deadline = time.monotonic() + 60
        while cluster.job("moved")["iterations"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        moved = cluster.migrate("moved")
        assert moved["from"] == "replica-0" and moved["to"] == "replica-1" and 3 <= moved["iterations"] < 500
        got = cluster.job_weights("moved", timeout_s=120)
        where = cluster.job("moved")
        assert where["replica"] == "replica-1" and where["resumed_at"] == moved["iterations"]  # went on, not over
        assert cluster.job("moved")["iterations"] == 500
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert cluster.status()["migrations"] == 1
        with pytest.raises(UnknownModelError, match="no training job"):
            cluster.migrate("nope")

        # A move that fails: the job keeps running where it was.
        cluster.train("stays", "tiny_cnn:4", 400, seed=1, replica="replica-0")
        cluster.kill_replica("replica-1")  # dies before the move: the router has not noticed yet
        with pytest.raises(Exception, match="replica-1|actor"):
            cluster.migrate("stays", to="replica-1")
        job = cluster.job("stays")
        assert job["replica"] == "replica-0" and job["status"] in ("running", "finished"), job
        deadline = time.monotonic() + 120
        while cluster.job("stays")["status"] != "finished":
            assert time.monotonic() < deadline, cluster.job("stays")
            time.sleep(0.05)
        assert cluster.job("stays")["iterations"] == 400 and cluster.status()["migrations"] == 1  # the first move only


def test_a_request_runs_on_the_replicas_cpu_when_its_device_is_busy(local_ray):
    """NOTE [CPU fallback], on a CPU replica whose "device" is a runtime of its own: a
    request to a resident model on an idle device stays on the device; behind a long
    request it runs on the CPU fallback, with the same outputs."""
    import time

    from timeshare.cluster.replica import ModelDef
    from timeshare.models.zoo import weights_path

    slow = ModelDef("slow", "small_resnet", str(weights_path("small_resnet")), batch=256)
    fast = ModelDef("fast", "tiny_mlp", str(weights_path("tiny_mlp")))
    refs = references([slow, fast])
    with Cluster([slow, fast], replicas=1, memory="8MiB", cpu_fallback="8MiB") as cluster:
        for _ in range(2):
            reply = cluster.infer("fast", *fast.example_inputs())
        assert not reply.on_cpu and outputs_equal(reply.outputs, refs["fast"])
        assert cluster.costs["cpu_s"][1] < cluster.costs["ready_s"][0]  # the premise: fast on the CPU beats slow
        pending = cluster.submit("slow", *slow.example_inputs())
        deadline = time.monotonic() + 30
        while cluster.replica_rows()[0].outstanding == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        reply = cluster.infer("fast", *fast.example_inputs())
        assert reply.on_cpu and outputs_equal(reply.outputs, refs["fast"])
        assert outputs_equal(pending.result(60).outputs, refs["slow"])
        assert cluster.status()["cpu_fallbacks"] == 1


def test_replica_errors_names_of_ended_jobs_and_deaths_seen_by_a_poll(local_ray):
    import time

    import torch

    from timeshare.cluster.cluster import OBSERVE
    from timeshare.errors import Conflict
    from timeshare.server.status import served_error, status_of

    models = model_defs(1)
    with Cluster(models, replicas=2, memory="3MiB") as cluster:
        # The replicas serve at the priority of the process that started them, not at Ray's
        # nice 15 for its workers.
        pids = [local_ray.get(s.actor.ping.remote(), timeout=60)["pid"] for s in cluster.slots if s.alive]
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert len(pids) == 2 and all(os.getpriority(os.PRIO_PROCESS, pid) == ours for pid in pids)
        # The replica's own error arrives as raised there, not wrapped in Ray's traceback.
        with pytest.raises(RuntimeError, match="conv2d") as raised:
            cluster.infer(models[0].name, torch.zeros(7))  # no conv takes a vector
        assert type(raised.value) is RuntimeError and "ray::" not in str(raised.value)
        assert status_of(served_error(models[0].name, raised.value)) == 400  # as the server answers it
        assert status_of(ReplicaLostError("gone")) == 503
        # A job's name is free again once it has ended, not while it runs; a paused job does not move.
        cluster.train("j", "tiny_cnn:4", 5, replica="replica-0")
        deadline = time.monotonic() + 60
        while cluster.job("j")["status"] != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cluster.train("j", "tiny_cnn:4", 100000, replica="replica-0")
        with pytest.raises(Conflict, match="is running|is queued"):
            cluster.train("j", "tiny_cnn:4", 5)
        cluster.control_job("j", "pause")
        while cluster.job("j")["status"] != "paused":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(Conflict, match="only a job that runs can move"):
            cluster.migrate("j")
        cluster.control_job("j", "cancel")
        # A replica killed is found by the next poll, with no request sent to it; its job with it.
        cluster.kill_replica("replica-0")
        deadline = time.monotonic() + 30
        while "replica-0" not in cluster.lost:
            assert time.monotonic() < deadline
            cluster.snapshots(timeout_s=2.0)
        assert [r.alive for r in cluster.replica_rows()] == [False, True]
        assert cluster.job_names() == [] and OBSERVE == "observe"
