"""Executing models on the device: binding a model's tensors into the arena, pipelined
loads, tracing and profiling. Logic only: runs in the process that computes (the
caller's for the in-process runtime, a worker process for the multi-process one).

The worker never decides placement. It is told at which arena offset a model lives
and whether its bytes are already there; the controller owns the allocator and the
eviction policy (see docs/architecture.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from timeshare.device import HostRegistrar, host_registrar, synchronize
from timeshare.errors import ConfigError, TimeshareError
from timeshare.memory.arena import Arena
from timeshare.models.binding import TensorLayout, bind, unbind
from timeshare.transfer.copy import CopyEngine, LoadEvents, LoadHandle
from timeshare.transfer.host_store import HostStore
from timeshare.transfer.planner import STRATEGIES, make_plan
from timeshare.transfer.profiler import (
    ExecutionOrder,
    LinkCosts,
    ModelProfile,
    measure_link,
    time_layers,
    trace_execution_order,
)
from timeshare.tree import map_tensors, shape_key, tensors_in

log = logging.getLogger(__name__)

LINK_PROBE_BYTES = 64 << 20  # large enough to reach the link's full bandwidth


@dataclass(frozen=True)
class LoadPlan:
    """A plan made ready for the switch path: byte ranges to copy, for each wait-point
    module (by id) the group it waits for, and the copy engine's per-group events, made
    by the plan's first load and re-recorded by the next (NOTE [Events made once per plan])."""

    ranges: tuple[tuple[int, int], ...]
    wait_of: dict[int, int]
    events: LoadEvents = field(default_factory=LoadEvents, compare=False, repr=False)


