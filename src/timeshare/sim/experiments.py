"""The simulator's many-model serving study (Salus's Table 1 is in ``sim/table1.py``).
Runs in the CLI's process; returns plain dicts (the CLI prints and saves them).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from timeshare.errors import ConfigError
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.thrashing import ThrashingDetector
from timeshare.sim.cache import ModelCache
from timeshare.sim.costs import WorkloadCosts
from timeshare.sim.engine import Simulator
from timeshare.sim.trace import serving_trace

log = logging.getLogger(__name__)


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
