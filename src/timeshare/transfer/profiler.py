"""Profiling a model on the actual device: the execution order of its tensors, each
layer's bytes and compute time, and the link's bandwidth and per-group overheads.
Runs in the process that computes.

# NOTE [Layers are wait points]
A "layer" for grouping is a module at whose forward pre-hook the compute must wait
for some weights. While tracing one forward, a TorchDispatchMode sees every aten op
and maps the address of each tensor argument to the model tensor it lies in; the
first op to touch a tensor assigns it to the module whose pre-hook fired most
recently, whose hook therefore runs before that first use. Modules with assigned
tensors, in the order of their first call, are the layers. Tracing at the dispatch
level, with a global (not per-module) pre-hook, keeps the code path the same as an
untraced forward (a TorchFunctionMode or per-module hooks turn off fused fast paths
such as nn.TransformerEncoderLayer's) and catches views and fused ops that read a
child's weights in the parent. This handles tied weights,
modules called several times or out of registration order, and parents reading a
child's weight directly.

A tensor the traced forward never reads (BatchNorm's num_batches_tracked, say) goes
into the layer of the first of its owner modules that ran, so it never delays
anything. Tensors of modules that never ran (an auxiliary head) form a tail copied
after all layers; those modules wait for the tail, which covers a later call taking
a different path, and the tail is waited for before any later use of the model.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from timeshare.errors import PipelineError
from timeshare.transfer.copy import CopyEngine, LoadEvents, LoadHandle
from timeshare.transfer.planner import Plan


@dataclass(frozen=True)
class Layer:
    """A wait point: a module and the tensors assigned to it (see NOTE [Layers are wait points])."""

    module: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class ExecutionOrder:
    layers: tuple[Layer, ...]
    unused: tuple[str, ...]

    def key_order(self) -> list[str]:
        return [k for layer in self.layers for k in layer.keys] + list(self.unused)


class _FirstUse(TorchDispatchMode):
    """Records, for each model tensor, the module whose pre-hook fired last before its first use."""

    def __init__(self, spans: Sequence[tuple[int, int, str]], last: list[str], first: dict[str, str]):
        super().__init__()
        self.starts = [a for a, _, _ in spans]
        self.ends = [b for _, b, _ in spans]
        self.keys = [k for _, _, k in spans]
        self.last, self.first = last, first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.numel():
                ptr = leaf.data_ptr()
                i = bisect.bisect_right(self.starts, ptr) - 1
                if i >= 0 and ptr < self.ends[i]:
                    key = self.keys[i]
                    if key not in self.first:
                        self.first[key] = self.last[0]
        return func(*args, **kwargs)


def trace_execution_order(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    spans: Sequence[tuple[int, int, str]],
    owners: dict[str, list[torch.nn.Module]],
) -> tuple[ExecutionOrder, object]:
    """Run ``module(*args, **kwargs)`` once and derive its layers (see NOTE [Layers are wait points]).

    ``spans`` are ``(start address, end address, key)`` of every model tensor as bound
    now; ``owners`` lists, per key, the modules holding it. Returns the order and the
    forward's output.
    """
    names: dict[int, str] = {}
    for n, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), n)
    last: list[str] = [""]  # the module whose pre-hook fired most recently
    call_order: list[str] = []
    first: dict[str, str] = {}  # key -> module name, in first-use order

    def pre(mod, _args):
        name = names.get(id(mod))
        if name is None:  # a module of something else running meanwhile
            return
        if name not in call_order:
            call_order.append(name)
        last[0] = name

    # A global hook, as in the pipelined forward: per-module hooks change some modules'
    # code path (nn.TransformerEncoderLayer skips its fused kernel when it sees them).
    handle = register_module_forward_pre_hook(pre)
    try:
        with _FirstUse(sorted(spans), last, first):
            out = module(*args, **kwargs)
    finally:
        handle.remove()
    by_module: dict[str, list[str]] = {}
    for key, mod in first.items():
        by_module.setdefault(mod, []).append(key)
    called = {n: i for i, n in enumerate(call_order)}
    unused = []
    for key, mods in owners.items():
        if key in first:
            continue
        ran = sorted((called[names[id(m)]], names[id(m)]) for m in mods if names.get(id(m)) in called)
        if ran:
            by_module.setdefault(ran[0][1], []).append(key)
        else:
            unused.append(key)
    layers = [Layer(m, tuple(by_module[m])) for m in call_order if m in by_module]
    if not layers:  # nothing read any weight: wait for everything at the start
        layers, unused = [Layer("", tuple(unused))], []
    return ExecutionOrder(tuple(layers), tuple(unused)), out


@dataclass
class LayerTimes:
    """Per-layer compute seconds for one input shape, and the plain forward's time."""

    compute_s: list[float]
    ready_s: float
    samples: int


