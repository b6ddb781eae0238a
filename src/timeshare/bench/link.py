"""``timeshare bench link``: the hardware's ceilings, which every other bench is judged by.

Pinned host-to-device and device-to-host bandwidth for copies from 64 KiB to 1 GiB, both
directions at once (two streams), and a device-to-device copy (bytes read plus bytes
written). On CUDA every copy is timed with device events on the stream that runs it, so
host-side launch cost is not counted as link time; the fixed cost of one copy call is
read off a straight-line fit ``seconds = overhead + bytes / bandwidth`` over the sizes,
and the bench reports both. The floor of loading ``B`` bytes is then
``overhead + B / bandwidth``.

On the CPU backend the "link" is a memory copy between two buffers (the copy thread's
work), timed with the host clock: the same report, useful to check the bench itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.units import format_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)


@dataclass
class LinkBenchConfig:
    device: str = "auto"
    sizes: Sequence[int] = DEFAULT_SIZES
    """Copy sizes in bytes."""
    repeats: int = 20
    """Timed copies per size (the median is reported); at least 3 for sizes over 256 MiB."""
    min_seconds: float = 0.05
    """Small sizes repeat until this much copying was timed."""


def run(config: LinkBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    device = resolve_device(config.device)
    sizes = sorted(int(s) for s in config.sizes)
    if not sizes or sizes[0] <= 0:
        raise ValueError("sizes must be positive byte counts")
    top = sizes[-1]
    timer = _CudaTimer(device) if device.type == "cuda" else _HostTimer()
    host_a = _host_buffer(top, device)
    host_b = _host_buffer(top, device)
    dev_a = torch.empty(top, dtype=torch.uint8, device=device)
    dev_b = torch.empty(top, dtype=torch.uint8, device=device)
    # Real bytes, not zeros (a copy engine never compresses, but keep the habit).
    gen = torch.Generator().manual_seed(0)
    host_a.copy_(torch.randint(0, 256, (top,), dtype=torch.uint8, generator=gen))
    dev_a.copy_(host_a)
    env = describe(device)

    rows = []
    for n in sizes:
        progress(format_bytes(n))
        reps = _repeats(config, n)
        h2d = timer.median(lambda: dev_b[:n].copy_(host_a[:n], non_blocking=True), reps)
        d2h = timer.median(lambda: host_b[:n].copy_(dev_a[:n], non_blocking=True), reps)
        both = timer.median_pair(
            lambda: dev_b[:n].copy_(host_a[:n], non_blocking=True),
            lambda: host_b[:n].copy_(dev_a[:n], non_blocking=True),
            reps,
        )
        d2d = timer.median(lambda: dev_b[:n].copy_(dev_a[:n], non_blocking=True), reps)
        rows.append({
            "bytes": n,
            "repeats": reps,
            "h2d_us": h2d * 1e6,
            "d2h_us": d2h * 1e6,
            "both_us": both * 1e6,
            "d2d_us": d2d * 1e6,
            "h2d_GBps": n / h2d / 1e9,
            "d2h_GBps": n / d2h / 1e9,
            "both_GBps": 2 * n / both / 1e9,
            "d2d_GBps": 2 * n / d2d / 1e9,  # bytes read plus bytes written
        })
    # Exactness of the round trip: a ceiling measured on copies that lose bytes is no ceiling.
    host_b.zero_()
    dev_b.copy_(host_a, non_blocking=True)
    host_b.copy_(dev_b, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    exact = bool(torch.equal(host_a, host_b))
    fits = {k: fit_line([r["bytes"] for r in rows], [r[f"{k}_us"] / 1e6 for r in rows]) for k in ("h2d", "d2h")}
    return {
        "benchmark": "link",
        "config": {"sizes": sizes, "repeats": config.repeats, "min_seconds": config.min_seconds,
                   "pinned": device.type == "cuda", "timer": timer.name},
        "environment": env,
        "results": rows,
        "fit": {k: {"overhead_us": v[0] * 1e6, "bandwidth_GBps": v[1] / 1e9} for k, v in fits.items()},
        "peak": {
            "h2d_GBps": max(r["h2d_GBps"] for r in rows),
            "d2h_GBps": max(r["d2h_GBps"] for r in rows),
            "both_GBps": max(r["both_GBps"] for r in rows),
            "d2d_GBps": max(r["d2d_GBps"] for r in rows),
        },
        "round_trip_exact": exact,
    }


def load_floor_ms(nbytes: int, bandwidth_Bps: float, overhead_s: float, ready_ms: float) -> float:
    """The floor of a first inference, the one definition every bench reports: no loader
    beats the link (a load's fixed overhead plus its bytes over the bandwidth), nor the
    ready model: max(overhead + bytes / bandwidth, ready)."""
    return max((overhead_s + nbytes / bandwidth_Bps) * 1e3, ready_ms)


def floor_ms(nbytes: int, link: dict, ready_ms: float) -> float:
    """``load_floor_ms`` with a ``bench link`` result's host-to-device fit."""
    fit = link["fit"]["h2d"]
    return load_floor_ms(nbytes, fit["bandwidth_GBps"] * 1e9, fit["overhead_us"] / 1e6, ready_ms)


def _repeats(config: LinkBenchConfig, n: int) -> int:
    # Enough copies of a small size to add up to min_seconds at ~25 GB/s, capped.
    by_time = int(config.min_seconds / max(n / 25e9, 1e-6))
    reps = max(config.repeats, min(by_time, 2000))
    return max(3, reps if n <= 256 * MiB else min(reps, max(3, config.repeats // 4)))


def _host_buffer(n: int, device: torch.device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + x / bw`` over the sizes of at least 1 MiB (where the
    intercept is not lost in noise); returns ``(a, bw)``."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x >= MiB] or list(zip(xs, ys, strict=True))
    if len(pts) < 2:
        x, y = pts[0]
        return 0.0, x / y
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - slope * mx
    # Fix the intercept from the smallest size when the fit's is negative (noise).
    if a < 0:
        a = 0.0
    return a, 1.0 / slope


class _CudaTimer:
    """Device-event timing on dedicated streams: start event, the copies, end event."""

    name = "cuda events"

    def __init__(self, device: torch.device):
        self.device = device
        self.s1 = torch.cuda.Stream(device)
        self.s2 = torch.cuda.Stream(device)

    def median(self, fn: Callable[[], object], reps: int) -> float:
        return self.median_pair(fn, None, reps)

    def median_pair(self, f1: Callable[[], object], f2: Callable[[], object] | None, reps: int) -> float:
        out = []
        for i in range(reps + 1):  # the first is a warm-up
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record(self.s1)
            with torch.cuda.device(self.device), torch.cuda.stream(self.s1):
                f1()
            if f2 is not None:
                self.s2.wait_event(start)
                with torch.cuda.device(self.device), torch.cuda.stream(self.s2):
                    f2()
                self.s1.wait_stream(self.s2)
            end.record(self.s1)
            end.synchronize()
            if i:
                out.append(start.elapsed_time(end) / 1e3)
        return statistics.median(out)


class _HostTimer:
    name = "host clock"

    def median(self, fn: Callable[[], object], reps: int) -> float:
        return self.median_pair(fn, None, reps)

    def median_pair(self, f1: Callable[[], object], f2: Callable[[], object] | None, reps: int) -> float:
        out = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            f1()
            if f2 is not None:
                f2()
            if i:
                out.append(time.perf_counter() - t0)
        return statistics.median(out)
