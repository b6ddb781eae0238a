"""What operators and tests read of a runtime: statistics and the diagnostics view as
plain dictionaries, and the metrics snapshot as a typed record (:class:`RuntimeSnapshot`),
each made from the runtime's parts; ``Observing``, the runtime's methods that show them.
Nothing here changes the parts (but reclaiming finished quarantined blocks, which only
frees). Runs in the controller (the caller's process).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from timeshare.executor.interface import Executor, Observed, PoolHealth
from timeshare.memory import Arena, Block
from timeshare.runtime.dispatch import Dispatcher
from timeshare.runtime.events import Listener, RuntimeLock
from timeshare.runtime.host_tier import HostTier, HostTierSnapshot
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.sharing import SharedTensors, SharingSnapshot
from timeshare.runtime.training import TrainingJob
from timeshare.scheduler.lanes import LanesView

if TYPE_CHECKING:
    from timeshare.runtime.jobs import JobTable
    from timeshare.runtime.table import ModelTable


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
             jobs: Iterable[TrainingJob], executor: Observed, gate: Dispatcher, failures: int,
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
        preemptions=gate.scheduler.preemptions,
        training_seconds=sum(j.stats.step_seconds for j in jobs),
        training_iterations=sum(j.stats.iterations for j in jobs),
        workers=executor.health(),
        lanes=gate.lanes(),
        host_tier=None if host is None else host.snapshot(),
        shared=shared,
    )


def diagnostics(arena: Arena, residency: Residency, models: Mapping[str, ModelEntry], executor: Observed,
                gate: Dispatcher, host: HostTier | None = None, sharing: SharedTensors | None = None,
                regions: Mapping[str, Block] | None = None) -> dict:
    alloc = arena.allocator
    return {
        "arena": {"name": arena.shm_name, "capacity_bytes": alloc.capacity, "free_ranges": alloc.free_ranges()},
        "models": {n: {"nbytes": m.nbytes, "offset": m.block.offset if m.block is not None else None,
                       "last_offset": m.last_offset, "loads": m.loads, "pinned": m.pinned,
                       "ephemeral_bytes": dict(m.ephemeral)}
                   for n, m in models.items()},
        "regions": {owner: {"offset": b.offset, "nbytes": b.size} for owner, b in dict(regions or {}).items()},
        "quarantined": residency.quarantined(),
        "scheduler_tasks": len(gate.scheduler.tasks),
        "lanes": _plain(gate.lanes()),
        "workers": _plain(executor.health()),
        "host_tier": None if host is None else dataclasses.asdict(host.snapshot()) | {"stores": host.models_view()},
        "shared": None if sharing is None else dataclasses.asdict(sharing.snapshot()) | {"sets": sharing.view()},
    }


def _plain(record: LanesView | PoolHealth | None) -> dict | None:
    """A part's record as the dictionary the diagnostics view shows (None stays None)."""
    return None if record is None else dataclasses.asdict(record)


class Observing:
    """What a ``Runtime`` shows of itself (its base: the methods operators, metrics and
    white-box tests call), made from the parts above."""

    if TYPE_CHECKING:  # the runtime's parts these read (``Runtime``'s)
        device: torch.device
        _arena: Arena
        _residency: Residency
        _table: ModelTable
        _jobs: JobTable
        _exec: Executor
        _gate: Dispatcher
        _lock: RuntimeLock

        def _turn(self) -> AbstractContextManager[None]: ...

    def worker_pids(self) -> list[int]:
        """The operating-system ids of the worker processes now in the pool (empty
        without workers): for operators and fault-injection tests."""
        return self._exec.pids()

    def stats(self) -> dict:
        with self._turn():
            return stats(self.device, self._arena, self._residency, self._table.entries)

    def snapshot(self) -> RuntimeSnapshot:
        """Counters and memory for metrics, read without waiting for the device (a
        scrape must not queue behind a long inference): a consistent-enough view, not
        an atomic one."""
        table = self._table
        return snapshot(self.device, self._arena, self._residency, table.entries.values(), self._jobs.all().values(),
                        self._exec, self._gate, table.failures, table.host, table.sharing, table.regions)

    def diagnostics(self) -> dict:
        """For operators and white-box tests, without waiting for the device: the arena
        (its shared-memory segment's name on the CPU, its free ranges), each model's size
        and placement, the blocks quarantined because a copy may still write them, the
        tasks the scheduler knows, and with workers the pool's view (as in ``snapshot``)."""
        with self._lock:
            return diagnostics(self._arena, self._residency, self._table.entries, self._exec, self._gate,
                               self._table.host, self._table.sharing, self._table.regions)

    @property
    def executor(self) -> Executor:
        """Where the models execute (``executor/``), for tests and benchmarks: the test
        hooks are ``timeshare.executor.testing``'s; production code asks the runtime."""
        return self._exec

    def is_resident(self, name: str) -> bool:
        """Whether ``name`` is in device memory now, read without waiting for the device
        (for a server's queueing decisions; ``resident()`` waits its turn)."""
        m = self._table.entries.get(name)
        return m is not None and m.block is not None

    def thrashing_factor(self) -> float:
        """How much longer callers should let requests gather into batches: 1.0 unless
        thrashing control is on and loads dominate the device's recent time (up to 5.0)."""
        detector = self._residency.detector
        return 1.0 if detector is None else detector.batch_factor(time.monotonic())

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` with a :class:`~timeshare.runtime.events.CallRecord` after
        every inference and an :class:`~timeshare.runtime.events.EvictionRecord` after
        every eviction. It runs after the runtime's lock is let go, in the thread that
        let it go, before that thread's call returns (NOTE [Records outside the lock]);
        listeners get the records one at a time, in order; what it raises is logged,
        never passed to the caller."""
        self._table.outbox.subscribe(listener)
