"""``timeshare bench cluster``: the routing policies on a real local Ray cluster of CPU
replicas (NOTE [Cluster deployment]), and a drill that kills one replica and adds
another while requests flow.

Models are zoo architectures with seeded weights (variants of four small ones); requests
pick a model with Zipf popularity and come from a few concurrent clients. Per policy:
loads per request as the replicas report them (a request whose model was not resident on
its replica), latency percentiles at the client, and every output compared with the
model run alone in this process. The floor is one load per model.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from timeshare.bench.common import outputs_equal
from timeshare.bench.environment import describe
from timeshare.cluster.cluster import REPLICA_CPUS, Cluster, import_ray, start_local_ray
from timeshare.cluster.replica import ModelDef
from timeshare.errors import ConfigError
from timeshare.models.spec import build_module
from timeshare.models.weights import read_weights
from timeshare.models.zoo import weights_path
from timeshare.sim.fleet import COLOURS  # the same colour per policy as sim cluster's plot

ARCHITECTURES = ("tiny_cnn", "tiny_mlp", "small_resnet", "tiny_bert")


@dataclass
class ClusterBenchConfig:
    replicas: int = 3
    models: int = 12
    requests: int = 600
    clients: int = 4
    zipf: float = 1.1
    memory: str = "3MiB"
    policies: tuple[str, ...] = field(default=("random", "ray", "timeshare"))
    drill: bool = True  # add a replica during the first third, kill one at two thirds
    seed: int = 0


def model_defs(count: int) -> list[ModelDef]:
    return [ModelDef(f"m{i}", ARCHITECTURES[i % len(ARCHITECTURES)],
                     str(weights_path(ARCHITECTURES[i % len(ARCHITECTURES)], seed=i)))
            for i in range(count)]


def references(models: list[ModelDef], threads: int = REPLICA_CPUS) -> dict[str, object]:
    """Each model's outputs on its example inputs, computed alone here with plain PyTorch
    on ``threads`` intra-op threads, as a replica computes them (``REPLICA_CPUS``): on the
    CPU the bits depend on the thread count, so a reference on this process's default
    count matched a replica's only where an earlier call had happened to lower it."""
    out = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in models:
            module = build_module(m.name, m.builder())
            if m.weights is not None:
                module.load_state_dict(read_weights(m.weights), strict=True)
            with torch.inference_mode():
                out[m.name] = module.eval()(*m.example_inputs())
    finally:
        torch.set_num_threads(before)
    return out


def trace(config: ClusterBenchConfig) -> list[int]:
    rng = np.random.default_rng(config.seed)
    weights = 1.0 / np.arange(1, config.models + 1) ** config.zipf
    return list(rng.choice(config.models, size=config.requests, p=weights / weights.sum()))


