"""Fitting the Salus trace's arrival process to Salus's FIFO row: the search behind
``CALIBRATED`` (NOTE [Salus arrival calibration] in sim/table1.py). Runs in the CLI's
process (``timeshare sim salus --calibrate``).

Only FIFO is simulated here; the other policies never enter the objective.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from timeshare.errors import ConfigError
from timeshare.sim.table1 import (
    CALIBRATION_SEEDS,
    DEFAULT_DEVICES,
    METRICS,
    SALUS_TABLE1,
    SalusPool,
    environment,
    fifo_figures,
    relative_errors,
)
from timeshare.sim.trace import SalusArrivals

log = logging.getLogger(__name__)

HELD_OUT_SEEDS = tuple(range(10, 20))


@dataclass(frozen=True)
class SearchGrid:
    """The values tried for each parameter of ``SalusArrivals.one_knob_mix``."""

    not_short: Sequence[float]
    """Share of 5- and 10-minute jobs."""
    order_correlation: Sequence[float]
    """How strongly longer jobs arrive earlier, 0..1."""
    mean_interarrival_s: Sequence[float]
    """Mean seconds between arrivals (0: all at once)."""

    def __post_init__(self):
        for name in ("not_short", "order_correlation", "mean_interarrival_s"):
            if not len(getattr(self, name)):
                raise ConfigError(f"the search grid needs at least one value of {name}")

    def points(self):
        return itertools.product(self.not_short, self.order_correlation, self.mean_interarrival_s)

    def __len__(self) -> int:
        return len(self.not_short) * len(self.order_correlation) * len(self.mean_interarrival_s)

    def describe(self) -> dict:
        return {"not_short": [float(v) for v in self.not_short],
                "order_correlation": [float(v) for v in self.order_correlation],
                "mean_interarrival_s": [float(v) for v in self.mean_interarrival_s]}


COARSE = SearchGrid(
    not_short=[round(0.05 * i, 2) for i in range(21)],
    order_correlation=[0.0, 0.25, 0.5, 0.75, 1.0],
    mean_interarrival_s=[0.0, 15.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0],
)


def fine_grid(not_short: float, order_correlation: float, mean_interarrival_s: float) -> SearchGrid:
    """A finer grid around a point: +-0.04 by 0.01, +-0.2 by 0.05, +-12 s by 3 s,
    clipped to each parameter's range."""
    def around(center: float, step: float, k: int, lo: float, hi: float) -> list[float]:
        values = {round(min(hi, max(lo, center + i * step)), 4) for i in range(-k, k + 1)}
        return sorted(values)

    return SearchGrid(around(not_short, 0.01, 4, 0.0, 1.0), around(order_correlation, 0.05, 4, 0.0, 1.0),
                      around(mean_interarrival_s, 3.0, 4, 0.0, float("inf")))


def score(errors: dict[str, float]) -> tuple[float, float]:
    """The objective, smaller is better: the largest relative error of FIFO's four
    figures, then the sum of their squares."""
    e = np.abs([errors[m] for m in METRICS])
    return (float(e.max()), float((e * e).sum()))


def evaluate(pool: SalusPool, grid: SearchGrid, *, devices: int, seeds: Sequence[int], jobs: int,
             progress: Callable[[int, int], None] | None = None, cache: dict | None = None) -> list[dict]:
    """FIFO's figures and errors at every point of ``grid``, best first. ``cache``: rows
    already evaluated, by point (filled in)."""
    rows = []
    for k, (q, rho, gap) in enumerate(grid.points()):
        row = cache.get((q, rho, gap)) if cache is not None else None
        if row is None:
            arrivals = SalusArrivals.one_knob_mix(gap, q, rho)
            figures = fifo_figures(pool, arrivals, devices=devices, seeds=seeds, jobs=jobs)
            errors = relative_errors(figures)
            row = {"not_short": q, "order_correlation": rho, "mean_interarrival_s": gap,
                   "fifo": figures, "errors": errors, "score": score(errors)}
            if cache is not None:
                cache[(q, rho, gap)] = row
        rows.append(row)
        if progress is not None:
            progress(k + 1, len(grid))
    rows.sort(key=lambda r: r["score"])
    return rows