def time_layers(
    module: torch.nn.Module,
    run: Callable[[], object],
    layer_modules: Sequence[torch.nn.Module],
    device: torch.device,
    repeats: int,
) -> LayerTimes:
    """Per-layer compute time: from one layer's first pre-hook to the next one's.

    ``run`` calls the model once; ``layer_modules`` are the wait-point modules in
    order. Also measures the forward without hooks (the ready model).
    """
    n = len(layer_modules)
    index = {id(m): i + 1 for i, m in enumerate(layer_modules)}  # mark 0 is the start, n + 1 the end
    marks = _Marks(device, n + 2)
    hit = [False] * (n + 2)

    def pre(mod, _args):
        i = index.get(id(mod))
        if i is not None and not hit[i]:
            hit[i] = True
            marks.mark(i)

    handles = [register_module_forward_pre_hook(pre)]  # global, as in the pipelined forward
    per_layer: list[list[float]] = [[] for _ in range(n)]
    try:
        for _ in range(repeats):
            hit[:] = [True] + [False] * n + [True]
            marks.mark(0)
            run()
            marks.mark(n + 1)
            marks.sync()  # the marks are read, and then recorded again by the next repeat
            for i, seconds in enumerate(_layer_seconds(marks, hit)):
                per_layer[i].append(seconds)
    finally:
        for h in handles:
            h.remove()
    ready = time_callable(run, device, repeats)
    compute = [statistics.median(x) for x in per_layer]
    # The marks themselves cost host time (a hook and, on CUDA, an event per layer); on a
    # launch-bound device forward that inflates every layer. Scale the layers so they add
    # up to the plain forward, keeping their proportions.
    total = sum(compute)
    if total > ready > 0:
        compute = [c * ready / total for c in compute]
    return LayerTimes(compute, ready, repeats)


class _Marks:
    """``count`` time marks, made once and recorded again by every repeat: CUDA events on
    the current stream, or the host clock."""

    def __init__(self, device: torch.device, count: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.times = [0.0] * count
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(count)] if self.cuda else []
        self.stream = torch.cuda.current_stream(device) if self.cuda else None

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record(self.stream)
        else:
            self.times[i] = time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def elapsed(self, a: int, b: int) -> float:
        if self.cuda:
            return self.events[a].elapsed_time(self.events[b]) / 1e3
        return self.times[b] - self.times[a]


def _layer_seconds(marks: _Marks, hit: Sequence[bool]) -> list[float]:
    """Each layer's seconds in one call: from its mark to the next layer's (marks 1..n;
    0 is the start, n + 1 the end). A layer never reached in the call takes the next
    mark (zero time); time before the first wait point counts to layer 0."""
    n = len(hit) - 2
    at = list(range(n + 2))
    for i in range(n, 0, -1):
        if not hit[i]:
            at[i] = at[i + 1]
    return [max(0.0, marks.elapsed(0 if i == 0 else at[i + 1], at[i + 2])) for i in range(n)]


