"""The fleet part of ``timeshare bench llm``: ``fleet_models`` models in a device budget
that holds the two largest, a Zipf-popular open-loop stream of streamed completions
through the OpenAI API, served by ``timeshare serve`` and by a reload-on-switch server
(``bench/reload_server.py``: one model at a time, unloaded and loaded with
``from_pretrained`` for a request to another, as llama-swap does): TTFT and end-to-end
percentiles, throughput, loads, and whether the two servers' greedy texts agree. Runs in
the CLI's process; the two servers are child processes.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from timeshare.bench.llm_models import TEXTS
from timeshare.errors import TimeshareError
from timeshare.llm import hfdir
from timeshare.llm import model as lm

if TYPE_CHECKING:
    from timeshare.bench.llm import LLMBenchConfig


def run_fleet(config: LLMBenchConfig, device: torch.device, dirs: list[Path], progress) -> dict:
    from timeshare.harness.process import ServerProcess, free_port

    names = [f"m{i}" for i in range(len(dirs))]
    sizes = sorted((sum(f.stat().st_size for f in hfdir.shard_files(d)) for d in dirs), reverse=True)
    scale = {"fp32": 1.0}.get(config.dtype, 0.5)
    # Room for the two largest, and every model's key/value pages (regions of the arena).
    pools = sum(lm.own_pool_bytes(d, None if config.dtype == "fp32" else config.dtype, 8) for d in dirs)
    budget = int((sizes[0] + sizes[1]) * scale * 1.05) + pools
    trace = _trace(config, names)
    out: dict = {"models": len(dirs), "budget_bytes": budget, "requests": len(trace),
                 "rate_per_s": config.fleet_rate_per_s, "max_tokens": config.fleet_max_tokens,
                 "distinct_models_requested": len({m for _, m, _ in trace})}
    ours_cfg = {"runtime": {"device": str(device), "memory": budget, "workers": 0, "eviction": "lru"},
                "server": {"request_timeout_s": 600, "max_connections": 1024},
                "llms": [{"name": n, "path": str(d), "dtype": config.dtype if config.dtype != "fp32" else None,
                          "max_sequences": 8} for n, d in zip(names, dirs)]}
    progress(f"fleet: timeshare serve with {len(dirs)} models (loading them)")
    with ServerProcess(ours_cfg, ready_timeout_s=1800) as server:  # __enter__ starts it
        progress(f"fleet: {len(trace)} requests to timeshare")
        out["timeshare"] = _play(server.url, trace, config.fleet_max_tokens)
        out["timeshare"]["loads"] = _loads(server.url)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="timeshare-reload-") as tmp:
        cfg_path = Path(tmp) / "reload.json"
        cfg_path.write_text(json.dumps({"port": port, "device": str(device), "dtype": config.dtype,
                                        "models": {n: str(d) for n, d in zip(names, dirs)}}))
        progress("fleet: the reload-on-switch server")
        with _Child(cfg_path, port) as url:
            out["reload_on_switch"] = _play(url, trace, config.fleet_max_tokens)
            out["reload_on_switch"]["loads"] = _health(url)["loads"]
    a, b = out["timeshare"], out["reload_on_switch"]
    out["p99_ttft_speedup"] = b["ttft_p99_s"] / a["ttft_p99_s"]
    out["p50_ttft_speedup"] = b["ttft_p50_s"] / a["ttft_p50_s"]
    out["texts_compared"] = sum(x is not None and y is not None for x, y in zip(a["texts"], b["texts"]))
    out["texts_agree"] = sum(x is not None and x == y for x, y in zip(a.pop("texts"), b.pop("texts")))
    return out


def _trace(config: LLMBenchConfig, names: list[str]) -> list[tuple[float, str, str]]:
    """(arrival offset, model, prompt): Poisson arrivals, Zipf popularity (a seeded
    shuffle decides which model is most popular)."""
    rng = random.Random(config.seed)
    order = names[:]
    rng.shuffle(order)
    weights = [1 / (k + 1) ** config.zipf for k in range(len(order))]
    t, trace = 0.0, []
    for _ in range(config.fleet_requests):
        t += rng.expovariate(config.fleet_rate_per_s)
        trace.append((t, rng.choices(order, weights)[0], rng.choice(TEXTS)))
    return trace


def _play(url: str, trace: list[tuple[float, str, str]], max_tokens: int) -> dict:
    return asyncio.run(_play_async(url, trace, max_tokens))


async def _play_async(url: str, trace, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        start = time.monotonic()
        results = await asyncio.gather(*(_one(client, start, t, m, p, max_tokens) for t, m, p in trace))
        makespan = time.monotonic() - start
    ok = [r for r in results if r["error"] is None]
    ttft = sorted(r["ttft_s"] for r in ok)
    e2e = sorted(r["e2e_s"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return {"ok": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
            "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99), "completion_tokens": tokens,
            "makespan_s": makespan, "tokens_per_s": tokens / makespan, "texts": [r["text"] for r in results],
            "requests": [{k: r.get(k) for k in ("model", "at_s", "ttft_s", "e2e_s", "tokens", "error")}
                         for r in results]}


async def _one(client, start: float, at: float, model: str, prompt: str, max_tokens: int) -> dict:
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    sent = time.monotonic()
    first, text, tokens, error = None, [], 0, None
    base = {"model": model, "at_s": at}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {**base, "error": f"HTTP {response.status_code}: {response.text[:200]}", "text": None}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"].get("message"))
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        first = first or time.monotonic()
                        text.append(choice["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:
        return {**base, "error": repr(exc), "text": None}
    done = time.monotonic()
    return {**base, "error": error, "ttft_s": (first or done) - sent, "e2e_s": done - sent, "tokens": tokens,
            "text": "".join(text)}


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def _loads(url: str) -> int:
    import httpx

    status = httpx.get(f"{url}/admin/status", timeout=30).json()
    return int(sum(status["loads"].values()))


def _health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=30).json()


class _Child:
    """The reload-on-switch server as a child process, until the block ends."""

    def __init__(self, config_path: Path, port: int):
        self.config_path, self.port = config_path, port

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen([sys.executable, "-m", "timeshare.bench.reload_server", str(self.config_path)])
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TimeshareError(f"the reload-on-switch server exited with code {self.proc.returncode}")
            try:
                httpx.get(f"{url}/health", timeout=2)
                return url
            except httpx.HTTPError:
                time.sleep(0.2)
        self.__exit__()
        raise TimeshareError("the reload-on-switch server did not start within 300 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
