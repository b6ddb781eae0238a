"""``timeshare demo`` (``make demo``): the real server on the embedded default config
(the zoo models and a training job, on whatever device is present) with a small
language model beside them (a directory written here from code: seeded weights, a
trained tokenizer), a mixed workload replayed through HTTP (the Open Inference Protocol
and, for the language model, streamed chats through the OpenAI-compatible API), and
what it shows: per-model latency, the switches and what they cost, time to first token,
and how busy the device was. Every chat's greedy text is compared with ``transformers``'
own ``generate`` on the same weights. Writes a PNG of latency over time with the
switches marked, and every number as JSON.

Runs in the caller's process; the server runs in a child process, started and stopped
(SIGTERM, drained) as an operator would.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from timeshare.config import DEFAULT_CONFIG, parse_config
from timeshare.models.zoo import get as zoo_get
from timeshare.units import parse_bytes


@dataclass
class DemoConfig:
    config: Path = DEFAULT_CONFIG
    duration_s: float = 40.0
    load: float = 0.6  # offered load as a share of the device's capacity at batch 1 (measured)
    phase_s: float = 10.0  # every phase favours other models, so residency has to change
    clients: int = 16
    seed: int = 0
    out: Path = Path("demo-output")
    llm: bool = True  # a small language model beside the zoo models (needs transformers)
    chat_interval_s: float = 2.0


def run(cfg: DemoConfig, progress=lambda msg: None) -> dict:
    from timeshare.harness.client import Client
    from timeshare.harness.process import ServerProcess

    doc = yaml.safe_load(Path(cfg.config).read_text()) or {}
    config = parse_config(doc, str(cfg.config))
    if not config.models or any(m.zoo is None for m in config.models):
        raise ValueError("the demo replays zoo models: every model of its config needs 'zoo'")
    models = [(m.name, m.zoo) for m in config.models if m.zoo is not None]  # all of them (checked above)
    cfg.out.mkdir(parents=True, exist_ok=True)
    chat = _chat_model(cfg, doc) if cfg.llm else None
    server = ServerProcess(doc, log_path=cfg.out / "server.log")
    t_start = time.perf_counter()
    progress("starting the server (registering and warming up the models)")
    server.start(progress=lambda line: progress(f"starting the server: {line[-100:]}"))
    startup_s = time.perf_counter() - t_start
    client = Client(server.url, timeout_s=120)
    try:
        status = client.http.get("/admin/status").json()
        # The device's pace at batch 1, from one resident call per model.
        ready_s = {}
        for name, zoo in models:
            inputs = _inputs(zoo, 0)
            client.infer(name, inputs)
            t0 = time.perf_counter()
            answer = client.infer(name, inputs)
            ready_s[name] = time.perf_counter() - t0 if answer.status == 200 else 1.0
        rate = cfg.load * len(models) / sum(ready_s.values())
        before = _metrics(client)
        progress(f"replaying {cfg.duration_s:.0f} s of requests at {rate:.1f}/s")
        chats: list[dict] = []
        chatter = None
        if chat is not None:
            chatter = threading.Thread(target=_chat, args=(server.url, chat, cfg, chats), daemon=True)
            chatter.start()
        records = _replay(client, models, rate, cfg)
        if chatter is not None:
            chatter.join(cfg.duration_s + 120)  # its chats end within the duration (each has a deadline)
            chats = list(chats)
        after = _metrics(client)
        jobs = client.http.get("/admin/training").json()
    finally:
        client.close()
        progress("stopping the server (SIGTERM: drain, then exit)")
        code = server.stop()
        leftovers = [server.describe(pid) for pid in server.leftovers()]
        server.close()
    summary = _summarize(records, models, before, after, cfg, rate)
    if chat is not None:
        summary["chat"] = _chat_summary(chat, chats)
        summary["errors"] += summary["chat"]["errors"] + summary["chat"]["mismatched"]
    summary.update(device=status.get("device"), memory_budget_bytes=status.get("capacity_bytes"),
                   startup_s=startup_s, ready_ms={k: v * 1e3 for k, v in ready_s.items()},
                   server_exit_code=code, server_leftover_processes=len(leftovers),
                   server_leftovers=leftovers, training=jobs)
    from timeshare.bench.environment import describe
    from timeshare.device import resolve_device

    result = {"demo": "serve", "config": str(cfg.config), "server_config": doc,
              "environment": describe(resolve_device(config.runtime.device)), "summary": summary, "requests": records}
    (cfg.out / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(records, summary, cfg.out / "demo.png")
    return result


# ---------------------------------------------------------------------- the language model
CHAT_NAME = "chat"
CHAT_PROMPTS = ("load the weights", "switch the model fast", "share the gpu time", "wake the cache")


def _chat_model(cfg: DemoConfig, doc: dict) -> dict | None:
    """Write a small Llama-style model directory into the output folder, add it to the
    server's config and compute the greedy reply to each prompt with ``transformers``
    (the reference every answer is compared with). None without ``transformers``."""
    try:
        import transformers
    except ImportError:
        return None
    from timeshare.llm import hfdir

    transformers.utils.logging.disable_progress_bar()  # the demo prints its own progress

    # About 20M parameters (80 MB) beside the zoo models in the default's budget; a 1.5 MB
    # model when the budget is small (a quick run's).
    memory = doc.get("runtime", {}).get("memory", "auto")
    small = memory != "auto" and parse_bytes(memory) < 200 << 20
    hidden, layers, heads = (128, 2, 4) if small else (512, 8, 8)
    path = hfdir.write_model_dir(cfg.out / "chat-model", "llama", seed=cfg.seed, hidden=hidden, layers=layers,
                                 heads=heads)
    doc.setdefault("llms", []).append({"name": CHAT_NAME, "path": str(path), "max_sequences": 4})
    if memory != "auto":  # its pages of key/value caches are a region of the arena too (NOTE [Regions of the arena])
        from timeshare.llm.model import own_pool_bytes

        doc["runtime"]["memory"] = parse_bytes(memory) + own_pool_bytes(path, None, 4)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    reference = {}
    for prompt in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")
        out = model.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=24,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        reference[prompt] = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"path": str(path), "reference": reference}


def _chat(url: str, chat: dict, cfg: DemoConfig, out: list[dict]) -> None:
    """Streamed greedy chats through the OpenAI-compatible API, one every
    ``chat_interval_s``, beside the replay."""
    import httpx

    rng = random.Random(cfg.seed + 1)
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.perf_counter() - t0 < cfg.duration_s:
            prompt = rng.choice(CHAT_PROMPTS)
            body = {"model": CHAT_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            sent = time.perf_counter()
            first, text, tokens, error = None, [], 0, None
            try:
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        error = f"HTTP {r.status_code}: {r.text[:200]}"
                    for line in r.iter_lines() if error is None else ():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                        for c in chunk.get("choices", []):
                            if c["delta"].get("content"):
                                first = first or time.perf_counter()
                                text.append(c["delta"]["content"])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            except httpx.HTTPError as exc:
                error = repr(exc)
            done = time.perf_counter()
            out.append({"sent_s": sent - t0, "prompt": prompt, "text": "".join(text), "error": error,
                        "ttft_ms": None if first is None else (first - sent) * 1e3, "latency_ms": (done - sent) * 1e3,
                        "tokens": tokens})
            time.sleep(max(0.0, cfg.chat_interval_s - (time.perf_counter() - sent)))


def _chat_summary(chat: dict, chats: list[dict]) -> dict:
    ok = [c for c in chats if c["error"] is None]
    ttft = [c["ttft_ms"] for c in ok if c["ttft_ms"] is not None]
    return {"model": CHAT_NAME, "requests": len(chats), "answered": len(ok), "errors": len(chats) - len(ok),
            "mismatched": sum(c["text"] != chat["reference"][c["prompt"]] for c in ok),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "latency_p50_ms": _pct([c["latency_ms"] for c in ok], 50), "tokens": sum(c["tokens"] for c in ok),
            "chats": chats}


def _inputs(zoo: str, seed: int) -> dict:
    z = zoo_get(zoo)
    return dict(zip(z.input_names, z.example_inputs(1, seed=seed)))


def _replay(client, models, rate: float, cfg: DemoConfig) -> list[dict]:
    """Open-loop Poisson arrivals; each phase draws models with rotated weights."""
    rng = random.Random(cfg.seed)
    names = [n for n, _ in models]
    zoo = dict(models)
    weights = [0.7] + [0.3 / max(1, len(names) - 1)] * (len(names) - 1)
    records, lock = [], threading.Lock()
    t0 = time.perf_counter()

    def send(i: int, name: str, at: float) -> None:
        inputs = _inputs(zoo[name], i + 1)
        sent = time.perf_counter() - t0
        answer = client.infer(name, inputs, request_id=str(i))
        done = time.perf_counter() - t0
        p = answer.parameters
        with lock:
            records.append({"id": i, "model": name, "sent_s": sent, "latency_ms": (done - sent) * 1e3,
                            "status": answer.status, "error": answer.error,
                            "queue_ms": p.get("timeshare_queue_ms"), "compute_ms": p.get("timeshare_compute_ms"),
                            "loaded": bool(p.get("timeshare_loaded")),
                            "switched_from": p.get("timeshare_switched_from"),
                            "batch_rows": p.get("timeshare_batch_rows")})

    with ThreadPoolExecutor(cfg.clients) as pool:
        at, i = 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at >= cfg.duration_s:
                break
            phase = int(at // cfg.phase_s)
            order = names[phase % len(names):] + names[:phase % len(names)]
            name = rng.choices(order, weights)[0]
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, i, name, at)
            i += 1
    records.sort(key=lambda r: r["id"])
    return records


def _metrics(client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.metrics_text()):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def _delta(before: dict, after: dict, name: str) -> float:
    """A counter's increase over the run, summed over its labels."""
    total = 0.0
    for key, value in after.items():
        if key == name or key.startswith(name + "|"):
            total += value - before.get(key, 0.0)
    return total