def _drive(cluster: Cluster, models: list[ModelDef], order: list[int], clients: int, refs: dict,
           at: Callable[[int], None] = lambda i: None) -> dict:
    """Send ``order`` from ``clients`` threads; ``at(i)`` runs before request ``i`` is taken."""
    lock = threading.Lock()
    position = 0
    latencies: list[float] = []
    loads = lost = inexact = 0
    served: dict[str, int] = {}
    errors: list[str] = []
    inputs = {m.name: m.example_inputs() for m in models}

    def client() -> None:
        nonlocal position, loads, lost, inexact
        while True:
            with lock:
                if position >= len(order):
                    return
                i = position
                position += 1
            at(i)
            name = models[order[i]].name
            t0 = time.perf_counter()
            try:
                reply = cluster.infer(name, *inputs[name])
            except Exception as exc:
                with lock:
                    lost += 1
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            dt = time.perf_counter() - t0
            exact = outputs_equal(reply.outputs, refs[name])
            with lock:
                latencies.append(dt)
                loads += int(reply.loaded)
                inexact += int(not exact)
                served[reply.replica] = served.get(reply.replica, 0) + 1

    threads = [threading.Thread(target=client, name=f"bench-client-{k}") for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.array(latencies) if latencies else np.full(1, np.nan)  # nothing answered: no latency
    return {
        "requests": len(order), "answered": len(latencies), "lost": lost, "inexact": inexact,
        "loads": loads, "loads_per_request": loads / max(1, len(latencies)),
        "latency_p50_s": float(np.percentile(lat, 50)), "latency_p99_s": float(np.percentile(lat, 99)),
        "latency_mean_s": float(statistics.fmean(lat)), "wall_s": wall, "req_per_s": len(latencies) / wall,
        "served_by": served, "errors": errors[:5], "latencies": latencies,
    }


def run(config: ClusterBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    if config.replicas < 2 or config.models < 1 or config.requests < 1 or config.clients < 1:
        raise ConfigError("bench cluster needs at least 2 replicas, 1 model, 1 request and 1 client")
    models = model_defs(config.models)
    refs = references(models)
    order = trace(config)
    owns = "ray" not in sys.modules or not import_ray().is_initialized()
    ray = start_local_ray(config.replicas + 3) if owns else import_ray()
    rows = []
    try:
        progress(f"starting {config.replicas} replicas")
        with Cluster(models, replicas=config.replicas, memory=config.memory, policy=config.policies[0],
                     seed=config.seed) as cluster:
            for policy in config.policies:  # the same replicas, emptied between policies
                cluster.use_policy(policy)
                progress(f"{policy}: {config.requests} requests")
                row = _drive(cluster, models, order, config.clients, refs)
                row["policy"] = policy
                rows.append(row)
            drill = None
            if config.drill:
                cluster.use_policy("timeshare")
                drill = _drill(cluster, order, models, refs, config.clients, progress)
    finally:
        if owns:
            ray.shutdown()
    by = {r["policy"]: r for r in rows}
    out = {
        "config": {**asdict(config), "policies": list(config.policies)},
        "environment": describe(torch.device("cpu")),
        "ray": ray.__version__,
        "floor_loads_per_request": len(set(order)) / len(order),
        "rows": rows,
        "drill": drill,
        "outputs_exact": all(r["inexact"] == 0 for r in rows) and (drill is None or drill["inexact"] == 0),
    }
    if "timeshare" in by:
        ours = by["timeshare"]["loads_per_request"]
        out["loads_vs"] = {p: (r["loads_per_request"] / ours if ours else None) for p, r in by.items()}
    return out


def _drill(cluster: Cluster, order, models, refs, clients: int, progress) -> dict:
    """timeshare's policy. The first third of the requests flow while one replica is
    added; then the rest, and halfway through them the replica holding the most models
    is killed. Nothing
    may be lost or wrong, and the added one must take load (the killed one's models are
    placed anew, and it is idle and empty)."""
    progress("drill: add a replica while requests flow, then kill the one holding the most models")
    added: dict[str, str] = {}
    adder = threading.Thread(target=lambda: added.setdefault("name", cluster.add_replica()), name="bench-add")
    adder.start()
    first = _drive(cluster, models, order[: len(order) // 3], clients, refs)
    adder.join(timeout=300)
    if "name" not in added:
        raise ConfigError("the replica added in the drill did not start")
    killed: dict[str, str] = {}
    fired = threading.Lock()
    rest = order[len(order) // 3:]

    def at(i: int) -> None:  # the client that reaches the point kills; the others go on
        with fired:
            if i < len(rest) // 2 or killed:
                return
            killed["name"] = ""
        live = [r for r in cluster.status()["replicas"] if r["alive"]]
        victim = max(live, key=lambda r: len(r.get("resident", [])))["replica"]  # the one holding most
        cluster.kill_replica(victim)
        killed["name"] = victim

    second = _drive(cluster, models, rest, clients, refs, at)
    status = cluster.status()
    served = {k: first["served_by"].get(k, 0) + second["served_by"].get(k, 0)
              for k in {*first["served_by"], *second["served_by"]}}
    answered = first["answered"] + second["answered"]
    lat = np.array(first["latencies"] + second["latencies"]) if answered else np.full(1, np.nan)
    return {
        "policy": "timeshare, drill", "requests": len(order), "answered": answered,
        "lost": first["lost"] + second["lost"], "inexact": first["inexact"] + second["inexact"],
        "loads": first["loads"] + second["loads"],
        "loads_per_request": (first["loads"] + second["loads"]) / max(1, answered),
        "latency_p50_s": float(np.percentile(lat, 50)), "latency_p99_s": float(np.percentile(lat, 99)),
        "req_per_s": answered / (first["wall_s"] + second["wall_s"]), "served_by": served,
        "added": added["name"], "added_served": served.get(added["name"], 0), "killed": killed.get("name"),
        "retried": status["retried"], "replicas_lost": status["replicas_lost"],
        "errors": first["errors"] + second["errors"],
    }


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "loads_per_request", "loads per request"),
                           (axes[1], "latency_p99_s", "p99 latency (s)")):
        values = [r[key] for r in rows]
        ax.bar(names, values, color=[COLOURS.get(n, "#999") for n in names])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(label)
    axes[0].axhline(result["floor_loads_per_request"], color="k", ls="--", lw=1, label="floor: one load per model")
    axes[0].legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"local Ray cluster: {c['replicas']} CPU replicas of {c['memory']}, {c['models']} models "
                 f"(Zipf {c['zipf']}), {c['requests']} requests from {c['clients']} clients")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
