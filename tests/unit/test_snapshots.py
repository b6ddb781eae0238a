"""The snapshots as typed records (issue 33, item 4): their JSON at the edges keeps the
keys, order and shape that ``/admin/status`` and ``/admin/replicas`` have always had;
a cluster adds its replicas' records up field by field; records survive pickling (they
cross Ray from the replicas)."""

from __future__ import annotations

import dataclasses
import pickle

from timeshare.cluster.snapshots import (
    ClusterSnapshot,
    ClusterView,
    ReplicaRow,
    ReplicaSnapshot,
    add_snapshots,
    keep_counters,
)
from timeshare.executor.interface import PoolHealth, WorkerFailure, WorkerRow
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.kv_budget import KVBudgetSnapshot
from timeshare.runtime.host_tier import HostTierSnapshot
from timeshare.runtime.observe import RuntimeSnapshot
from timeshare.runtime.sharing import SharingSnapshot
from timeshare.scheduler.lanes import LaneManager, LaneRow, LanesView
from timeshare.scheduler.task import Kind, Task
from timeshare.server.llms import LLMState
from timeshare.server.snapshot import ServiceSnapshot

# The keys of the dictionaries these records replaced, in their order: the JSON contract.
RUNTIME_KEYS = ["device", "capacity_bytes", "used_bytes", "resident", "reserved", "host_bytes", "host_pinned_bytes",
                "loads", "evictions", "failures", "preemptions", "training_seconds", "training_iterations", "workers",
                "lanes", "host_tier", "shared"]
SERVICE_KEYS = ["queue_depth", "inference_seconds", "jobs", "llms"]
CLUSTER_KEYS = ["policy", "replicas", "replicas_alive", "requests", "loads", "retried", "failed", "replicas_lost",
                "migrations", "cpu_fallbacks", "recent_migrations"]
ROW_KEYS = ["replica", "alive", "starting", "outstanding", "error", "routed_resident", "jobs"]


def _pool(worker_id: int, failed: bool = False) -> PoolHealth:
    last = WorkerFailure(worker_id, "crashed", "killed by signal 9", 1.5) if failed else None
    return PoolHealth(size=2, ready=1, replacements=int(failed), failures={"crashed": int(failed), "hung": 0},
                      last_failure=last, failing_to_start=0, profilings=3, homes={"job": worker_id}, step_homes={},
                      workers=[WorkerRow(worker_id, 100 + worker_id, "idle", 1)])


def _runtime(used: int = 10, *, loads: int = 1, workers: PoolHealth | None = None) -> RuntimeSnapshot:
    return RuntimeSnapshot(
        device="cpu", capacity_bytes=100, used_bytes=used, resident={"a": used}, reserved={}, host_bytes=50,
        host_pinned_bytes=0,
        loads={"a": loads}, evictions=loads, failures=0, preemptions=0, training_seconds=0.5, training_iterations=4,
        workers=workers, lanes=LanesView(64, 8, 16, 0, [LaneRow(0, 16, 1, "a")]),
        host_tier=HostTierSnapshot(200, 50, 0, 1, 1, 0, 1, 0, 0, 50, 0.25, 0),
        shared=SharingSnapshot(2, 1, 40, 10, 90, 10, 0, 40))


def _view(rows: list[ReplicaRow]) -> ClusterView:
    return ClusterView(policy="timeshare", replicas=rows, replicas_alive=sum(r.alive for r in rows), requests=7,
                       loads=2, retried=1, failed=0, replicas_lost=0, migrations=0, cpu_fallbacks=0,
                       recent_migrations=[])


def test_a_runtime_snapshot_becomes_the_json_it_always_was():
    snap = _runtime(workers=_pool(1, failed=True))
    got = snap.to_json()
    assert list(got) == RUNTIME_KEYS
    assert got["lanes"] == {"capacity": 64, "persistent": 8, "in_lanes": 16, "waiting_admission": 0,
                            "lanes": [{"id": 0, "size": 16, "tasks": 1, "running": "a"}]}
    assert list(got["workers"]) == ["size", "ready", "replacements", "failures", "last_failure", "failing_to_start",
                                    "profilings", "homes", "step_homes", "workers"]
    assert got["workers"]["last_failure"] == {"worker": 1, "kind": "crashed", "cause": "killed by signal 9",
                                              "at": 1.5}
    assert got["workers"]["workers"] == [{"id": 1, "pid": 101, "state": "idle", "profiles": 1}]
    assert list(got["host_tier"]) == ["budget", "used", "shared_bytes", "models", "filled", "drops", "fills",
                                      "streamed_fills", "demotions", "bytes_read", "read_seconds", "spilled_bytes"]
    assert list(got["shared"]) == ["models", "sets", "own_bytes", "shared_bytes", "logical_bytes",
                                   "resident_shared_bytes", "spare_sets", "saved_bytes"]
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_the_pools_health_is_a_record_with_the_keys_of_its_json():
    health = PoolHealth(size=2, ready=2, replacements=1, failures={"crashed": 1},
                        last_failure=WorkerFailure(0, "crashed", "gone", 2.0), failing_to_start=0, profilings=1,
                        homes={"t": 1}, step_homes={}, workers=[WorkerRow(1, 11, "busy", 2)])
    # The diagnostics view and /admin/status show it as this dictionary.
    assert dataclasses.asdict(health) == {
        "size": 2, "ready": 2, "replacements": 1, "failures": {"crashed": 1},
        "last_failure": {"worker": 0, "kind": "crashed", "cause": "gone", "at": 2.0}, "failing_to_start": 0,
        "profilings": 1, "homes": {"t": 1}, "step_homes": {}, "workers": [{"id": 1, "pid": 11, "state": "busy",
                                                                          "profiles": 2}]}
    assert pickle.loads(pickle.dumps(health)) == health


