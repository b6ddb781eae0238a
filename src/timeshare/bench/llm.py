"""``timeshare bench llm``: language models woken with pipelined loading (issue 18). Runs
in the CLI's process; the fleet's two servers are child processes.

Three parts, each on model directories written here from code (seeded weights):
- **wake**: one model, time to first token (TTFT) of a ``prompt_tokens`` prompt when the
  model is resident (warm) and when it is not (cold: evicted, its blocks poisoned, loaded
  pipelined while its prefill runs), against a load-then-generate baseline
  (``from_pretrained`` onto the device, then the prefill: what a server without a
  resident copy does) and against the floor ``max(bytes / measured link bandwidth,
  warm TTFT)``; the cold greedy tokens are compared with the warm ones.
- **decode**: tokens per second of one greedy generation with the model resident, against
  plain ``transformers`` (the same weights, resident, ``generate``), and of ``concurrent``
  generations batched together.
- **fleet**: ``fleet_models`` models in a device budget that holds the two largest, a
  Zipf-popular open-loop stream of streamed completions through the OpenAI API, served by
  ``timeshare serve`` and by a reload-on-switch server (``bench/reload_server.py``: one
  model at a time, unloaded and loaded with ``from_pretrained`` for a request to another,
  as llama-swap does): TTFT and end-to-end percentiles, throughput, loads, and whether the
  two servers' greedy texts agree.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from timeshare.bench.environment import describe
from timeshare.device import resolve_device, synchronize
from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, TimeshareError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime

# (hidden, layers, heads) of the models each size writes; the fleet cycles through them.
SIZES = {
    "tiny": [(64, 2, 4), (96, 2, 4)],
    "small": [(768, 12, 12), (832, 12, 8), (896, 12, 14), (1024, 12, 16)],  # about 64M to 113M parameters
    "1b": [(2048, 24, 32)],  # about 0.9B parameters (a GPU's size: 1.8 GB in bf16)
}
TEXTS = ("the model switch fast load weights layer token", "a gpu share time memory host device cache",
         "group stream copy wake sleep serve request answer", "fast slow memory the a model gpu time")


@dataclass
class LLMBenchConfig:
    arch: str = "llama"
    size: str = "small"
    dtype: str = "fp32"
    prompt_tokens: int = 64
    new_tokens: int = 32
    concurrent: int = 4
    repeats: int = 5
    fleet_models: int = 8
    fleet_requests: int = 100
    fleet_rate_per_s: float = 0.5
    fleet_max_tokens: int = 16
    zipf: float = 1.0
    device: str = "auto"
    seed: int = 0
    workdir: str | None = None  # where the model directories are written (default: a temporary one)
    workers: int = 0  # wake and decode: worker processes (NOTE [Generation in worker processes])
    parts: tuple[str, ...] = field(default_factory=lambda: ("wake", "decode", "fleet"))

    def __post_init__(self):
        if self.size not in SIZES or self.arch not in hfdir.ARCHITECTURES:
            raise ConfigError(f"size must be one of {list(SIZES)} and arch one of {list(hfdir.ARCHITECTURES)}")
        if min(self.prompt_tokens, self.new_tokens, self.concurrent, self.repeats) < 1 or self.new_tokens < 2:
            raise ConfigError("prompt_tokens, concurrent and repeats must be at least 1, new_tokens at least 2")
        unknown = set(self.parts) - {"wake", "decode", "fleet"}
        if unknown:
            raise ConfigError(f"unknown parts {sorted(unknown)}; known: wake, decode, fleet")
        if "fleet" in self.parts and (self.fleet_models < 3 or self.fleet_requests < 1 or self.fleet_rate_per_s <= 0):
            raise ConfigError("the fleet needs at least 3 models, 1 request and a positive rate")
        if self.workers < 0 or self.workers == 1:
            raise ConfigError("workers must be 0 (in-process) or at least 2 (a home and a standby)")


def run(config: LLMBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench prints its own progress
    device = resolve_device(config.device)
    with tempfile.TemporaryDirectory(prefix="timeshare-llm-") as tmp:
        root = Path(config.workdir or tmp)
        count = config.fleet_models if "fleet" in config.parts else 1
        progress(f"writing {count} model directories under {root}")
        dirs = [_write(root, config, i) for i in range(count)]
        result: dict = {"config": asdict(config), "environment": describe(device),
                        "models": [{"path": str(d), "parameters": _parameters(d)} for d in dirs]}
        prompt = _prompt(dirs[0], config.prompt_tokens)
        if "wake" in config.parts:
            progress("wake: warm and cold time to first token")
            result["wake"] = _wake(config, device, dirs[0], prompt)
        if "decode" in config.parts:
            progress("decode: tokens per second")
            result["decode"] = _decode(config, device, dirs[0], prompt)
        if "fleet" in config.parts:
            result["fleet"] = _fleet(config, device, dirs, progress)
    return result


def _write(root: Path, config: LLMBenchConfig, i: int) -> Path:
    hidden, layers, heads = SIZES[config.size][i % len(SIZES[config.size])]
    path = root / f"{config.arch}-{config.size}-{i}"
    if not (path / "config.json").exists():
        hfdir.write_model_dir(path, config.arch, seed=config.seed + i, hidden=hidden, layers=layers, heads=heads,
                              max_positions=max(512, 2 * (config.prompt_tokens + config.new_tokens)),
                              max_shard_size="100MB")
    return path


def _parameters(path: Path) -> int:
    from safetensors import safe_open

    n = 0
    for shard in hfdir.shard_files(path):
        with safe_open(str(shard), "pt") as f:
            n += sum(_numel(f.get_slice(key).get_shape()) for key in f.keys())
    return n


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _prompt(path: Path, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids: list[int] = []
    rng = random.Random(tokens)
    while len(ids) < tokens:
        ids += tok(" " + rng.choice(TEXTS), add_special_tokens=False)["input_ids"]
    return ids[:tokens]


def _ttft(seq) -> float:
    assert seq.first_token_at is not None
    return seq.first_token_at - seq.arrived


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------- wake
def _wake(config: LLMBenchConfig, device: torch.device, path: Path, prompt: list[int]) -> dict:
    dtype = None if config.dtype == "fp32" else config.dtype
    one = SamplingParams(max_tokens=1, temperature=0)
    greedy = SamplingParams(max_tokens=config.new_tokens, temperature=0)
    with Runtime(device, "auto", poison_evicted=True, workers=config.workers) as rt:
        seen: list[CallRecord] = []
        rt.subscribe(lambda r: seen.append(r) if isinstance(r, CallRecord) else None)
        model = lm.load(rt, "m", path, dtype=dtype)
        link_Bps = rt.profile("m").link.bandwidth_Bps
        want = model.generate(prompt, greedy).result(600).tokens
        warm, cold, moved, exact = [], [], [], 0
        for _ in range(config.repeats):
            seq = model.generate(prompt, one)
            seq.result(600)
            warm.append(_ttft(seq))
            rt.evict("m")
            before = len(seen)
            seq = model.generate(prompt, greedy)
            exact += seq.result(600).tokens == want
            cold.append(_ttft(seq))
            moved += [r.moved_bytes for r in seen[before:] if r.loaded and r.moved_bytes]
        model.close()
    nbytes = max(moved) if moved else 0
    copy_s = nbytes / link_Bps
    baseline = _load_then_generate(config, device, path, prompt)
    w, c = _median(warm), _median(cold)
    return {"bytes": nbytes, "link_GBps": link_Bps / 1e9, "copy_s": copy_s, "warm_ttft_s": w, "cold_ttft_s": c,
            "warm_samples_s": warm, "cold_samples_s": cold, "floor_s": max(copy_s, w),
            "cold_over_warm_plus_copy": c / (w + copy_s), "cold_over_floor": c / max(copy_s, w),
            "load_then_generate_s": baseline, "speedup_vs_load_then_generate": baseline / c,
            "cold_tokens_exact": exact, "cold_runs": config.repeats}


def _load_then_generate(config: LLMBenchConfig, device: torch.device, path: Path, prompt: list[int]) -> float:
    """``from_pretrained`` onto the device, then the prefill to the first token (median)."""
    from transformers import AutoModelForCausalLM

    dtype = parse_dtype(config.dtype)
    times = []
    for _ in range(config.repeats):
        t0 = time.perf_counter()
        module: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        module = module.to(device).eval()
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            int(module(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
        synchronize(device)
        times.append(time.perf_counter() - t0)
        del module
    return _median(times)


# ---------------------------------------------------------------------- decode
def _decode(config: LLMBenchConfig, device: torch.device, path: Path, prompt: list[int]) -> dict:
    """Ours and plain ``transformers`` alternate, repeat after repeat, so that the
    machine's drift falls on both alike."""
    from transformers import AutoModelForCausalLM

    dtype = None if config.dtype == "fp32" else config.dtype
    n = config.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0)
    module: Any = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(config.dtype))
    module = module.to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def plain_rate() -> float:
        t = []
        for k in (1, n):
            synchronize(device)
            t0 = time.perf_counter()
            module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                            do_sample=False, pad_token_id=0)
            synchronize(device)
            t.append(time.perf_counter() - t0)
        return (n - 1) / (t[1] - t[0])

    ours, plain, batched = [], [], []
    with Runtime(device, "auto", workers=config.workers) as rt:
        model = lm.load(rt, "m", path, dtype=dtype)
        model.generate(prompt, params).result(600)
        plain_rate()  # both warmed up
        for _ in range(config.repeats):
            seq = model.generate(prompt, params)
            seq.result(600)
            assert seq.first_token_at is not None and seq.last_token_at is not None
            ours.append((len(seq.tokens) - 1) / (seq.last_token_at - seq.first_token_at))
            plain.append(plain_rate())
            t0 = time.monotonic()
            seqs = [model.generate(prompt, params) for _ in range(config.concurrent)]
            total = sum(len(s.result(600).tokens) for s in seqs)
            batched.append(total / (time.monotonic() - t0))
        model.close()
    return {"tokens": n, "ours_tokens_per_s": _median(ours), "plain_tokens_per_s": _median(plain),
            "ours_over_plain": _median(ours) / _median(plain), "concurrent": config.concurrent,
            "ours_batched_tokens_per_s": _median(batched), "ours_samples": ours, "plain_samples": plain}