def time_callable(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, synchronized with the device."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclass
class LinkCosts:
    """The host-to-device link as the copy engine sees it. Fields added later have
    defaults, so a profile made before them still loads (and reads them as zero)."""

    bandwidth_Bps: float  # bytes per second for large copies
    alpha_s: float  # extra seconds per group on the copy side (the copy engine's own, on CUDA)
    beta_s: float  # extra seconds per group on the compute side (a wait that is already satisfied)
    latency_s: float = 0.0  # arrival to a blocked compute resuming (host-side waits only)
    probe_bytes: int = field(default=0)
    queue_s: float = 0.0  # host seconds to queue one more group of a load (NOTE [Pipeline cost model])
    overhead_s: float = 0.0  # a one-group load's seconds beyond its bytes: the floor's fixed part


PROBE_GROUPS = 64  # tiny groups of the many-group probe load
PROBE_GROUP_BYTES = 512
# A probe load's wait for one group: scratch bytes, measured once per worker, which the
# user's ``load_timeout_s`` (made for a model's loads, and small in tests of it) does
# not govern; a loaded host takes a while to copy 64 MiB, a hung copy thread stops it.
PROBE_DEADLINE_S = 60.0


def measure_link(
    engine: CopyEngine, src: torch.Tensor, dst: torch.Tensor, device: torch.device, repeats: int = 5
) -> LinkCosts:
    """The link's costs from loads through ``engine``, as ``_LinkProbe`` times them:
    bandwidth and the fixed cost of a load from a whole-buffer and a one-tiny-group
    load; alpha and the host's queueing cost per group from many tiny groups; beta
    from waits for groups that have arrived."""
    nbytes = min(int(src.numel()), int(dst.numel()))
    tiny = min(PROBE_GROUP_BYTES, nbytes)
    step = max(PROBE_GROUP_BYTES, nbytes // PROBE_GROUPS // 512 * 512)
    small = [(i * step, i * step + tiny) for i in range(PROBE_GROUPS) if i * step + tiny <= nbytes]
    whole, one = [(0, nbytes)], small[:1]
    probe = _LinkProbe(engine, src, dst, device)
    for ranges in (whole, one, small):
        probe.load(ranges)  # warm-up; makes each probe's events, as a plan's first load does
    _, big = probe.median(whole, repeats)
    queue_one, one_s = probe.median(one, repeats)
    queue_many, many_s = probe.median(small, repeats)
    extra = max(1, len(small) - 1)
    # The whole-buffer load less the one-group load: what remains is bytes over the link,
    # without the fixed cost of a load (which, host-timed, holds the start, the hand-off
    # and the synchronize).
    bandwidth = (nbytes - tiny) / max(big - one_s, 1e-9)
    overhead = max(0.0, one_s - tiny / bandwidth)
    alpha = max(0.0, (many_s - one_s - (len(small) - 1) * tiny / bandwidth) / extra)
    queue = max(0.0, (queue_many - queue_one) / extra)
    h = probe.load(small)[2]
    t0 = time.perf_counter()
    for k in range(h.n_groups):
        h.wait(k)
    beta = (time.perf_counter() - t0) / h.n_groups
    # A one-group load, start to resumed waiter, less its copy: the hand-off to the copy
    # thread and back. Device-side waits (CUDA) have no such cost on the compute's path.
    latency = max(0.0, overhead - alpha) if engine.host_waits else 0.0
    return LinkCosts(bandwidth, alpha, beta, latency, nbytes, queue_s=queue, overhead_s=overhead)


class _LinkProbe:
    """Times loads of scratch buffers through a copy engine, each kind of load with its
    own events kept across repeats (NOTE [Events made once per plan]), as a plan's are.

    A load's seconds come from the engine's device events where it has them (CUDA: the
    first copy's start to the last arrival, no host launch or synchronize in it), and
    the copy stream is held until every group is queued, so they show the copy
    engine's own costs; the host's cost of queueing is timed apart, around ``start``.
    Otherwise (the CPU copy thread) they are host wall time, from the start to the
    waiter resuming."""

    HOLD_S = 1e-3  # plus HOLD_PER_GROUP_S per group: well above any host's queueing time
    HOLD_PER_GROUP_S = 50e-6

    def __init__(self, engine: CopyEngine, src: torch.Tensor, dst: torch.Tensor, device: torch.device):
        self.engine, self.src, self.dst, self.device = engine, src, dst, device
        self.events: dict[tuple, LoadEvents] = {}

    def load(self, ranges: Sequence[tuple[int, int]]) -> tuple[float, float, LoadHandle]:
        """One load: (host seconds to queue it, seconds of the load, its handle)."""
        engine = self.engine
        events = self.events.setdefault(tuple(ranges), LoadEvents())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        if engine.device_timed:
            engine.hold(self.HOLD_S + self.HOLD_PER_GROUP_S * len(ranges))
        t0 = time.perf_counter()
        h = engine.start(self.src, self.dst, ranges, "link probe", events=events, deadline_s=PROBE_DEADLINE_S)
        queued = time.perf_counter() - t0
        h.wait_all()
        if cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        seconds = h.copy_seconds() if engine.device_timed else wall
        if seconds is None:
            raise PipelineError("the copy engine has no timing for a finished load", where="link probe")
        return queued, seconds, h

    def median(self, ranges: Sequence[tuple[int, int]], repeats: int) -> tuple[float, float]:
        """Medians over ``repeats`` loads: (host seconds to queue, seconds of the load)."""
        samples = [self.load(ranges)[:2] for _ in range(repeats)]
        return statistics.median(q for q, _ in samples), statistics.median(s for _, s in samples)


@dataclass
class ModelProfile:
    """Everything measured for one (model, device, dtype, input shape), and the plans."""

    model: str
    device: str
    shape_key: str
    layer_names: list[str]
    layer_bytes: list[int]
    compute_s: list[float]
    link: LinkCosts
    ready_s: float
    tail_bytes: int
    plans: dict[str, Plan]
    ephemeral_bytes: int = 0  # peak bytes of one call beyond the weights (NOTE [Counting ephemeral bytes])
    # NOTE [Direct host access]: the leading layers computed from the host store, not copied,
    # and their compute seconds so (measured with them bound to the host store).
    direct_layers: int = 0
    direct_compute_s: list[float] = field(default_factory=list)

    @property
    def transfer_s(self) -> list[float]:
        return [b / self.link.bandwidth_Bps for b in self.layer_bytes]

    def cost_model(self, disk_Bps: float | None = None, layer_bytes: Sequence[int] | None = None):
        """The planner's costs; with ``disk_Bps``, for a load whose bytes are read from a
        disk of that bandwidth as they are copied (NOTE [Disk to device]): disk and link
        work in series on a stream of chunks, so each layer's bytes move at the slower
        of the two. ``layer_bytes``: a load that moves other bytes per layer than the
        profiled ones (shared tensors not resident yet, NOTE [Shared tensors])."""
        from timeshare.transfer.planner import CostModel

        link = self.link
        bw = link.bandwidth_Bps if disk_Bps is None else min(link.bandwidth_Bps, disk_Bps)
        k = self.direct_layers  # NOTE [Direct host access]: not moved, computed from the host
        moved = self.layer_bytes if layer_bytes is None else layer_bytes
        transfer = [0.0] * k + [b / bw for b in moved[k:]]
        compute = list(self.direct_compute_s[:k]) + list(self.compute_s[k:])
        return CostModel(tuple(transfer), tuple(compute), link.alpha_s, link.beta_s, link.latency_s, link.queue_s)

    def summary(self) -> dict:
        return {
            "model": self.model,
            "device": self.device,
            "inputs": self.shape_key,
            "layers": len(self.layer_names),
            "bytes": sum(self.layer_bytes),
            "tail_bytes": self.tail_bytes,
            "ephemeral_bytes": self.ephemeral_bytes,
            "bandwidth_GBps": self.link.bandwidth_Bps / 1e9,
            "alpha_us": self.link.alpha_s * 1e6,
            "beta_us": self.link.beta_s * 1e6,
            "latency_us": self.link.latency_s * 1e6,
            "queue_us": self.link.queue_s * 1e6,
            "overhead_us": self.link.overhead_s * 1e6,
            "ready_ms": self.ready_s * 1e3,
            "compute_ms": sum(self.compute_s) * 1e3,
            "plans": {
                name: {"groups": len(p), "ends": list(p.ends), "predicted_ms": p.predicted_s * 1e3}
                for name, p in self.plans.items()
            },
        }
