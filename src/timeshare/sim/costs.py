"""The simulator's cost model: per-model compute, transfer and memory figures, read
from measured data only. Runs in the simulator's process (the CLI).

Two sources:
  * Salus's job pool (``timeshare/sim/data/salus-workloads.csv``): per model and batch
    size, the iteration time and start-up of a training job (NOTE [Salus job pool]);
  * timeshare's own benchmark JSON (``bench/results/pipeline-*.json``, and optionally
    ``switch-*.json``): per model, the ready latency at batch 1 and 8, the pipelined
    load, the weights' size and the stop-and-start latency.

# NOTE [Salus job pool]
For each model and batch size the pool has jobs of about 1, 5 and 10 minutes. The
iteration time is (JCT_long - JCT_short) / (iterations_long - iterations_short), the
start-up JCT_short - iterations_short x iteration time (data/README.md). Upstream names
one job twice (``vgg16_100_1min``, the second the 10-minute job); ``read_salus_pool``
relabels that model and batch size's jobs by iteration count, so the pool has 99
distinct jobs.
Memory: the peak is measured; Salus splits it into persistent (weights and optimizer
slots) and ephemeral (activations) memory, which the pool does not record. We take
persistent = parameters x 8 bytes (fp32 weights and one momentum slot; parameter counts
are the models' published ones), at most half the peak, and ephemeral = the rest.
Utilization: how much of the device a job keeps busy alone, from its per-sample time
against the same model's largest batch (the largest batch is taken as saturating):
u = (seconds per sample at the largest batch) / (seconds per sample at this batch).
Jobs that run together at total utilization U > 1 each slow down by U
(NOTE [Device sharing model]).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from timeshare.errors import ConfigError

# Published parameter counts (millions) of the job pool's models.
_PARAMS_M = {
    "alexnet": 61.1, "googlenet": 6.6, "inception3": 23.8, "inception4": 42.7, "overfeat": 145.9,
    "resnet50": 25.6, "resnet101": 44.5, "resnet152": 60.2, "vgg11": 132.9, "vgg16": 138.4, "vgg19": 143.7,
}
_MB = 1_000_000


@dataclass(frozen=True)
class ModelCosts:
    """Figures for one model (training: one job type; inference: one served model).
    Seconds, bytes."""

    name: str
    unit_s: float  # one training iteration, or one request at batch 1 on a resident model
    batch8_s: float | None = None  # inference: one batch of 8 (batches interpolate linearly)
    load_s: float = 0.0  # inference: host -> device, pipelined with the first request
    nbytes: int = 0  # resident size of the weights
    persistent: int = 0  # Salus memory classes (training)
    ephemeral: int = 0
    startup_s: float = 0.0  # training: first start of a job
    restart_s: float | None = None  # stop-and-start: kill, new process, load, one request
    utilization: float = 1.0

    def compute_s(self, batch: int) -> float:
        """One batch of ``batch`` requests, at most 8 (the measured range)."""
        if self.batch8_s is None:  # no batch-8 figure: requests one after another
            return self.unit_s * max(1, batch)
        batch = min(max(batch, 1), 8)
        return self.unit_s + (self.batch8_s - self.unit_s) * (batch - 1) / 7


@dataclass
class WorkloadCosts:
    models: dict[str, ModelCosts]
    source: str

    def __getitem__(self, name: str) -> ModelCosts:
        try:
            return self.models[name]
        except KeyError:
            raise ConfigError(f"the cost model ({self.source}) has no model {name!r}; "
                              f"known: {sorted(self.models)[:20]}") from None

    def variants(self, n: int) -> WorkloadCosts:
        """``n`` served models named m00, m01..., cycling through the measured ones."""
        if n < 1:
            raise ConfigError(f"the number of models must be positive, got {n}")
        base = sorted(self.models)
        return WorkloadCosts({f"m{i:02d}": replace(self.models[base[i % len(base)]], name=f"m{i:02d}")
                          for i in range(n)}, f"{n} variants of {self.source}")

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_salus_csv(cls, path: str | Path) -> WorkloadCosts:
        """One entry per job of the pool, named like the CSV rows (NOTE [Salus job pool])."""
        groups: dict[tuple[str, int], list[dict]] = {}
        for j in read_salus_pool(path):
            groups.setdefault((j["model"], j["batch"]), []).append(j)
        per_sample: dict[tuple[str, int], float] = {}
        timing: dict[tuple[str, int], tuple[float, float]] = {}
        for key, jobs in groups.items():
            jobs.sort(key=lambda j: j["iters"])  # length labels are not reliable upstream
            short, long = jobs[0], jobs[-1]
            if long["iters"] == short["iters"]:
                raise ConfigError(f"{path}: {key} needs jobs of two lengths to derive an iteration time")
            it = (long["jct"] - short["jct"]) / (long["iters"] - short["iters"])
            timing[key] = (it, max(0.0, short["jct"] - short["iters"] * it))
            per_sample[key] = it / key[1]
        best: dict[str, float] = {}
        for (model, _batch), s in per_sample.items():
            best[model] = min(best.get(model, math.inf), s)
        models = {}
        for (model, batch), jobs in groups.items():
            it, startup = timing[(model, batch)]
            params = _PARAMS_M.get(model)
            for j in jobs:
                peak = int(j["peak"] * _MB)
                persistent = min(int(params * 8 * _MB), peak // 2) if params else peak // 4
                models[j["name"]] = ModelCosts(
                    j["name"], unit_s=it, startup_s=startup, persistent=persistent, ephemeral=peak - persistent,
                    utilization=min(1.0, best[model] / per_sample[(model, batch)]),
                )
        return cls(models, f"Salus job pool ({Path(path).name})")

    @classmethod
    def from_bench(cls, pipeline: str | Path, pipeline_b8: str | Path | None = None,
                   switch: str | Path | None = None) -> WorkloadCosts:
        """Served-model costs from ``timeshare bench pipeline`` JSON (batch 1), optionally
        the same at batch 8 and ``timeshare bench switch`` JSON (stop-and-start)."""
        b1 = _read_json(pipeline)
        b8 = {r["model"]: r for r in _read_json(pipeline_b8)["results"]} if pipeline_b8 else {}
        restarts = {}
        if switch:
            for r in _read_json(switch)["results"]:
                s = r.get("stop_and_start") or {}
                if s.get("median_ms") is not None:
                    restarts[r["model"]] = s["median_ms"] / 1e3
        models = {}
        for r in b1["results"]:
            try:
                ready = r["ready_ms"] / 1e3
                piped = r["strategies"]["optimal"]["median_ms"] / 1e3
                nbytes = int(r["bytes"])
            except (KeyError, TypeError) as exc:
                raise ConfigError(f"{pipeline}: result without {exc}") from None
            r8 = b8.get(r["model"])
            models[r["model"]] = ModelCosts(
                r["model"], unit_s=ready, batch8_s=r8["ready_ms"] / 1e3 if r8 else None,
                load_s=max(0.0, piped - ready), nbytes=nbytes, restart_s=restarts.get(r["model"]),
            )
        env = b1.get("environment", {})
        return cls(models,
                   f"bench pipeline on {env.get('device', '?')} {env.get('cpu') or env.get('gpu') or ''}".strip())


_LENGTH_LABELS = ("1min", "5min", "10min")


def read_salus_pool(path: str | Path) -> list[dict]:
    """The pool's jobs: name, model, batch, jct (s), iters, peak (MB). Names are made
    unique: where a name occurs twice (upstream labels ``vgg16_100_1min`` twice, the
    second the 10-minute job), the jobs of that model and batch size are relabelled
    1min, 5min, 10min by iteration count (NOTE [Salus job pool])."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"cannot read the Salus job pool {path}: {exc}") from None
    jobs: list[dict[str, Any]] = []
    for r in rows:
        try:
            model, batch, _length = r["name"].rsplit("_", 2)
            jobs.append({"name": r["name"], "model": model, "batch": int(batch), "jct": float(r["jct_seconds"]),
                         "iters": int(r["iterations"]), "peak": float(r["peak_mem_mb"])})
        except (KeyError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{path}: malformed row {r!r} ({exc})") from None
    seen: dict[str, int] = {}
    for j in jobs:
        seen[j["name"]] = seen.get(j["name"], 0) + 1
    for dup in [n for n, k in seen.items() if k > 1]:
        model, batch, _ = dup.rsplit("_", 2)
        group = sorted((j for j in jobs if j["model"] == model and j["batch"] == int(batch)), key=lambda j: j["iters"])
        if len(group) != len(_LENGTH_LABELS):
            raise ConfigError(f"{path}: job name {dup!r} repeats and its model and batch size do not have "
                              f"{len(_LENGTH_LABELS)} jobs to relabel by length")
        for j, label in zip(group, _LENGTH_LABELS):
            j["name"] = f"{model}_{batch}_{label}"
    names = [j["name"] for j in jobs]
    if len(set(names)) != len(names):
        repeats = sorted(n for n in set(names) if names.count(n) > 1)
        raise ConfigError(f"{path}: job names still repeat after relabelling: {repeats}")
    return jobs


def _read_json(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read benchmark results {path}: {exc}") from None