@dataclass
class WorkerModel:
    """What a worker knows of one model: its module and how to load it."""

    name: str
    module: nn.Module
    layout: TensorLayout
    store: HostStore
    order: ExecutionOrder | None = None
    layer_modules: list[nn.Module] = field(default_factory=list)
    layer_spans: list[tuple[int, int]] = field(default_factory=list)  # byte range of each layer in the store
    tail_span: tuple[int, int] = (0, 0)  # tensors of modules that never ran in the trace
    waits: list[tuple[nn.Module, int]] = field(default_factory=list)  # module -> layer index it waits for
    profiles: dict[str, ModelProfile] = field(default_factory=dict)
    last_profile: str | None = None
    bound_at: int | None = None  # arena offset the module's slots point at (see NOTE [Sticky placement])
    load_plans: dict[tuple[str, str], LoadPlan] = field(default_factory=dict)
    pending: LoadHandle | None = None
    last_use: object = None  # CUDA: an event after the model's last forward (see NOTE [Arena reuse ordering])


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
    ):
        self.device = device
        self.arena = arena
        self.engine = engine
        self.profile_repeats = profile_repeats
        self.fixed_group_bytes = fixed_group_bytes
        self.pin_host = device.type == "cuda" if pin_host is None else pin_host
        # Page-locks the host stores this worker packs (NOTE [Exact host pinning]); a
        # test passes a fake one to check the bookkeeping on the CPU.
        default = host_registrar(device) if self.pin_host else None
        self.host_registrar = registrar if registrar is not None else default
        self.models: dict[str, WorkerModel] = {}
        self._link: LinkCosts | None = None
        self._fences: list[object] = []  # CUDA: last-use events of evicted models
        self.last_load: LoadHandle | None = None  # the latest pipelined load, for its timing

    # ------------------------------------------------------------------ model set
    def add(self, name: str, module: nn.Module, layout: TensorLayout, store: HostStore,
            order: ExecutionOrder | None = None) -> WorkerModel:
        wm = WorkerModel(name, module, layout, store)
        self.models[name] = wm
        if order is not None:
            self._adopt_order(wm, order, repack=False)
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
        unbind(wm.layout)
        self._drop_store(wm.store)

    def pinned_host_bytes(self) -> int:
        """Host memory this worker's stores hold page-locked (safe to call from any thread)."""
        return sum(wm.store.pinned_nbytes for wm in list(self.models.values()))

    # ------------------------------------------------------------------ execution
    def run(self, name: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str):
        """Forward ``name`` on device inputs. Its bytes are at ``offset`` if ``resident``;
        otherwise they are loaded there first (pipelined once the model is profiled)."""
        wm = self.models[name]
        if resident:
            self.finish_pending(name)
            self._bind(wm, offset)
            with torch.no_grad():
                out = wm.module(*args, **kwargs)
        elif wm.order is None or not wm.profiles:
            out = self._first_load(wm, offset, args, kwargs)
        else:
            out = self._pipelined_load(wm, offset, args, kwargs, strategy)
        self._mark_used(wm)
        return out

    def profile(self, name: str, offset: int, args: tuple, kwargs: dict) -> ModelProfile:
        """Profile a resident model for these inputs (cached per input shape)."""
        wm = self.models[name]
        self.finish_pending(name)
        self._bind(wm, offset)
        key = shape_key(args, kwargs)
        if key not in wm.profiles:
            self._profile_resident(wm, offset, args, kwargs)
        return wm.profiles[key]

    def finish_pending(self, name: str) -> None:
        wm = self.models[name]
        if wm.pending is not None:
            wm.pending.wait_all()
            wm.pending = None

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
        as it is. A worker process then pickles the result, with no further copy."""
        ptr = self.arena.buffer.untyped_storage().data_ptr()

        def give(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.device.type != "cpu":
                return t.cpu()
            if t.untyped_storage().data_ptr() == ptr:
                return t.clone()
            return t

        return map_tensors(out, give)

    def aliases_arena(self, out) -> bool:
        ptr = self.arena.buffer.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ptr for t in tensors_in(out))

    # ------------------------------------------------------------------ loading
    def _first_load(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict):
        """Load whole; trace the execution order if unknown (repacking the store in that
        order); profile for these inputs."""
        try:
            self._copy_whole(wm, offset, "first load")
            self._bind(wm, offset)
            out = None
            if wm.order is None:
                spans = wm.store.spans(self.arena.buffer.data_ptr() + offset)
                with torch.no_grad():
                    order, out = trace_execution_order(wm.module, args, kwargs, spans, owners_of(wm.layout))
                self._adopt_order(wm, order, repack=True)
                self._copy_whole(wm, offset, "first load, execution order")
                self._bind(wm, offset)
            if out is None:
                with torch.no_grad():
                    out = wm.module(*args, **kwargs)
            self._profile_resident(wm, offset, args, kwargs)
            return out
        except BaseException:
            wm.pending = None
            if not wm.profiles:
                self._forget_order(wm)  # the next load starts over
            raise

    # NOTE [Pipelined forward]
    # All groups (and the tail) are queued on the copy engine before the forward starts.
    # Queuing costs host time per group (slicing, the copy call, recording its event;
    # the events themselves are made once per plan, NOTE [Events made once per plan]).
    # The planner charges it, as a later start of the forward and copies that start no
    # earlier than they are queued (NOTE [Pipeline cost model]). For the forward, one
    # global module pre-hook looks each module up in the plan's
    # wait map and waits for the last group holding a tensor that module needs; groups
    # arrive in order, so waiting for group g covers every earlier group and a module
    # whose group was already waited for costs a dict lookup. On CUDA the wait is a
    # device-side stream wait, so the host never blocks and keeps queuing kernels. The
    # hook removes itself once the last group has been waited for (a global hook sends
    # every module call down nn.Module's slow path, a few microseconds each, which on a
    # launch-bound GPU forward is the largest cost of a load), and at the latest when the
    # forward ends: a resident model runs exactly the code of a plain module.
    def _pipelined_load(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict, strategy: str):
        plan = self._load_plan(wm, shape_key(args, kwargs), strategy)
        self._bind(wm, offset)
        region = self.arena.buffer[offset : offset + wm.store.nbytes]
        handle = self.engine.start(
            wm.store.buffer, region, plan.ranges, f"loading {wm.name}", self._take_fences(), plan.events
        )
        wm.pending = self.last_load = handle
        wait_of = plan.wait_of
        last = handle.n_groups - 1
        upto = [-1]

        def hook(mod, _args):
            group = wait_of.get(id(mod))
            if group is not None and group > upto[0]:
                handle.wait(group)
                upto[0] = group
                if group >= last:  # everything is waited for: the rest of the forward runs hook-free
                    registration.remove()

        registration = register_module_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                out = wm.module(*args, **kwargs)
        finally:
            registration.remove()  # idempotent
        if upto[0] < handle.n_groups - 1 and self.aliases_arena(out):
            handle.wait_all()  # an output that is a weight must have arrived
            upto[0] = handle.n_groups - 1
        if upto[0] >= handle.n_groups - 1:
            wm.pending = None  # everything arrived and was waited for
        return out

    def load_plan(self, name: str, key: str, strategy: str) -> LoadPlan:
        """The ready-made plan that loads of ``name`` for input shape ``key`` follow:
        its byte ranges and which group each wait-point module waits for."""
        return self._load_plan(self.models[name], key, strategy)

    def _load_plan(self, wm: WorkerModel, key: str, strategy: str) -> LoadPlan:
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
        if key not in wm.profiles:
            key = wm.last_profile  # type: ignore[assignment]
        cached = wm.load_plans.get((key, strategy))
        if cached is not None:
            return cached
        plan = wm.profiles[key].plans[strategy]
        ranges = [(wm.layer_spans[a][0], wm.layer_spans[b - 1][1]) for a, b in plan.groups]
        has_tail = wm.tail_span[1] > wm.tail_span[0]
        if has_tail:
            ranges.append(wm.tail_span)
        group_of_layer = [g for g, (a, b) in enumerate(plan.groups) for _ in range(a, b)]
        wait_of = {}
        for mod, layer in wm.waits:
            if layer < len(group_of_layer):
                wait_of[id(mod)] = group_of_layer[layer]
            elif has_tail:  # a module that only owns tail tensors (an empty tail needs no wait)
                wait_of[id(mod)] = len(plan)
        made = wm.load_plans[(key, strategy)] = LoadPlan(tuple(ranges), wait_of)
        return made

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
    def _bind(self, wm: WorkerModel, offset: int) -> None:
        if wm.bound_at != offset:
            bind(wm.layout, self.arena.views(offset, wm.store.entries))
            wm.bound_at = offset

    def _adopt_order(self, wm: WorkerModel, order: ExecutionOrder, *, repack: bool) -> None:
        """Take ``order`` as the model's layers; with ``repack``, lay the host store out in
        that order (the store is then this worker's own)."""
        if repack:
            by_key = {e.key: e for e in wm.store.entries}
            entries = [by_key[k] for k in order.key_order()]
            old = wm.store
            wm.store = HostStore.pack(entries, old.state(), pin=self.host_registrar is not None,
                                      registrar=self.host_registrar)
            wm.bound_at = None
            self._drop_store(old)  # the store in registration order
        elif [e.key for e in wm.store.entries] != order.key_order():
            raise TimeshareError(f"model {wm.name!r}: the host store is not laid out in the traced order")
        wm.order = order
        wm.load_plans.clear()
        offsets = {e.key: e.offset for e in wm.store.entries}
        starts = [offsets[layer.keys[0]] for layer in order.layers]
        tail_start = offsets[order.unused[0]] if order.unused else wm.store.nbytes
        wm.layer_spans = list(zip(starts, starts[1:] + [tail_start]))
        wm.tail_span = (tail_start, wm.store.nbytes)
        # Layer modules wait for their layer; modules owning tail tensors (they never ran
        # in the trace) wait for the tail. See NOTE [Layers are wait points].
        n = len(order.layers)
        modules = dict(wm.module.named_modules(remove_duplicate=False))
        wm.layer_modules = [modules[layer.module] if layer.module else wm.module for layer in order.layers]
        wm.waits = [(mod, i) for i, mod in enumerate(wm.layer_modules)]
        waiting = {id(mod) for mod in wm.layer_modules}
        tail = set(order.unused)
        for slot in wm.layout.slots:
            if slot.key in tail and id(slot.module) not in waiting:
                wm.waits.append((slot.module, n))
                waiting.add(id(slot.module))

    def _forget_order(self, wm: WorkerModel) -> None:
        wm.order = None
        wm.layer_modules, wm.layer_spans, wm.waits = [], [], []
        wm.tail_span = (0, 0)
        wm.load_plans.clear()
        wm.profiles.clear()
        wm.last_profile = None

    # ------------------------------------------------------------------ profiling
    def _profile_resident(self, wm: WorkerModel, offset: int, args: tuple, kwargs: dict) -> None:
        assert wm.order is not None
        link = self._link_costs()

        def run():
            with torch.no_grad():
                wm.module(*args, **kwargs)

        run()  # warm-up
        times = time_layers(wm.module, run, wm.layer_modules, self.device, self.profile_repeats)
        layer_bytes = [b - a for a, b in wm.layer_spans]
        key = shape_key(args, kwargs)
        profile = ModelProfile(
            model=wm.name,
            device=str(self.device),
            shape_key=key,
            layer_names=[layer.module or "<root>" for layer in wm.order.layers],
            layer_bytes=layer_bytes,
            compute_s=times.compute_s,
            link=link,
            ready_s=times.ready_s,
            tail_bytes=wm.tail_span[1] - wm.tail_span[0],
            plans={},
        )
        cost = profile.cost_model()
        profile.plans = {s: make_plan(s, cost, layer_bytes, self.fixed_group_bytes) for s in STRATEGIES}
        wm.profiles[key] = profile
        wm.last_profile = key
        best = profile.plans["optimal"]
        log.info("profiled %s for %s: %d layers, optimal %d groups, predicted %.2f ms (ready %.2f ms)",
                 wm.name, key, len(layer_bytes), len(best), best.predicted_s * 1e3, times.ready_s * 1e3)

    def _link_costs(self) -> LinkCosts:
        """Measured once per worker, at the first profile (never on a switch), by copying
        a scratch host buffer to a scratch device buffer through the copy engine."""
        if self._link is None:
            src = torch.full((LINK_PROBE_BYTES,), 7, dtype=torch.uint8, pin_memory=self.pin_host)
            dst = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=self.device)
            self._link = measure_link(self.engine, src, dst, self.device)
            del src, dst
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            release_host_cache(self.device)
            link = self._link
            log.info("link: %.2f GB/s + %.1f us per load, alpha %.1f us, beta %.1f us, latency %.1f us, "
                     "queue %.1f us per group", link.bandwidth_Bps / 1e9, link.overhead_s * 1e6, link.alpha_s * 1e6,
                     link.beta_s * 1e6, link.latency_s * 1e6, link.queue_s * 1e6)
        return self._link

    # ------------------------------------------------------------------ helpers
    def _copy_whole(self, wm: WorkerModel, offset: int, why: str) -> None:
        region = self.arena.buffer[offset : offset + wm.store.nbytes]
        handle = self.engine.start(
            wm.store.buffer, region, [(0, wm.store.nbytes)], f"loading {wm.name} ({why})", self._take_fences()
        )
        handle.wait_all()

    def _mark_used(self, wm: WorkerModel) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            wm.last_use = ev

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

    def _take_fences(self) -> list:
        fences, self._fences = self._fences, []
        return fences


def owners_of(layout: TensorLayout) -> dict[str, list[nn.Module]]:
    """Per tensor key, the distinct modules holding it, in store-entry order."""
    owners: dict[str, list[nn.Module]] = {e.key: [] for e in layout.entries}
    for slot in layout.slots:
        if all(slot.module is not o for o in owners[slot.key]):
            owners[slot.key].append(slot.module)
    return owners


def release_host_cache(device: torch.device) -> None:
    """Give cached pinned host blocks back to the OS (CUDA builds that expose it)."""
    if device.type == "cuda":
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
