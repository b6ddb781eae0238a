"""Traces for the simulator: what arrives when. Runs in the simulator's process.

A trace is a CSV file with a header and one row per arrival:
``time,kind,model,work,priority,slo_s`` (seconds; ``kind`` training or inference;
``work`` iterations or requests; ``priority`` lc or be; ``slo_s`` empty for none).
Generators are deterministic for a seed.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timeshare.errors import ConfigError
from timeshare.scheduler.task import Kind, Priority

FIELDS = ("time", "kind", "model", "work", "priority", "slo_s")


@dataclass(slots=True)
class Arrival:
    time: float
    kind: Kind
    model: str
    work: float = 1.0
    priority: Priority = Priority.BEST_EFFORT
    slo_s: float | None = None


def read_trace(path: str | Path) -> list[Arrival]:
    path = Path(path)
    out = []
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = set(FIELDS[:3]) - set(reader.fieldnames or ())
            if missing:
                raise ConfigError(f"trace {path}: missing columns {sorted(missing)}; expected {list(FIELDS)}")
            for line, row in enumerate(reader, start=2):
                empty = [k for k in FIELDS[:3] if not (row.get(k) or "").strip()]
                if empty:  # a short row, or blank required fields
                    raise ConfigError(f"trace {path}, line {line}: no {', '.join(empty)}")
                try:
                    slo = row.get("slo_s") or ""
                    a = Arrival(
                        float(row["time"]), Kind(row["kind"].strip().lower()), row["model"].strip(),
                        float(row.get("work") or 1), Priority.parse(row.get("priority") or "be"),
                        float(slo) if slo.strip() else None,
                    )
                except (ValueError, TypeError) as exc:
                    raise ConfigError(f"trace {path}, line {line}: {exc}") from None
                if not math.isfinite(a.time) or a.time < 0 or not a.work > 0:
                    raise ConfigError(f"trace {path}, line {line}: arrival {a} needs a time >= 0 and work > 0")
                out.append(a)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    out.sort(key=lambda a: a.time)
    return out


def write_trace(path: str | Path, trace: list[Arrival]) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for a in trace:
            w.writerow([repr(a.time), a.kind.value, a.model, repr(float(a.work)),
                        "lc" if a.priority is Priority.LATENCY_CRITICAL else "be",
                        "" if a.slo_s is None else repr(a.slo_s)])


def salus_trace(jobs: list[str], iterations: dict[str, float], n: int = 100, *, seed: int = 0,
                mean_interarrival_s: float = 60.0,
                length_mix: tuple[float, float, float] | None = (0.7, 0.15, 0.15)) -> list[Arrival]:
    """``n`` training jobs drawn from the pool ``jobs``, Poisson arrivals (Salus does
    not publish its arrival process). ``length_mix``: the shares of short, medium and
    long jobs (the pool's 1, 5 and 10-minute jobs of each model and batch, told apart
    by their iteration counts); None draws uniformly from the pool."""
    rng = np.random.default_rng(seed)
    if length_mix is None:
        picks = [jobs[i] for i in rng.integers(0, len(jobs), size=n)]
    else:
        if len(length_mix) != 3 or min(length_mix) < 0 or sum(length_mix) <= 0:
            raise ConfigError(f"length_mix must be three non-negative shares, got {length_mix!r}")
        groups: dict[str, list[str]] = {}
        for j in jobs:
            groups.setdefault(j.rsplit("_", 1)[0], []).append(j)
        tiers: list[list[str]] = [[], [], []]
        for members in groups.values():
            members.sort(key=lambda j: iterations[j])
            for tier, j in zip(tiers, (members[0], members[len(members) // 2], members[-1])):
                tier.append(j)
        p = np.asarray(length_mix, dtype=float)
        which = rng.choice(3, size=n, p=p / p.sum())
        picks = [tiers[w][rng.integers(0, len(tiers[w]))] for w in which]
    times = np.cumsum(rng.exponential(mean_interarrival_s, size=n))
    times -= times[0]
    return [Arrival(float(t), Kind.TRAINING, j, float(iterations[j])) for t, j in zip(times, picks)]


def serving_trace(models: list[str], n: int, *, rate_per_s: float, zipf_s: float = 1.0, seed: int = 0,
                  slo_s: dict[str, float] | None = None) -> list[Arrival]:
    """``n`` inference requests, Poisson arrivals at ``rate_per_s``, models drawn with
    Zipf popularity (model k has weight 1/k^zipf_s, in the order given), each with its
    model's SLO if ``slo_s`` has one."""
    if n < 1 or rate_per_s <= 0:
        raise ConfigError(f"a serving trace needs requests >= 1 and a positive rate, got {n}, {rate_per_s}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(models) + 1) ** zipf_s
    picks = rng.choice(len(models), size=n, p=weights / weights.sum())
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()
    slo = slo_s or {}
    lc = Priority.LATENCY_CRITICAL
    return [Arrival(t, Kind.INFERENCE, models[i], 1.0, lc, slo.get(models[i]))
            for t, i in zip(times, picks.tolist())]
