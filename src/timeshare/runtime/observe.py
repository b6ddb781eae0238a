"""What operators and tests read of a runtime: statistics as a plain dictionary, the
metrics snapshot (:class:`RuntimeSnapshot`) and the diagnostics view (:class:`Diagnostics`)
as typed records, each made from the runtime's parts (``Runtime``'s methods that show them call these).
Nothing here changes the parts (but reclaiming finished quarantined blocks, which only
frees). Runs in the controller (the caller's process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from timeshare.executor.interface import Observed, PoolHealth
from timeshare.memory import Arena, Block
from timeshare.runtime.dispatch import Dispatcher
from timeshare.runtime.host_tier import HostTier, HostTierSnapshot, StoreView
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.sharing import SetView, SharedTensors, SharingSnapshot
from timeshare.runtime.training import TrainingJob
from timeshare.scheduler.lanes import LanesView


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    """A runtime's counters and memory, for metrics and status pages, read without
    waiting for the device: a consistent-enough view, not an atomic one. The optional
    parts are None when the runtime has no such part. A plain record: it crosses Ray
    from a cluster's replicas, and becomes JSON only at the edges (``to_json``)."""

    device: str
    capacity_bytes: int  # the arena
    used_bytes: int  # held by resident models and reserved regions
    resident: dict[str, int]  # resident model -> its device bytes
    reserved: dict[str, int]  # a region's owner -> its bytes (NOTE [Regions of the arena])
    host_bytes: int  # the models' host copies (with a host budget: those in memory)
    host_pinned_bytes: int  # of those, page-locked (NOTE [Exact host pinning])
    loads: dict[str, int]  # model -> its loads so far
    evictions: int
    failures: int  # calls that raised
    preemptions: int  # training jobs told to stop at their next preemption point
    training_seconds: float
    training_iterations: int
    workers: PoolHealth | None  # with workers: the pool
    lanes: LanesView | None  # with lanes (PACK): their budget, each lane (NOTE [Lanes in the runtime])
    host_tier: HostTierSnapshot | None  # with a host budget (NOTE [Host tier])
    shared: SharingSnapshot | None  # with dedup: tensors held once (NOTE [Shared tensors])

    def to_json(self) -> dict:
        """As JSON's types, under the field names, in their order."""
        return dataclasses.asdict(self)


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
             jobs: Iterable[TrainingJob], executor: Observed, dispatcher: Dispatcher, failures: int,
             host: HostTier | None = None, sharing: SharedTensors | None = None,
             regions: Mapping[str, Block] | None = None) -> RuntimeSnapshot:
    alloc = arena.allocator
    models, jobs = list(models), list(jobs)
    shared = None if sharing is None else sharing.snapshot()
    return RuntimeSnapshot(
        device=str(device),
        capacity_bytes=alloc.capacity,
        used_bytes=alloc.used,
        resident={m.name: m.nbytes for m in models if m.block is not None},
        reserved={owner: block.size for owner, block in dict(regions or {}).items()},
        host_bytes=(sum(m.nbytes for m in models) + (shared.shared_bytes if shared else 0)) if host is None
        else host.used,
        host_pinned_bytes=executor.pinned_host_bytes(),
        loads={m.name: m.loads for m in models},
        evictions=residency.evictions,
        failures=failures,
        preemptions=dispatcher.scheduler.preemptions,
        training_seconds=sum(j.stats.step_seconds for j in jobs),
        training_iterations=sum(j.stats.iterations for j in jobs),
        workers=executor.health(),
        lanes=dispatcher.lanes(),
        host_tier=None if host is None else host.snapshot(),
        shared=shared,
    )


@dataclass(frozen=True, slots=True)
class ArenaView:
    """The arena: its shared-memory segment's name (on the CPU; None on CUDA), its bytes
    and its free ranges (offset, bytes)."""

    name: str | None
    capacity_bytes: int
    free_ranges: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class RegionView:
    """A region of the arena (NOTE [Regions of the arena])."""

    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """A registered model in the arena: its bytes, its offset (None: not resident), where
    it was last, its loads, whether it is pinned, and its measured ephemeral bytes by
    input shape."""

    nbytes: int
    offset: int | None
    last_offset: int | None
    loads: int
    pinned: bool
    ephemeral_bytes: dict[str, int]


@dataclass(frozen=True, slots=True)
class Diagnostics:
    """For operators and white-box tests, without waiting for the device: the arena, each
    model's placement, the regions by owner, how many blocks are quarantined
    because a copy may still write them, the tasks the scheduler knows, the lanes, the
    pool's view, the host tier and its stores, and the shared sets (each None, or empty,
    where the runtime has no such part)."""

    arena: ArenaView
    models: dict[str, Placement]
    regions: dict[str, RegionView]
    quarantined: int
    scheduler_tasks: int
    lanes: LanesView | None
    workers: PoolHealth | None
    host_tier: HostTierSnapshot | None
    host_stores: dict[str, StoreView]
    shared: SharingSnapshot | None
    shared_sets: dict[str, SetView]


def diagnostics(arena: Arena, residency: Residency, models: Mapping[str, ModelEntry], executor: Observed,
                dispatcher: Dispatcher, host: HostTier | None = None, sharing: SharedTensors | None = None,
                regions: Mapping[str, Block] | None = None) -> Diagnostics:
    alloc = arena.allocator
    return Diagnostics(
        arena=ArenaView(arena.shm_name, alloc.capacity, list(alloc.free_ranges())),
        models={n: Placement(m.nbytes, m.block.offset if m.block is not None else None, m.last_offset, m.loads,
                             m.pinned, dict(m.ephemeral))
                for n, m in models.items()},
        regions={owner: RegionView(b.offset, b.size) for owner, b in dict(regions or {}).items()},
        quarantined=residency.quarantined(),
        scheduler_tasks=len(dispatcher.scheduler.tasks),
        lanes=dispatcher.lanes(),
        workers=executor.health(),
        host_tier=None if host is None else host.snapshot(),
        host_stores={} if host is None else host.models_view(),
        shared=None if sharing is None else sharing.snapshot(),
        shared_sets={} if sharing is None else sharing.view(),
    )
