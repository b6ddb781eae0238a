"""``timeshare bench llm``: language models woken with pipelined loading (issue 18). Runs
in the CLI's process; the fleet's two servers are child processes.

Three parts, each on model directories written from code (seeded weights,
``bench/llm_models.py``):
- **wake**: one model, time to first token (TTFT) of a ``prompt_tokens`` prompt when the
  model is resident (warm) and when it is not (cold: evicted, its blocks poisoned, loaded
  pipelined while its prefill runs), against a load-then-generate baseline
  (``from_pretrained`` onto the device, then the prefill: what a server without a
  resident copy does; off with ``baseline=False`` and for the sizes that say why) and
  against the floor ``max(bytes / measured link bandwidth, warm TTFT)``; the cold greedy
  tokens are compared with the warm ones.
- **decode**: for each count of ``concurrent`` sequences generated together, tokens per
  second with the model resident against plain ``transformers`` (the same weights,
  resident, ``generate`` of a batch as large), and whether the greedy tokens are those of
  ``transformers``.
- **fleet** (``bench/llm_fleet.py``): many models in room for two behind the OpenAI API,
  against a reload-on-switch server.

Wake and decode share one runtime and one registration of the model.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from timeshare.bench import llm_models as models
from timeshare.bench.environment import describe
from timeshare.bench.llm_fleet import run_fleet
from timeshare.device import resolve_device, synchronize
from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime
from timeshare.units import format_bytes

SIZES = models.SIZES


@dataclass
class LLMBenchConfig:
    arch: str = "llama"
    size: str = "small"
    dtype: str = "fp32"
    prompt_tokens: int = 64
    new_tokens: int = 32
    concurrent: tuple[int, ...] = (1, 4)  # decode: the counts of sequences generated together, one row each
    repeats: int = 5
    baseline: bool = True  # wake: the load-then-generate baseline (sizes may turn it off: Size.baseline_skipped)
    fleet_models: int = 8
    fleet_requests: int = 100
    fleet_rate_per_s: float = 0.5
    fleet_max_tokens: int = 16
    zipf: float = 1.0
    device: str = "auto"
    seed: int = 0
    workdir: str | None = None  # where the model directories are written (default: a temporary one)
    workers: int = 0  # wake and decode: worker processes (NOTE [One step, two places])
    compile: str = "auto"  # the decode step the graphs capture (NOTE [Compiled decode steps])
    parts: tuple[str, ...] = field(default_factory=lambda: ("wake", "decode", "fleet"))

    def __post_init__(self):
        if self.size not in SIZES or self.arch not in hfdir.ARCHITECTURES:
            raise ConfigError(f"size must be one of {list(SIZES)} and arch one of {list(hfdir.ARCHITECTURES)}")
        self.concurrent = tuple(self.concurrent)
        if not self.concurrent or min(self.concurrent) < 1:
            raise ConfigError(f"concurrent must be one or more counts of sequences, each at least 1, "
                              f"got {list(self.concurrent)}")
        if min(self.prompt_tokens, self.new_tokens, self.repeats) < 1 or self.new_tokens < 2:
            raise ConfigError("prompt_tokens, concurrent and repeats must be at least 1, new_tokens at least 2")
        unknown = set(self.parts) - {"wake", "decode", "fleet"}
        if unknown:
            raise ConfigError(f"unknown parts {sorted(unknown)}; known: wake, decode, fleet")
        if "fleet" in self.parts and (self.fleet_models < 3 or self.fleet_requests < 1 or self.fleet_rate_per_s <= 0):
            raise ConfigError("the fleet needs at least 3 models, 1 request and a positive rate")
        if self.compile not in ("auto", "inductor", "off"):
            raise ConfigError(f"compile must be auto, inductor or off, got {self.compile!r}")
        if self.workers < 0 or self.workers == 1:
            raise ConfigError("workers must be 0 (in-process) or at least 2 (a home and a standby)")
        size = SIZES[self.size]
        if size.drawn and self.arch not in models.DRAWN_ARCHITECTURES:
            raise ConfigError(f"size {self.size} is Llama-shaped: arch one of {list(models.DRAWN_ARCHITECTURES)}, "
                              f"got {self.arch!r}")
        if size.drawn and self.dtype == "fp32":
            raise ConfigError(f"size {self.size} is written in bf16: --dtype bf16 or fp16, not fp32 "
                              "(twice its bytes on the device and in host memory)")
        if "fleet" in self.parts and not size.fleet:
            raise ConfigError(f"size {self.size} runs the wake and decode parts only (the fleet writes "
                              f"{self.fleet_models} models)")

    @property
    def baseline_skipped(self) -> str | None:
        """Why the wake's load-then-generate baseline does not run (None: it runs)."""
        if not self.baseline:
            return "off (--no-baseline)"
        return SIZES[self.size].baseline_skipped


