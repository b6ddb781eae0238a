"""``timeshare bench switch``: PipeSwitch's Figures 5 and 9 on the device present.

The latency of the first inference after switching from a training task to an
inference task, per model, from the request to the output back in the caller:

- native: the same module in plain PyTorch in the bench's own process (eval, inference
  mode, weights resident, no runtime), inputs from the host and outputs back to it:
  what timeshare's resident path costs over no runtime at all;
- ready: the model resident, nothing to stop (the lower bound of a switch);
- timeshare: a training job runs in a worker; the model is not resident. The switch
  protocol stops the job at its next iteration boundary while a standby loads the model
  pipelined (NOTE [Switch protocol]). Stop, start, load and clean are reported too;
- two_processes: the job is stopped, then a worker process is started for the request
  (no standby): process start, framework import and model construction on the path,
  weights still from the shared host store;
- one_process: one plain process trains, stops, frees its training state, allocates
  the model on the device and copies its weights unpipelined, then runs;
- stop_and_start: the training process is killed and a new one imports torch, builds
  the model, reads its weights file, moves it to the device and runs.

Ready and timeshare are timed in alternating rounds; every output is compared bitwise
with the ready model's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from timeshare.bench.common import (
    cast_inputs,
    native_call,
    native_module,
    outputs_equal,
    pause_job,
    resume_training,
    stats_of,
)
from timeshare.bench.environment import describe
from timeshare.bench.pipeline import DEFAULT_MODELS
from timeshare.device import resolve_device
from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, TimeshareError
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime

BASELINES = ("two_processes", "one_process", "stop_and_start")
SWITCH_TRIES = 5  # NOTE [A switch in every timed sample]


@dataclass
class SwitchBenchConfig:
    models: Sequence[str] = DEFAULT_MODELS
    batch: int | None = None  # default: 8 on CUDA (PipeSwitch's), 1 on the CPU
    dtype: str = "fp32"
    device: str = "auto"
    repeats: int = 10  # ready/timeshare rounds
    warmup: int = 2
    baseline_repeats: int = 3
    baselines: Sequence[str] = BASELINES
    train: str | None = None  # background training "model:batch"; default resnet152:64 on CUDA, tiny_cnn:32 on CPU
    memory: str = "auto"
    copy_delay_s: float = 0.0  # diagnostic (NOTE [Poisoned reloads]): a forgotten wait then surely reads poison


def defaults(device: torch.device, config: SwitchBenchConfig) -> tuple[int, TrainingWorkload]:
    batch = config.batch or (8 if device.type == "cuda" else 1)
    train = TrainingWorkload.parse(config.train or ("resnet152:64" if device.type == "cuda" else "tiny_cnn:32"))
    return batch, train


def run(config: SwitchBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    for b in config.baselines:
        if b not in BASELINES:
            raise ConfigError(f"unknown baseline {b!r}; known: {list(BASELINES)}")
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype)
    batch, train = defaults(device, config)
    results = []
    # poison_evicted: the outputs after loads are checked over NaN, not stale bytes (NOTE [Poisoned reloads])
    with Runtime(device=device, memory=config.memory, workers=2, poison_evicted=True,
                 copy_delay_s=config.copy_delay_s) as rt:
        env = describe(rt.device)
        inputs = {}
        for name in config.models:
            progress(f"{name}: registering")
            zoo = zoo_get(name)
            inputs[name] = cast_inputs(zoo.example_inputs(batch, torch.float32), dtype)
            rt.register(name, zoo.builder, weights_path(name), inputs[name], dtype=dtype)
        job = rt.train("background", **train.train_args(), seed=0)
        try:
            for name in config.models:
                results.append(_measure(rt, job, name, inputs[name], config, batch, train, progress))
        finally:
            job.cancel()
            job.wait(60)
        iteration_ms = job.stats.step_seconds / max(1, job.stats.iterations) * 1e3
    return {
        "benchmark": "switch",
        "config": {"models": list(config.models), "batch": batch, "dtype": config.dtype, "repeats": config.repeats,
                   "warmup": config.warmup, "baseline_repeats": config.baseline_repeats,
                   "baselines": list(config.baselines), "train": str(train),
                   "copy_delay_ms": config.copy_delay_s * 1e3},
        "environment": env,
        "background_training": {"workload": str(train), "mean_iteration_ms": iteration_ms,
                                "iterations": job.stats.iterations},
        "results": results,
    }


def _measure(rt: Runtime, job, name: str, inputs: tuple, config: SwitchBenchConfig, batch: int,
             train: TrainingWorkload, progress) -> dict:
    pause_job(job)
    reference = rt.infer(name, *inputs)  # first load: profiles, in the active worker
    plain = native_module(name, parse_dtype(config.dtype), rt.device)
    ready, native, shared, parts = [], [], [], []
    calls: list = []  # the runtime's record of each call: where a call through a worker spends its time
    rt.subscribe(lambda rec: calls.append(rec) if isinstance(rec, CallRecord) else None)
    breakdown: list[dict] = []
    exact, missed = True, 0
    for round_ in range(config.warmup + config.repeats):
        progress(f"{name}: round {round_ + 1}/{config.warmup + config.repeats}")
        pause_job(job)
        rt.infer(name, *inputs)  # resident
        ms, out = _time_ms(lambda: rt.infer(name, *inputs), rt.device)
        exact &= outputs_equal(out, reference)
        if round_ >= config.warmup:
            ready.append(ms)
            if calls and calls[-1].timings is not None:
                breakdown.append({**dataclasses.asdict(calls[-1].timings), "call_s": ms / 1e3})
        ms, out = _time_ms(functools.partial(native_call, plain, inputs, rt.device), rt.device)
        exact &= outputs_equal(out, reference)
        if round_ >= config.warmup:
            native.append(ms)
        # NOTE [A switch in every timed sample]: the job runs in segments; a request that
        # lands between two of them finds the device free and makes no switch, which
        # would time a plain load. Such a try is thrown away and made again, a few times.
        for _ in range(SWITCH_TRIES):
            rt.evict(name)
            resume_training(job)
            before = len(rt.switches())
            ms, out = _time_ms(lambda: rt.infer(name, *inputs), rt.device)
            exact &= outputs_equal(out, reference)
            switch = _last_switch(rt, before)
            if switch is not None:
                break
            missed += 1
        if round_ >= config.warmup:
            shared.append(ms)
            parts.append(switch)
    del plain
    r: dict[str, Any] = {"model": name, "native": stats_of(native), "ready": stats_of(ready),
                         "timeshare": stats_of(shared), "outputs_match_ready": exact}
    r["native_ms"], r["ready_ms"], r["timeshare_ms"] = (r["native"]["median_ms"], r["ready"]["median_ms"],
                                                        r["timeshare"]["median_ms"])
    r["timeshare_vs_ready"] = r["timeshare_ms"] / r["ready_ms"]
    r["overhead_ms"] = r["timeshare_ms"] - r["ready_ms"]
    r["components_ms"] = {
        k: _median([p[f"{k}_s"] * 1e3 for p in parts if p and p.get(f"{k}_s") is not None])
        for k in ("stop", "start", "load", "clean")
    }
    r["switches_measured"] = sum(1 for p in parts if p)
    r["tries_without_switch"] = missed
    r["ready_breakdown_ms"] = _breakdown(breakdown)
    for baseline in config.baselines:
        samples = []
        for i in range(config.baseline_repeats):
            progress(f"{name}: {baseline} {i + 1}/{config.baseline_repeats}")
            if baseline == "two_processes":
                resume_training(job)
                t0 = time.perf_counter()
                pause_job(job)
                out = rt.infer_in_new_process(name, inputs)
                samples.append((time.perf_counter() - t0) * 1e3)
                exact &= outputs_equal(out, reference)
            else:
                pause_job(job)  # the baseline's own process trains meanwhile
                ms, out = _standalone(baseline, name, batch, config.dtype, train, str(rt.device))
                samples.append(ms)
                exact &= outputs_equal(out, reference)  # its weights loaded strictly, its output bit for bit
        r[baseline] = stats_of(samples)
        r[f"{baseline}_ms"] = r[baseline]["median_ms"]
    r["outputs_match_ready"] = exact
    if "stop_and_start" in config.baselines:
        r["stop_and_start_vs_timeshare"] = r["stop_and_start_ms"] / r["timeshare_ms"]
    rt.evict(name)
    return r


def _breakdown(samples: list[dict]) -> dict:
    """Medians, in ms, of where a resident call through a worker spends its time: the
    worker's parts, the pipe and pickling (round trip less the worker's handling and its
    unpickling) and the controller (the call less the round trip: dispatcher, lock, outputs)."""
    if not samples:
        return {}
    keys = ("call_s", "round_trip_s", "worker_s", "unpickle_s", "upload_s", "forward_s", "to_host_s", "sync_s")
    out = {k[:-2]: _median([s[k] * 1e3 for s in samples if s.get(k) is not None]) for k in keys}
    timed = [s for s in samples if s.get("round_trip_s") is not None and s.get("worker_s") is not None]
    out["pipe_and_pickle"] = _median([(s["round_trip_s"] - s["worker_s"] - (s.get("unpickle_s") or 0.0)) * 1e3
                                      for s in timed])
    out["controller"] = _median([(s["call_s"] - s["round_trip_s"]) * 1e3 for s in timed])
    return out


def _time_ms(fn, device) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()  # outputs come back on the host: the copy synchronizes
    return (time.perf_counter() - t0) * 1e3, out


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _last_switch(rt: Runtime, before: int, timeout_s: float = 60.0) -> dict | None:
    """The switch the last inference made, once the stopped job has reported back; None
    if it made none (the job was not running when the request came)."""
    now = time.monotonic()
    deadline, appear_by = now + timeout_s, now + 2.0
    while time.monotonic() < deadline:
        switches = rt.switches()
        if len(switches) > before:
            if switches[-1]["stop_s"] is not None:
                return switches[-1]
        elif time.monotonic() > appear_by:
            return None
        time.sleep(0.002)
    return None


def _standalone(baseline: str, name: str, batch: int, dtype: str, train: TrainingWorkload,
                device: str) -> tuple[float, object]:
    """One run of a plain-process baseline: milliseconds from the switch request to the
    output, and the output (saved by the process after the timing)."""
    cmd = [sys.executable, "-m", "timeshare.bench.standalone"]
    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory(prefix="timeshare-baseline-") as tmp:
        out_path = os.path.join(tmp, "output.pt")
        ms = _run_standalone(cmd, baseline, name, batch, dtype, train, device, log, out_path)
        return ms, torch.load(out_path)


def _run_standalone(cmd: list[str], baseline: str, name: str, batch: int, dtype: str, train: TrainingWorkload,
                    device: str, log, out_path: str) -> float:
    """Run one baseline's processes; the milliseconds from the switch request to the output."""
    if baseline == "stop_and_start":
        trainer = _start(cmd + ["train", train.model, str(train.batch), device], log)
        try:
            _expect(trainer, "training", log)
            t0 = time.perf_counter()
            trainer.kill()
            trainer.wait(60)
            fresh = _start(cmd + ["serve", name, str(batch), device, dtype, out_path], log)
            try:
                return _answered_ms(fresh, t0, log)
            finally:
                _reap(fresh)
        finally:
            _reap(trainer)
    proc = _start(cmd + ["one-process", train.model, str(train.batch), name, str(batch), device, dtype,
                         out_path], log)
    try:
        _expect(proc, "training", log)
        assert proc.stdin is not None, "_start opens stdin as a pipe"
        t0 = time.perf_counter()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        return _answered_ms(proc, t0, log)
    finally:
        _reap(proc)


def _answered_ms(proc: subprocess.Popen, t0: float, log) -> float:
    """Milliseconds from ``t0`` until ``proc`` says "done"; then wait for it to have saved
    its output (outside the timing)."""
    _expect(proc, "done", log)
    ms = (time.perf_counter() - t0) * 1e3
    _expect(proc, "saved", log)
    return ms


def _start(cmd: list[str], log) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)


def _expect(proc: subprocess.Popen, word: str, log, timeout_s: float = 300.0) -> None:
    assert proc.stdout is not None, "_start opens stdout as a pipe"
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if line != word:
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
        raise TimeshareError(f"baseline process did not say {word!r} (said {line!r}); its stderr:\n{tail}")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()
