"""Executing models on the device: the set of models, running them and their loads (a
first load traces and profiles; later ones are pipelined, ``worker/loading.py``), the
host stores it copies from (its models' and its shared sets', page-locked or not: NOTE
[Exact host pinning], NOTE [Locked host tier]), where its models' tensors are bound (NOTE
[Sticky placement], NOTE [Direct host access]) and profiling a resident model (measuring
is in ``worker/profiling.py``). Logic only: runs in the process that computes (the
caller's for the in-process runtime, a worker process for the multi-process one).

The worker never decides placement. It is told at which arena offset a model lives
and whether its bytes are already there; the controller owns the allocator and the
eviction policy (see docs/architecture.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from timeshare.decode.runner import Decoders, relaid_out
from timeshare.decode.step import Step, StepKind, StepOutcome
from timeshare.device import HostRegistrar, host_registrar, synchronize
from timeshare.errors import DeviceError, PipelineError, TimeshareError
from timeshare.memory.arena import Arena
from timeshare.models.binding import TensorLayout, bind, bind_some, unbind
from timeshare.transfer.copy import CopyEngine, LoadHandle, Piece, Ready, SharedCopies
from timeshare.transfer.disk import READ_THREADS, FillSpec, StreamFill
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder, LinkCosts, ModelProfile, time_layers, trace_execution_order
from timeshare.tree import map_tensors, shape_key, tensors_in
from timeshare.worker.loading import (
    LoadPlan,
    WorkerModel,
    adopt_order,
    forget_order,
    forward_while_loading,
    load_plan_of,
)
from timeshare.worker.profiling import owners_of, probe_link, profile_resident, with_direct_layers

log = logging.getLogger(__name__)


class Worker:
    """Runs models whose weights live in ``arena``, loading them through ``engine``."""

    def __init__(
        self,
        device: torch.device,
        arena: Arena,
        engine: CopyEngine,
        *,
        profile_repeats: int = 3,
        fixed_group_bytes: int = 2 << 20,
        pin_host: bool | None = None,
        registrar: HostRegistrar | None = None,
        direct_host_access: bool | None = None,
    ):
        self.device = device
        self.arena = arena
        self._arena_at = arena.buffer.untyped_storage().data_ptr()  # fixed for the arena's life
        self.engine = engine
        self.profile_repeats = profile_repeats
        self.fixed_group_bytes = fixed_group_bytes
        self.pin_host = device.type == "cuda" if pin_host is None else pin_host
        # NOTE [Direct host access]: only where host memory is the device's, for now.
        self.direct_host_access = device.type == "cpu" if direct_host_access is None else direct_host_access
        # Page-locks the host stores this worker packs (NOTE [Exact host pinning]); a
        # test passes a fake one to check the bookkeeping on the CPU.
        default = host_registrar(device) if self.pin_host else None
        self.host_registrar = registrar if registrar is not None else default
        self.models: dict[str, WorkerModel] = {}
        self.shared: dict[str, HostStore] = {}  # NOTE [Shared tensors]: the host stores of shared sets
        self._shared_loads: dict[str, LoadHandle] = {}  # the latest load that copied each set
        self._link: LinkCosts | None = None
        self._fences: list[object] = []  # CUDA: last-use events of evicted models
        self.last_load: LoadHandle | None = None  # the latest pipelined load, for its timing
        self.last_fill: StreamFill | None = None  # the latest load's reads from disk, for their timing
        self.read_deadline_s = 600.0  # a load's reads from disk
        self.read_threads = READ_THREADS
        self.disk_Bps: float | None = None  # the latest load from disk's read bandwidth
        self.moved_bytes = 0  # bytes the latest ``run``'s load copies to the device (shared sets included)
        self.lock_s: float | None = None  # the latest ``run``'s page-locking of its store (NOTE [Locked host tier])
        self._lock_refused: set[str] = set()  # models whose stores could not be page-locked (warned once)
        # NOTE [Direct host access]: the models with keys bound to host memory now (kept by
        # ``_bind`` and ``_bind_direct``), so that ``to_host`` looks at those alone, not at
        # every registered model on every call.
        self._host_bound: set[str] = set()
        # NOTE [One step, two places]: language models' steps run here, on pages in the arena.
        self.decoders = Decoders(lambda: self.arena.buffer)

    # ------------------------------------------------------------------ model set
    def add(self, name: str, module: nn.Module, layout: TensorLayout, store: HostStore,
            order: ExecutionOrder | None = None,
            shared: Mapping[str, tuple[str, TensorEntry]] | None = None, droppable: bool = False) -> WorkerModel:
        """``shared``: the model's keys held in shared sets (NOTE [Shared tensors]), which
        needs ``order``; the store holds the others. ``droppable``: the host tier gives the
        store's pages back and fills them again; this worker page-locks it at its loads
        and until ``unpin_store`` (NOTE [Locked host tier])."""
        if shared and order is None:
            raise TimeshareError(f"model {name!r}: shared tensors need the execution order traced at registration")
        sets = frozenset(sid for sid, _ in (shared or {}).values())
        missing = sets - self.shared.keys()
        if missing:
            raise TimeshareError(f"model {name!r} uses shared sets {sorted(missing)} this worker does not have")
        wm = WorkerModel(name, module, layout, store, shared=dict(shared or {}), shared_sets=sets,
                         shared_sizes={sid: self.shared[sid].nbytes for sid in sets}, droppable=droppable)
        self.models[name] = wm
        if order is not None:
            self._adopt_order(wm, order, repack=False)
            # Traced at registration and laid out so by the store's owner (a pool's shared
            # segment, a host tier's pages): a failed first load must not retrace and
            # repack it into a buffer of this worker's own, out of its owner's reach.
            wm.order_fixed = True
        return wm

    def adopt_profile(self, name: str, profile: ModelProfile) -> None:
        """A profile another worker measured (same device, same model): loads of this
        shape are pipelined here at once, with no profiling of our own."""
        wm = self.models[name]
        wm.profiles[profile.shape_key] = profile
        wm.last_profile = wm.last_profile or profile.shape_key
        if self._link is None:
            self._link = profile.link

    def remove(self, name: str) -> None:
        """Forget ``name``; its host store is unpinned (NOTE [Exact host pinning])."""
        wm = self.models.pop(name)
        self._host_bound.discard(name)
        self.decoders.drop(name)
        unbind(wm.layout)
        self._drop_store(wm.store)

    # ------------------------------------------------------------------ execution
    def load_seconds(self) -> float | None:
        """How long the copies of the latest ``run``'s pipelined load took, once they are
        over (None: that run loaded nothing pipelined, or its copies still run)."""
        return self.last_load.copy_seconds() if self.last_load is not None else None

    def run(self, name: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            fill: FillSpec | None = None, shared: Mapping[str, tuple[int, bool]] | None = None,
            host_keys: tuple[str, ...] | None = None, step: Step | None = None):
        """Forward ``name`` on device inputs, or run a language model's ``step`` instead
        (NOTE [One step, two places]: its outcome). Its bytes are at ``offset`` if ``resident``;
        otherwise they are loaded there first (pipelined once the model is profiled).
        ``fill``: the host store is on disk; its reads run beside the load (NOTE [Disk
        to device]). ``shared``: each of its shared sets' arena offset and whether its
        bytes are there; a load copies those that are not (NOTE [Shared tensors]).
        ``host_keys``: for a resident run, the keys its load left on the host store (NOTE
        [Direct host access]; None: as this worker bound them). A resident run leaves
        ``last_load`` alone: with lanes it may overlap a load."""
        wm = self.models[name]
        if resident and not shared and not wm.shared_sets and wm.pending is None and wm.bound_at == offset \
                and not wm.shared_bound and (host_keys is None or host_keys == wm.host_bound):
            # The resident call's path: bound where it is, nothing shared, nothing in flight.
            self.lock_s = None
            with torch.no_grad():
                out = wm.module(*args, **kwargs) if step is None else self.decoders.run(name, wm.module, step)
            self._mark_used(wm)
            return out
        at = self._shared_offsets(wm, shared)
        missing = tuple(sid for sid, (_, there) in (shared or {}).items() if not there)
        if resident and missing:
            raise TimeshareError(f"model {name!r} is resident but its shared sets {list(missing)} are not")
        locked = False
        self.lock_s = None
        if not resident:
            self.last_load = None
            self.last_fill = None
            self.moved_bytes = 0
        try:
            if not resident and wm.droppable:
                # NOTE [Locked host tier]: before the reads from disk, so that they land in
                # locked memory, and before any copy, so that the copies are asynchronous.
                t0 = time.perf_counter()
                locked = self.pin_store(name)
                self.lock_s = time.perf_counter() - t0 if locked else None
            if resident:
                self.finish_pending(name)
                self._bind(wm, offset, at)
                if host_keys is not None:
                    self._bind_direct(wm, host_keys)
                with torch.no_grad():
                    out = wm.module(*args, **kwargs) if step is None else self.decoders.run(name, wm.module, step)
            elif fill is not None:
                out = self._load_from_disk(wm, offset, args, kwargs, strategy, fill, missing, at, step)
            elif wm.order is None or not wm.profiles:
                out = self._first_load(wm, offset, args, kwargs, missing, at, step)
            else:
                out = self._pipelined_load(wm, offset, args, kwargs, strategy, missing=missing, at=at, step=step)
            if missing:
                # The sets are "there" for the next model once this call returns: their
                # copies must be over, or their failure this load's (NOTE [Shared tensors]).
                self.finish_pending(name)
        except BaseException:
            for sid in missing:  # the controller frees those sets: no later call waits on this load
                self._shared_loads.pop(sid, None)
            if locked:
                self.unlock_failed_load(name)
            raise
        self._mark_used(wm)
        return out

    def _shared_offsets(self, wm: WorkerModel, shared: Mapping[str, tuple[int, bool]] | None) -> dict[str, int]:
        """Where ``wm``'s shared sets are, checked; those already there are waited for if
        a load still copies them (a device-side wait on CUDA)."""
        given = dict(shared or {})
        if given.keys() != wm.shared_sets:
            raise TimeshareError(f"model {wm.name!r} uses shared sets {sorted(wm.shared_sets)}, given {sorted(given)}")
        for sid, (_, there) in given.items():
            handle = self._shared_loads.get(sid) if there else None
            if handle is not None:
                handle.wait_all()  # a device-side wait on CUDA
                self._shared_loads.pop(sid, None)
        return {sid: off for sid, (off, _) in given.items()}

    def _load_from_disk(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict, strategy: str,
                        fill: FillSpec, missing: tuple[str, ...] = (), at: Mapping[str, int] | None = None,
                        step: Step | None = None):
        """A load whose source is read from disk meanwhile; the store is whole at the end.
        ``missing`` and ``at``: the model's shared sets, as for ``run`` (their stores stay
        in memory: only the model's own store is read from disk)."""
        stream = self.last_fill = StreamFill(fill, wm.store.buffer, threads=self.read_threads,
                                             deadline_s=self.read_deadline_s).start()
        try:
            if wm.order is None or not wm.profiles:
                stream.wait_all()
                out = self._first_load(wm, offset, args, kwargs, missing, at, step)
            else:
                out = self._pipelined_load(wm, offset, args, kwargs, strategy, ready=stream.wait_until,
                                           disk_Bps=self.disk_Bps, missing=missing, at=at, step=step)
            stream.wait_all()
            if stream.read_s > 0:  # measured on every load from disk; the next plans for it
                self.disk_Bps = stream.bytes_read / stream.read_s
            return out
        except PipelineError as exc:
            if stream.error is not None:  # the copy waited for a read that failed: say which
                raise stream.error from exc
            raise
        finally:
            stream.close()

    def profile(self, name: str, offset: int, args: tuple, kwargs: dict,
                shared: Mapping[str, tuple[int, bool]] | None = None,
                host_keys: tuple[str, ...] | None = None) -> ModelProfile:
        """Profile a resident model for these inputs (cached per input shape)."""
        wm = self.models[name]
        at = self._shared_offsets(wm, shared)
        self.finish_pending(name)
        self._bind(wm, offset, at)
        if host_keys is not None:
            self._bind_direct(wm, host_keys)
        key = shape_key(args, kwargs)
        if key not in wm.profiles:
            self._profile_resident(wm, args, kwargs)
        return wm.profiles[key]

    def release(self, name: str) -> LoadHandle | None:
        """The model leaves the arena. Waits for its copies; returns the load if one
        may still be writing (its deadline passed), so the caller keeps the block out
        of use until ``done()``. Never raises."""
        wm = self.models[name]
        handle, wm.pending = wm.pending, None
        if wm.last_use is not None:  # see NOTE [Arena reuse ordering]
            self._fences.append(wm.last_use)
            wm.last_use = None
        if handle is None:
            return None
        try:
            handle.wait_all()  # a copy must not land in memory that is reused
        except TimeshareError as exc:
            log.warning("releasing %s after a failed load: %s", name, exc)
        if self.engine.host_waits and not handle.done():
            return handle
        return None

    def to_host(self, out):
        """``out`` with every tensor on the CPU and none aliasing the arena, so that it
        stays valid after the model leaves (and can cross a process boundary). Each
        output is copied at most once: a device tensor comes down once, a host tensor
        that is a view of the arena is cloned once, any other host tensor is returned
        as it is. A worker process then copies it into its tensor channel, or pickles
        what does not fit there (NOTE [Tensor channel])."""
        if type(out) is StepOutcome:  # a step's: token ids, nothing on the device
            return out
        if type(out) is torch.Tensor and not self._host_bound:  # one tensor, no store to alias
            t = out.detach() if out.requires_grad else out
            if not t.is_cpu:
                return t.cpu()
            return t.clone() if t.untyped_storage().data_ptr() == self._arena_at else t
        owned = {self.arena.buffer.untyped_storage().data_ptr()}
        # A model computing from its host store (NOTE [Direct host access]) may return one
        # of those tensors: a copy, since the store's pages may go (and a shared set's
        # bytes are every variant's).
        for name in self._host_bound:
            wm = self.models[name]
            owned.add(wm.store.buffer.untyped_storage().data_ptr())
            owned |= {self.shared[wm.shared[k][0]].buffer.untyped_storage().data_ptr()
                      for k in wm.host_bound if k in wm.shared}

        def give(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.device.type != "cpu":
                return t.cpu()
            if t.untyped_storage().data_ptr() in owned:
                return t.clone()
            return t

        return map_tensors(out, give)

    def aliases_arena(self, out) -> bool:
        ptr = self.arena.buffer.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ptr for t in tensors_in(out))

    # ------------------------------------------------------------------ loading
    def _first_load(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict, missing: tuple[str, ...] = (),
                    at: Mapping[str, int] | None = None, step: Step | None = None):
        """Load whole; trace the execution order if unknown (repacking the store in that
        order); profile for these inputs (a ``step``: for a plain forward like it, then
        the step itself runs once, the model resident)."""
        if step is not None:
            args, kwargs = map_tensors(step.example(), lambda t: t.to(self.device))
        try:
            at = at or {}
            self._copy_whole(wm, offset, "first load", missing, at)
            self._bind(wm, offset, at)
            out = None
            if wm.order is None:
                spans = wm.store.spans(self.arena.buffer.data_ptr() + offset)
                with torch.no_grad():
                    order, out = trace_execution_order(wm.module, args, kwargs, spans, owners_of(wm.layout))
                self._adopt_order(wm, order, repack=True)
                self._copy_whole(wm, offset, "first load, execution order")
                self._bind(wm, offset, at)
            if out is None and step is None:
                with torch.no_grad():
                    out = wm.module(*args, **kwargs)
            self._profile_resident(wm, args, kwargs)
            if step is not None:
                with torch.no_grad():
                    out = self.decoders.run(wm.name, wm.module, step)
            return out
        except BaseException:
            wm.pending = None
            if not wm.profiles and not wm.order_fixed:
                forget_order(wm)  # the next load starts over
            raise

    def _pipelined_load(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict, strategy: str,
                        ready: Ready | None = None, disk_Bps: float | None = None, missing: tuple[str, ...] = (),
                        at: Mapping[str, int] | None = None, step: Step | None = None):
        """Queue every group, then forward while they arrive (NOTE [Pipelined forward]);
        ``ready`` and ``disk_Bps``: the source is read from disk meanwhile (NOTE [Disk to
        device]); ``missing``: shared sets this load copies too (NOTE [Shared tensors]).
        A ``step`` runs instead of the forward: a prefill computes while the groups
        arrive, as a forward does; any other step waits for the whole load first (NOTE
        [Decode graphs]: a replay meets no layer's wait)."""
        plan = load_plan_of(wm, shape_key(args, kwargs), strategy, disk_Bps, self.fixed_group_bytes, missing)
        at = at or {}
        self._bind(wm, offset, at)
        self._bind_direct(wm, plan.direct_keys)
        if ready is not None and plan.direct_end:
            # Computed from the store itself, which this load is still reading from disk
            # (NOTE [Disk to device]): the direct layers wait for their bytes like a group.
            ready(plan.direct_end)
        region = self.arena.buffer[offset : offset + wm.store.nbytes]
        handle = self.engine.start(
            wm.store.buffer, region, plan.ranges, f"loading {wm.name}", self._take_fences(), plan.events, ready,
            self._shared_copies(plan.sources, plan.pieces, at)
        )
        wm.pending = self.last_load = handle
        self._shared_loads.update(dict.fromkeys(plan.sources, handle))
        self.moved_bytes = sum(b - a for a, b in plan.ranges) + sum(b - a for g in plan.pieces for _, a, b in g)
        out: object
        if step is not None and step.kind is not StepKind.PREFILL:
            handle.wait_all()
            with torch.no_grad():
                out, arrived = self.decoders.run(wm.name, wm.module, step), True
        elif step is not None:
            out, arrived = forward_while_loading(wm.module, handle, plan.wait_of,
                                                 lambda: self.decoders.run(wm.name, wm.module, step),
                                                 self.aliases_arena)
        else:
            out, arrived = forward_while_loading(wm.module, handle, plan.wait_of, lambda: wm.module(*args, **kwargs),
                                                 self.aliases_arena)
        if arrived:
            wm.pending = None  # everything arrived and was waited for
        return out

    def load_plan(self, name: str, key: str, strategy: str) -> LoadPlan:
        """The ready-made plan that loads of ``name`` for input shape ``key`` follow:
        its byte ranges and which group each wait-point module waits for."""
        return load_plan_of(self.models[name], key, strategy)

    # ------------------------------------------------------------------ helpers
    def _copy_whole(self, wm: WorkerModel, offset: int, why: str, missing: tuple[str, ...] = (),
                    at: Mapping[str, int] | None = None) -> None:
        region = self.arena.buffer[offset : offset + wm.store.nbytes]
        pieces = (tuple((i, 0, self.shared[sid].nbytes) for i, sid in enumerate(missing)),)
        handle = self.engine.start(
            wm.store.buffer, region, [(0, wm.store.nbytes)], f"loading {wm.name} ({why})", self._take_fences(),
            shared=self._shared_copies(missing, pieces, at or {})
        )
        handle.wait_all()
        for sid in missing:  # copied in full: no earlier load of these sets matters any more
            self._shared_loads.pop(sid, None)
        self.moved_bytes = wm.store.nbytes + sum(self.shared[sid].nbytes for sid in missing)

    def _shared_copies(self, sources: tuple[str, ...], pieces: tuple[tuple[Piece, ...], ...],
                       at: Mapping[str, int]) -> SharedCopies | None:
        """The copies of shared sets ``sources`` into their blocks at ``at`` (NOTE [Shared tensors])."""
        if not sources:
            return None
        stores = [(self.shared[sid], at[sid]) for sid in sources]
        pairs = tuple((store.buffer, self.arena.buffer[at:at + store.nbytes]) for store, at in stores)
        return SharedCopies(pairs, tuple(pieces))

    def _mark_used(self, wm: WorkerModel) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            wm.last_use = ev

    def _take_fences(self) -> list:
        fences, self._fences = self._fences, []
        return fences

    # ------------------------------------------------------------------ host stores, page-locked or not
    def add_shared(self, sid: str, store: HostStore) -> None:
        """A shared set's host store (NOTE [Shared tensors]): models added later refer to it."""
        if self.pin_host and self.host_registrar is not None:
            store.pin(self.host_registrar)
        self.shared[sid] = store

    def release_shared(self, sid: str) -> LoadHandle | None:
        """The set leaves the arena: waits for the latest load that copied it; returns
        that load if it may still be writing (its deadline passed). Never raises."""
        handle = self._shared_loads.pop(sid, None)
        if handle is None:
            return None
        try:
            handle.wait_all()
        except TimeshareError as exc:
            log.warning("releasing shared set %s after a failed load: %s", sid, exc)
        if self.engine.host_waits and not handle.done():
            return handle
        return None

    def remove_shared(self, sid: str) -> None:
        """Forget a set no model refers to any more; its store is unpinned."""
        self.release_shared(sid)
        self._drop_store(self.shared.pop(sid))

    def pin_store(self, name: str) -> bool:
        """Page-lock ``name``'s host store now, if this worker locks stores and it is not
        locked (NOTE [Locked host tier]); True if this call locked it."""
        wm = self.models[name]
        if self.host_registrar is None or wm.store.pinned:
            return False
        try:
            wm.store.pin(self.host_registrar)
        except DeviceError as exc:  # best effort: the load copies from pageable memory instead
            if name not in self._lock_refused:
                self._lock_refused.add(name)
                log.warning("cannot page-lock the host store of %s; its loads copy from pageable memory: %s",
                            name, exc)
            return False
        return True

    def unpin_store(self, name: str) -> None:
        """``name``'s host store is about to lose its pages (NOTE [Locked host tier]):
        unlocked once no copy reads it. Idempotent."""
        wm = self.models.get(name)
        if wm is None:
            return
        try:
            self.finish_pending(name)  # a tail still copying reads the store
        except Exception as exc:  # that load's failure is its own: unlocked all the same, once the device is idle
            log.warning("unlocking the host store of %s after a failed copy: %s", name, exc)
        self._drop_store(wm.store)

    def store_pinned(self, name: str) -> bool:
        """Whether ``name``'s host store is page-locked in this process now."""
        wm = self.models.get(name)
        return wm is not None and wm.store.pinned

    def pinned_host_bytes(self) -> int:
        """Host memory this worker's stores hold page-locked (safe to call from any thread)."""
        stores = [wm.store for wm in list(self.models.values())] + list(self.shared.values())
        return sum(store.pinned_nbytes for store in stores)

    def unlock_failed_load(self, name: str) -> None:
        """A load that locked ``name``'s droppable store failed: unlock it, so that only a
        successful call reports a lock (NOTE [Locked host tier]). Never raises: the
        failure being handled is the one to report."""
        try:
            self.unpin_store(name)
        except Exception:
            log.exception("unlocking the host store of %s after a failed load", name)
            self.models[name].store.release()  # the device is broken: nothing copies any more

    def finish_pending(self, name: str) -> None:
        wm = self.models[name]
        if wm.pending is not None:
            wm.pending.wait_all()
            wm.pending = None

    def _drop_store(self, store: HostStore) -> None:
        """Unpin ``store`` once no copy reads it. A device-side wait does not mean the
        copies ran, and unregistering memory a DMA still reads is undefined, so a pinned
        store waits for the device first (off the switch path: a first load, a removal).
        The latest load, kept for its timing, then lets go of the store and of the arena
        range it copied (``done()`` drops them once the copies are over), so that an
        unregister frees the host memory and a close the device memory."""
        if store.pinned:
            synchronize(self.device)
        if self.last_load is not None:
            self.last_load.done()
        store.release()

    # ------------------------------------------------------------------ where its models' tensors are bound
    # NOTE [Sticky placement]
    # Building and binding views for every tensor costs milliseconds of host time for a
    # large model, too much for the switch path. So a model goes back to the arena
    # offset it had before when that range is free, and eviction leaves its slots
    # pointing at the old offset (stale views, never read: the module is private to the
    # runtime and only called through a load). A model that lands where it was bound
    # needs no binding at all. Removing a model points the slots at meta tensors.
    #
    # NOTE [Poisoned reloads]
    # Sticky placement makes exactness checks weak: a model reloaded where it was finds
    # its old bytes still there, so a load that forgot to wait for a group would still
    # compute the right outputs. Checks therefore run with two diagnostics of the
    # Runtime: ``poison_evicted`` fills an evicted model's block with 0xFF bytes (NaN in
    # every floating type) before it is freed, and ``copy_delay_s`` starts each group's
    # copy later (a sleep on the CPU copy thread, a device-side spin on the CUDA copy
    # stream), so a compute that does not wait surely reads poison and the check fails.
    def _bind(self, wm: WorkerModel, offset: int, at: Mapping[str, int]) -> None:
        """The slots on the arena: the store's tensors at ``offset``, the shared ones where
        the model's sets are (``at``, NOTE [Shared tensors])."""
        if wm.bound_at != offset or wm.shared_bound != at:
            views = self.arena.views(offset, wm.store.entries)
            for sid, entries in _by_set(wm, wm.shared).items():
                views.update(self.arena.views(at[sid], entries))
            bind(wm.layout, views)
            relaid_out(wm.module)  # NOTE [Decode graphs]: graphs captured before are stale
            wm.bound_at = offset
            wm.shared_bound = dict(at)
            wm.host_bound = ()
            self._host_bound.discard(wm.name)

    def _bind_direct(self, wm: WorkerModel, keys: tuple[str, ...]) -> None:
        """After ``_bind``: the slots of ``keys`` on the host store, the others' on the
        arena (NOTE [Direct host access])."""
        if keys == wm.host_bound:
            return
        leaving = set(wm.host_bound) - set(keys)
        back = [e for e in wm.store.entries if e.key in leaving]
        if back:  # copied by this load's plan: the arena's bytes again
            assert wm.bound_at is not None
            bind_some(wm.layout, self.arena.views(wm.bound_at, back))
        for sid, entries in _by_set(wm, leaving).items():  # in their set's block again
            bind_some(wm.layout, self.arena.views(wm.shared_bound[sid], entries))
        if keys:
            bind_some(wm.layout, {k: self._host_tensor(wm, k) for k in keys})
        relaid_out(wm.module)
        wm.host_bound = keys
        if keys:
            self._host_bound.add(wm.name)
        else:
            self._host_bound.discard(wm.name)

    def _host_tensor(self, wm: WorkerModel, key: str) -> torch.Tensor:
        """``key``'s bytes in host memory: the model's store, or its shared set's."""
        if key in wm.shared:
            sid, e = wm.shared[key]
            return HostStore.view(self.shared[sid].buffer, e)
        return wm.store.tensor(key)

    def reads_host(self, name: str) -> bool:
        """Whether ``name`` computes from its host store (NOTE [Direct host access]): the
        store must stay in memory while the model may run."""
        return bool(self.host_keys(name))

    def host_keys(self, name: str) -> tuple[str, ...]:
        """The keys of ``name`` bound to its host store now (NOTE [Direct host access])."""
        wm = self.models.get(name)
        return wm.host_bound if wm is not None else ()

    def _adopt_order(self, wm: WorkerModel, order: ExecutionOrder, *, repack: bool) -> None:
        """Take ``order`` as the model's layers; with ``repack``, lay the host store out in
        that order (the store is then this worker's own)."""
        if repack:
            if wm.order_fixed:
                raise TimeshareError(f"model {wm.name!r}: its store's layout is fixed by its owner and cannot be "
                                     "repacked")
            by_key = {e.key: e for e in wm.store.entries}
            entries = [by_key[k] for k in order.key_order()]
            old = wm.store
            wm.store = HostStore.pack(entries, old.state(), pin=self.host_registrar is not None,
                                      registrar=self.host_registrar)
            wm.bound_at = None
            self._drop_store(old)  # the store in registration order
        elif [e.key for e in wm.store.entries] != [k for k in order.key_order() if k not in wm.shared]:
            raise TimeshareError(f"model {wm.name!r}: the host store is not laid out in the traced order")
        adopt_order(wm, order, direct=self.direct_host_access)

    # ------------------------------------------------------------------ profiling a resident model
    def _profile_resident(self, wm: WorkerModel, args: tuple, kwargs: dict) -> None:
        profile = profile_resident(wm, args, kwargs, self._link_costs(), self.device,
                                   repeats=self.profile_repeats, fixed_group_bytes=self.fixed_group_bytes)
        if wm.direct_candidates:
            # A candidate's shared tensors count as bytes its direct access spares: a load
            # that copies their set copies them last (NOTE [Direct host access]).
            spared = [b + sum(e - a for _, a, e in runs) for b, runs in zip(profile.layer_bytes, wm.layer_shared)]
            profile = with_direct_layers(profile, self._time_direct(wm, args, kwargs), self.fixed_group_bytes,
                                         spared)
        wm.profiles[profile.shape_key] = profile
        wm.last_profile = profile.shape_key

    def _time_direct(self, wm: WorkerModel, args: tuple, kwargs: dict) -> list[float]:
        """The candidate layers' compute seconds with their tensors on the host store
        (NOTE [Direct host access]); the binding is put back after."""
        assert wm.order is not None and wm.bound_at is not None
        keys = tuple(k for layer in wm.order.layers[:wm.direct_candidates] for k in layer.keys)
        before = wm.host_bound
        self._bind_direct(wm, keys)

        def run():
            with torch.no_grad():
                wm.module(*args, **kwargs)

        try:
            times = time_layers(wm.module, run, wm.layer_modules, self.device, self.profile_repeats)
        finally:
            self._bind_direct(wm, before)
        return times.compute_s[:wm.direct_candidates]

    def _link_costs(self) -> LinkCosts:
        """Measured once per worker, at the first profile (never on a switch), by copying
        a scratch host buffer to a scratch device buffer through the copy engine."""
        if self._link is None:
            self._link = probe_link(self.engine, self.device, pin_host=self.pin_host)
        return self._link


def _by_set(wm: WorkerModel, keys: Iterable[str]) -> dict[str, list[TensorEntry]]:
    """The shared ones among ``keys``, as entries of their sets named by the model's keys."""
    by_set: dict[str, list[TensorEntry]] = {}
    for key in keys:
        if key in wm.shared:
            sid, e = wm.shared[key]
            by_set.setdefault(sid, []).append(replace(e, key=key))
    return by_set