def parse_counts(text: str) -> tuple[int, ...]:
    """"1,8,32" (or "4") as counts of sequences."""
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"concurrent must be comma-separated whole numbers like 1,8,32, got {text!r}") from None


def run(config: LLMBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench prints its own progress
    device = resolve_device(config.device)
    with tempfile.TemporaryDirectory(prefix="timeshare-llm-") as tmp:
        root = Path(config.workdir or tmp)
        count = config.fleet_models if "fleet" in config.parts else 1
        progress(f"writing (or reusing) {count} model directories under {root}")
        positions = max(512, 2 * (config.prompt_tokens + config.new_tokens))
        dirs = [models.write(root, config.arch, config.size, i, seed=config.seed + i, max_positions=positions,
                             device=device) for i in range(count)]
        result: dict = {"config": asdict(config), "environment": describe(device),
                        "models": [models.describe(d) for d in dirs]}
        if {"wake", "decode"} & set(config.parts):
            result.update(_resident(config, device, dirs[0], result["models"][0], progress))
        if "fleet" in config.parts:
            result["fleet"] = run_fleet(config, device, dirs, progress)
    return result


def _resident(config: LLMBenchConfig, device: torch.device, path: Path, described: dict, progress) -> dict:
    """The wake and decode parts, on one runtime that registers the model once."""
    prompt = models.prompt(path, config.prompt_tokens)
    weights = described["parameters"] * torch.empty((), dtype=parse_dtype(config.dtype)).element_size()
    sequences = max(8, *config.concurrent)
    pool = lm.own_pool_bytes(path, config.dtype, sequences)  # its key/value pages, in the arena too
    memory = _arena(device, weights, pool)
    # NOTE [Conversions the weights do not need]: weights already in the run's dtype are
    # registered as the directory has them. (lm.load's dtype once converted the rotary
    # embedding's float32 inv_freq with the weights, and the bf16 greedy tokens parted from
    # transformers' after some tens of positions; computed constants now keep their dtype.)
    convert = described["dtype"] == "mixed" or parse_dtype(config.dtype) != parse_dtype(described["dtype"])
    out: dict = {"memory": {"weights_bytes": weights, "kv_pool_bytes": pool, "arena": memory},
                 "converted_to": config.dtype if convert else None}
    with Runtime(device, memory, poison_evicted=True, workers=config.workers) as rt:
        progress(f"registering the model ({format_bytes(weights)})")
        before = _reserved(device)
        with _without_initialisation():
            model = lm.load(rt, "m", path, dtype=config.dtype if convert else None,
                            max_sequences=sequences, compile=config.compile)
        snap = model.engine.snapshot()
        # What registration took beside the arena (allocated before it; the page pool is a
        # region of the arena): the graphs' memory, the compiled step's and the allocator's
        # cache (None off CUDA).
        after = _reserved(device)
        out["graphs"] = {"captures": snap.graph_captures, "compiled": snap.graphs_compiled,
                         "capture_s": snap.capture_s,
                         "registration_reserved_bytes": None if after is None or before is None else after - before}
        try:
            if "wake" in config.parts:
                progress("wake: warm and cold time to first token")
                out["wake"] = _wake(config, rt, model, prompt)
            if "decode" in config.parts:
                progress(f"decode: tokens per second at {', '.join(map(str, config.concurrent))} sequences")
                out["decode"] = _decode(config, device, model, path, prompt, weights)
        finally:
            model.close()
    if "wake" in config.parts:  # after the runtime let its memory go, as a server without one would have it
        skipped = config.baseline_skipped
        if skipped is None:
            progress("wake: load then generate")
        baseline = None if skipped else _load_then_generate(config, device, path, prompt)
        out["wake"].update({"load_then_generate_s": baseline, "baseline_skipped": skipped,
                            "speedup_vs_load_then_generate": None if baseline is None
                            else baseline / out["wake"]["cold_ttft_s"]})
    return out


def _arena(device: torch.device, weights: int, pool: int) -> int | str:
    """The runtime's memory: "auto" (half the free device memory on CUDA, at most 2 GiB on
    the CPU) where it holds the weights with a quarter to spare for the prefill and the
    key/value ``pool``, else exactly that, refused when the device has not got it."""
    need = weights * 5 // 4 + pool
    if device.type != "cuda":
        return "auto" if need <= 2 << 30 else need
    free = torch.cuda.mem_get_info(device)[0]
    if need > free * 0.9:
        raise ConfigError(f"the model's weights and a quarter more, and its key/value pages ({format_bytes(need)}), "
                          f"do not fit in nine tenths of {device}'s free memory ({format_bytes(free)})")
    return "auto" if free // 2 >= need else need


@contextlib.contextmanager
def _without_initialisation() -> Iterator[None]:
    """NOTE [Registration without initialisation]: the runtime builds a language model's
    module with ``transformers``' ``from_config``, whose random initialisation runs on one
    CPU core (0.13 GB/s measured: half a minute for 1b, four minutes and more for 8b) for
    weights that ``lm.load`` then replaces, every one, from the shards. The bench registers
    with that initialisation off, as ``from_pretrained`` builds its module; nothing measured
    starts before registration ends, and the decode part compares the greedy tokens with
    those of ``from_pretrained``'s module. Worker processes build their own module and pay
    the initialisation there."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    with no_init_weights():
        yield


def _reserved(device: torch.device) -> int | None:
    """The bytes PyTorch's CUDA allocator holds on ``device`` (None off CUDA)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else None


def _ttft(seq) -> float:
    assert seq.first_token_at is not None
    return seq.first_token_at - seq.arrived


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------- wake
def _wake(config: LLMBenchConfig, rt: Runtime, model: Any, prompt: list[int]) -> dict:
    one = SamplingParams(max_tokens=1, temperature=0)
    greedy = SamplingParams(max_tokens=config.new_tokens, temperature=0)
    seen: list[CallRecord] = []
    rt.subscribe(lambda r: seen.append(r) if isinstance(r, CallRecord) else None)
    link_Bps = rt.profile("m").link.bandwidth_Bps
    want = model.generate(prompt, greedy).result(600).tokens
    warm, cold, moved, exact, replayed = [], [], [], 0, 0
    for _ in range(config.repeats):
        seq = model.generate(prompt, one)
        seq.result(600)
        warm.append(_ttft(seq))
        rt.evict("m")
        before = len(seen)
        counts = model.engine.snapshot()
        seq = model.generate(prompt, greedy)
        got = seq.result(600).tokens
        exact += got == want
        cold.append(_ttft(seq))
        moved += [r.moved_bytes for r in seen[before:] if r.loaded and r.moved_bytes]
        # NOTE [Decode graphs]: every decode step after the wake, the first included, replayed.
        after = model.engine.snapshot()
        replayed += (after.eager_steps == counts.eager_steps
                     and after.graph_replays - counts.graph_replays >= len(got) - 1)
    nbytes = max(moved) if moved else 0
    copy_s = nbytes / link_Bps
    w, c = _median(warm), _median(cold)
    return {"bytes": nbytes, "link_GBps": link_Bps / 1e9, "copy_s": copy_s, "warm_ttft_s": w, "cold_ttft_s": c,
            "warm_samples_s": warm, "cold_samples_s": cold, "floor_s": max(copy_s, w),
            "cold_over_warm_plus_copy": c / (w + copy_s), "cold_over_floor": c / max(copy_s, w),
            "cold_tokens_exact": exact, "cold_runs": config.repeats, "cold_decode_replayed_runs": replayed,
            "graph_captures": model.engine.snapshot().graph_captures}


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
def _decode(config: LLMBenchConfig, device: torch.device, model: Any, path: Path, prompt: list[int],
            weights: int) -> dict:
    """At each count of sequences, ours and plain ``transformers`` alternate, repeat after
    repeat, so that the machine's drift falls on both alike. A rate counts the tokens after
    each sequence's first over the time they took: ours from the last first token (the
    engine prefills the sequences queued together one by one before their first decode
    step, so every one is in the batch then) to the last token; ``transformers``' as
    ``generate`` of n tokens less ``generate`` of one, for a batch of the same prompt."""
    from transformers import AutoModelForCausalLM

    n = config.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0)
    module: Any = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(config.dtype))
    module = module.to(device).eval()
    model.generate(prompt, params).result(600)  # resident again after the wake, and warm
    counts = config.concurrent
    want = {c: _plain_tokens(module, device, prompt, c, n) for c in {1, *counts}}  # warms transformers up too
    ours: dict[int, list[float]] = {c: [] for c in counts}
    plain: dict[int, list[float]] = {c: [] for c in counts}
    agree: dict[int, list[int]] = {c: [] for c in counts}
    exact = dict.fromkeys(counts, 0)
    replays = dict.fromkeys(counts, 0)
    eager = dict.fromkeys(counts, 0)
    memory_Bps = device_bandwidth(device)
    for _ in range(config.repeats):
        for c in counts:
            before = model.engine.snapshot()
            seqs = [model.generate(prompt, params) for _ in range(c)]
            got = [s.result(600).tokens for s in seqs]
            exact[c] += sum(g == w for g, w in zip(got, want[c]))
            agree[c] += [_prefix(g, w) for g, w in zip(got, want[c])]
            ours[c].append(_batch_rate(seqs))
            after = model.engine.snapshot()
            replays[c] += after.graph_replays - before.graph_replays
            eager[c] += after.eager_steps - before.eager_steps
            plain[c].append(_plain_rate(module, device, prompt, c, n))
    del module
    # NOTE [Near ties]: in bf16 with a large vocabulary (8b: 128256 tokens, random weights)
    # the two best logits can be equal (8b on the H200: a gap of 0.000 at the 17th token),
    # and a batch of another size, whose kernels add in another order, breaks the tie the
    # other way: transformers' own batch of c parts from its single sequence there. Each
    # row's plain_self_prefix_mean is that control (8b: ours 32/17/16 tokens at 1/8/32
    # sequences, transformers' own 32/17/17).
    # The floor: each step reads every weight and each row's keys and values once, at the
    # device's memory bandwidth (measured here, a copy within the device).
    kv = lm.kv_bytes_per_token(model.config, config.dtype) * (len(prompt) + n // 2)
    floor = {c: c * memory_Bps / (weights + c * kv) for c in counts}
    rows = [{"sequences": c, "ours_tokens_per_s": _median(ours[c]), "plain_tokens_per_s": _median(plain[c]),
             "ours_over_plain": _median(ours[c]) / _median(plain[c]),
             "floor_tokens_per_s": floor[c], "ours_over_floor": _median(ours[c]) / floor[c],
             "graph_replays": replays[c], "eager_steps": eager[c],
             "tokens_exact": exact[c],
             "sequences_compared": len(agree[c]), "agreeing_prefix_mean": statistics.fmean(agree[c]),
             "plain_self_prefix_mean": statistics.fmean(_prefix(w, want[1][0]) for w in want[c]),
             "ours_samples": ours[c], "plain_samples": plain[c]}
            for c in counts]
    # The first row also under the names of the runs of one count, which readers of earlier
    # results take (bench/campaign_tables.py).
    first = {k: rows[0][k] for k in ("ours_tokens_per_s", "plain_tokens_per_s", "ours_over_plain")}
    return {"tokens": n, "memory_GBps": memory_Bps / 1e9, "weights_bytes": weights, "rows": rows, **first}


def device_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a copy within ``device`` reads and writes (the best of five)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def _prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _batch_rate(seqs: list) -> float:
    start = max(s.first_token_at for s in seqs)
    end = max(s.last_token_at for s in seqs)
    tokens = sum(len(s.tokens) - 1 for s in seqs)
    return tokens / (end - start) if end > start else float("nan")


def _plain_generate(module: Any, device: torch.device, prompt: list[int], c: int, k: int, *, exactly: bool):
    ids = torch.tensor([prompt] * c, device=device)
    return module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                           pad_token_id=0, **({"min_new_tokens": k} if exactly else {}))


