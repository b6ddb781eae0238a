"""What the latency benchmarks share: statistics of samples, exact output comparison,
the plain-PyTorch (native) baseline, and holding the background training job still or
letting it run. Runs in the benchmark's process."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from timeshare.device import synchronize
from timeshare.errors import TimeshareError
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.tree import map_tensors, tensors_in


def outputs_equal(a, b) -> bool:
    """Bitwise: as many tensors, each of the same shape and bits."""
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def stats_of(samples: list[float]) -> dict:
    """Median, quartiles, minimum and the samples, in ms."""
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
    return {
        "median_ms": statistics.median(samples),
        "p25_ms": q[0],
        "p75_ms": q[2],
        "iqr_ms": q[2] - q[0],
        "min_ms": min(samples),
        "samples_ms": samples,
    }


def cast_inputs(inputs: tuple, dtype) -> tuple:
    return tuple(t.to(dtype) if t.is_floating_point() and dtype is not None else t for t in inputs)


def native_module(name: str, dtype, device: torch.device) -> torch.nn.Module:
    """The zoo model in plain PyTorch: built, its weights file loaded strictly, moved to
    the device, eval mode. What a user without timeshare runs with weights resident."""
    from timeshare.models.weights import load_strictly, read_weights

    module = zoo_get(name).build()
    load_strictly(module, read_weights(weights_path(name)), name)
    if dtype is not None:
        module = module.to(dtype)
    return module.to(device).eval()


def native_call(module: torch.nn.Module, inputs: tuple, device: torch.device):
    """One inference as the runtime's caller sees it: inputs from the host, outputs back."""
    with torch.inference_mode():
        out = module(*(t.to(device, non_blocking=True) for t in inputs))
        return map_tensors(out, lambda t: t.cpu())


def pause_job(job, timeout_s: float = 120.0) -> None:
    """Stop the background job at its next preemption point and wait until it has."""
    job.pause()
    deadline = time.monotonic() + timeout_s
    while job.status != "paused":
        if job.wait(0):
            raise TimeshareError(f"the background training job ended: {job.status} ({job.error})")
        if time.monotonic() > deadline:
            raise TimeshareError(f"the background training job did not stop within {timeout_s:g} s")
        time.sleep(0.002)


def resume_training(job, iterations: int = 3, timeout_s: float = 120.0) -> None:
    """Let the background job run a few iterations, so that a switch finds it mid-run."""
    start = job.stats.iterations
    job.resume()
    deadline = time.monotonic() + timeout_s
    while job.stats.iterations < start + iterations:
        if job.wait(0):
            raise TimeshareError(f"the background training job ended: {job.status} ({job.error})")
        if time.monotonic() > deadline:
            raise TimeshareError(f"the background training job made no progress within {timeout_s:g} s")
        time.sleep(0.001)


def batch_rate(seqs: list) -> float:
    """Decode tokens per second of generations that ran together: their tokens after the
    first, from the last first token to the last token (the prefills left out)."""
    start = max(s.first_token_at for s in seqs)
    end = max(s.last_token_at for s in seqs)
    tokens = sum(len(s.tokens) - 1 for s in seqs)
    return tokens / (end - start) if end > start else float("nan")


def plain_generate(module: Any, device: torch.device, prompt: list[int], rows: int, k: int, *, exactly: bool,
                   **extra: Any) -> torch.Tensor:
    """``transformers``' greedy ``generate`` of ``rows`` copies of ``prompt``, ``k`` new tokens
    (``exactly``: no end before them); ``extra`` to ``generate`` (PEFT's ``adapter_names``)."""
    ids = torch.tensor([prompt] * rows, device=device)
    return module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                           pad_token_id=0, **({"min_new_tokens": k} if exactly else {}), **extra)


def plain_rate(module: Any, device: torch.device, prompt: list[int], rows: int, n: int, **extra: Any) -> float:
    """Decode tokens per second of ``plain_generate``: ``n`` tokens against one, the
    prefill's time falling out. The one-token run is timed before and after, its shorter
    time kept: a hiccup in a single short run made the difference negative (seen in CI
    with a tiny model, 6 tokens)."""
    t: dict[int, float] = {}
    for k in (1, n, 1):
        synchronize(device)
        t0 = time.perf_counter()
        plain_generate(module, device, prompt, rows, k, exactly=True, **extra)
        synchronize(device)
        t[k] = min(t.get(k, math.inf), time.perf_counter() - t0)
    return rows * (n - 1) / (t[n] - t[1])
