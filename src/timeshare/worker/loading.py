"""Pipelined loading, the worker's side (runs in the process that computes): what a
worker knows of one model's layout in execution order (``WorkerModel``), the load plans
made from its profiles (``LoadPlan``), and the forward that waits for each group of
weights as it is first needed (NOTE [Pipelined forward]).

The :class:`~timeshare.worker.worker.Worker` places, binds and starts the copies; the
functions here derive a model's layers, wait points and plans, and run the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from timeshare.errors import ConfigError
from timeshare.memory.allocator import align_up
from timeshare.models.binding import TensorLayout
from timeshare.transfer.copy import LoadEvents, LoadHandle, Piece
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.planner import STRATEGIES, make_plan
from timeshare.transfer.profiler import ExecutionOrder, ModelProfile


@dataclass(frozen=True)
class LoadPlan:
    """A plan made ready for the switch path: byte ranges to copy, for each wait-point
    module (by id) the group it waits for, and the copy engine's per-group events, made
    by the plan's first load and re-recorded by the next (NOTE [Events made once per plan])."""

    ranges: tuple[tuple[int, int], ...]
    wait_of: dict[int, int]
    events: LoadEvents = field(default_factory=LoadEvents, compare=False, repr=False)
    direct_keys: tuple[str, ...] = ()  # NOTE [Direct host access]: bound to the host store, never copied
    direct_end: int = 0  # the store's bytes before this are those direct layers' own
    # NOTE [Shared tensors]: the shared sets this load copies too (not resident yet), and
    # each group's pieces of them, as (index in ``sources``, start, end).
    sources: tuple[str, ...] = ()
    pieces: tuple[tuple[Piece, ...], ...] = ()


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
    load_plans: dict[tuple[str, str, float | None, tuple[str, ...]], LoadPlan] = field(default_factory=dict)
    pending: LoadHandle | None = None
    last_use: object = None  # CUDA: an event after the model's last forward (see NOTE [Arena reuse ordering])
    order_fixed: bool = False  # the store was laid out in ``order`` by its owner: never retraced or repacked
    droppable: bool = False  # under a host budget: page-locked only while it holds bytes (NOTE [Locked host tier])
    direct_candidates: int = 0  # leading layers that may be computed from the host store (NOTE [Direct host access])
    host_bound: tuple[str, ...] = ()  # keys whose slots point at the host store now
    # NOTE [Shared tensors]: keys held once in a shared set, not in ``store``: the set and
    # the key's entry there; each layer's (and the tail's) byte runs of those sets.
    shared: dict[str, tuple[str, TensorEntry]] = field(default_factory=dict)
    shared_sets: frozenset[str] = frozenset()
    shared_sizes: dict[str, int] = field(default_factory=dict)  # each set's bytes
    layer_shared: list[tuple[tuple[str, int, int], ...]] = field(default_factory=list)
    tail_shared: tuple[tuple[str, int, int], ...] = ()
    shared_bound: dict[str, int] = field(default_factory=dict)  # shared set -> arena offset the slots point at


# NOTE [Direct host access]
# A layer that reads a few rows of a large table (an embedding) costs far less to compute
# from host memory than to copy first: BERT-base's word embedding is 94 MB, the first
# thing a load copies and the first thing the forward waits for. Such leading layers of
# the execution order are candidates (``direct_candidates``); a profile times them bound
# to the host store and keeps them direct (``ModelProfile.direct_layers``) while the
# extra compute costs less than their copy; the plan then copies from the first other
# layer on, and a load binds the direct layers' tensors to the host store
# (``LoadPlan.direct_keys``, ``WorkerModel.host_bound``). Only a prefix: a group is
# one contiguous range of the store. On the CPU host memory is the device's memory, so
# the compute costs the same. On CUDA a device-visible mapping of the pinned store is
# needed and is not used yet: the candidates are none there. A model with host-bound
# tensors reads its host store whenever it runs, so the host tier keeps that store. With
# workers, the binding is the loading worker's: it reports the host-bound keys, and a
# worker that runs the model resident later (a standby, a replacement) is told them
# (``RunModel.host_keys``), since their bytes were never copied to the arena. A direct
# layer's tensors held in a shared set (NOTE [Shared tensors]) are read from the set's
# host store, and the profile weighs their bytes too; a load that copies the set still
# copies them, since another model may read the set in the arena, but with its last
# group, where no layer waits for them. The choice is made once per profile: when the set
# is resident already (a switch between variants), the direct layer spares no copy and
# costs only its compute from host memory, the same on the CPU.
DIRECT_MODULES = (nn.Embedding, nn.EmbeddingBag)


