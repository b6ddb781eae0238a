"""``timeshare bench scheduler``: how fast the scheduler decides and how fast the
simulator replays. Runs in the CLI's process; no device.

  * decision: with ``queued`` tasks waiting (training jobs and requests, mixed
    priorities and deadlines), the running task finishes or is preempted, a new task
    arrives, and ``schedule(now)`` picks what runs next; each call is timed;
  * replay: ``requests`` requests of the serving study through the simulator.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from timeshare.bench.environment import describe
from timeshare.errors import ConfigError
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.policies import POLICIES
from timeshare.scheduler.task import Finished, Kind, Priority, Run, Stopped, Task
from timeshare.sim.costs import WorkloadCosts


@dataclass
class SchedulerBenchConfig:
    queued: int = 1000
    decisions: int = 20_000
    requests: int = 1_000_000
    costs: tuple[str, ...] = ()  # bench pipeline JSON (b1[, b8[, switch]]); empty: the committed CPU results
    seed: int = 0


def _task(i: int, now: float, rng: random.Random) -> Task:
    gb = 1 << 30
    if rng.random() < 0.5:
        return Task(i, Kind.TRAINING, f"job{i % 50}", now, rng.randint(10, 10_000), rng.uniform(0.01, 1.0),
                    Priority.BEST_EFFORT, persistent=rng.randint(gb // 10, gb), ephemeral=rng.randint(gb // 2, 4 * gb))
    return Task(i, Kind.INFERENCE, f"m{i % 50}", now, 1, rng.uniform(0.005, 0.2), Priority.LATENCY_CRITICAL,
                now + rng.uniform(0.05, 2.0), persistent=rng.randint(gb // 10, gb), ephemeral=rng.randint(gb // 20, gb))


def decision_latency(policy: str, queued: int, decisions: int, seed: int) -> dict:
    rng = random.Random(seed)
    # Salus's memory model on a 16 GiB device: admission and lanes are part of each decision.
    s = Scheduler(policy, capacity=16 << 30, quantum_s=0.5 if policy in ("fifo", "fair") else None)
    now = 0.0
    next_id = 0
    for _ in range(queued + 1):
        s.submit(_task(next_id, now, rng), now)
        next_id += 1
    samples = np.empty(decisions, dtype=np.int64)
    clock = time.perf_counter_ns
    s.schedule(now)
    for k in range(decisions):
        now += 0.01
        for t in list(s.running.values()):  # the running task ends or (training) stops
            if t.kind is Kind.TRAINING and rng.random() < 0.5:
                s.update(Stopped(t.id, now, min(t.work - 1, t.done + 1)))
            else:
                s.update(Finished(t.id, now))
        for t in list(s.stopping.values()):
            s.update(Stopped(t.id, now, min(t.work - 1, t.done + 1)))
        while s.waiting < queued:
            s.submit(_task(next_id, now, rng), now)
            next_id += 1
        t0 = clock()
        d = s.schedule(now)
        samples[k] = clock() - t0
        assert any(isinstance(x, Run) for x in d) or s.running, "the scheduler left the device idle"
    us = samples / 1e3
    return {"policy": policy, "queued": queued, "decisions": decisions, "median_us": float(np.median(us)),
            "p99_us": float(np.percentile(us, 99)), "mean_us": float(us.mean())}


def run(cfg: SchedulerBenchConfig, progress=lambda msg: None) -> dict:
    from timeshare.sim.experiments import serving

    result: dict[str, Any] = {"benchmark": "scheduler", "config": vars(cfg).copy(),
                              "environment": describe(torch.device("cpu")), "decision": []}
    for policy in sorted(POLICIES):
        progress(f"decision latency: {policy}")
        result["decision"].append(decision_latency(policy, cfg.queued, cfg.decisions, cfg.seed))
    progress(f"replaying {cfg.requests:,} requests")
    costs = load_costs(cfg.costs)
    t0 = time.perf_counter()
    study = serving(costs=costs, requests=cfg.requests, modes=("lru",), seed=cfg.seed)
    wall = time.perf_counter() - t0
    r = study["results"]["lru"]
    result["replay"] = {"requests": cfg.requests, "wall_s": wall, "simulate_s": r["wall_s"],
                        "events": r["events"], "requests_per_s": cfg.requests / wall,
                        "p99_ms": r["inference"]["p99_ms"], "config": study["config"]}
    return result


def load_costs(paths: tuple[str, ...] | list[str]) -> WorkloadCosts:
    from pathlib import Path

    if not paths:
        root = Path("bench") / "results"  # the repository's measured costs, from its root
        paths = [str(root / "pipeline-cpu-epyc-2core-b1-fp32.json"), str(root / "pipeline-cpu-epyc-2core-b8-fp32.json"),
                 str(root / "switch-cpu-epyc-2core-b1-fp32.json")]
    missing = [p for p in paths[:3] if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"bench result files not found: {missing} (run from the repository's root, or pass them)")
    return WorkloadCosts.from_bench(*paths[:3])
