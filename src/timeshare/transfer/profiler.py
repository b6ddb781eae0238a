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

from timeshare.transfer.copy import CopyEngine
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
    index = {id(m): i for i, m in enumerate(layer_modules)}
    cuda = device.type == "cuda"
    marks: list[object | None] = [None] * (n + 1)

    def now():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(device))
            return ev
        return time.perf_counter()

    def elapsed(a, b) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    def pre(mod, _args):
        i = index.get(id(mod))
        if i is not None and marks[i] is None:
            marks[i] = now()

    handles = [register_module_forward_pre_hook(pre)]  # global, as in the pipelined forward
    per_layer: list[list[float]] = [[] for _ in range(n)]
    try:
        for _ in range(repeats):
            marks[:] = [None] * (n + 1)
            start = now()
            run()
            marks[n] = now()
            if cuda:
                torch.cuda.synchronize(device)
            # A layer never reached in this call inherits the next mark (zero time).
            for i in range(n - 1, -1, -1):
                if marks[i] is None:
                    marks[i] = marks[i + 1]
            for i in range(n):
                a = start if i == 0 else marks[i]  # time before the first wait point counts to layer 0
                per_layer[i].append(max(0.0, elapsed(a, marks[i + 1])))
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
    """The host-to-device link as the copy engine sees it."""

    bandwidth_Bps: float  # bytes per second for large copies
    alpha_s: float  # extra seconds per group on the copy side
    beta_s: float  # extra seconds per group on the compute side (a wait that is already satisfied)
    latency_s: float = 0.0  # arrival to a blocked compute resuming (host-side waits only)
    probe_bytes: int = field(default=0)


def measure_link(
    engine: CopyEngine, src: torch.Tensor, dst: torch.Tensor, device: torch.device, repeats: int = 5
) -> LinkCosts:
    """Bandwidth from whole-buffer copies; alpha and beta from many tiny groups."""
    nbytes = min(int(src.numel()), int(dst.numel()))

    def copy(ranges):
        h = engine.start(src, dst, ranges, "link probe")
        h.wait_all()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return h

    copy([(0, nbytes)])  # warm-up
    big = time_callable(lambda: copy([(0, nbytes)]), device, repeats)
    n_small = 64
    step = max(512, nbytes // n_small // 512 * 512)
    small_ranges = [(i * step, i * step + min(512, nbytes)) for i in range(n_small) if i * step + 512 <= nbytes]
    one = time_callable(lambda: copy(small_ranges[:1]), device, repeats)
    many = time_callable(lambda: copy(small_ranges), device, repeats)
    alpha = max(0.0, (many - one) / max(1, len(small_ranges) - 1))
    h = copy(small_ranges)
    t0 = time.perf_counter()
    for k in range(h.n_groups):
        h.wait(k)
    beta = (time.perf_counter() - t0) / h.n_groups
    # The whole-buffer copy less a one-group copy: what remains is bytes over the link,
    # without the fixed cost of a call (start, hand-off, synchronize), which alpha and
    # latency account for. Host-timed, so the fixed part must be taken out this way.
    bandwidth = (nbytes - min(512, nbytes)) / max(big - one, 1e-9)
    # A one-group load, start to resumed waiter, less its copy: the hand-off to the copy
    # thread and back. Device-side waits (CUDA) have no such cost on the compute's path.
    latency = max(0.0, one - alpha - 512 / bandwidth) if engine.host_waits else 0.0
    return LinkCosts(bandwidth, alpha, beta, latency, nbytes)


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

    @property
    def transfer_s(self) -> list[float]:
        return [b / self.link.bandwidth_Bps for b in self.layer_bytes]

    def cost_model(self):
        from timeshare.transfer.planner import CostModel

        return CostModel(
            tuple(self.transfer_s), tuple(self.compute_s), self.link.alpha_s, self.link.beta_s, self.link.latency_s
        )

    def summary(self) -> dict:
        return {
            "model": self.model,
            "device": self.device,
            "inputs": self.shape_key,
            "layers": len(self.layer_names),
            "bytes": sum(self.layer_bytes),
            "tail_bytes": self.tail_bytes,
            "bandwidth_GBps": self.link.bandwidth_Bps / 1e9,
            "alpha_us": self.link.alpha_s * 1e6,
            "beta_us": self.link.beta_s * 1e6,
            "latency_us": self.link.latency_s * 1e6,
            "ready_ms": self.ready_s * 1e3,
            "compute_ms": sum(self.compute_s) * 1e3,
            "plans": {
                name: {"groups": len(p), "ends": list(p.ends), "predicted_ms": p.predicted_s * 1e3}
                for name, p in self.plans.items()
            },
        }