def adopt_order(wm: WorkerModel, order: ExecutionOrder, direct: bool = False) -> None:
    """Take ``order`` as the model's layers, its host store being laid out in that order:
    each layer's byte span, the tail's, and which module waits for which layer; with
    ``direct``, how many leading layers are candidates for direct host access."""
    wm.order = order
    wm.load_plans.clear()
    offsets = {e.key: e.offset for e in wm.store.entries}
    # A layer's span in the store: from its first key held there (its tensors may all be
    # shared: NOTE [Shared tensors]) to the next layer's start.
    own_tail = [k for k in order.unused if k in offsets]
    tail_start = offsets[own_tail[0]] if own_tail else wm.store.nbytes
    starts, nxt = [0] * len(order.layers), tail_start
    for i in reversed(range(len(order.layers))):
        own = [k for k in order.layers[i].keys if k in offsets]
        nxt = starts[i] = offsets[own[0]] if own else nxt
    wm.layer_spans = list(zip(starts, starts[1:] + [tail_start]))
    wm.tail_span = (tail_start, wm.store.nbytes)
    wm.layer_shared = [shared_runs(wm, layer.keys) for layer in order.layers]
    wm.tail_shared = shared_runs(wm, order.unused)
    # Layer modules wait for their layer; modules owning tail tensors (they never ran
    # in the trace) wait for the tail. See NOTE [Layers are wait points].
    n = len(order.layers)
    modules = dict(wm.module.named_modules(remove_duplicate=False))
    wm.layer_modules = [modules[layer.module] if layer.module else wm.module for layer in order.layers]
    wm.direct_candidates = 0
    while direct and wm.direct_candidates < n - 1 and \
            isinstance(wm.layer_modules[wm.direct_candidates], DIRECT_MODULES):
        wm.direct_candidates += 1
    wm.waits = [(mod, i) for i, mod in enumerate(wm.layer_modules)]
    waiting = {id(mod) for mod in wm.layer_modules}
    tail = set(order.unused)
    for slot in wm.layout.slots:
        if slot.key in tail and id(slot.module) not in waiting:
            wm.waits.append((slot.module, n))
            waiting.add(id(slot.module))


