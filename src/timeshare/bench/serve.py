"""``timeshare bench serve``: many concurrent clients over several models through HTTP,
with a memory budget that holds only some of them, so requests force switches. Every
response is checked against the model's reference output, computed alone in this
process from the same weights: none may be lost, duplicated or mismatched.
Runs in the caller's process; the server is a child process (or a given URL).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.models.weights import read_weights
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.client import Answer, Client
from timeshare.server.endpoint import flatten_outputs

SMALL_MODELS = ["tiny_mlp", "tiny_cnn", "tiny_bert", "tied_lm"]


@dataclass
class ServeBenchConfig:
    models: list[str] = field(default_factory=lambda: list(SMALL_MODELS))
    clients: int = 16
    requests: int = 2000
    device: str = "cpu"
    memory: str | None = None  # default: room for about half of the models' bytes
    workers: int = 0
    max_batch: int = 8
    max_queue: int = 256
    distinct_inputs: int = 8  # per model; a response is checked against its own input's reference
    retries: int = 20  # a 503 is retried after its Retry-After, at most this often
    seed: int = 0

    def __post_init__(self):
        for name in self.models:
            zoo_get(name)
        if self.clients < 1 or self.requests < 1 or self.distinct_inputs < 1:
            raise ConfigError("clients, requests and distinct_inputs must be at least 1")


@dataclass
class _Case:
    inputs: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]


def references(cfg: ServeBenchConfig) -> dict[str, list[_Case]]:
    """Per model, ``distinct_inputs`` seeded inputs and the outputs of the model run alone on each."""
    out = {}
    for name in cfg.models:
        zoo = zoo_get(name)
        module = zoo.build()
        module.load_state_dict(read_weights(str(weights_path(name))), strict=False)
        module.eval()
        cases = []
        for i in range(cfg.distinct_inputs):
            args = zoo.example_inputs(1, seed=1000 + i)
            with torch.no_grad():
                ref = dict(flatten_outputs(module(*args)))
            cases.append(_Case(dict(zip(zoo.input_names, args)), ref))
        out[name] = cases
    return out


def server_config(cfg: ServeBenchConfig) -> dict:
    memory: str | int | None = cfg.memory
    if memory is None:
        # The weights files' sizes stand for the models' (alignment and buffers add a little).
        sizes = sorted(weights_path(m).stat().st_size for m in cfg.models)
        memory = int(max(sizes[-1] * 1.1 + 4096, sum(sizes) / 2))  # the largest fits; not all at once
    return {
        "runtime": {"device": cfg.device, "memory": memory, "workers": cfg.workers},
        "server": {"request_timeout_s": 120, "warmup": True},
        "models": [{"name": m, "zoo": m, "max_batch": cfg.max_batch, "max_queue": cfg.max_queue}
                   for m in cfg.models],
    }


def drive(url: str, cfg: ServeBenchConfig, cases: dict[str, list[_Case]]) -> dict:
    """Send ``cfg.requests`` requests from ``cfg.clients`` threads; check every answer."""
    rng = random.Random(cfg.seed)
    plan = [(i, rng.choice(cfg.models), rng.randrange(cfg.distinct_inputs)) for i in range(cfg.requests)]
    lock = threading.Lock()
    seen: dict[str, int] = {}
    records: list[dict] = []
    client = Client(url, timeout_s=180)

    def one(item) -> None:
        i, model, k = item
        case = cases[model][k]
        rid = f"req-{i}"
        t0 = time.perf_counter()
        statuses: list[int | str] = []
        answer: Answer | None = None
        for _attempt in range(cfg.retries + 1):
            try:
                answer = client.infer(model, case.inputs, request_id=rid)
            except Exception as exc:  # transport error: counted as lost
                statuses.append(f"transport: {type(exc).__name__}")
                answer = None
                break
            statuses.append(answer.status)
            if answer.status != 503:
                break
            time.sleep(min(5.0, float(answer.retry_after or 1)))
        latency = time.perf_counter() - t0
        good = answer if answer is not None and answer.status == 200 else None
        ok = good is not None
        mismatch = None
        if good is not None:
            if good.id != rid:
                mismatch = f"answer id {good.id!r} for request {rid!r}"
            else:
                mismatch = compare_outputs(good.outputs, case.reference)
        with lock:
            # An answer delivered for two requests shows up as one id seen twice; an answer
            # without an id is a mismatch (above), not a duplicate.
            if good is not None and good.id is not None:
                seen[good.id] = seen.get(good.id, 0) + 1
            records.append({"id": i, "model": model, "latency_s": latency, "statuses": statuses, "ok": ok,
                            "mismatch": mismatch,
                            "switched": bool(good is not None and good.parameters.get("timeshare_switched_from")),
                            "loaded": bool(good is not None and good.parameters.get("timeshare_loaded")),
                            "batch_rows": good.parameters.get("timeshare_batch_rows") if good is not None else None})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.clients) as pool:
        list(pool.map(one, plan))
    wall = time.perf_counter() - t0
    client.close()
    return summarize(records, seen, wall, cfg)


def compare_outputs(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str | None:
    if set(got) != set(ref):
        return f"outputs {sorted(got)} instead of {sorted(ref)}"
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape or g.dtype != r.dtype:
            return f"output {name!r}: {g.dtype}{list(g.shape)} instead of {r.dtype}{list(r.shape)}"
        # Batched forwards may round differently (NOTE [Request batching]); another
        # request's output differs by far more than this.
        scale = float(r.abs().max()) if r.numel() else 0.0
        if not torch.allclose(g, r, rtol=1e-4, atol=1e-5 + 1e-5 * scale):
            return f"output {name!r} differs from the reference by {float((g - r).abs().max()):.3g}"
    return None


def summarize(records: list[dict], seen: dict[str, int], wall: float, cfg: ServeBenchConfig) -> dict:
    ok = [r for r in records if r["ok"]]
    lat = np.array([r["latency_s"] for r in ok]) if ok else np.array([0.0])
    statuses = [s for r in records for s in r["statuses"]]
    per_model = {}
    for m in cfg.models:
        mine = [r["latency_s"] for r in ok if r["model"] == m]
        per_model[m] = {"requests": sum(r["model"] == m for r in records), "answered": len(mine),
                        "p50_ms": _pct(mine, 50), "p99_ms": _pct(mine, 99),
                        "switches": sum(r["switched"] for r in ok if r["model"] == m),
                        "loads": sum(r["loaded"] for r in ok if r["model"] == m)}
    return {
        "requests": len(records),
        "answered": len(ok),
        "lost": len(records) - len(ok),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "mismatched": sum(r["mismatch"] is not None for r in ok),
        "mismatch_examples": [r["mismatch"] for r in ok if r["mismatch"]][:5],
        "status_5xx": sum(isinstance(s, int) and s >= 500 for s in statuses),
        "status_503_retried": sum(s == 503 for s in statuses),
        "status_4xx": sum(isinstance(s, int) and 400 <= s < 500 for s in statuses),
        "transport_errors": sum(isinstance(s, str) for s in statuses),
        "wall_s": wall,
        "throughput_rps": len(ok) / wall if wall > 0 else 0.0,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "mean_batch_rows": float(np.mean([r["batch_rows"] for r in ok])) if ok else 0.0,
        "switches": sum(r["switched"] for r in ok),
        "loads": sum(r["loaded"] for r in ok),
        "per_model": per_model,
    }


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values else None


def run(cfg: ServeBenchConfig, progress=None) -> dict:
    """The whole benchmark: references, a server process, the load, its shutdown."""
    from timeshare.server.process import ServerProcess

    cases = references(cfg)
    server_cfg = server_config(cfg)
    with ServerProcess(server_cfg) as server:
        if progress:
            progress("server ready; sending requests")
        result = drive(server.url, cfg, cases)
        code = server.stop()
        result["server_exit_code"] = code
        leftovers = [server.describe(pid) for pid in server.leftovers()]
        result["server_leftover_processes"] = len(leftovers)
        result["server_leftovers"] = leftovers
    return {"benchmark": "serve", "config": asdict(cfg), "server_config": server_cfg,
            "environment": describe(resolve_device(cfg.device)), "result": result}