def _plain_rate(module: Any, device: torch.device, prompt: list[int], c: int, n: int) -> float:
    t = []
    for k in (1, n):
        synchronize(device)
        t0 = time.perf_counter()
        _plain_generate(module, device, prompt, c, k, exactly=True)
        synchronize(device)
        t.append(time.perf_counter() - t0)
    return c * (n - 1) / (t[1] - t[0])


def _plain_tokens(module: Any, device: torch.device, prompt: list[int], c: int, n: int) -> list[list[int]]:
    """``transformers``' greedy tokens for a batch of ``c`` prompts, each row up to and with
    its first end-of-sequence token (as ours stop there)."""
    eos = module.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows = []
    for row in _plain_generate(module, device, prompt, c, n, exactly=False)[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


# ---------------------------------------------------------------------- plot
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("wake", "decode", "fleet") if p in result]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        {"wake": _plot_wake, "decode": _plot_decode, "fleet": _plot_fleet}[part](ax, result[part])
    fig.suptitle(f"bench llm on {result['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_wake(ax, r: dict) -> None:
    bars = [("warm", r["warm_ttft_s"], "#999"), ("cold (timeshare)", r["cold_ttft_s"], "#1f77b4"),
            ("floor", r["floor_s"], "#2ca02c")]
    if r["load_then_generate_s"] is not None:
        bars.append(("load then\ngenerate", r["load_then_generate_s"], "#d62728"))
    ax.bar([b[0] for b in bars], [b[1] * 1e3 for b in bars], color=[b[2] for b in bars])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"wake: {r['bytes'] / 2**20:.0f} MiB model")


