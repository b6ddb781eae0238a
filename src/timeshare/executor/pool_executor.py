"""Models run in worker processes that map the arena (the ``Executor`` of
``executor/interface.py`` for ``workers>0``): host stores and shared sets in shared memory
that every worker maps, the :class:`~timeshare.executor.pool.ProcessPool` doing the rest.
Runs in the controller.
"""

from __future__ import annotations

import pickle
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
from torch import nn

from timeshare import protocol as P
from timeshare.decode.step import Step
from timeshare.errors import ConfigError
from timeshare.executor.interface import Packed, PoolHealth, Ran, Shared
from timeshare.executor.packing import Tiered, trace_on_host
from timeshare.executor.pool import ProcessPool
from timeshare.memory.arena import map_shared_memory, reserve_shared_memory
from timeshare.memory.ephemeral import LaneBound
from timeshare.models.binding import TensorLayout
from timeshare.models.spec import ModelSpec
from timeshare.transfer.backing import HostPages
from timeshare.transfer.copy import LoadHandle
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder, ModelProfile
from timeshare.tree import map_tensors
from timeshare.worker.profiling import release_host_cache
from timeshare.worker.trainer import TrainSpec


class PoolExecutor:
    """Models run in worker processes that map the arena; host stores live in shared
    memory that every worker maps (and page-locks, on CUDA)."""

    def __init__(self, device: torch.device, pool: ProcessPool):
        self.device = device
        self._pool = pool
        self._segments: dict[str, SharedMemory] = {}  # model -> its host store's segment
        self._shared_segments: dict[str, SharedMemory] = {}  # shared set -> its store's segment
        # NOTE [Locked host tier]: models whose stores the host tier drops and refills, and
        # for each the workers whose results said they hold it page-locked.
        self._droppable: set[str] = set()
        self._locked_in: dict[str, set[int]] = {}
        # NOTE [Direct host access]: each resident model's keys its load left on the host
        # store, as the loading worker said; told to any worker that runs it resident.
        self._host_keys: dict[str, tuple[str, ...]] = {}

    @property
    def pool(self) -> ProcessPool:
        return self._pool

    def check_registrable(self, spec: ModelSpec) -> None:
        """Worker processes rebuild the module from ``build`` and trace it with the example
        inputs, so both must be sendable to another process."""
        if not spec.example_inputs and not spec.example_kwargs:
            raise ConfigError(
                f"model {spec.name!r}: with workers, register() needs example_inputs (the execution order is "
                "traced at registration)"
            )
        try:
            pickle.dumps(spec.build)
        except Exception as exc:
            raise ConfigError(
                f"model {spec.name!r}: with workers, build must be a 'module:function' string or a top-level "
                f"function that worker processes can import, not {spec.build!r} ({exc})"
            ) from None

    def pack(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore) -> Packed:
        # Workers map the store, so it is laid out in execution order once, here.
        order = trace_on_host(module, layout, store, spec)
        by_key = {e.key: e for e in store.entries}
        segment = self._segment(spec.name, store.nbytes)
        try:
            buffer = map_shared_memory(segment.name, store.nbytes)  # NOTE [Mappings outlive close]
            packed = HostStore.pack([by_key[k] for k in order.key_order()], store.state(), pin=False, buffer=buffer)
        except BaseException:
            _unlink(segment)
            raise
        # The controller keeps no view of the store: only the workers map it from now on.
        return Packed(spec.name, spec, module, layout, None, packed.nbytes, segment, order, tuple(packed.entries))

    def pack_tiered(self, spec: ModelSpec, tiered: Tiered,
                    shared: dict[str, tuple[str, TensorEntry]] | None = None) -> Packed:
        store = tiered.store
        segment = self._segment(spec.name, store.nbytes)
        try:
            pages = HostPages(store.nbytes, shared_name=segment.name)
            view = HostStore(store.entries, pages.tensor, store.alignment)
            if tiered.filled:
                view.buffer.copy_(store.buffer)
            else:
                pages.drop()  # reserved, and empty until a load needs it
        except BaseException:
            _unlink(segment)
            raise
        return Packed(spec.name, spec, tiered.module, tiered.layout, None, store.nbytes, segment, tiered.order,
                      tuple(store.entries), pages=pages, view=view, shared=shared)

    def pack_shared(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore,
                    order: ExecutionOrder, shared: dict[str, tuple[str, TensorEntry]]) -> Packed:
        segment, view = self._in_segment(spec.name, store)
        # The controller keeps ``view`` (the same pages the workers map): deduplication
        # compares new models' tensors with it and moves tensors out of it.
        return Packed(spec.name, spec, module, layout, None, view.nbytes, segment, order, tuple(view.entries),
                      view=view, shared=shared)

    def add_shared(self, sid: str, store: HostStore) -> HostStore:
        segment, view = self._in_segment(sid, store)
        try:
            self._pool.add_shared(P.AddShared(0, sid, tuple(view.entries), segment.name, view.nbytes))
        except BaseException:
            _unlink(segment)
            raise
        self._shared_segments[sid] = segment
        return view

    def _in_segment(self, what: str, store: HostStore) -> tuple[SharedMemory, HostStore]:
        """A copy of ``store`` in a new shared-memory segment, and the controller's view of it."""
        segment = self._segment(what, store.nbytes)
        try:
            view = HostStore.pack(store.entries, store.state(), buffer=map_shared_memory(segment.name, store.nbytes))
        except BaseException:
            _unlink(segment)
            raise
        return segment, view

    def release_shared(self, sid: str) -> LoadHandle | None:
        return None  # workers finish every copy before they answer

    def remove_shared(self, sid: str) -> None:
        self._pool.remove_shared(sid)
        segment = self._shared_segments.pop(sid, None)
        if segment is not None:
            _unlink(segment)

    def host_dropping(self, name: str) -> None:
        # Workers answer a call only once its copies are over; those holding the store
        # locked unlock it first (NOTE [Locked host tier]), and a benchmark's one-shot
        # worker, which may have locked it unrecorded, is stopped.
        self._pool.stop_retired()
        workers = self._locked_in.get(name)
        if workers:
            self._pool.unpin_store(name, workers)
        self._locked_in.pop(name, None)

    def host_filling(self, name: str) -> None:
        return None  # a registration locks for its own process: each worker locks at its load

    def reads_host(self, name: str) -> bool:
        return bool(self._host_keys.get(name))

    def add(self, packed: Packed) -> None:
        assert packed.segment is not None and packed.order is not None
        shared = tuple((k, sid, e) for k, (sid, e) in (packed.shared or {}).items())
        self._pool.add(P.AddModel(0, packed.name, packed.spec.build, packed.entries, packed.segment.name,
                                  packed.nbytes, packed.order, droppable=packed.pages is not None, shared=shared))
        self._segments[packed.name] = packed.segment
        if packed.pages is not None:
            self._droppable.add(packed.name)

    def discard(self, packed: Packed) -> None:
        if packed.segment is not None and packed.name not in self._segments:
            _unlink(packed.segment)

    @staticmethod
    def _segment(name: str, nbytes: int) -> SharedMemory:
        """A shared-memory segment for ``name``'s host store, reserved (closed here: it is
        mapped by name)."""
        segment = SharedMemory(create=True, size=nbytes)
        reserve_shared_memory(segment, f"the host copy of model {name!r}",
                              "free space in /dev/shm (unregister models, or enlarge it: Docker's default "
                              "is 64 MB, --shm-size raises it)")
        segment.close()
        return segment

    def run(self, name: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            lane: LaneBound | None = None, fill: FillSpec | None = None, shared: Shared = None,
            step: Step | None = None) -> Ran:
        ran = self._pool.run(name, offset, resident, args, kwargs, strategy, lane, fill, shared,
                             self._host_keys.get(name, ()) if resident else None, step)
        if not resident and ran.timings is not None:
            self._host_keys[name] = tuple(ran.timings.host_keys)
            if name in self._droppable:  # NOTE [Locked host tier]
                workers = self._locked_in.setdefault(name, set())
                if ran.timings.store_pinned:
                    workers.add(ran.timings.worker)
                else:
                    workers.discard(ran.timings.worker)
        return ran

    def profile(self, name: str, offset: int, args: tuple, kwargs: dict, shared: Shared = None) -> ModelProfile:
        return self._pool.profile(name, offset, args, kwargs, shared, self._host_keys.get(name, ()))

    def release(self, name: str) -> LoadHandle | None:
        self._pool.release(name)  # workers finish every copy before they answer: no handle to wait on
        return None

    def remove(self, name: str) -> None:
        self._pool.remove(name)
        self._droppable.discard(name)
        self._locked_in.pop(name, None)
        self._host_keys.pop(name, None)
        segment = self._segments.pop(name, None)
        if segment is not None:
            _unlink(segment)

    def inputs(self, obj: Any) -> Any:
        # Inputs stay on the host: they cross in the worker's tensor channel and the worker
        # uploads them once, from its page-locked mapping of it (NOTE [Tensor channel]).
        # Moving them here would cost a device-to-host copy here and another upload there.
        return map_tensors(obj, lambda t: t.cpu())

    def check_trainable(self, spec: TrainSpec) -> None:
        spec.check_shippable()
        if len(self._pool.workers) < 2:
            raise ConfigError("training with workers needs workers >= 2: one holds the job, another "
                              "stays free so that inference never waits for a process to start")

    def start_job(self, spec: TrainSpec) -> ProcessPool:
        self._pool.drop_job(spec.name)  # a finished job of that name
        return self._pool

    def drop_job(self, name: str) -> None:
        self._pool.drop_job(name)

    def pids(self) -> list[int]:
        return list(self._pool.pids())

    def health(self) -> PoolHealth | None:
        return self._pool.health()

    def pinned_host_bytes(self) -> int:
        """Every worker registers each store's segment: the same pages, counted once; a
        droppable store while a live worker holds it locked (NOTE [Locked host tier])."""
        if self.device.type != "cuda":
            return 0
        live = {w.id for w in list(self._pool.workers)}
        return sum(s.size for name, s in self._segments.items()
                   if name not in self._droppable or self._locked_in.get(name, set()) & live) + \
            sum(s.size for s in self._shared_segments.values())

    def run_in_new_process(self, name: str, offset: int, args: tuple, kwargs: dict, strategy: str,
                           shared: Shared = None) -> Any:
        return self._pool.run_in_new_worker(name, offset, args, kwargs, strategy, shared)

    def close(self) -> None:
        try:
            self._pool.close()
        finally:
            for segment in list(self._segments.values()) + list(self._shared_segments.values()):
                _unlink(segment)
            self._segments.clear()
            self._shared_segments.clear()
            release_host_cache(self.device)


def _unlink(segment: SharedMemory) -> None:
    """Remove a store's segment: its name now, its memory when the last mapping goes
    (NOTE [Mappings outlive close])."""
    try:
        segment.unlink()
    except FileNotFoundError:
        pass
