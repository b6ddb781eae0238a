"""Executing models on the device: the set of models, running them and their loads (a
first load traces and profiles; later ones are pipelined, ``worker/loading.py``). Logic
only: runs in the process that computes (the caller's for the in-process runtime, a worker
process for the multi-process one). ``Worker`` builds on three parts of its own: the host
stores it copies from (``worker/host_stores.py``), where a model's tensors are bound
(``worker/placement.py``) and profiling a resident model (``worker/resident_profiling.py``;
measuring is in ``worker/profiling.py``).

The worker never decides placement. It is told at which arena offset a model lives
and whether its bytes are already there; the controller owns the allocator and the
eviction policy (see docs/architecture.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
from torch import nn

from timeshare.decode.runner import Decoders
from timeshare.decode.step import Step, StepKind, StepOutcome
from timeshare.device import HostRegistrar, host_registrar
from timeshare.errors import PipelineError, TimeshareError
from timeshare.memory.arena import Arena
from timeshare.models.binding import TensorLayout, unbind
from timeshare.transfer.copy import CopyEngine, LoadHandle, Piece, Ready, SharedCopies
from timeshare.transfer.disk import READ_THREADS, FillSpec, StreamFill
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder, LinkCosts, ModelProfile, trace_execution_order
from timeshare.tree import map_tensors, shape_key, tensors_in
from timeshare.worker.loading import LoadPlan, WorkerModel, forget_order, forward_while_loading, load_plan_of
from timeshare.worker.profiling import owners_of
from timeshare.worker.resident_profiling import ResidentProfiling

log = logging.getLogger(__name__)


class Worker(ResidentProfiling):
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