def _plot_decode(ax, r: dict) -> None:
    x = range(len(r["rows"]))
    ax.bar([i - 0.27 for i in x], [row["ours_tokens_per_s"] for row in r["rows"]], 0.27, label="timeshare")
    ax.bar([i for i in x], [row["plain_tokens_per_s"] for row in r["rows"]], 0.27, label="transformers")
    ax.bar([i + 0.27 for i in x], [row.get("floor_tokens_per_s", float("nan")) for row in r["rows"]], 0.27,
           label="memory-bandwidth floor", color="#2ca02c")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [str(row["sequences"]) for row in r["rows"]])
    ax.set_xlabel("sequences together")
    ax.set_ylabel("tokens per second")
    ax.set_title("decode, model resident")
    ax.legend()


def _plot_fleet(ax, r: dict) -> None:
    a, b = r["timeshare"], r["reload_on_switch"]
    x = range(2)
    ax.bar([i - 0.2 for i in x], [a["ttft_p50_s"], a["ttft_p99_s"]], 0.4, label="timeshare")
    ax.bar([i + 0.2 for i in x], [b["ttft_p50_s"], b["ttft_p99_s"]], 0.4, label="reload on switch")
    ax.set_xticks(list(x), ["p50", "p99"])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"fleet: {r['models']} models, room for 2")
    ax.legend()
