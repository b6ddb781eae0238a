"""What operators and tests read of a runtime: statistics, the metrics snapshot and the
diagnostics view, as plain dictionaries made from the runtime's parts. Nothing here
changes them (but reclaiming finished quarantined blocks, which only frees).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from timeshare.memory import Arena
from timeshare.runtime.dispatch import Dispatcher
from timeshare.runtime.executor import Executor
from timeshare.runtime.host_tier import HostTier
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.sharing import SharedTensors
from timeshare.runtime.training import TrainingJob


def stats(device: torch.device, arena: Arena, residency: Residency, models: Mapping[str, ModelEntry]) -> dict:
    alloc = arena.allocator
    return {
        "device": str(device),
        "capacity_bytes": alloc.capacity,
        "used_bytes": alloc.used,
        "free_bytes": alloc.free,
        "largest_free_bytes": alloc.largest_free,
        "blocks": len(alloc.blocks()),
        "resident": residency.order(models),
        "loads": {n: m.loads for n, m in models.items()},
        "evictions": residency.evictions,
    }


def snapshot(device: torch.device, arena: Arena, residency: Residency, models: Iterable[ModelEntry],
             jobs: Iterable[TrainingJob], executor: Executor, gate: Dispatcher, failures: int,
             host: HostTier | None = None, sharing: SharedTensors | None = None) -> dict:
    alloc = arena.allocator
    models, jobs = list(models), list(jobs)
    shared = None if sharing is None else sharing.snapshot()
    return {
        "device": str(device),
        "capacity_bytes": alloc.capacity,
        "used_bytes": alloc.used,
        "resident": {m.name: m.nbytes for m in models if m.block is not None},
        "host_bytes": (sum(m.nbytes for m in models) + (shared["shared_bytes"] if shared else 0)) if host is None
        else host.used,
        "host_pinned_bytes": executor.pinned_host_bytes(),
        "loads": {m.name: m.loads for m in models},
        "evictions": residency.evictions,
        "failures": failures,
        "preemptions": gate.scheduler.preemptions,
        "training_seconds": sum(j.stats.step_seconds for j in jobs),
        "training_iterations": sum(j.stats.iterations for j in jobs),
        # With workers: the pool's size, the workers ready to serve, replacements so far.
        "workers": executor.health(),
        # With lanes (PACK): their budget, each lane, admissions waiting (NOTE [Lanes in the runtime]).
        "lanes": gate.lanes(),
        # With a host budget: host memory as a cache over disk (NOTE [Host tier]).
        "host_tier": None if host is None else host.snapshot(),
        # With dedup: tensors held once across models (NOTE [Shared tensors]).
        "shared": shared,
    }


def diagnostics(arena: Arena, residency: Residency, models: Mapping[str, ModelEntry], executor: Executor,
                gate: Dispatcher, host: HostTier | None = None, sharing: SharedTensors | None = None) -> dict:
    alloc = arena.allocator
    return {
        "arena": {"name": arena.shm_name, "capacity_bytes": alloc.capacity, "free_ranges": alloc.free_ranges()},
        "models": {n: {"nbytes": m.nbytes, "offset": m.block.offset if m.block is not None else None,
                       "last_offset": m.last_offset, "loads": m.loads, "pinned": m.pinned,
                       "ephemeral_bytes": dict(m.ephemeral)}
                   for n, m in models.items()},
        "quarantined": residency.quarantined(),
        "scheduler_tasks": len(gate.scheduler.tasks),
        "lanes": gate.lanes(),
        "workers": executor.health(),
        "host_tier": None if host is None else host.snapshot() | {"stores": host.models_view()},
        "shared": None if sharing is None else sharing.snapshot() | {"sets": sharing.view()},
    }
