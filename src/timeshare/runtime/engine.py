"""The in-process runtime: registered models, the arena they live in, pipelined loads
and eviction. Runs in the process that computes (the caller's, for now).

A model's life: ``register`` builds it on the CPU, checks and packs its weights into a
host store, then points its slots at meta tensors (it holds no weights of its own).
The first load copies it whole into the arena, traces one forward to learn the
execution order (see NOTE [Layers are wait points]), repacks the host store in that
order, and profiles the layers to plan groups. Every later load is pipelined: all
groups are queued on the copy engine at once and forward pre-hooks make the compute
wait for each group as it is first needed (see NOTE [Pipelined forward]).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from timeshare.device import resolve_device, synchronize
from timeshare.errors import (
    ConfigError,
    DuplicateModelError,
    MemoryBudgetError,
    ModelError,
    ModelTooLargeError,
    TimeshareError,
    UnknownModelError,
)
from timeshare.memory import Arena, Block, make_eviction_policy
from timeshare.models.binding import TensorLayout, bind, collect, unbind
from timeshare.models.spec import Builder, ModelSpec, build_module
from timeshare.models.weights import apply_weights, read_weights
from timeshare.runtime.tree import map_tensors, shape_key, tensors_in
from timeshare.transfer.copy import LoadHandle, make_copy_engine
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.planner import STRATEGIES, make_plan
from timeshare.transfer.profiler import (
    ExecutionOrder,
    LinkCosts,
    ModelProfile,
    measure_link,
    time_layers,
    trace_execution_order,
)
from timeshare.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

LINK_PROBE_BYTES = 64 << 20  # large enough to reach the link's full bandwidth

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; known: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class _LoadPlan:
    """A plan made ready for the switch path: byte ranges to copy and, for each
    wait-point module (by id), the group it waits for."""

    ranges: tuple[tuple[int, int], ...]
    wait_of: dict[int, int]


@dataclass
class _Model:
    spec: ModelSpec
    module: nn.Module
    layout: TensorLayout
    store: HostStore
    order: ExecutionOrder | None = None
    layer_modules: list[nn.Module] = field(default_factory=list)
    layer_spans: list[tuple[int, int]] = field(default_factory=list)  # byte range of each layer in the store
    tail_span: tuple[int, int] = (0, 0)  # tensors no traced forward used
    waits: list[tuple[nn.Module, int]] = field(default_factory=list)  # module -> last layer index it needs
    profiles: dict[str, ModelProfile] = field(default_factory=dict)
    last_profile: str | None = None
    block: Block | None = None
    bound_at: int | None = None  # arena offset the module's slots point at (see NOTE [Sticky placement])
    last_offset: int | None = None
    load_plans: dict[tuple[str, str], "_LoadPlan"] = field(default_factory=dict)
    pending: LoadHandle | None = None
    last_use: object = None  # CUDA: an event after the model's last forward (see NOTE [Arena reuse ordering])
    pinned: bool = False
    loads: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


class Runtime:
    """Time-shares one device among registered models.

    ``device``: "auto", "cpu", "cuda" or "cuda:N". ``memory``: the arena's size in bytes
    or a string like "4GiB"; "auto" takes half the free device memory on CUDA and an
    eighth of RAM (at most 2 GiB) on the CPU. ``eviction``: the policy that picks which
    resident model leaves when a new one needs room. ``strategy``: how loads are
    grouped: "optimal" (default), "per_layer", "whole" or "fixed".

    Outputs are returned on the CPU, so the same call works when the model runs in
    another process.
    """

    def __init__(
        self,
        device: str | torch.device = "auto",
        memory: int | str = "auto",
        *,
        eviction: str = "lru",
        strategy: str = "optimal",
        profile_repeats: int = 3,
        fixed_group_bytes: int | str = "2MiB",
        load_timeout_s: float = 60.0,
    ):
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
        if profile_repeats < 1:
            raise ConfigError(f"profile_repeats must be at least 1, got {profile_repeats}")
        if load_timeout_s <= 0:
            raise ConfigError(f"load_timeout_s must be positive, got {load_timeout_s}")
        self.device = resolve_device(device)
        self.strategy = strategy
        self.profile_repeats = profile_repeats
        self.fixed_group_bytes = parse_bytes(fixed_group_bytes, what="fixed_group_bytes")
        self._policy = make_eviction_policy(eviction)
        capacity = self._resolve_memory(memory)
        try:
            self._arena = Arena(self.device, capacity)
        except torch.OutOfMemoryError as exc:
            raise MemoryBudgetError(
                f"cannot reserve an arena of {format_bytes(capacity)} on {self.device}: {exc}"
            ) from exc
        try:
            self._engine = make_copy_engine(self.device, load_timeout_s)
        except BaseException:
            self._arena.close()
            raise
        self._quarantine: list[tuple[Block, LoadHandle]] = []  # blocks a stuck copy may still write
        self._fences: list[object] = []  # CUDA: last-use events of evicted models
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()
        self._link: LinkCosts | None = None
        self._closed = False
        self._evictions = 0

    # ------------------------------------------------------------------ public API
    def register(
        self,
        name: str,
        build: Builder,
        weights=None,
        example_inputs: tuple = (),
        *,
        example_kwargs: dict | None = None,
        dtype: str | torch.dtype | None = None,
        pin: bool = False,
    ) -> None:
        """Register a model: build it, check and pack its weights. Nothing is loaded yet.

        ``build`` is a callable or a "module:function" string returning an ``nn.Module``;
        ``weights`` a safetensors path or a state dict (None keeps the module's own
        initial values); ``example_inputs`` the positional inputs used to profile it;
        ``dtype`` converts floating tensors; ``pin`` keeps it resident once loaded.
        """
        self._check_open()
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"model name must be a non-empty string without '/', got {name!r}")
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        with self._lock:
            if name in self._models:
                raise DuplicateModelError(f"a model named {name!r} is already registered")
        spec = ModelSpec(name, build, weights, example_inputs, dict(example_kwargs or {}), parse_dtype(dtype))
        module = build_module(name, build)
        module.eval()
        layout = collect(module)
        if not layout.entries:
            raise ModelError(f"model {name!r} has no parameters or buffers to manage")
        current = layout.tensors()
        tensors = current if weights is None else apply_weights(layout, current, read_weights(weights))
        if spec.dtype is not None:
            layout.entries = [_with_dtype(e, spec.dtype) for e in layout.entries]
            tensors = {e.key: tensors[e.key].to(e.dtype) for e in layout.entries}
        store = HostStore.pack(layout.entries, tensors, pin=self.device.type == "cuda")
        del tensors, current
        unbind(layout)  # the module now holds no weights of its own
        model = _Model(spec, module, layout, store, pinned=pin)
        with self._lock:
            if name in self._models:
                raise DuplicateModelError(f"a model named {name!r} is already registered")
            if store.nbytes > self._arena.capacity:
                log.warning("model %s (%s) is larger than the arena (%s)", name,
                            format_bytes(store.nbytes), format_bytes(self._arena.capacity))
            self._models[name] = model
        log.info("registered %s: %d tensors, %s", name, len(layout.entries), format_bytes(store.nbytes))

    def infer(self, name: str, *args, **kwargs):
        """Run model ``name`` on the inputs, loading it first (pipelined) if needed.

        Tensors in the inputs may live anywhere; outputs come back on the CPU with the
        structure the module returned (tensor, tuple, dict, dataclass...).
        """
        return self._infer(name, args, kwargs, None)

    def profile(self, name: str, *args, **kwargs) -> ModelProfile:
        """Profile ``name`` for these inputs (default: its example inputs) and plan its
        groupings. Loads the model if needed; plans are cached per input shape."""
        with self._lock:
            m = self._get(name)
            if not args and not kwargs:
                args, kwargs = m.spec.example_inputs, m.spec.example_kwargs
            if not args and not kwargs:
                raise ConfigError(f"model {name!r} has no example inputs; pass inputs to profile()")
            args, kwargs = self._to_device(args), self._to_device(kwargs)
            key = shape_key(args, kwargs)
            if m.block is None:
                self._run(m, args, kwargs, None)
            self._finish_pending(m)
            if key not in m.profiles:
                self._profile_resident(m, args, kwargs)
            return m.profiles[key]

    def evict(self, name: str) -> bool:
        """Remove ``name`` from device memory; True if it was resident."""
        with self._lock:
            m = self._get(name)
            if m.block is None:
                return False
            self._evict(m)
            return True

    def resident(self) -> list[str]:
        """Names of the models in device memory, least recently used first."""
        with self._lock:
            return [n for n in self._policy.candidates() if self._models[n].block is not None]

    def models(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned model is never evicted to make room for another."""
        with self._lock:
            self._get(name).pinned = pinned

    def unregister(self, name: str) -> None:
        with self._lock:
            m = self._get(name)
            self._evict(m)
            unbind(m.layout)
            del self._models[name]
            _release_host_cache(self.device)

    def stats(self) -> dict:
        with self._lock:
            alloc = self._arena.allocator
            return {
                "device": str(self.device),
                "capacity_bytes": alloc.capacity,
                "used_bytes": alloc.used,
                "free_bytes": alloc.free,
                "largest_free_bytes": alloc.largest_free,
                "blocks": len(alloc.blocks()),
                "resident": self.resident(),
                "loads": {n: m.loads for n, m in self._models.items()},
                "evictions": self._evictions,
            }

    def close(self) -> None:
        """Evict everything and give the arena back. Idempotent; every step runs even if
        an earlier one fails, so no segment, thread or device memory is left behind."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for m in self._models.values():
                    self._evict(m)
                    unbind(m.layout)
                self._models.clear()
            finally:
                try:
                    self._engine.close()
                    synchronize(self.device)
                finally:
                    self._quarantine.clear()
                    self._arena.close()
                    _release_host_cache(self.device)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten close() must not leak the shared-memory segment
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # interpreter shutdown: modules may be half torn down
            pass

    # ------------------------------------------------------------------ internals
    def _infer(self, name: str, args: tuple, kwargs: dict, strategy: str | None):
        with self._lock:
            m = self._get(name)
            args, kwargs = self._to_device(args), self._to_device(kwargs)
            out = self._run(m, args, kwargs, strategy)
            return self._to_caller(out)

    def _run(self, m: _Model, args: tuple, kwargs: dict, strategy: str | None):
        """Forward ``m`` on device inputs, loading it first if it is not resident."""
        if m.block is not None:
            self._finish_pending(m)
            self._policy.touched(m.name)
            with torch.no_grad():
                out = m.module(*args, **kwargs)
            self._mark_used(m)
            return out
        if m.order is None:
            return self._first_load(m, args, kwargs)
        return self._pipelined_load(m, args, kwargs, strategy or self.strategy)

    def _first_load(self, m: _Model, args: tuple, kwargs: dict):
        """Load whole, trace the execution order, repack in that order, profile."""
        block = self._place(m)
        try:
            region = self._arena.region(block)
            self._copy_whole(m, region, "first load")
            self._bind(m, block)
            base = self._arena.buffer.data_ptr() + block.offset
            spans = [(base + e.offset, base + e.offset + e.nbytes, e.key) for e in m.store.entries if e.nbytes]
            owners: dict[str, list[nn.Module]] = {e.key: [] for e in m.store.entries}
            for slot in m.layout.slots:
                if all(slot.module is not o for o in owners[slot.key]):
                    owners[slot.key].append(slot.module)
            with torch.no_grad():
                order, out = trace_execution_order(m.module, args, kwargs, spans, owners)
            self._adopt_order(m, order)
            self._copy_whole(m, region, "first load, execution order")
            self._bind(m, block)
            m.loads += 1
            self._mark_used(m)
            self._profile_resident(m, args, kwargs)
            return out
        except BaseException:
            self._forget_order(m)  # the next load starts over
            self._evict(m)
            raise

    # NOTE [Pipelined forward]
    # All groups (and the tail) are queued on the copy engine before the forward starts.
    # For the forward, one global module pre-hook looks each module up in the plan's
    # wait map and waits for the last group holding a tensor that module needs; groups
    # arrive in order, so waiting for group g covers every earlier group and a module
    # whose group was already waited for costs a dict lookup. On CUDA the wait is a
    # device-side stream wait, so the host never blocks and keeps queuing kernels. The
    # hook is removed when the forward ends: a resident model runs exactly the code of
    # a plain module, with no hooks at all.
    def _pipelined_load(self, m: _Model, args: tuple, kwargs: dict, strategy: str):
        plan = self._load_plan(m, shape_key(args, kwargs), strategy)
        block = self._place(m)
        try:
            self._bind(m, block)
            handle = self._engine.start(
                m.store.buffer, self._arena.region(block), plan.ranges, f"loading {m.name}", self._take_fences()
            )
            m.pending = handle
            wait_of = plan.wait_of
            upto = [-1]

            def hook(mod, _args):
                group = wait_of.get(id(mod))
                if group is not None and group > upto[0]:
                    handle.wait(group)
                    upto[0] = group

            registration = register_module_forward_pre_hook(hook)
            try:
                with torch.no_grad():
                    out = m.module(*args, **kwargs)
            finally:
                registration.remove()
            if upto[0] < handle.n_groups - 1 and self._aliases_arena(out):
                handle.wait_all()  # an output that is a weight must have arrived
                upto[0] = handle.n_groups - 1
            if upto[0] >= handle.n_groups - 1:
                m.pending = None  # everything arrived and was waited for
            m.loads += 1
            self._mark_used(m)
            self._policy.touched(m.name)
            return out
        except BaseException:
            self._evict(m)
            raise

    def _load_plan(self, m: _Model, key: str, strategy: str) -> _LoadPlan:
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
        if key not in m.profiles:
            key = m.last_profile  # type: ignore[assignment]
        cached = m.load_plans.get((key, strategy))
        if cached is not None:
            return cached
        plan = m.profiles[key].plans[strategy]
        ranges = [(m.layer_spans[a][0], m.layer_spans[b - 1][1]) for a, b in plan.groups]
        has_tail = m.tail_span[1] > m.tail_span[0]
        if has_tail:
            ranges.append(m.tail_span)
        group_of_layer = [g for g, (a, b) in enumerate(plan.groups) for _ in range(a, b)]
        wait_of = {}
        for mod, layer in m.waits:
            if layer < len(group_of_layer):
                wait_of[id(mod)] = group_of_layer[layer]
            elif has_tail:  # a module that only owns tail tensors (an empty tail needs no wait)
                wait_of[id(mod)] = len(plan)
        made = m.load_plans[(key, strategy)] = _LoadPlan(tuple(ranges), wait_of)
        return made

    # NOTE [Sticky placement]
    # Building and binding views for every tensor costs milliseconds of host time for a
    # large model, too much for the switch path. So a model goes back to the arena
    # offset it had before when that range is free, and eviction leaves its slots
    # pointing at the old offset (stale views, never read: the module is private to the
    # runtime and only called through _run, which loads first). A model that lands
    # where it was bound needs no binding at all. close() and unregister() point the
    # slots at meta tensors.
    def _bind(self, m: _Model, block: Block) -> None:
        if m.bound_at != block.offset:
            bind(m.layout, self._arena.views(block.offset, m.store.entries))
            m.bound_at = block.offset

    def _adopt_order(self, m: _Model, order: ExecutionOrder) -> None:
        """Repack ``m``'s host store in execution order and derive layers and waits."""
        by_key = {e.key: e for e in m.store.entries}
        entries = [by_key[k] for k in order.key_order()]
        m.store = HostStore.pack(entries, m.store.state(), pin=self.device.type == "cuda")
        m.order = order
        m.bound_at = None
        m.load_plans.clear()
        offsets = {e.key: e.offset for e in m.store.entries}
        starts = [offsets[layer.keys[0]] for layer in order.layers]
        tail_start = offsets[order.unused[0]] if order.unused else m.store.nbytes
        m.layer_spans = list(zip(starts, starts[1:] + [tail_start]))
        m.tail_span = (tail_start, m.store.nbytes)
        # Layer modules wait for their layer; modules owning tail tensors (they never ran
        # in the trace) wait for the tail. See NOTE [Layers are wait points].
        n = len(order.layers)
        modules = dict(m.module.named_modules(remove_duplicate=False))
        m.layer_modules = [modules[layer.module] if layer.module else m.module for layer in order.layers]
        m.waits = [(mod, i) for i, mod in enumerate(m.layer_modules)]
        waiting = {id(mod) for mod in m.layer_modules}
        tail = set(order.unused)
        for slot in m.layout.slots:
            if slot.key in tail and id(slot.module) not in waiting:
                m.waits.append((slot.module, n))
                waiting.add(id(slot.module))
        _release_host_cache(self.device)  # the store in registration order is gone

    def _forget_order(self, m: _Model) -> None:
        m.order = None
        m.layer_modules, m.layer_spans, m.waits = [], [], []
        m.tail_span = (0, 0)
        m.load_plans.clear()
        m.profiles.clear()
        m.last_profile = None

    def _profile_resident(self, m: _Model, args: tuple, kwargs: dict) -> None:
        assert m.block is not None and m.order is not None
        link = self._link_costs(m)

        def run():
            with torch.no_grad():
                m.module(*args, **kwargs)

        run()  # warm-up
        times = time_layers(m.module, run, m.layer_modules, self.device, self.profile_repeats)
        layer_bytes = [b - a for a, b in m.layer_spans]
        key = shape_key(args, kwargs)
        profile = ModelProfile(
            model=m.name,
            device=str(self.device),
            shape_key=key,
            layer_names=[layer.module or "<root>" for layer in m.order.layers],
            layer_bytes=layer_bytes,
            compute_s=times.compute_s,
            link=link,
            ready_s=times.ready_s,
            tail_bytes=m.tail_span[1] - m.tail_span[0],
            plans={},
        )
        cost = profile.cost_model()
        profile.plans = {s: make_plan(s, cost, layer_bytes, self.fixed_group_bytes) for s in STRATEGIES}
        plans = profile.plans
        m.profiles[key] = profile
        m.last_profile = key
        log.info("profiled %s for %s: %d layers, optimal %d groups, predicted %.2f ms (ready %.2f ms)",
                 m.name, key, len(layer_bytes), len(plans["optimal"]), plans["optimal"].predicted_s * 1e3,
                 times.ready_s * 1e3)

    def _link_costs(self, m: _Model) -> LinkCosts:
        """Measured once per runtime (at the first profile, never on a switch). The probe
        copies a resident model's store over itself, or a scratch buffer of up to
        ``LINK_PROBE_BYTES`` into free arena space when the model is smaller than that."""
        if self._link is not None:
            return self._link
        assert m.block is not None
        src, region = m.store.buffer, self._arena.region(m.block)[: m.store.nbytes]
        scratch = None
        want = min(LINK_PROBE_BYTES, self._arena.allocator.largest_free)
        if want > m.store.nbytes:
            scratch = self._arena.allocate(want, "<link probe>")
        try:
            if scratch is not None:
                src = torch.empty(scratch.size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                src.fill_(7)
                region = self._arena.region(scratch)
            self._link = measure_link(self._engine, src, region, self.device)
        finally:
            if scratch is not None:
                synchronize(self.device)
                self._arena.release(scratch)
                _release_host_cache(self.device)
        log.info("link: %.2f GB/s, alpha %.1f us, beta %.1f us", self._link.bandwidth_Bps / 1e9,
                 self._link.alpha_s * 1e6, self._link.beta_s * 1e6)
        return self._link

    def _place(self, m: _Model) -> Block:
        """A block for ``m``, evicting unpinned models in policy order until it fits."""
        need = m.nbytes
        if self._arena.allocator.rounded(need) > self._arena.capacity:
            raise ModelTooLargeError(m.name, need, self._arena.capacity)
        self._reclaim_quarantine()
        block = None
        if m.last_offset is not None:  # see NOTE [Sticky placement]
            block = self._arena.allocator.allocate_at(m.last_offset, need, m.name)
        if block is None:
            block = self._arena.allocate(need, m.name)
        while block is None:
            protected = {n for n, x in self._models.items() if x.pinned or x is m}
            victims = [n for n in self._policy.candidates(protected) if self._models[n].block is not None]
            if not victims:
                alloc = self._arena.allocator
                raise MemoryBudgetError(
                    f"cannot place model {m.name!r} ({format_bytes(need)}): {format_bytes(alloc.free)} free, "
                    f"largest free range {format_bytes(alloc.largest_free)}, and every resident model is pinned"
                )
            self._evict(self._models[victims[0]])
            if m.last_offset is not None:
                block = self._arena.allocator.allocate_at(m.last_offset, need, m.name)
            if block is None:
                block = self._arena.allocate(need, m.name)
        m.block = block
        m.last_offset = block.offset
        self._policy.admitted(m.name)
        return block

    def _evict(self, m: _Model) -> None:
        """Make ``m`` non-resident. Never raises: a failed copy is logged, and a block a
        copy may still be writing (its deadline passed) is quarantined, not reused."""
        if m.block is None:
            return
        block, handle = m.block, m.pending
        m.block, m.pending = None, None
        self._policy.removed(m.name)
        self._evictions += 1
        if m.last_use is not None:  # see NOTE [Arena reuse ordering]
            self._fences.append(m.last_use)
            m.last_use = None
        if handle is not None:
            try:
                handle.wait_all()  # a copy must not land in memory that is reused
            except TimeshareError as exc:
                log.warning("evicting %s after a failed load: %s", m.name, exc)
            if self._engine.host_waits and not handle.done():
                self._quarantine.append((block, handle))
                return
        self._arena.release(block)  # the slots keep stale views: NOTE [Sticky placement]

    def _reclaim_quarantine(self) -> None:
        still = []
        for block, handle in self._quarantine:
            if handle.done():
                self._arena.release(block)
            else:
                still.append((block, handle))
        self._quarantine = still

    def _finish_pending(self, m: _Model) -> None:
        if m.pending is not None:
            m.pending.wait_all()
            m.pending = None

    def _mark_used(self, m: _Model) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            m.last_use = ev

    def _take_fences(self) -> list:
        fences, self._fences = self._fences, []
        return fences

    def _copy_whole(self, m: _Model, region: torch.Tensor, why: str) -> None:
        handle = self._engine.start(
            m.store.buffer, region, [(0, m.store.nbytes)], f"loading {m.name} ({why})", self._take_fences()
        )
        handle.wait_all()

    def _get(self, name: str) -> _Model:
        self._check_open()
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModelError(f"no model named {name!r} is registered; known: {sorted(self._models)}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TimeshareError("this runtime is closed")

    def _to_device(self, obj):
        return map_tensors(obj, lambda t: t.to(self.device))

    def _aliases_arena(self, out) -> bool:
        arena_ptr = self._arena.buffer.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == arena_ptr for t in tensors_in(out))

    def _to_caller(self, out):
        arena_ptr = self._arena.buffer.untyped_storage().data_ptr()

        def give(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.device.type != "cpu":
                return t.cpu()
            if t.untyped_storage().data_ptr() == arena_ptr:  # never hand out arena memory
                return t.clone()
            return t

        return map_tensors(out, give)

    def _resolve_memory(self, memory: int | str) -> int:
        if memory != "auto":
            return parse_bytes(memory, what="memory")
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return free // 2
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(2 << 30, total // 8)


def _release_host_cache(device: torch.device) -> None:
    """Give cached pinned host blocks back to the OS (CUDA builds that expose it)."""
    if device.type == "cuda":
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


def _with_dtype(e: TensorEntry, dtype: torch.dtype) -> TensorEntry:
    if not e.dtype.is_floating_point:
        return e
    return TensorEntry(e.key, e.names, e.kind, e.shape, dtype, e.requires_grad, e.offset)
