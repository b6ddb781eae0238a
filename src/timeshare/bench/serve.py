"""``timeshare bench serve``: many concurrent clients over several models through HTTP,
with a memory budget that holds only some of them, so requests force switches. Every
response is checked against the model's reference output, computed alone in this
process from the same weights: none may be lost, duplicated or mismatched.

Beside timeshare's server, the same client sends the same requests to a plain-PyTorch
server (``bench/plain_server.py``: every model resident, one lock around the forward),
in turns, first one request at a time (``sequential``: what a request costs alone),
then the load; each server's hops (NOTE [Request hops]) are summed over each pass, so
the report says where a request's time went in each, and the ratio of the two.
Runs in the caller's process; the servers are child processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
import torch

from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.harness.client import Answer, Client
from timeshare.models.weights import read_weights
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.endpoint import flatten_outputs

SMALL_MODELS = ["tiny_mlp", "tiny_cnn", "tiny_bert", "tied_lm"]


@dataclass
class ServeBenchConfig:
    models: list[str] = field(default_factory=lambda: list(SMALL_MODELS))
    clients: int = 16
    requests: int = 2000
    device: str = "cpu"
    memory: str | None = None  # default: room for about half of the models' bytes; "all": room for every model
    workers: int = 0
    max_batch: int = 8
    max_queue: int = 256
    distinct_inputs: int = 8  # per model; a response is checked against its own input's reference
    retries: int = 20  # a 503 is retried after its Retry-After, at most this often
    seed: int = 0
    baseline: bool = True  # also the plain-PyTorch server, same client, same requests, in turns
    sequential: int = 200  # first, this many requests one at a time (one client) to each server
    rounds: int = 1  # both passes on both servers this often; ratios of the medians

    def __post_init__(self):
        for name in self.models:
            zoo_get(name)
        if self.clients < 1 or self.requests < 1 or self.distinct_inputs < 1:
            raise ConfigError("clients, requests and distinct_inputs must be at least 1")
        if self.sequential < 0 or self.rounds < 1:
            raise ConfigError(f"sequential must be at least 0 and rounds at least 1, got {self.sequential} and "
                              f"{self.rounds}")


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
    # The weights files' sizes stand for the models' (alignment and buffers add a little).
    sizes = sorted(weights_path(m).stat().st_size for m in cfg.models)
    if memory is None:
        memory = int(max(sizes[-1] * 1.1 + 4096, sum(sizes) / 2))  # the largest fits; not all at once
    elif memory == "all":
        memory = int(sum(sizes) * 1.25 + 4096 * len(sizes))  # every model resident: no switch
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
                            "batch_rows": good.parameters.get("timeshare_batch_rows", 1) if good is not None else None})

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


def hop_sums(url: str) -> tuple[int, dict[str, float]]:
    """Timeshare's server's hop sums so far (NOTE [Request hops]), from its ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    count, sums = 0, {}
    for family in text_string_to_metric_families(text):
        if family.name == "timeshare_request_hops":
            count = int(family.samples[0].value)
        elif family.name == "timeshare_request_hop_seconds":
            sums = {s.labels["hop"]: s.value for s in family.samples}
    return count, sums


def per_request_us(before: tuple[int, dict[str, float]], after: tuple[int, dict[str, float]]) -> dict:
    """Each hop's mean microseconds per request between two readings of the sums."""
    n = after[0] - before[0]
    if n <= 0:
        return {"requests": 0, "us": {}}
    us = {h: (after[1][h] - before[1].get(h, 0.0)) / n * 1e6 for h in after[1]}
    return {"requests": n, "us": us, "total_us": sum(us.values())}


def measured_pass(url: str, cfg: ServeBenchConfig, cases: dict[str, list[_Case]], sums) -> dict:
    """``drive`` with the server's hops per request over the pass; ``sums()`` reads them."""
    before = sums()
    result = drive(url, cfg, cases)
    result["hops"] = per_request_us(before, sums())
    return result


def _plain_sums(plain) -> tuple[int, dict[str, float]]:
    stats = plain.stats()
    return stats["requests"], stats["hop_seconds"]


def compare(passes: dict[str, dict[str, list[dict]]]) -> dict:
    """Per pass: each server's median requests/s and p50 over the rounds, and
    timeshare's over plain PyTorch's."""
    out = {}
    for name, by_server in passes.items():
        row: dict = {}
        for server, results in by_server.items():
            row[server] = {"throughput_rps": statistics.median(r["throughput_rps"] for r in results),
                           "p50_ms": statistics.median(r["p50_ms"] for r in results),
                           "p99_ms": statistics.median(r["p99_ms"] for r in results)}
        if "plain" in row and row["plain"]["throughput_rps"] > 0:
            ts, plain = row["timeshare"], row["plain"]
            row["throughput_ratio"] = ts["throughput_rps"] / plain["throughput_rps"]
            row["p50_ratio"] = ts["p50_ms"] / plain["p50_ms"] if plain["p50_ms"] > 0 else None
            row["p50_added_ms"] = ts["p50_ms"] - plain["p50_ms"]
        out[name] = row
    return out


def run(cfg: ServeBenchConfig, progress=None) -> dict:
    """The whole benchmark: references, the servers' processes, the passes in turns,
    their shutdown."""
    from timeshare.bench.plain_server import PlainServerProcess
    from timeshare.harness.process import ServerProcess

    cases = references(cfg)
    server_cfg = server_config(cfg)
    alone = dataclasses.replace(cfg, clients=1, requests=cfg.sequential)
    plan = ([("alone", alone)] if cfg.sequential else []) + [("load", cfg)]
    passes: dict[str, dict[str, list[dict]]] = {name: {} for name, _ in plan}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(server_cfg))
        plain = stack.enter_context(PlainServerProcess(cfg.models, cfg.device)) if cfg.baseline else None
        servers = [("timeshare", server.url, lambda: hop_sums(server.url))]
        if plain is not None:
            servers.append(("plain", plain.url, lambda: _plain_sums(plain)))
        for i in range(cfg.rounds):
            for name, pass_cfg in plan:
                for label, url, sums in servers:
                    if progress:
                        progress(f"round {i + 1}/{cfg.rounds}: {name} on {label}")
                    passes[name].setdefault(label, []).append(measured_pass(url, pass_cfg, cases, sums))
        result = passes["load"]["timeshare"][-1]
        code = server.stop()
        result["server_exit_code"] = code
        leftovers = [server.describe(pid) for pid in server.leftovers()]
        result["server_leftover_processes"] = len(leftovers)
        result["server_leftovers"] = leftovers
    return {"benchmark": "serve", "config": asdict(cfg), "server_config": server_cfg,
            "environment": describe(resolve_device(cfg.device)), "result": result,
            "passes": passes, "comparison": compare(passes)}