def shared_runs(wm: WorkerModel, keys: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """The byte runs of ``keys``' tensors in shared sets, in order, as (set, start, end),
    consecutive tensors of one set merged (the alignment gap between them goes along)."""
    runs: list[tuple[str, int, int]] = []
    for k in keys:
        if k not in wm.shared:
            continue
        sid, e = wm.shared[k]
        a, b = e.offset, e.offset + e.nbytes
        if runs and runs[-1][0] == sid and runs[-1][2] <= a <= align_up(runs[-1][2], wm.store.alignment):
            runs[-1] = (sid, runs[-1][1], b)
        else:
            runs.append((sid, a, b))
    return tuple(runs)


def unused_runs(wm: WorkerModel, index: dict[str, int]) -> tuple[Piece, ...]:
    """The byte ranges of the sets in ``index`` (set -> source number) that none of
    ``wm``'s runs covers."""
    gaps: list[Piece] = []
    for sid, i in index.items():
        used = sorted((a, b) for runs in [*wm.layer_shared, wm.tail_shared] for s, a, b in runs if s == sid)
        pos = 0
        for a, b in used:
            if a > pos:
                gaps.append((i, pos, a))
            pos = max(pos, b)
        if pos < wm.shared_sizes[sid]:
            gaps.append((i, pos, wm.shared_sizes[sid]))
    return tuple(gaps)


def forget_order(wm: WorkerModel) -> None:
    """Drop the execution order and everything made from it: the next load starts over."""
    wm.order = None
    wm.layer_modules, wm.layer_spans, wm.waits = [], [], []
    wm.tail_span = (0, 0)
    wm.load_plans.clear()
    wm.profiles.clear()
    wm.last_profile = None


def load_plan_of(wm: WorkerModel, key: str, strategy: str, disk_Bps: float | None = None,
                 fixed_group_bytes: int = 2 << 20, missing: tuple[str, ...] = ()) -> LoadPlan:
    """The ready-made plan that loads of ``wm`` for input shape ``key`` follow (the last
    profiled shape's when ``key`` was never profiled), made once and cached. With
    ``disk_Bps``, the plan of a load read from disk as it goes (NOTE [Disk to device]),
    made for that bandwidth (rounded to a power of 2^(1/4), so that measurements that
    differ a little share a plan). ``missing``: the shared sets of the model not in the
    arena yet, copied by this load too (NOTE [Shared tensors])."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
    if key not in wm.profiles:
        key = wm.last_profile  # type: ignore[assignment]
    profile = wm.profiles[key]
    disk = None
    if disk_Bps is not None and disk_Bps < profile.link.bandwidth_Bps:
        disk = 2 ** (round(math.log2(disk_Bps) * 4) / 4)
    missing = tuple(sorted(missing))
    cached = wm.load_plans.get((key, strategy, disk, missing))
    if cached is not None:
        return cached
    index = {sid: i for i, sid in enumerate(missing)}
    k = profile.direct_layers  # NOTE [Direct host access]: the leading k layers are not copied
    extra = [[(index[sid], a, b) for sid, a, b in runs if sid in index] for runs in wm.layer_shared]
    # The direct layers' shared tensors are read from the set's host store; their set is
    # whole in the arena after the load all the same (another model may read them there),
    # so they are copied last, where nothing waits for them.
    spared = tuple(p for i in range(k) for p in extra[i])
    extra[:k] = [[] for _ in range(k)]
    if any(extra) or spared:  # more bytes than the profile's: planned for what this load moves
        moved = [n + sum(b - a for _, a, b in pieces) for n, pieces in zip(profile.layer_bytes, extra)]
        moved[-1] += sum(b - a for _, a, b in spared)
        plan = make_plan(strategy, profile.cost_model(disk, moved), moved, fixed_group_bytes)
    elif disk is None:
        plan = profile.plans[strategy]
    else:
        plan = make_plan(strategy, profile.cost_model(disk), profile.layer_bytes, fixed_group_bytes)
    first = wm.layer_spans[k][0]
    ranges = [(wm.layer_spans[max(a, k)][0], wm.layer_spans[b - 1][1]) if b > k else (first, first)
              for a, b in plan.groups]
    pieces = [tuple(p for i in range(a, b) for p in extra[i]) for a, b in plan.groups]
    tail_pieces = tuple((index[sid], a, b) for sid, a, b in wm.tail_shared if sid in index)
    has_tail = wm.tail_span[1] > wm.tail_span[0] or bool(tail_pieces)
    if has_tail:
        ranges.append(wm.tail_span)
        pieces.append(tail_pieces)
    if index and pieces:
        # A set is whole in the arena after any load that copies it, also the tensors this
        # model does not use (another model sharing the set may): they go with the last group.
        pieces[-1] = pieces[-1] + spared + unused_runs(wm, index)
    group_of_layer = [g for g, (a, b) in enumerate(plan.groups) for _ in range(a, b)]
    wait_of = {}
    for mod, layer in wm.waits:
        if layer < k:
            continue  # computed from the host store: nothing to wait for
        if layer < len(group_of_layer):
            wait_of[id(mod)] = group_of_layer[layer]
        elif has_tail:  # a module that only owns tail tensors (an empty tail needs no wait)
            wait_of[id(mod)] = len(plan)
    direct_keys = tuple(key for layer in wm.order.layers[:k] for key in layer.keys) if wm.order else ()
    made = wm.load_plans[(key, strategy, disk, missing)] = LoadPlan(
        tuple(ranges), wait_of, direct_keys=direct_keys, direct_end=first if k else 0, sources=missing,
        pieces=tuple(pieces) if missing else ())
    return made


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
def forward_while_loading(module: nn.Module, handle: LoadHandle, wait_of: dict[int, int], body: Callable[[], object],
                          aliases_arena: Callable[[object], bool]) -> tuple[object, bool]:
    """Run ``body`` (a forward of ``module``, or a language model's step) while ``handle``'s
    groups arrive, each module waiting for the group ``wait_of`` gives it. Returns the
    output and whether every group was waited for (an output that aliases the arena, a
    weight, waits for all of them)."""
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
            out = body()
    finally:
        registration.remove()  # idempotent
    if upto[0] < handle.n_groups - 1 and aliases_arena(out):
        handle.wait_all()  # an output that is a weight must have arrived
        upto[0] = handle.n_groups - 1
    return out, upto[0] >= handle.n_groups - 1