def test_the_lanes_view_is_a_record():
    lm = LaneManager(100)
    task = Task(id=1, kind=Kind.INFERENCE, model="m", arrival=0.0)
    lm.admit(1, 10, 20)
    view = lm.view({1: task})
    assert view == LanesView(capacity=100, persistent=10, in_lanes=20, waiting_admission=0,
                             lanes=[LaneRow(id=0, size=20, tasks=1, running=None)])


def test_a_service_snapshot_puts_the_servers_keys_after_the_runtimes():
    engine = EngineSnapshot(1, 0, 64, 0, 0, 5, 2, 8, 256)
    llms = {"llama": LLMState("READY", engine=engine), "broken": LLMState("UNAVAILABLE", reason="no weights"),
            "late": LLMState("LOADING")}
    snap = ServiceSnapshot.of(_runtime(), queue_depth={"a": 0}, inference_seconds=1.0, jobs={"t": 4}, llms=llms,
                              kv_memory=KVBudgetSnapshot(100, 64, 1, 32))
    got = snap.to_json()
    assert list(got) == RUNTIME_KEYS + SERVICE_KEYS + ["kv_memory"]
    assert got["llms"] == {"llama": {"state": "READY", **dataclasses.asdict(engine)},
                           "broken": {"state": "UNAVAILABLE", "reason": "no weights"},
                           "late": {"state": "LOADING", "reason": None}}
    assert got["kv_memory"] == {"capacity": 100, "on_device": 64, "moves": 1, "moved_bytes": 32}
    before_open = ServiceSnapshot.of(None, queue_depth={}, inference_seconds=0.0, jobs={}, llms={}, kv_memory=None)
    assert before_open.runtime is None and list(before_open.to_json()) == SERVICE_KEYS


def test_a_clusters_snapshot_keeps_its_shape_with_and_without_reports():
    rows = [ReplicaRow("r0", True, False, 1, None, ["a"], []), ReplicaRow("r1", False, False, 0, "lost", [], [])]
    reported = dataclasses.replace(rows[0], resident={"a": 10}, used_bytes=10, capacity_bytes=100, loads=1)
    assert list(rows[1].to_json()) == ROW_KEYS  # not reported: no keys for what it holds
    assert list(reported.to_json()) == ROW_KEYS + ["resident", "used_bytes", "capacity_bytes", "loads"]
    view = _view([reported, rows[1]])
    assert list(view.to_json()) == CLUSTER_KEYS and view.to_json()["replicas"][1] == rows[1].to_json()
    merged = dataclasses.replace(_runtime(), device="cpu x 1 replicas")
    snap = ClusterSnapshot("cpu x 1 replicas", merged, 100, view)
    got = ServiceSnapshot.of(snap, queue_depth={}, inference_seconds=0.0, jobs={}, llms={}, kv_memory=None).to_json()
    assert list(got) == RUNTIME_KEYS + ["replica_capacity_bytes", "cluster"] + SERVICE_KEYS
    assert got["device"] == "cpu x 1 replicas" and got["cluster"] == view.to_json()
    empty = ServiceSnapshot.of(ClusterSnapshot("cpu x 0 replicas", None, None, _view(rows)), queue_depth={},
                               inference_seconds=0.0, jobs={}, llms={}, kv_memory=None)
    assert empty.runtime is None and list(empty.to_json()) == ["device", "cluster"] + SERVICE_KEYS


def test_replicas_add_up_field_by_field_and_lost_counters_stay():
    a, b = _runtime(10, loads=1, workers=_pool(1)), _runtime(30, loads=2, workers=_pool(2, failed=True))
    total = add_snapshots([a, b])
    assert isinstance(total, RuntimeSnapshot) and total.used_bytes == 40 and total.loads == {"a": 3}
    assert total.device == "cpu" and total.training_seconds == 1.0
    assert [w.id for w in total.workers.workers] == [1, 2] and total.workers.failures == {"crashed": 1, "hung": 0}
    assert total.workers.last_failure == b.workers.last_failure  # the only one there is
    assert [lane.running for lane in total.lanes.lanes] == ["a", "a"] and total.lanes.capacity == 128
    lost = _runtime(50, loads=5)
    kept = keep_counters(add_snapshots([a]), add_snapshots([a, lost]))
    assert kept.loads == {"a": 6} and kept.evictions == 6 and kept.used_bytes == 10  # levels: the live ones only
    report = ReplicaSnapshot("r0", a, [("a", 10)], {}, None, {"llama": EngineSnapshot(0, 0, 0, 0, 0, 0, 0, 8, 256)})
    assert pickle.loads(pickle.dumps(report)) == report
