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


@dataclass(frozen=True, slots=True)
class SalusArrivals:
    """How the jobs of a Salus trace arrive: Salus does not publish its arrival process,
    so these are fitted to its FIFO row (NOTE [Salus arrival calibration] in
    ``sim/table1.py``)."""

    mean_interarrival_s: float
    """Mean gap between arrivals in seconds (Poisson: exponential gaps); 0 submits every
    job at once."""
    length_mix: tuple[float, float, float] | None
    """Shares of the pool's short, medium and long jobs (about 1, 5 and 10 minutes); the
    counts are exact (largest remainder), the model and batch size within a length
    uniform. None: every job drawn uniformly from the pool."""
    order_correlation: float = 0.0
    """0..1: how strongly longer jobs arrive earlier. Each job gets the key
    -rho * z + sqrt(1 - rho^2) * noise (z: its solo time, standardized; noise standard
    normal) and jobs arrive in the order of their keys: 0 is a random order, 1 longest
    first."""

    def __post_init__(self):
        if not (math.isfinite(self.mean_interarrival_s) and self.mean_interarrival_s >= 0):
            raise ConfigError(f"mean_interarrival_s must be a finite number >= 0, got {self.mean_interarrival_s!r}")
        mix = self.length_mix
        if mix is not None and (len(mix) != 3 or min(mix) < 0 or not sum(mix) > 0):
            raise ConfigError(f"length_mix must be three non-negative shares with a positive sum, got {mix!r}")
        if not 0.0 <= self.order_correlation <= 1.0:
            raise ConfigError(f"order_correlation must be in [0, 1], got {self.order_correlation!r}")

    @classmethod
    def one_knob_mix(cls, mean_interarrival_s: float, not_short: float, order_correlation: float) -> SalusArrivals:
        """The calibrated family: a share ``not_short`` of jobs split evenly between the
        medium and long ones, the rest short."""
        return cls(mean_interarrival_s, (1.0 - not_short, not_short / 2, not_short / 2), order_correlation)


def length_tiers(jobs: list[str], iterations: dict[str, float]) -> list[list[str]]:
    """The pool's short, medium and long jobs: for each model and batch size its jobs by
    iteration count (the length labels are not reliable upstream: data/README.md)."""
    groups: dict[str, list[str]] = {}
    for j in jobs:
        groups.setdefault(j.rsplit("_", 1)[0], []).append(j)
    tiers: list[list[str]] = [[], [], []]
    for members in groups.values():
        members.sort(key=lambda j: iterations[j])
        for tier, j in zip(tiers, (members[0], members[len(members) // 2], members[-1])):
            tier.append(j)
    return tiers


def exact_counts(shares, n: int) -> list[int]:
    """``n`` split by ``shares`` into whole counts that sum to ``n`` (largest remainder)."""
    p = np.asarray(shares, dtype=float)
    raw = p / p.sum() * n
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: n - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


def salus_trace(jobs: list[str], iterations: dict[str, float], n: int = 100, *, seed: int = 0,
                arrivals: SalusArrivals, solo_s: dict[str, float] | None = None) -> list[Arrival]:
    """``n`` training jobs drawn from the pool ``jobs`` as ``arrivals`` says; ``solo_s``
    (each job's seconds alone on the device) orders them when ``order_correlation`` is
    not 0. Deterministic for a seed."""
    if n < 1:
        raise ConfigError(f"a Salus trace needs at least one job, got {n}")
    rng = np.random.default_rng(seed)
    if arrivals.length_mix is None:
        picks = [jobs[i] for i in rng.integers(0, len(jobs), size=n)]
    else:
        tiers = length_tiers(jobs, iterations)
        picks = [tiers[w][rng.integers(0, len(tiers[w]))]
                 for w, count in enumerate(exact_counts(arrivals.length_mix, n)) for _ in range(count)]
        picks = [picks[i] for i in rng.permutation(n)]
    rho = arrivals.order_correlation
    if rho > 0:
        if solo_s is None:
            raise ConfigError("order_correlation needs each job's solo time (solo_s)")
        d = np.array([solo_s[j] for j in picks])
        z = (d - d.mean()) / d.std() if d.std() > 0 else np.zeros(n)
        key = -rho * z + math.sqrt(max(0.0, 1.0 - rho * rho)) * rng.standard_normal(n)
        picks = [picks[i] for i in np.argsort(key, kind="stable")]
    if arrivals.mean_interarrival_s > 0:
        times = np.cumsum(rng.exponential(arrivals.mean_interarrival_s, size=n))
        times -= times[0]
    else:
        times = np.zeros(n)
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
