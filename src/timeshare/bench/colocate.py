"""``timeshare bench colocate``: inference requests next to a training job on the real
runtime, under FIFO time-slicing and under priority preemption (SwitchFlow's
experiment). Runs in the CLI's process (and the runtime's workers, if any).

Requests arrive open-loop (Poisson, seeded) while a training job runs without end.
  * fifo: the runtime's scheduler serves calls and the job in arrival order, and the
    job keeps the device for a time slice (``time_slice_s``) before waiting requests
    get it;
  * priority: requests are latency-critical and preempt the job at its next iteration
    boundary (NOTE [Preemption points]).
Reported: request latency p50/p95/p99 (from the scheduled arrival to the output, so
queueing counts), the job's throughput against the same job alone, and whether every
output equals the ready model's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from timeshare.bench.common import outputs_equal
from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.facade import Runtime

MODES = ("fifo", "priority")


@dataclass
class ColocateBenchConfig:
    model: str = "tiny_bert"
    batch: int = 1
    device: str = "auto"
    train: str | None = None  # default: resnet152:64 on CUDA, tiny_cnn:32 on the CPU
    duration_s: float = 20.0  # of requests, per mode
    rate_per_s: float | None = None  # default: requests take ~10% of the device
    time_slice_s: float = 0.1
    workers: int = 0
    memory: str = "auto"
    seed: int = 0
    modes: tuple[str, ...] = field(default=MODES)


def run(config: ColocateBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    for m in config.modes:
        if m not in MODES:
            raise ConfigError(f"unknown colocate mode {m!r}; known: {list(MODES)}")
    if config.duration_s <= 0 or config.time_slice_s <= 0 or config.batch < 1:
        raise ConfigError("duration_s and time_slice_s must be positive, batch at least 1")
    device = resolve_device(config.device)
    train = TrainingWorkload.parse(config.train or ("resnet152:64" if device.type == "cuda" else "tiny_cnn:32"))
    zoo = zoo_get(config.model)
    inputs = zoo.example_inputs(config.batch)

    progress("training alone")
    alone, ready_s, reference, env = _alone(config, device, train, zoo, inputs)
    rate = config.rate_per_s or min(50.0, 0.1 / ready_s)
    rng = np.random.default_rng(config.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * config.duration_s * 2) + 10))
    arrivals = arrivals[arrivals < config.duration_s]
    modes = {}
    for mode in config.modes:
        progress(f"{mode}: {len(arrivals)} requests at {rate:.1f}/s next to training")
        modes[mode] = _colocated(config, device, train, zoo, inputs, mode, arrivals, reference)
        modes[mode]["training_fraction"] = modes[mode]["training_it_per_s"] / alone
    result = {
        "benchmark": "colocate",
        "config": {**{k: v for k, v in vars(config).items() if k != "modes"}, "modes": list(config.modes),
                   "train": str(train), "rate_per_s": rate, "requests": int(len(arrivals))},
        "environment": env,
        "ready_ms": ready_s * 1e3,
        "training_alone_it_per_s": alone,
        "modes": modes,
    }
    if "fifo" in modes and "priority" in modes:
        result["p95_fifo_over_priority"] = modes["fifo"]["p95_ms"] / modes["priority"]["p95_ms"]
    return result


def _runtime(config, device, mode: str) -> Runtime:
    kw = dict(scheduling="fifo", time_slice_s=config.time_slice_s) if mode == "fifo" else dict(scheduling="priority")
    return Runtime(device=device, memory=config.memory, workers=config.workers, **kw)


def _alone(config, device, train, zoo, inputs):
    with _runtime(config, device, "priority") as rt:
        env = describe(rt.device)
        rt.register(config.model, zoo.builder, weights_path(config.model), inputs)
        reference = rt.infer(config.model, *inputs)
        samples = []
        for _ in range(20):
            t0 = time.perf_counter()
            rt.infer(config.model, *inputs)
            samples.append(time.perf_counter() - t0)
        ready = float(np.median(samples))
        job = rt.train("background", **train.train_args(), seed=0)
        try:
            rate = _throughput(job, min(config.duration_s, 10.0))
        finally:
            job.cancel()
            job.wait(60)
    return rate, ready, reference, env


def _throughput(job, seconds: float, warmup_s: float = 1.0) -> float:
    deadline = time.monotonic() + 60
    while job.stats.iterations < 2:  # built and past its first iterations
        if time.monotonic() > deadline or job.wait(0):
            raise ConfigError(f"background training did not start: {job.error or job.status}")
        time.sleep(0.01)
    time.sleep(warmup_s)
    i0, t0 = job.stats.iterations, time.perf_counter()
    time.sleep(seconds)
    return (job.stats.iterations - i0) / (time.perf_counter() - t0)


def _colocated(config, device, train, zoo, inputs, mode, arrivals, reference) -> dict:
    with _runtime(config, device, mode) as rt:
        rt.register(config.model, zoo.builder, weights_path(config.model), inputs)
        rt.infer(config.model, *inputs)  # resident and profiled, as a served model is
        job = rt.train("background", **train.train_args(), seed=0)
        try:
            _throughput(job, 0.0)
            latencies = np.full(len(arrivals), np.nan)
            exact = [True]
            lock = threading.Lock()

            def request(k: int, due: float) -> None:
                out = rt.infer(config.model, *inputs)
                latencies[k] = time.perf_counter() - due
                if not outputs_equal(out, reference):
                    with lock:
                        exact[0] = False

            i0, t0 = job.stats.iterations, time.perf_counter()
            with ThreadPoolExecutor(max_workers=16, thread_name_prefix="colocate-client") as pool:
                futures = []
                for k, at in enumerate(arrivals):
                    due = t0 + float(at)
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    futures.append(pool.submit(request, k, due))
                for f in futures:
                    f.result(timeout=300)
            elapsed = time.perf_counter() - t0
            iterations = job.stats.iterations - i0
        finally:
            job.cancel()
            job.wait(60)
        lat_ms = latencies * 1e3
        return {
            "p50_ms": float(np.percentile(lat_ms, 50)), "p95_ms": float(np.percentile(lat_ms, 95)),
            "p99_ms": float(np.percentile(lat_ms, 99)), "mean_ms": float(lat_ms.mean()),
            "max_ms": float(lat_ms.max()), "training_it_per_s": iterations / elapsed,
            "training_preemptions": job.stats.preemptions, "outputs_match_ready": exact[0],
        }