# ---------------------------------------------------------------------- fleet
def _fleet(config: LLMBenchConfig, device: torch.device, dirs: list[Path], progress) -> dict:
    from timeshare.server.process import ServerProcess, free_port

    names = [f"m{i}" for i in range(len(dirs))]
    sizes = sorted((sum(f.stat().st_size for f in hfdir.shard_files(d)) for d in dirs), reverse=True)
    scale = {"fp32": 1.0}.get(config.dtype, 0.5)
    budget = int((sizes[0] + sizes[1]) * scale * 1.05)  # room for the two largest
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


# ---------------------------------------------------------------------- plot
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("wake", "decode", "fleet") if p in result]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        r = result[part]
        if part == "wake":
            labels = ["warm", "cold (timeshare)", "floor", "load then\ngenerate"]
            values = [r["warm_ttft_s"], r["cold_ttft_s"], r["floor_s"], r["load_then_generate_s"]]
            ax.bar(labels, [v * 1e3 for v in values], color=["#999", "#1f77b4", "#2ca02c", "#d62728"])
            ax.set_ylabel("time to first token (ms)")
            ax.set_title(f"wake: {r['bytes'] / 2**20:.0f} MiB model")
        elif part == "decode":
            ax.bar(["timeshare", "transformers", f"timeshare\n{r['concurrent']} together"],
                   [r["ours_tokens_per_s"], r["plain_tokens_per_s"], r["ours_batched_tokens_per_s"]],
                   color=["#1f77b4", "#999", "#17becf"])
            ax.set_ylabel("tokens per second")
            ax.set_title("decode, model resident")
        else:
            a, b = r["timeshare"], r["reload_on_switch"]
            x = range(2)
            ax.bar([i - 0.2 for i in x], [a["ttft_p50_s"], a["ttft_p99_s"]], 0.4, label="timeshare")
            ax.bar([i + 0.2 for i in x], [b["ttft_p50_s"], b["ttft_p99_s"]], 0.4, label="reload on switch")
            ax.set_xticks(list(x), ["p50", "p99"])
            ax.set_yscale("log")
            ax.set_ylabel("time to first token (s)")
            ax.set_title(f"fleet: {r['models']} models, room for 2")
            ax.legend()
    fig.suptitle(f"bench llm on {result['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
