"""``timeshare bench pipeline``: PipeSwitch's Figure 7 on the device present.

For each model, the latency of the first inference when the model is not resident,
for each way of moving its weights (whole model first, per-layer pipelining,
fixed-size groups, the optimal grouping), beside the ready model (already resident)
and the floor max(bytes / bandwidth, ready compute). Medians over repeats after a
warm-up; every timing ends with a device synchronize (the outputs' copy to the host).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from timeshare.bench.environment import describe
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.engine import Runtime, parse_dtype
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
    repeats: int = 5
    """Timed first inferences per strategy (the median is reported)."""
    warmup: int = 1
    """Untimed runs per strategy before timing."""
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
    floor_ms: float
    transfer_ms: float
    strategies: dict[str, dict] = field(default_factory=dict)
    profile: dict = field(default_factory=dict)
    outputs_match_ready: bool = True


def run(config: PipelineBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    for s in config.strategies:
        if s not in STRATEGIES:
            from timeshare.errors import ConfigError

            raise ConfigError(f"unknown strategy {s!r}; known: {list(STRATEGIES)}")
    dtype = parse_dtype(config.dtype)
    results = []
    with Runtime(device=config.device, memory=config.memory) as rt:
        env = describe(rt.device)
        for name in config.models:
            zoo = zoo_get(name)
            progress(f"{name}: weights")
            rt.register(name, zoo.builder, weights_path(name), dtype=dtype)
            inputs = tuple(
                t.to(dtype) if t.is_floating_point() else t for t in zoo.example_inputs(config.batch, torch.float32)
            )
            progress(f"{name}: profiling")
            prof = rt.profile(name, *inputs)
            reference = rt.infer(name, *inputs)

            def ready():
                return rt._infer(name, inputs, {}, None)

            ready_ms = _median_ms(ready, rt.device, config.repeats, config.warmup)
            r = ModelResult(
                model=name,
                bytes=sum(prof.layer_bytes) + prof.tail_bytes,
                needed_bytes=sum(prof.layer_bytes),
                layers=len(prof.layer_bytes),
                ready_ms=ready_ms,
                transfer_ms=sum(prof.layer_bytes) / prof.link.bandwidth_Bps * 1e3,
                floor_ms=max(sum(prof.layer_bytes) / prof.link.bandwidth_Bps * 1e3, ready_ms),
                profile=prof.summary(),
            )
            for strategy in config.strategies:
                progress(f"{name}: {strategy}")
                outs = []

                def first(strategy=strategy):
                    out = rt._infer(name, inputs, {}, strategy)
                    outs.append(out)

                ms = _median_ms(first, rt.device, config.repeats, config.warmup, before=lambda: rt.evict(name))
                same = all(_equal(o, reference) for o in outs)
                r.outputs_match_ready &= same
                r.strategies[strategy] = {
                    "ms": ms,
                    "groups": len(prof.plans[strategy]),
                    "predicted_ms": prof.plans[strategy].predicted_s * 1e3,
                    "vs_ready": ms / ready_ms,
                    "vs_floor": ms / r.floor_ms,
                    "outputs_match_ready": same,
                }
            results.append(r)
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
        },
        "results": [r.__dict__ for r in results],
    }


def _median_ms(fn, device, repeats: int, warmup: int, before=None) -> float:
    for _ in range(warmup):
        if before:
            before()
        fn()
    samples = []
    for _ in range(repeats):
        if before:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()  # returns CPU outputs: the copy to the host synchronizes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _equal(a, b) -> bool:
    from timeshare.runtime.tree import tensors_in

    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))