def _summarize(records, models, before, after, cfg: DemoConfig, rate: float) -> dict:
    ok = [r for r in records if r["status"] == 200]
    wall = max((r["sent_s"] + r["latency_ms"] / 1e3 for r in records), default=cfg.duration_s)
    per_model = {}
    for name, _ in models:
        mine = [r for r in ok if r["model"] == name]
        sw = [r["compute_ms"] for r in mine if r["switched_from"]]
        per_model[name] = {
            "requests": sum(r["model"] == name for r in records), "answered": len(mine),
            "p50_ms": _pct([r["latency_ms"] for r in mine], 50), "p99_ms": _pct([r["latency_ms"] for r in mine], 99),
            "loads": sum(r["loaded"] for r in mine), "switches": len(sw), "switch_p50_ms": _pct(sw, 50),
        }
    switched = [r["compute_ms"] for r in ok if r["switched_from"]]
    busy = _delta(before, after, "timeshare_device_busy_seconds_total")
    inference = _delta(before, after, "timeshare_device_busy_seconds_total|task=inference")
    return {
        "duration_s": cfg.duration_s, "offered_rate_per_s": rate, "requests": len(records), "answered": len(ok),
        "errors": len(records) - len(ok), "per_model": per_model,
        "switches": len(switched),
        "switches_from_training": sum(1 for r in ok if r["switched_from"] and r["switched_from"] not in dict(models)),
        "switch_p50_ms": _pct(switched, 50), "switch_p99_ms": _pct(switched, 99),
        "loads": sum(r["loaded"] for r in ok),
        "evictions": _delta(before, after, "timeshare_evictions_total"),
        "preemptions": _delta(before, after, "timeshare_preemptions_total"),
        "training_iterations": _delta(before, after, "timeshare_training_iterations_total"),
        "device_busy_s": busy, "device_utilization": busy / wall if wall > 0 else None,
        "inference_busy_s": inference, "inference_utilization": inference / wall if wall > 0 else None,
        "mean_batch_rows": float(np.mean([r["batch_rows"] for r in ok])) if ok else None,
    }


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if values else None


def plot(records: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    names = list(summary["per_model"])
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for name in names:
        mine = [r for r in records if r["model"] == name and r["status"] == 200]
        ax.scatter([r["sent_s"] for r in mine], [r["latency_ms"] for r in mine], s=10, color=colors[name],
                   label=f"{name} (p50 {summary['per_model'][name]['p50_ms'] or 0:.0f} ms)")
        loads = [r for r in mine if r["loaded"]]
        ax.scatter([r["sent_s"] for r in loads], [r["latency_ms"] for r in loads], s=60, marker="^",
                   facecolors="none", edgecolors=colors[name])
    for r in records:
        if r["status"] == 200 and r["switched_from"] and r["switched_from"] in names:
            ax.axvline(r["sent_s"], color="grey", alpha=0.25, lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("time since the workload started (s)")
    ax.set_ylabel("request latency (ms, log)")
    util = summary.get("device_utilization")
    ax.set_title(f"timeshare demo on {summary.get('device')}: {summary['answered']} requests, "
                 f"{summary['switches']} switches (grey: between models; triangles: loaded the model), "
                 f"device busy {100 * util:.0f}%" if util is not None else "timeshare demo", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
