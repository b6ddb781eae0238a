"""The simulator's two studies: Salus's Table 1 and many-model serving. Runs in the
CLI's process; returns plain dicts (the CLI prints and saves them).
"""

from __future__ import annotations

import csv
import logging
import time
from importlib import resources
from pathlib import Path

import numpy as np

from timeshare.errors import ConfigError
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.thrashing import ThrashingDetector
from timeshare.sim.cache import ModelCache
from timeshare.sim.costs import WorkloadCosts
from timeshare.sim.engine import Simulator
from timeshare.sim.trace import salus_trace, serving_trace

log = logging.getLogger(__name__)


# Salus's Table 1 (minutes; 100 jobs, 2 x P100): ../shared/data/README.md
SALUS_TABLE1 = {
    "fifo": {"makespan_min": 303.4, "avg_queuing_min": 167.6, "avg_jct_min": 170.6, "p95_jct_min": 251.1},
    "srtf": {"makespan_min": 306.0, "avg_queuing_min": 28.6, "avg_jct_min": 53.4, "p95_jct_min": 217.0},
    "pack": {"makespan_min": 287.4, "avg_queuing_min": 129.9, "avg_jct_min": 145.5, "p95_jct_min": 266.1},
    "fair": {"makespan_min": 301.6, "avg_queuing_min": 58.5, "avg_jct_min": 96.6, "p95_jct_min": 281.2},
}
SALUS_POLICIES = ("fifo", "srtf", "pack", "fair")


def find_salus_pool(path: str | Path | None = None) -> Path:
    """``path``, or the copy of Salus's job pool that ships with the package."""
    candidate = Path(path) if path else Path(str(resources.files("timeshare.sim") / "data" / "salus-workloads.csv"))
    if candidate.is_file():
        return candidate
    raise ConfigError(f"Salus's job pool not found at {candidate}; pass --pool")


def salus(*, pool: str | Path | None = None, jobs: int = 100, seeds: int = 1, seed: int = 0,
          mean_interarrival_s: float = 90.0, length_mix=(0.85, 0.05, 0.10), capacity_gb: float = 16.0,
          fair_quantum_s: float = 2.0) -> dict:
    """Every policy on the same traces of ``jobs`` jobs from Salus's pool; the first
    seed's table plus, with ``seeds`` > 1, the ratios over seeds."""
    path = find_salus_pool(pool)
    costs = WorkloadCosts.from_salus_csv(path)
    with path.open(newline="") as f:
        iterations = {r["name"]: float(r["iterations"]) for r in csv.DictReader(f)}
    names = sorted(costs.models)
    runs = []
    for s in range(seed, seed + seeds):
        trace = salus_trace(names, iterations, jobs, seed=s, mean_interarrival_s=mean_interarrival_s,
                            length_mix=length_mix)
        per = {}
        for policy in SALUS_POLICIES:
            sched = Scheduler(policy, capacity=int(capacity_gb * 1e9),
                              quantum_s=fair_quantum_s if policy == "fair" else None)
            per[policy] = Simulator(sched, costs).run(trace).report()
        runs.append(per)
    first = runs[0]
    table = {}
    for policy, r in first.items():
        t = r["training"]
        table[policy] = {
            "makespan_min": r["makespan_s"] / 60, "avg_queuing_min": t["avg_queuing_s"] / 60,
            "avg_jct_min": t["avg_jct_s"] / 60, "p95_jct_min": t["p95_jct_s"] / 60,
            "preemptions": r["preemptions"], "utilization": r["utilization"], "unfinished": r["unfinished"],
        }
    jct = {p: np.array([r[p]["training"]["avg_jct_s"] for r in runs]) for p in SALUS_POLICIES}
    span = {p: np.array([r[p]["makespan_s"] for r in runs]) for p in SALUS_POLICIES}
    checks = {
        "srtf_over_fifo_avg_jct": _spread(jct["srtf"] / jct["fifo"]),
        "fair_over_fifo_avg_jct": _spread(jct["fair"] / jct["fifo"]),
        "fair_over_srtf_avg_jct": _spread(jct["fair"] / jct["srtf"]),
        "pack_best_makespan_share": float(np.mean([min(SALUS_POLICIES, key=lambda p: r[p]["makespan_s"]) == "pack"
                                                   for r in runs])),
        "pack_over_fifo_makespan": _spread(span["pack"] / span["fifo"]),
    }
    return {
        "config": {"pool": str(path), "jobs": jobs, "seed": seed, "seeds": seeds,
                   "mean_interarrival_s": mean_interarrival_s, "length_mix": list(length_mix),
                   "capacity_gb": capacity_gb, "fair_quantum_s": fair_quantum_s, "devices": 1},
        "table": table, "salus_table1": SALUS_TABLE1, "over_seeds": checks,
    }


