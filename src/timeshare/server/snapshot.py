"""What a server shows of itself at scrape time and on ``/admin/status``: the
:class:`ServiceSnapshot`, its runtime's snapshot (or its cluster's) with the server's own
levels and counters, read without waiting for the device. The metrics read its fields;
the status page turns it into JSON with ``to_json``, under the keys it has always had.
Runs in the server's process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from timeshare.cluster.snapshots import ClusterSnapshot
from timeshare.llm.kv_budget import KVBudgetSnapshot
from timeshare.runtime.observe import RuntimeSnapshot
from timeshare.server.llms import LLMState


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """A server's snapshot: its runtime's (on a cluster, the replicas' added up; None
    before the runtime opens or before any replica has reported), its cluster's own part
    (None without a cluster), the requests waiting for each model, the device seconds
    of inference calls, each training job's iterations, each language model's state,
    and the key/value cache budget (None without ``kv_memory``)."""

    runtime: RuntimeSnapshot | None
    cluster: ClusterSnapshot | None
    queue_depth: dict[str, int]
    inference_seconds: float
    jobs: dict[str, int]
    llms: dict[str, LLMState]
    kv_memory: KVBudgetSnapshot | None

    @classmethod
    def of(cls, backend: RuntimeSnapshot | ClusterSnapshot | None, *, queue_depth: dict[str, int],
           inference_seconds: float, jobs: dict[str, int], llms: dict[str, LLMState],
           kv_memory: KVBudgetSnapshot | None) -> ServiceSnapshot:
        """The snapshot of a server whose runtime gave ``backend`` (None: none yet)."""
        if isinstance(backend, ClusterSnapshot):
            return cls(backend.runtime, backend, queue_depth, inference_seconds, jobs, llms, kv_memory)
        return cls(backend, None, queue_depth, inference_seconds, jobs, llms, kv_memory)

    def to_json(self) -> dict:
        """The runtime's keys (a cluster's: see ``ClusterSnapshot.to_json``), then the
        server's; "kv_memory" only with a key/value cache budget."""
        if self.cluster is not None:
            out = self.cluster.to_json()
        else:
            out = {} if self.runtime is None else self.runtime.to_json()
        out |= {"queue_depth": dict(self.queue_depth), "inference_seconds": self.inference_seconds,
                "jobs": dict(self.jobs), "llms": {n: s.to_json() for n, s in self.llms.items()}}
        if self.kv_memory is not None:
            out["kv_memory"] = dataclasses.asdict(self.kv_memory)
        return out
