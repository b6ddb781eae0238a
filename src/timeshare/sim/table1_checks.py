"""Targeted simulations behind docs/table1.md: where our Table 1 differs from Salus's,
these measure why. Runs in the CLI's process (``timeshare sim salus --explain``).

Three measurements, all on the traces of the calibrated arrival process unless said:
  * variants: each policy without the memory model (every job admitted at once), and
    SRTF and FAIR work-conserving (Salus ran SRTF so): as many jobs at once as memory
    lanes allow, or two at once, with and without the memory model;
  * the FIFO-consistent region: every point of a grid around the fit whose FIFO figures
    are all within ``tolerance`` of Salus's, with the other policies run there, so
    that a claim can be told apart from an accident of the one fitted point;
  * FIFO's queuing / makespan ratio with jobs in random order, against Salus's 0.552
    (NOTE [Salus arrival calibration]).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from timeshare.sim.calibrate import SearchGrid, evaluate
from timeshare.sim.table1 import (
    CALIBRATION_SEEDS,
    METRICS,
    SALUS_POLICIES,
    SALUS_TABLE1,
    SalusPool,
    calibrated_arrivals,
    criteria,
    environment,
    run_policy,
)
from timeshare.sim.trace import SalusArrivals

Progress = Callable[[str, int, int], None]

VARIANTS: dict[str, tuple[str, dict]] = {
    "srtf, no memory model": ("srtf", {"capacity_gb": None}),
    "srtf, two shortest at once, no memory model": ("srtf", {"capacity_gb": None, "slots": 2}),
    "srtf, work-conserving in lanes": ("srtf", {"slots": math.inf}),
    "srtf, two at once in lanes": ("srtf", {"slots": 2}),
    "fair, work-conserving in lanes": ("fair", {"slots": math.inf}),
    "fair, no memory model": ("fair", {"capacity_gb": None}),
    "fair, 32 GB": ("fair", {"capacity_gb": 32.0}),
    "pack, 32 GB": ("pack", {"capacity_gb": 32.0}),
}


def _table(pool: SalusPool, arrivals: SalusArrivals, runs: dict[str, tuple[str, dict]], *, devices: int,
           seeds: Sequence[int]) -> dict[str, dict]:
    per: dict[str, list[dict]] = {name: [] for name in runs}
    for s in seeds:
        trace = pool.trace(arrivals, seed=s)
        for name, (policy, options) in runs.items():
            per[name].append(run_policy(pool, policy, trace, devices=devices, **options))
    return {name: {k: float(np.mean([r[k] for r in rows])) for k in (*METRICS, "preemptions")}
            for name, rows in per.items()}


def variants(pool: SalusPool, *, devices: int, seeds: Sequence[int] = CALIBRATION_SEEDS) -> dict:
    """The four policies as calibrated, and ``VARIANTS``, on the same traces."""
    runs = {p: (p, {}) for p in SALUS_POLICIES} | VARIANTS
    return _table(pool, calibrated_arrivals(devices), runs, devices=devices, seeds=seeds)


def region_grid(arrivals: SalusArrivals) -> SearchGrid:
    """not_short within 0.08 of the fit by 0.02, every order correlation by 0.1, mean
    inter-arrival 0-90 s by 6 s."""
    assert arrivals.length_mix is not None, "the calibrated family has a length mix"
    q = round(1.0 - arrivals.length_mix[0], 4)
    return SearchGrid(sorted({round(min(1.0, max(0.0, q + 0.02 * i)), 4) for i in range(-4, 5)}),
                      [round(0.1 * i, 1) for i in range(11)], [6.0 * i for i in range(16)])


def fifo_consistent_region(pool: SalusPool, *, devices: int, seeds: Sequence[int] = CALIBRATION_SEEDS,
                           tolerance: float = 0.10, grid: SearchGrid | None = None,
                           progress: Progress | None = None) -> dict:
    """Table 1's claims at every grid point whose four FIFO figures are all within
    ``tolerance`` of Salus's: how many points, and each claim's range and share."""
    grid = grid or region_grid(calibrated_arrivals(devices))
    rows = evaluate(pool, grid, devices=devices, seeds=seeds, jobs=100,
                    progress=(lambda i, n: progress("region: FIFO", i, n)) if progress else None)
    inside = [r for r in rows if r["score"][0] <= tolerance]
    points = []
    for k, r in enumerate(inside):
        arrivals = SalusArrivals.one_knob_mix(r["mean_interarrival_s"], r["not_short"], r["order_correlation"])
        per: dict[str, list[dict]] = {p: [] for p in SALUS_POLICIES}
        for s in seeds:
            trace = pool.trace(arrivals, seed=s)
            for p in SALUS_POLICIES:
                per[p].append(run_policy(pool, p, trace, devices=devices))
        table = {p: {m: float(np.mean([x[m] for x in v])) for m in METRICS} for p, v in per.items()}
        c = criteria(table, per)
        points.append({"not_short": r["not_short"], "order_correlation": r["order_correlation"],
                       "mean_interarrival_s": r["mean_interarrival_s"], "fifo_worst_error": r["score"][0],
                       "srtf_over_fifo": c["srtf_avg_jct_at_most_a_third_of_fifo"]["ratio"],
                       "fair_position": c["fair_between_srtf_and_fifo"]["position"],
                       "pack_best": c["pack_best_makespan"]["holds"]})
        if progress is not None:
            progress("region: all policies", k + 1, len(inside))

    def summary(key: str, holds: Callable[[float], bool]) -> dict:
        v = np.array([p[key] for p in points], dtype=float)
        return {"min": float(v.min()), "max": float(v.max()), "share_holding": float(np.mean([holds(x) for x in v]))}

    out: dict = {"grid": grid.describe(), "grid_points": len(grid), "tolerance": tolerance,
                 "fifo_consistent_points": len(points), "seeds": list(seeds)}
    if points:
        out |= {"srtf_over_fifo": summary("srtf_over_fifo", lambda x: x <= 1 / 3),
                "fair_position": summary("fair_position", lambda x: 0 < x < 1),
                "pack_best_share": float(np.mean([p["pack_best"] for p in points])),
                "lowest_srtf_over_fifo": min(points, key=lambda p: p["srtf_over_fifo"]),
                "points": points}
    return out


def random_order_queuing(pool: SalusPool, *, not_short: float, mean_interarrival_s: float,
                         seeds: Sequence[int] = range(300)) -> dict:
    """FIFO's average queuing over its makespan, one device, jobs in random order."""
    arrivals = SalusArrivals.one_knob_mix(mean_interarrival_s, not_short, 0.0)
    runs = [run_policy(pool, "fifo", pool.trace(arrivals, seed=s), devices=1) for s in seeds]
    r = np.array([x["avg_queuing_min"] / x["makespan_min"] for x in runs])
    salus = SALUS_TABLE1["fifo"]["avg_queuing_min"] / SALUS_TABLE1["fifo"]["makespan_min"]
    return {"not_short": not_short, "mean_interarrival_s": mean_interarrival_s, "traces": len(r),
            "mean": float(r.mean()), "std": float(r.std(ddof=1)), "max": float(r.max()),
            "share_reaching_salus": float((r >= salus).mean()), "salus": salus}


def explain(pool: SalusPool, *, devices: int, seeds: Sequence[int] = CALIBRATION_SEEDS,
            progress: Progress | None = None) -> dict:
    """All three measurements for ``devices`` devices."""
    t0 = time.perf_counter()
    arrivals = calibrated_arrivals(devices)
    assert arrivals.length_mix is not None
    q = round(1.0 - arrivals.length_mix[0], 4)
    out = {"devices": devices, "seeds": list(seeds), "variants": variants(pool, devices=devices, seeds=seeds),
           "fifo_consistent_region": fifo_consistent_region(pool, devices=devices, seeds=seeds, progress=progress)}
    if devices == 1:
        out["random_order_queuing"] = [random_order_queuing(pool, not_short=q, mean_interarrival_s=gap)
                                       for gap in (0.0, arrivals.mean_interarrival_s)]
    out["wall_s"] = time.perf_counter() - t0
    out["environment"] = environment()
    return out