def _spread(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max()), "n": int(len(values))}


SERVING_MODES = ("lru", "clock", "second_chance", "working_set", "cost", "lru+thrash", "lru_count", "stop_and_start")


def serving(*, costs: WorkloadCosts, models: int = 50, requests: int = 100_000, rate_per_s: float | None = None,
            zipf_s: float = 1.0, fit_models: int = 5, slo_factor: float = 10.0, seed: int = 0,
            policy: str = "edf", max_batch: int = 8, modes=SERVING_MODES) -> dict:
    """Many models with Zipf popularity on a device that holds ``fit_models`` of them
    (by bytes: ``fit_models`` x the mean size), each eviction policy against an
    LRU-by-count cache (Ray Serve: as many models as fit at the largest size) and a
    process swap per model change (stop-and-start). SLO: ``slo_factor`` x the model's
    ready latency at batch 1."""
    cm = costs.variants(models)
    names = sorted(cm.models)
    sizes = np.array([cm[n].nbytes for n in names])
    if not sizes.all():
        raise ConfigError("the serving study needs model sizes in the cost model (bench pipeline JSON)")
    capacity = int(fit_models * sizes.mean())
    per_count = max(1, int(capacity // sizes.max()))
    if rate_per_s is None:  # half the device's capacity at batch 1 on resident models
        rate_per_s = 0.5 / float(np.mean([cm[n].unit_s for n in names]))
    slo = {n: slo_factor * cm[n].unit_s for n in names}
    trace = serving_trace(names, requests, rate_per_s=rate_per_s, zipf_s=zipf_s, seed=seed, slo_s=slo)
    results = {}
    for mode in modes:
        restart = mode == "stop_and_start"
        detector = ThrashingDetector() if mode.endswith("+thrash") else None
        if mode == "lru_count":
            cache = ModelCache(max_models=per_count, policy="lru")
        elif restart:
            cache = ModelCache(max_models=1, policy="lru")
        else:
            cache = ModelCache(capacity=capacity, policy=mode.split("+")[0], detector=detector)
        sched = Scheduler(policy, max_batch=max_batch)
        t0 = time.perf_counter()
        r = Simulator(sched, cm, cache=cache, restart=restart).run(trace).report()
        r["wall_s"] = time.perf_counter() - t0
        results[mode] = r
        log.info("serving %s: %.1f s", mode, r["wall_s"])
    return {
        "config": {"models": models, "requests": requests, "rate_per_s": rate_per_s, "zipf_s": zipf_s,
                   "fit_models": fit_models, "capacity_bytes": capacity, "lru_count_models": per_count,
                   "slo_factor": slo_factor, "seed": seed, "policy": policy, "max_batch": max_batch,
                   "costs": cm.source},
        "results": results,
    }


def plot_salus(result: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("makespan_min", "avg_queuing_min", "avg_jct_min", "p95_jct_min")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, table) in zip(axes, (("timeshare sim", result["table"]), ("Salus Table 1", SALUS_TABLE1))):
        x = np.arange(len(metrics))
        for i, p in enumerate(SALUS_POLICIES):
            ax.bar(x + i * 0.2 - 0.3, [table[p][m] for m in metrics], 0.2, label=p.upper())
        ax.set_xticks(x, [m.replace("_min", "") for m in metrics])
        ax.set_ylabel("minutes")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serving(result: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["results"])
    rs = [result["results"][m] for m in modes]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(modes, [r["inference"]["p99_ms"] for r in rs])
    axes[0].set_yscale("log")
    axes[0].set_title("p99 latency (ms, log)")
    axes[1].bar(modes, [100 * (r["inference"]["slo_attainment"] or 0) for r in rs])
    axes[1].set_title("SLO attainment (%)")
    axes[2].bar(modes, [r["loads"] for r in rs])
    axes[2].set_title("model loads")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
