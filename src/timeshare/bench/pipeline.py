"""``timeshare bench pipeline``: PipeSwitch's Figure 7 on the device present.

For each model, the latency of the first inference when the model is not resident,
for each way of moving its weights (whole model first, per-layer pipelining,
fixed-size groups, the optimal grouping), beside the ready model (already resident)
and the floor max(overhead + bytes / bandwidth, ready compute), with the bandwidth and a
load's fixed overhead measured by the profiler's link probe (device events on CUDA; see
``bench.link.load_floor_ms``). Every timing ends with a device synchronize (the
outputs' copy to the host).

Timings are taken in rounds: each round times the ready model and then every
strategy once, so slow drift of the machine (other tenants, clocks, caches) hits all
of them alike. We report the median and quartiles over rounds, and call the optimal
grouping "within noise" of the best strategy when its median exceeds the best median
by no more than the larger of the two interquartile ranges.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from timeshare.bench.common import native_call, native_module, outputs_equal, stats_of
from timeshare.bench.environment import describe
from timeshare.bench.link import load_floor_ms
from timeshare.dtypes import parse_dtype
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.facade import Runtime
from timeshare.transfer.planner import STRATEGIES

log = logging.getLogger(__name__)

DEFAULT_MODELS = ("resnet152", "inception_v3", "bert_base")


@dataclass
class PipelineBenchConfig:
    models: Sequence[str] = DEFAULT_MODELS
    """Zoo models to measure."""
    batch: int = 8
    """Batch size of the inputs."""
    dtype: str = "fp32"
    """Weights and inputs dtype: fp32, fp16 or bf16."""
    device: str = "auto"
    """Device to run on."""
    repeats: int = 10
    """Timed rounds; each round times the ready model and every strategy once."""
    warmup: int = 1
    """Untimed rounds before timing."""
    strategies: Sequence[str] = STRATEGIES
    """Grouping strategies to compare."""
    memory: str = "auto"
    """Arena size."""


@dataclass
class ModelResult:
    model: str
    bytes: int
    needed_bytes: int
    layers: int
    ready_ms: float
    floor_ms: float  # max(overhead_ms + transfer_ms, ready_ms)
    transfer_ms: float  # needed bytes over the measured bandwidth
    overhead_ms: float = 0.0  # the fixed cost of a load, as the link probe measured it
    native_ms: float = 0.0
    native: dict = field(default_factory=dict)
    native_matches_ready: bool = True
    strategies: dict[str, dict] = field(default_factory=dict)
    profile: dict = field(default_factory=dict)
    ready: dict = field(default_factory=dict)
    verdict: dict = field(default_factory=dict)
    outputs_match_ready: bool = True


def run(config: PipelineBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    for s in config.strategies:
        if s not in STRATEGIES:
            from timeshare.errors import ConfigError

            raise ConfigError(f"unknown strategy {s!r}; known: {list(STRATEGIES)}")
    dtype = parse_dtype(config.dtype)
    results = []
    # Outputs after each load are compared with the resident ones over poisoned blocks
    # (NOTE [Poisoned reloads]); the poison is written at eviction, outside the timings.
    # The strategies copy every layer; where the host is the device's memory, a second
    # runtime adds the row of direct host access (NOTE [Direct host access]).
    with Runtime(device=config.device, memory=config.memory, poison_evicted=True, direct_host_access=False) as rt:
        env = describe(rt.device)
        for name in config.models:
            results.append(_measure_model(rt, name, config, dtype, progress))
            rt.unregister(name)
    return {
        "benchmark": "pipeline",
        "config": {
            "models": list(config.models), "batch": config.batch, "dtype": config.dtype,
            "repeats": config.repeats, "warmup": config.warmup, "strategies": list(config.strategies),
        },
        "environment": env,
        "link": results[0].profile and {
            "bandwidth_GBps": results[0].profile["bandwidth_GBps"],
            "alpha_us": results[0].profile["alpha_us"],
            "beta_us": results[0].profile["beta_us"],
            "latency_us": results[0].profile["latency_us"],
            "queue_us": results[0].profile["queue_us"],
            "overhead_us": results[0].profile["overhead_us"],
        },
        "results": [r.__dict__ for r in results],
    }


def _measure_model(rt: Runtime, name: str, config: PipelineBenchConfig, dtype,
                   progress: Callable[[str], None]) -> ModelResult:
    """One model: registered, profiled, timed in rounds, and its row with every strategy's
    figures and the verdict on the optimal grouping."""
    zoo = zoo_get(name)
    progress(f"{name}: weights")
    rt.register(name, zoo.builder, weights_path(name), dtype=dtype)
    inputs = tuple(
        t.to(dtype) if t.is_floating_point() else t for t in zoo.example_inputs(config.batch, torch.float32)
    )
    progress(f"{name}: profiling")
    prof = rt.profile(name, *inputs)
    reference = rt.infer(name, *inputs)

    native = native_module(name, dtype, rt.device)
    native_out = native_call(native, inputs, rt.device)
    samples, matches = _time_rounds(rt, name, native, inputs, reference, config, progress)
    del native
    ready = stats_of(samples["ready"])
    native_stats = stats_of(samples["native"])
    needed = sum(prof.layer_bytes)
    link = prof.link
    r = ModelResult(
        model=name,
        bytes=needed + prof.tail_bytes,
        needed_bytes=needed,
        layers=len(prof.layer_bytes),
        ready_ms=ready["median_ms"],
        ready=ready,
        transfer_ms=needed / link.bandwidth_Bps * 1e3,
        overhead_ms=link.overhead_s * 1e3,
        floor_ms=load_floor_ms(needed, link.bandwidth_Bps, link.overhead_s, ready["median_ms"]),
        profile=prof.summary(),
        native_ms=native_stats["median_ms"],
        native=native_stats,
        native_matches_ready=outputs_equal(native_out, reference),
    )
    for strategy in config.strategies:
        st = stats_of(samples[strategy])
        r.outputs_match_ready &= matches[strategy]
        r.strategies[strategy] = {
            **st,
            "ms": st["median_ms"],
            "groups": len(prof.plans[strategy]),
            "predicted_ms": prof.plans[strategy].predicted_s * 1e3,
            "vs_ready": st["median_ms"] / r.ready_ms,
            "vs_floor": st["median_ms"] / r.floor_ms,
            "outputs_match_ready": matches[strategy],
        }
    if rt.device.type == "cpu":
        direct = _direct_row(name, inputs, reference, config, dtype, r.ready_ms, r.floor_ms, progress)
        if direct is not None:
            r.strategies["optimal+direct"] = direct
            r.outputs_match_ready &= direct["outputs_match_ready"]
    if "optimal" in r.strategies:
        r.verdict = _verdict(r.strategies)
    return r


def _time_rounds(rt: Runtime, name: str, native, inputs: tuple, reference, config: PipelineBenchConfig,
                 progress: Callable[[str], None]) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """The timed rounds: each times plain PyTorch, the ready model and every strategy once
    (a strategy's load after an eviction), so that the machine's drift hits all alike.
    Returns the samples by label and, per strategy, whether every output was exact."""
    samples: dict[str, list[float]] = {k: [] for k in ["native", "ready", *config.strategies]}
    matches = {k: True for k in config.strategies}
    for round_ in range(config.warmup + config.repeats):
        progress(f"{name}: round {round_ + 1}/{config.warmup + config.repeats}")
        for label in samples:
            strategy = None if label in ("ready", "native") else label
            if strategy is not None:
                rt.evict(name)
            if label == "native":
                ms, out = _time_ms(functools.partial(native_call, native, inputs, rt.device), rt.device)
            else:
                ms, out = _time_ms(lambda: rt.call(name, inputs, strategy=strategy).output, rt.device)
            if round_ >= config.warmup:
                samples[label].append(ms)
            if strategy is not None:
                matches[strategy] &= outputs_equal(out, reference)
    return samples, matches


def _verdict(strategies: dict[str, dict]) -> dict:
    """The optimal grouping against the best strategy: within noise when its median exceeds
    the best one's by no more than the larger interquartile range."""
    best = min(strategies, key=lambda k: strategies[k]["ms"])
    opt, top = strategies["optimal"], strategies[best]
    return {
        "best": best,
        "optimal_minus_best_ms": opt["ms"] - top["ms"],
        "noise_ms": max(opt["iqr_ms"], top["iqr_ms"]),
        "optimal_within_noise_of_best": opt["ms"] - top["ms"] <= max(opt["iqr_ms"], top["iqr_ms"]),
    }


def _direct_row(name: str, inputs: tuple, reference, config: PipelineBenchConfig, dtype, ready_ms: float,
                floor_ms: float, progress: Callable[[str], None]) -> dict | None:
    """Loads planned with direct host access (NOTE [Direct host access]) in a runtime of
    their own; None when the model has no layer that gains from it."""
    zoo = zoo_get(name)
    with Runtime(device=config.device, memory=config.memory, poison_evicted=True, direct_host_access=True) as rt:
        rt.register(name, zoo.builder, weights_path(name), dtype=dtype)
        prof = rt.profile(name, *inputs)
        if not prof.direct_layers:
            return None
        samples, match = [], True
        for round_ in range(config.warmup + config.repeats):
            progress(f"{name}: direct host access, round {round_ + 1}/{config.warmup + config.repeats}")
            rt.evict(name)
            ms, out = _time_ms(lambda: rt.call(name, inputs, strategy="optimal").output, rt.device)
            if round_ >= config.warmup:
                samples.append(ms)
            match &= outputs_equal(out, reference)
        st = stats_of(samples)
        plan = prof.plans["optimal"]
        copied = sum(prof.layer_bytes[prof.direct_layers:])
        return {**st, "ms": st["median_ms"], "groups": len(plan), "predicted_ms": plan.predicted_s * 1e3,
                "vs_ready": st["median_ms"] / ready_ms, "vs_floor": st["median_ms"] / floor_ms,
                "outputs_match_ready": match, "direct_layers": prof.direct_layers,
                "bytes_not_copied": sum(prof.layer_bytes) - copied}


def _time_ms(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()  # returns CPU outputs: the copy to the host synchronizes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


