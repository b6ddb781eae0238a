"""``timeshare bench cycles``: PipeSwitch's Figure 6 on the device present.

An inference task and a training task take turns on the device. Every scheduling
cycle the training job runs for the cycle length; then inference requests run back to
back for the cycle length, the first one paying the switch (the job is stopped at its
next iteration boundary while a standby loads the model, NOTE [Switch protocol]). By
default the model is evicted at every training turn, as in PipeSwitch, where training
took the whole device memory. The result is the inference throughput over its turns
(requests / time from the first request to the last output) as a fraction of the ready
model's, measured back to back with the job paused for as long, right after each turn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from timeshare.bench.common import cast_inputs, outputs_equal, pause_job, resume_training
from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.dtypes import parse_dtype
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.facade import Runtime


@dataclass
class CyclesBenchConfig:
    model: str = "resnet152"
    batch: int | None = None  # default: 8 on CUDA, 1 on the CPU
    dtype: str = "fp32"
    device: str = "auto"
    cycles: Sequence[float] = (1, 2, 5, 10, 30)
    rounds: int = 2
    evict: bool = True
    train: str | None = None
    memory: str = "auto"
    copy_delay_s: float = 0.0  # diagnostic (NOTE [Poisoned reloads]): a forgotten wait then surely reads poison
    min_inference_s: float = 20.0  # short cycles get more rounds, so each length gets this much inference


def run(config: CyclesBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype)
    batch = config.batch or (8 if device.type == "cuda" else 1)
    train = TrainingWorkload.parse(config.train or ("resnet152:64" if device.type == "cuda" else "tiny_cnn:32"))
    name = config.model
    zoo = zoo_get(name)
    inputs = cast_inputs(zoo.example_inputs(batch, torch.float32), dtype)
    results = []
    # poison_evicted (NOTE [Poisoned reloads]): the bench evicts before each training turn,
    # outside the timed inference turns, so the poison costs the throughput nothing and the
    # exactness check reads NaN, not stale bytes, wherever a load forgot to wait.
    with Runtime(device=device, memory=config.memory, workers=2, poison_evicted=True,
                 copy_delay_s=config.copy_delay_s) as rt:
        env = describe(rt.device)
        progress(f"{name}: registering")
        rt.register(name, zoo.builder, weights_path(name), inputs, dtype=dtype)
        job = rt.train("background", **train.train_args(), seed=0)
        try:
            pause_job(job)
            reference = rt.infer(name, *inputs)  # first load and profile
            for _ in range(2):  # warm up the pipelined path and the resident one
                rt.evict(name)
                rt.infer(name, *inputs)
            exact = True
            all_ready_n, all_ready_s = 0, 0.0
            for cycle in config.cycles:
                total_n, total_s, switches = 0, 0.0, 0
                ready_n, ready_s = 0, 0.0
                rounds = max(config.rounds, math.ceil(config.min_inference_s / cycle))
                for round_ in range(rounds):
                    if round_ % 2:  # the ready turn first every other round: drift hits both alike
                        progress(f"cycle {cycle:g} s: round {round_ + 1}/{rounds}, ready")
                        n, elapsed, ok = _serve(rt, name, inputs, reference, cycle)
                        exact &= ok
                        ready_n, ready_s = ready_n + n, ready_s + elapsed
                    progress(f"cycle {cycle:g} s: round {round_ + 1}/{rounds}, training")
                    if config.evict:
                        rt.evict(name)
                    before = len(rt.switches())
                    resume_training(job, iterations=1)
                    time.sleep(max(0.0, cycle - 0.0))
                    progress(f"cycle {cycle:g} s: round {round_ + 1}/{rounds}, inference")
                    # Inference's turn: its first request preempts the job (the switch), which
                    # then stays stopped for the rest of the turn.
                    job.hold()
                    n, elapsed, ok = _serve(rt, name, inputs, reference, cycle)
                    pause_job(job)  # stopped by the first request; waits until it is parked
                    exact &= ok
                    total_n, total_s = total_n + n, total_s + elapsed
                    switches += len(rt.switches()) - before
                    if round_ % 2 == 0:  # the ready model for as long (job paused, model resident)
                        progress(f"cycle {cycle:g} s: round {round_ + 1}/{rounds}, ready")
                        n, elapsed, ok = _serve(rt, name, inputs, reference, cycle)
                        exact &= ok
                        ready_n, ready_s = ready_n + n, ready_s + elapsed
                rps, ready_rps = total_n / total_s, ready_n / ready_s
                all_ready_n, all_ready_s = all_ready_n + ready_n, all_ready_s + ready_s
                results.append({"cycle_s": cycle, "rounds": rounds, "requests": total_n, "inference_s": total_s,
                                "rps": rps, "ready_rps": ready_rps, "fraction_of_ready": rps / ready_rps,
                                "switches": switches})
        finally:
            job.cancel()
            job.wait(60)
    return {
        "benchmark": "cycles",
        "config": {"model": name, "batch": batch, "dtype": config.dtype, "cycles": list(config.cycles),
                   "rounds": config.rounds, "min_inference_s": config.min_inference_s,
                   "evict": config.evict, "train": str(train),
                   "copy_delay_ms": config.copy_delay_s * 1e3},
        "environment": env,
        "ready_rps": all_ready_n / all_ready_s,
        "outputs_match_ready": exact,
        "results": results,
    }


def _serve(rt: Runtime, name: str, inputs: tuple, reference, seconds: float) -> tuple[int, float, bool]:
    """Requests back to back until ``seconds`` have passed: (count, elapsed, all exact)."""
    exact = True
    n = 0
    t0 = time.perf_counter()
    while True:
        out = rt.infer(name, *inputs)
        exact &= outputs_equal(out, reference)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n, elapsed, exact
