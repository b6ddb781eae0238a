"""``timeshare bench tiers``: many zoo-size models, more than host memory holds, served
from disk, host and device memory as one hierarchy (NOTE [Host tier]). Runs in the CLI's
process.

``models`` models (the zoo models named, round robin, each with weights of its own seed)
are registered under a host budget of ``host_fraction`` of their bytes, then requests
with Zipf popularity (exponent ``zipf``, model ranks shuffled) are served one at a time.
Every output is compared bitwise with the model's plain-PyTorch output (computed first,
one model at a time). Reported: registration time and the host memory it took, the
time to profile each requested model once (its first load; an untimed warm-up, after
which every model is back on disk), then for the timed requests: each one's latency by
where its model was (device, host, disk), host drops and fills, device loads and
evictions. Beside them:
- plain PyTorch with the same memory: an LRU cache of loaded modules holding at most the
  host budget plus the arena's bytes; a miss is ``load_file`` + ``load_state_dict`` (the
  module built beforehand, not timed; the file's pages dropped from the page cache first,
  as timeshare's reads drop them: neither gets the page cache as extra memory) and the request;
- the floor: every request at its model's resident (ready) time.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from timeshare.bench.common import native_call, outputs_equal
from timeshare.bench.disk import drop_cached
from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.models.weights import load_strictly
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime
from timeshare.runtime.host_tier import HostTierSnapshot
from timeshare.runtime.observe import RuntimeSnapshot


@dataclass
class TiersBenchConfig:
    models: int = 50
    zoo: Sequence[str] = field(default=("resnet152", "inception_v3", "bert_base"))
    host_fraction: float = 0.2
    requests: int = 300
    zipf: float = 1.0
    batch: int = 1
    device: str = "auto"
    memory: str = "auto"  # the arena
    workers: int = 0
    seed: int = 0


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_s": xs[len(xs) // 2], "p95_s": xs[min(len(xs) - 1, int(len(xs) * 0.95))],
            "mean_s": statistics.fmean(xs)}


def run(config: TiersBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    if config.models < 1 or config.requests < 1 or not 0 < config.host_fraction <= 1 or config.batch < 1:
        raise ConfigError("models and requests must be at least 1, host_fraction in (0, 1], batch at least 1")
    for z in config.zoo:
        zoo_get(z)
    device = resolve_device(config.device)
    names = [f"m{i:02d}" for i in range(config.models)]
    kind = {n: config.zoo[i % len(config.zoo)] for i, n in enumerate(names)}
    seed = {n: i // len(config.zoo) for i, n in enumerate(names)}
    paths = {}
    for i, n in enumerate(names):
        progress(f"weights {i + 1}/{len(names)}")
        paths[n] = weights_path(kind[n], seed=seed[n])
    sizes = {n: paths[n].stat().st_size for n in names}
    total = sum(sizes.values())
    budget = int(total * config.host_fraction)
    inputs = {z: zoo_get(z).example_inputs(config.batch, torch.float32) for z in config.zoo}

    rng = random.Random(config.seed)
    ranked = names[:]
    rng.shuffle(ranked)
    weights = [1 / (r + 1) ** config.zipf for r in range(len(ranked))]
    sequence = rng.choices(ranked, weights=weights, k=config.requests)

    progress("plain PyTorch references")
    reference, ready_s = {}, {}
    for n in sorted(set(sequence)):
        module = zoo_get(kind[n]).build()
        load_strictly(module, load_file(str(paths[n])), n)
        module = module.to(device).eval()
        reference[n] = native_call(module, inputs[kind[n]], device)
        t0 = time.perf_counter()
        native_call(module, inputs[kind[n]], device)
        ready_s[n] = time.perf_counter() - t0
        del module

    progress("plain PyTorch, an LRU of loaded modules in the same memory")
    arena = None
    with Runtime(device, config.memory, host_memory=budget, workers=config.workers) as rt:
        arena = rt.stats()["capacity_bytes"]
        baseline = _plain_lru(sequence, kind, paths, sizes, inputs, device, budget + arena)

        progress("timeshare: registering")
        t0 = time.perf_counter()
        for n in names:
            rt.register(n, zoo_get(kind[n]).builder, paths[n], inputs[kind[n]])
        register_s = time.perf_counter() - t0
        host_after_register = _tier(rt.snapshot()).used
        # Each requested model's first load traces and profiles it (seconds, once per
        # model); done here, untimed, as a deployment warms up, and every model then goes
        # back to disk: the timed requests see the switching, not the profiling.
        t0 = time.perf_counter()
        for i, n in enumerate(sorted(set(sequence))):
            progress(f"timeshare: profiling {i + 1}/{len(set(sequence))}")
            rt.profile(n, *inputs[kind[n]])
            rt.evict(n, host=True)
        profile_s = time.perf_counter() - t0
        start, start_evictions = rt.snapshot(), rt.stats()["evictions"]
        records: list[CallRecord] = []
        rt.subscribe(lambda r: records.append(r) if isinstance(r, CallRecord) else None)
        lat: dict[str, list[float]] = {"device": [], "host": [], "disk": []}
        exact = 0
        for i, n in enumerate(sequence):
            if i % 10 == 0:
                progress(f"timeshare: request {i + 1}/{len(sequence)}")
            before = _tier(rt.snapshot())
            resident = rt.is_resident(n)
            t0 = time.perf_counter()
            out = rt.infer(n, *inputs[kind[n]])
            seconds = time.perf_counter() - t0
            after = _tier(rt.snapshot())
            where = "device" if resident else "disk" if after.fills > before.fills else "host"
            lat[where].append(seconds)
            exact += outputs_equal(out, reference[n])
        snap, stats = rt.snapshot(), rt.stats()
    first, last = dataclasses.asdict(_tier(start)), dataclasses.asdict(_tier(snap))
    host = {k: v - first[k] if k in ("drops", "fills", "streamed_fills", "demotions", "bytes_read", "read_seconds",
                                     "spilled_bytes") else v for k, v in last.items()}
    ours = sum(sum(v) for v in lat.values())
    floor = sum(ready_s[n] for n in sequence)
    return {
        "environment": describe(device),
        "config": {"models": config.models, "zoo": list(config.zoo), "host_fraction": config.host_fraction,
                   "requests": config.requests, "zipf": config.zipf, "batch": config.batch,
                   "workers": config.workers, "seed": config.seed, "memory": config.memory},
        "model_bytes_total": total, "host_budget_bytes": budget, "arena_bytes": arena,
        "distinct_models_requested": len(set(sequence)),
        "register_s": register_s, "host_bytes_after_register": host_after_register, "profile_s": profile_s,
        "requests_exact": exact, "requests": len(sequence),
        "latency": {k: _percentiles(v) for k, v in lat.items()},
        "host_tier": host, "device_loads": sum(snap.loads.values()) - sum(start.loads.values()),
        "device_evictions": stats["evictions"] - start_evictions,
        "timeshare_total_s": ours, "plain_pytorch": baseline, "floor_total_s": floor,
        "speedup_vs_plain": baseline["total_s"] / ours if ours else None,
    }


def _tier(snap: RuntimeSnapshot) -> HostTierSnapshot:
    """The host tier's part of ``snap``: this benchmark's runtime always has a host budget."""
    assert snap.host_tier is not None, "the runtime was opened with host_memory"
    return snap.host_tier


def _plain_lru(sequence: list[str], kind: dict, paths: dict, sizes: dict, inputs: dict, device: torch.device,
               capacity: int) -> dict:
    """What a user without timeshare does with the same memory: modules loaded on demand
    into an LRU cache of at most ``capacity`` bytes, built beforehand (not timed)."""
    cache: OrderedDict[str, torch.nn.Module] = OrderedDict()
    held = 0
    total, misses = 0.0, 0
    for n in sequence:
        if n in cache:
            cache.move_to_end(n)
            t0 = time.perf_counter()
        else:
            misses += 1
            while cache and held + sizes[n] > capacity:
                old, _ = cache.popitem(last=False)
                held -= sizes[old]
            module = zoo_get(kind[n]).build().eval()
            drop_cached(paths[n])  # the same memory: the page cache is not a second cache
            t0 = time.perf_counter()
            load_strictly(module, load_file(str(paths[n])), n)
            cache[n] = module.to(device)
            held += sizes[n]
        native_call(cache[n], inputs[kind[n]], device)
        total += time.perf_counter() - t0
    return {"total_s": total, "misses": misses, "capacity_bytes": capacity}
