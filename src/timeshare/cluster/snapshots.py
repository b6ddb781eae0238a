"""What a cluster shows of itself, as typed records: each replica's report
(:class:`ReplicaSnapshot`, sent over Ray by the replica), the replicas as the router
sees them (:class:`ReplicaRow`), and the cluster's snapshot (:class:`ClusterSnapshot`:
the replicas' runtimes added up, with the cluster's own counters), as a server shows a
cluster's (NOTE [A cluster behind the server] in ``cluster/backend.py``). Runs in the
server's process; a ``ReplicaSnapshot`` is made in a replica's actor and crosses Ray
pickled, as plain records do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from timeshare.llm.adapters import AdapterInfo
from timeshare.llm.engine import EngineSnapshot
from timeshare.runtime.observe import RuntimeSnapshot


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """What a replica reports at each poll, without waiting for its device: its
    runtime's snapshot, the evictions since its last report (model, bytes), each training
    job's view, its CPU fallback's snapshot (NOTE [CPU fallback]) and its language
    models' engines."""

    replica: str
    runtime: RuntimeSnapshot
    evicted: list[tuple[str, int]]
    jobs: dict[str, dict]
    cpu_fallback: RuntimeSnapshot | None
    llms: dict[str, EngineSnapshot]
    # NOTE [Adapters on a cluster]: each language model's adapters here, which are on its device.
    adapters: dict[str, tuple[AdapterInfo, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """A replica slot in use as the router sees it: alive, still starting, requests
    outstanding, its error, the models routed to it as resident, its training jobs; and,
    once it has reported (``ClusterSnapshot``), what it holds by its own account."""

    replica: str
    alive: bool
    starting: bool
    outstanding: int
    error: str | None
    routed_resident: list[str]
    jobs: list[str]
    resident: dict[str, int] | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    loads: int | None = None

    def to_json(self) -> dict:
        """As JSON's types; a replica that has not reported has no keys for what it holds."""
        out = dataclasses.asdict(self)
        if self.resident is None:
            for key in ("resident", "used_bytes", "capacity_bytes", "loads"):
                del out[key]
        return out


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster's own part of its snapshot: the routing policy, each replica, how many
    are alive, and its counters (requests, loads, retries, failures, replicas lost,
    migrations, CPU fallbacks), with the latest migrations."""

    policy: str
    replicas: list[ReplicaRow]
    replicas_alive: int
    requests: int
    loads: int
    retried: int
    failed: int
    replicas_lost: int
    migrations: int
    cpu_fallbacks: int
    recent_migrations: list[dict]

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "replicas": [r.to_json() for r in self.replicas]}


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """A cluster's snapshot as the server reads it (NOTE [A cluster behind the server]):
    the device it names (the replicas' and how many), the replicas' runtimes added up
    (None before any has reported), what one training job may take (one replica's
    budget, not the sum), and the cluster's own view."""

    device: str
    runtime: RuntimeSnapshot | None
    replica_capacity_bytes: int | None
    view: ClusterView

    def to_json(self) -> dict:
        """The replicas' runtimes added up, under the runtime's keys, then one replica's
        budget and the cluster's view under "cluster"."""
        if self.runtime is None:
            return {"device": self.device, "cluster": self.view.to_json()}
        return self.runtime.to_json() | {"replica_capacity_bytes": self.replica_capacity_bytes,
                                         "device": self.device, "cluster": self.view.to_json()}


def add_snapshots(values: list) -> Any:
    """The replicas' snapshots added up: numbers summed, mappings key by key, records
    field by field, lists joined, None where none has a value; anything else is the
    first's."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, bool):
        return all(present)
    if isinstance(first, (int, float)):
        return sum(present)
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in present for k in v)
        return {k: add_snapshots([v.get(k) for v in present]) for k in keys}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return type(first)(**{f.name: add_snapshots([getattr(v, f.name) for v in present])
                              for f in dataclasses.fields(first)})
    if isinstance(first, list):
        return [x for v in present for x in v]
    return first


def keep_counters(merged: RuntimeSnapshot, every: RuntimeSnapshot) -> RuntimeSnapshot:
    """``merged`` (the live replicas' snapshots added up) with the counters of ``every``
    (the lost replicas' last snapshots added in): counters never go back; the rest are
    levels (memory, residency, queues), the live replicas' only."""
    return dataclasses.replace(merged, loads=every.loads, evictions=every.evictions, failures=every.failures,
                               preemptions=every.preemptions, training_seconds=every.training_seconds,
                               training_iterations=every.training_iterations)
