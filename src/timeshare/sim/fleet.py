"""``timeshare sim cluster``: routing policies on a fleet of devices serving many models.
Runs in the simulator's process (the CLI).

NOTE [Cluster simulation]
A trace of requests (Poisson arrivals; models drawn with Zipf popularity) is routed by
one policy of NOTE [Fleet routing] (the router's own compiled steps) to devices that each
serve their queue first come, first served. A request whose model is resident takes the
model's ready time; one whose model is not takes its pipelined cold time (and a model
evicted while requests of it were still queued on that device owes one more load, paid
on that device). Each model is a variant of one of three architectures with PipeSwitch's
measured V100 times (batch 8: ready, and the pipelined first inference) and sizes
(../shared/REFERENCES.md); device memory is a V100's 16 GB by default. The offered load
is a fraction of what the fleet serves with every model resident. Reported per policy:
loads per request, latency percentiles, device utilisation (busy seconds over the
fleet's seconds until the last request ends), and the simulator's own wall time. The
runs are independent and compiled code without the GIL: one thread per core runs them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numba
import numpy as np

from timeshare.errors import ConfigError
from timeshare.memory.ephemeral import cores
from timeshare.scheduler.routing import POLICIES, Fleet, choose, place, policy_code, queued

# PipeSwitch's artifact on a V100, batch 8, fp32: ready and pipelined first-inference
# latency (s), bytes moved (../shared/REFERENCES.md).
ARCHITECTURES = {
    "resnet152": (0.03706, 0.04345, 241.4e6),
    "inception_v3": (0.04054, 0.04059, 95.5e6),
    "bert_base": (0.03933, 0.05385, 433.2e6),
}
V100_PCIE3_BYTES_PER_S = 12e9  # what an evicted model's reload costs alone: its bytes over the link


@dataclass
class ClusterSimConfig:
    devices: int = 1000
    models: int = 10_000
    requests: int = 10_000_000
    zipf: float = 1.0
    memory_bytes: int = 16_000_000_000
    load: float = 0.7  # offered load, a fraction of the fleet's capacity with every model resident
    policies: tuple[str, ...] = field(default=tuple(POLICIES))
    ray_max_models: int = 0  # Ray's max_num_models_per_replica; 0: memory over the mean model size
    ray_max_ongoing: float = 5.0
    replicate_margin: float = 4.0  # timeshare's (NOTE [Fleet routing])
    margins: tuple[float, ...] = ()  # also run timeshare at each of these margins (the loads/latency trade)
    seed: int = 0

    def check(self) -> None:
        if self.devices < 1 or self.models < 1 or self.requests < 1:
            raise ConfigError("devices, models and requests must each be at least 1")
        if not 0 < self.load < 1:
            raise ConfigError(f"load must be between 0 and 1 (a fraction of the fleet's capacity), got {self.load}")
        if self.zipf < 0:
            raise ConfigError(f"zipf must be non-negative, got {self.zipf}")
        for p in self.policies:
            policy_code(p)
        if self.memory_bytes < max(a[2] for a in ARCHITECTURES.values()):
            raise ConfigError(f"device memory {self.memory_bytes} bytes holds no model of "
                              f"{max(a[2] for a in ARCHITECTURES.values()):.0f} bytes")


@dataclass
class Workload:
    size: np.ndarray
    compute_s: np.ndarray
    cold_s: np.ndarray
    load_s: np.ndarray
    arrivals: np.ndarray  # [N] seconds, increasing
    models: np.ndarray  # [N] model index, by popularity rank (0 the most popular)


def workload(config: ClusterSimConfig) -> Workload:
    """Models (architecture drawn uniformly per model) and the request trace, seeded."""
    rng = np.random.default_rng(config.seed)
    table = np.array(list(ARCHITECTURES.values()))
    arch = rng.integers(0, len(table), config.models)
    compute, cold, size = table[arch, 0], table[arch, 1], table[arch, 2].astype(np.int64)
    weights = 1.0 / np.arange(1, config.models + 1) ** config.zipf
    cdf = np.cumsum(weights / weights.sum())
    models = np.minimum(np.searchsorted(cdf, rng.random(config.requests)), config.models - 1).astype(np.int32)
    mean_compute = float((weights / weights.sum()) @ compute)
    rate = config.load * config.devices / mean_compute
    arrivals = np.cumsum(rng.exponential(1.0 / rate, config.requests))
    return Workload(size, compute, cold, size / V100_PCIE3_BYTES_PER_S, arrivals, models)


# Not cached on disk as routing's steps are: numba's cache of a function is keyed on its
# own file, and a cached loop would keep running a changed ``routing_steps.py``'s old
# code. Compiled per process (2.6 s on the 2-core VM, the steps loaded from their cache).
@numba.njit(nogil=True)
def _replay(policy, seed, arrivals, models, latency, params, st):
    compute_s, cold_s, capacity, free_at = st[1], st[2], st[4], st[7]
    np.random.seed(seed)
    u = np.empty(4)
    busy = np.zeros(len(capacity))
    loads, owed_loads = 0, 0
    for i in range(len(arrivals)):
        now, m = arrivals[i], models[i]
        for k in range(4):
            u[k] = np.random.random()
        d = choose(policy, m, now, u, params, st)
        if d < 0:  # fits on no device (ClusterSimConfig.check refuses such fleets)
            latency[i] = np.inf
            continue
        resident, owed_s, owed_n = place(m, d, now, params, st)
        service = owed_s + (compute_s[m] if resident else cold_s[m])
        if not resident:
            loads += 1
        owed_loads += owed_n
        finish = max(now, free_at[d]) + service
        queued(d, m, finish, st)
        busy[d] += service
        latency[i] = finish - now
    return loads, owed_loads, busy


def _compile() -> None:
    tiny = Workload(np.array([1], np.int64), np.array([0.001]), np.array([0.002]), np.array([0.001]),
                    np.array([0.0]), np.array([0], np.int32))
    run_policy(ClusterSimConfig(devices=1, models=1, requests=1, memory_bytes=1), tiny, "timeshare")


def run_policy(config: ClusterSimConfig, w: Workload, policy: str, margin: float | None = None) -> dict:
    mean_size = float(w.size.mean())
    max_models = config.ray_max_models or max(1, int(config.memory_bytes // mean_size))
    fleet = Fleet.create(w.size, w.compute_s, w.cold_s, w.load_s, np.full(config.devices, config.memory_bytes),
                         max_models=max_models if policy == "ray" else 0, max_ongoing=config.ray_max_ongoing,
                         replicate_margin=config.replicate_margin if margin is None else margin)
    latency = np.empty(len(w.arrivals))
    t0 = time.perf_counter()
    loads, owed, busy = _replay(policy_code(policy), config.seed, w.arrivals, w.models, latency, fleet.params(),
                                fleet.arrays())
    wall = time.perf_counter() - t0
    span = float(fleet.free_at.max() - w.arrivals[0])
    p50, p99, p999 = np.percentile(latency, [50, 99, 99.9])
    return {
        "policy": policy,
        "loads_per_request": (loads + owed) / len(latency),
        "loads": int(loads), "reloads_owed": int(owed),
        "latency_mean_s": float(latency.mean()), "latency_p50_s": float(p50), "latency_p99_s": float(p99),
        "latency_p999_s": float(p999),
        "utilisation": float(busy.sum() / (config.devices * span)),
        "resident_models_mean_per_device": float(fleet.nmodels.mean()),
        "replicas_of_the_most_popular": int(fleet.nholders[0]),
        "ray_max_models_per_replica": max_models if policy == "ray" else None,
        "replicate_margin": fleet.replicate_margin if policy == "timeshare" else None,
        "wall_s": wall,
    }


def run(config: ClusterSimConfig, progress=lambda s: None) -> dict:
    config.check()
    t0 = time.perf_counter()
    w = workload(config)
    progress(f"trace: {config.requests:,} requests over {w.arrivals[-1]:.0f} s to {config.models:,} models")
    runs = [(p, None) for p in config.policies] + [("timeshare", m) for m in config.margins]
    _compile()  # before any run is timed

    def one(run: tuple[str, float | None]) -> dict:
        row = run_policy(config, w, *run)
        progress(f"{run[0]}{'' if run[1] is None else f', margin {run[1]:g}'}: {row['loads_per_request']:.4f} "
                 f"loads per request, p99 {row['latency_p99_s'] * 1e3:.1f} ms ({row['wall_s']:.1f} s)")
        return row

    # Runs are independent and release the GIL: one thread per core.
    with ThreadPoolExecutor(max_workers=max(1, min(cores(), len(runs)))) as pool:
        done = list(pool.map(one, runs))
    rows, sweep = done[: len(config.policies)], done[len(config.policies):]
    by = {r["policy"]: r for r in rows}
    out = {
        "config": {**asdict(config), "policies": list(config.policies), "margins": list(config.margins)},
        "architectures": {k: {"ready_s": v[0], "cold_s": v[1], "bytes": v[2]} for k, v in ARCHITECTURES.items()},
        "trace_seconds": float(w.arrivals[-1] - w.arrivals[0]),
        "rows": rows,
        "margin_sweep": sweep,
        "wall_s": time.perf_counter() - t0,
    }
    if "timeshare" in by:
        ours = by["timeshare"]["loads_per_request"]
        out["loads_vs"] = {p: (r["loads_per_request"] / ours if ours else None)
                           for p, r in by.items() if p != "timeshare"}
    return out


COLOURS = {"random": "#999", "least-loaded": "#79c", "ray": "#c97", "timeshare": "#4a4"}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [("loads_per_request", "loads per request", True), ("latency_p99_s", "p99 latency (s)", True),
              ("utilisation", "device utilisation", False)]
    for ax, (key, label, log) in zip(axes, panels):
        values = [max(r[key], 1e-6) for r in rows]
        ax.bar(names, values, color=[COLOURS.get(n, "#999") for n in names])
        if log:
            ax.set_yscale("log")
        ax.set_title(label)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    ax = axes[3]  # the trade: loads against tail latency, our margin swept
    for r in rows:
        ax.scatter(r["loads_per_request"], r["latency_p99_s"], label=r["policy"], zorder=3,
                   color=COLOURS.get(r["policy"], "#999"))
    sweep = sorted(result.get("margin_sweep") or [], key=lambda r: r["replicate_margin"])
    if sweep:
        ax.plot([r["loads_per_request"] for r in sweep], [r["latency_p99_s"] for r in sweep], "-o", color="#4a4",
                alpha=0.5, label="timeshare, margin swept")
        for r in sweep:
            ax.annotate(f"{r['replicate_margin']:g}", (r["loads_per_request"], r["latency_p99_s"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loads per request")
    ax.set_ylabel("p99 latency (s)")
    ax.legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"{c['requests']:,} requests, {c['models']:,} models (Zipf {c['zipf']}), {c['devices']:,} devices "
                 f"of {c['memory_bytes'] / 1e9:.0f} GB, offered load {c['load']:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