def _point(row: dict) -> tuple[float, float, float]:
    return (row["not_short"], row["order_correlation"], row["mean_interarrival_s"])


def calibrate(*, pool: SalusPool | None = None, devices: int = DEFAULT_DEVICES,
              seeds: Sequence[int] = CALIBRATION_SEEDS, jobs: int = 100, coarse: SearchGrid = COARSE,
              refine: bool = True, max_rounds: int = 6, top: int = 10,
              progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Fit ``SalusArrivals.one_knob_mix`` to Salus's FIFO row on ``devices`` devices:
    ``coarse`` first, then (``refine``) fine grids around the best point so far until
    the best is the centre of its fine grid (at most ``max_rounds``). Returns the
    best point with FIFO's figures on the fitted seeds and on held-out ones, the best
    ``top`` points of each stage and the largest average-queuing / makespan ratio seen
    with jobs in random order (NOTE [Salus arrival calibration])."""
    if devices < 1 or jobs < 1 or not seeds:
        raise ConfigError(f"calibration needs devices >= 1, jobs >= 1 and some seeds; got {devices}, {jobs}, {seeds}")
    loaded = pool if pool is not None else SalusPool.load()
    t0 = time.perf_counter()
    rows = evaluate(loaded, coarse, devices=devices, seeds=seeds, jobs=jobs,
                    progress=(lambda i, n: progress("coarse", i, n)) if progress else None)
    random_order = [r for r in rows if r["order_correlation"] == 0.0]
    searched: dict = {"coarse": {"grid": coarse.describe(), "points": len(coarse), "best": rows[:top]}}
    if refine:  # fine grids around the best point until the best is the centre of its own grid
        cache = {_point(r): r for r in rows}
        searched["fine"] = []
        for stage in range(1, max_rounds + 1):
            center = _point(rows[0])
            fine = fine_grid(*center)
            fine_rows = evaluate(loaded, fine, devices=devices, seeds=seeds, jobs=jobs, cache=cache,
                                 progress=(lambda i, n: progress(f"fine {stage}", i, n)) if progress else None)
            searched["fine"].append({"grid": fine.describe(), "points": len(fine), "best": fine_rows[:top]})
            rows = sorted(cache.values(), key=lambda r: r["score"])
            if _point(rows[0]) == center:
                break
        else:
            log.warning("calibration: the best point still moved after %d fine grids", max_rounds)
        random_order = [r for r in cache.values() if r["order_correlation"] == 0.0]
    best = rows[0]
    arrivals = SalusArrivals.one_knob_mix(best["mean_interarrival_s"], best["not_short"], best["order_correlation"])
    held = [s for s in HELD_OUT_SEEDS if s not in set(seeds)]
    held_fifo = fifo_figures(loaded, arrivals, devices=devices, seeds=held, jobs=jobs) if held else None
    ratio = max((r["fifo"]["avg_queuing_min"] / r["fifo"]["makespan_min"] for r in random_order), default=None)
    salus = SALUS_TABLE1["fifo"]
    return {
        "devices": devices, "jobs": jobs, "seeds": list(seeds),
        "targets": salus,
        "objective": "largest |ours/Salus - 1| over FIFO's makespan, avg queuing, avg JCT and p95 JCT "
                     "(each the mean over the seeds); ties: smallest sum of squares",
        "best": {"not_short": best["not_short"], "order_correlation": best["order_correlation"],
                 "mean_interarrival_s": best["mean_interarrival_s"], "length_mix": list(arrivals.length_mix or ()),
                 "fifo": best["fifo"], "errors": best["errors"],
                 "held_out": None if held_fifo is None else {"seeds": held, "fifo": held_fifo,
                                                              "errors": relative_errors(held_fifo)}},
        "search": searched,
        "random_order_max_queuing_over_makespan": ratio,
        "salus_queuing_over_makespan": salus["avg_queuing_min"] / salus["makespan_min"],
        "wall_s": time.perf_counter() - t0, "environment": environment(),
    }
