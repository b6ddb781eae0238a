"""``timeshare bench llm``: language models woken with pipelined loading (issue 18), in each
deployment mode side by side (issue 45): in-process and with worker processes (NOTE [One
step, two places]). Runs in the CLI's process; the fleet's two servers are child processes.

Five parts, each on model directories written from code (seeded weights,
``bench/llm_models.py``); wake, decode, prefix and structured run once per mode (``modes``) and are
reported under ``modes``, with decode's rates compared between the modes:
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
- **prefix** (NOTE [Prefix caching]): a ``system_tokens`` system prompt followed by short
  user turns: time to first token with the system prompt's pages cached against the same
  request on a registration of the model without prefix caching (the tokens compared), and
  decode tokens/s at a 0% hit rate (every prompt new) with and without prefix caching.
- **structured** (NOTE [Constrained decoding]): decode tokens/s of answers held to drawn
  JSON schemas against unconstrained ones at the largest count of ``concurrent``, and the
  host time of the grammars' masks per token.
- **fleet** (``bench/llm_fleet.py``): many models in room for two behind the OpenAI API,
  against a reload-on-switch server.

In each mode, wake, decode and prefix share one runtime and one registration of the model
(two with prefix: the second without prefix caching).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from timeshare.bench import llm_models as models
from timeshare.bench.common import batch_rate, plain_generate, plain_rate
from timeshare.bench.environment import describe
from timeshare.bench.llm_adapters import plain_peft, run_adapters, write_adapters
from timeshare.bench.llm_fleet import run_fleet
from timeshare.device import resolve_device, synchronize
from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.adapters import DEFAULT_SLOTS
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime
from timeshare.units import format_bytes

SIZES = models.SIZES
MODES = ("in-process", "workers")
PARTS = ("wake", "decode", "prefix", "structured", "fleet", "adapters")
DEFAULT_PARTS = ("wake", "decode", "prefix", "structured", "fleet")


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
    modes: tuple[str, ...] = MODES  # wake, decode and prefix in each (NOTE [One step, two places])
    workers: int = 2  # the worker processes of the "workers" mode
    compile: str = "auto"  # the decode step the graphs capture (NOTE [Compiled decode steps])
    system_tokens: int = 1500  # prefix: the system prompt every request shares
    turn_tokens: int = 16  # prefix: each request's own turn after it
    adapters: tuple[int, ...] = (1, 8)  # adapters: the counts of adapters a batch mixes (bench/llm_adapters.py)
    lora_rank: int = 16  # adapters: their rank, on every projection
    max_loras: int = DEFAULT_SLOTS  # adapters: the slots on the device (as timeshare serve's default)
    parts: tuple[str, ...] = field(default_factory=lambda: DEFAULT_PARTS)

    def __post_init__(self):
        if self.size not in SIZES or self.arch not in hfdir.ARCHITECTURES:
            raise ConfigError(f"size must be one of {list(SIZES)} and arch one of {list(hfdir.ARCHITECTURES)}")
        self.concurrent = tuple(self.concurrent)
        if not self.concurrent or min(self.concurrent) < 1:
            raise ConfigError(f"concurrent must be one or more counts of sequences, each at least 1, "
                              f"got {list(self.concurrent)}")
        if min(self.prompt_tokens, self.new_tokens, self.repeats) < 1 or self.new_tokens < 2:
            raise ConfigError("prompt_tokens, concurrent and repeats must be at least 1, new_tokens at least 2")
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ConfigError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
        self.modes = tuple(self.modes)
        if not self.modes or set(self.modes) - set(MODES) or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"modes must be one or both of {', '.join(MODES)}, got {list(self.modes)}")
        if min(self.system_tokens, self.turn_tokens) < 1:
            raise ConfigError("system_tokens and turn_tokens must be at least 1")
        if "fleet" in self.parts and (self.fleet_models < 3 or self.fleet_requests < 1 or self.fleet_rate_per_s <= 0):
            raise ConfigError("the fleet needs at least 3 models, 1 request and a positive rate")
        self.adapters = tuple(self.adapters)
        if "adapters" in self.parts and (not self.adapters or min(self.adapters) < 1 or self.lora_rank < 1
                                         or self.max_loras < 1):
            raise ConfigError(f"adapters must be counts of at least 1, lora_rank and max_loras at least 1, got "
                              f"{list(self.adapters)}, {self.lora_rank} and {self.max_loras}")
        if self.compile not in ("auto", "inductor", "off"):
            raise ConfigError(f"compile must be auto, inductor or off, got {self.compile!r}")
        if "workers" in self.modes and self.workers < 2:
            raise ConfigError("workers must be at least 2 (a home and a standby) for the workers mode")
        size = SIZES[self.size]
        if size.drawn and self.arch not in models.DRAWN_ARCHITECTURES:
            raise ConfigError(f"size {self.size} is Llama-shaped: arch one of {list(models.DRAWN_ARCHITECTURES)}, "
                              f"got {self.arch!r}")
        if size.drawn and self.dtype == "fp32":
            raise ConfigError(f"size {self.size} is written in bf16: --dtype bf16 or fp16, not fp32 "
                              "(twice its bytes on the device and in host memory)")
        if "fleet" in self.parts and not size.fleet:
            raise ConfigError(f"size {self.size} runs the wake, decode and prefix parts only (the fleet writes "
                              f"{self.fleet_models} models)")

    @property
    def context(self) -> int:
        """The positions the model is loaded for: a decode's prompt and tokens, or the
        prefix part's system prompt, turn and tokens."""
        need = self.prompt_tokens + self.new_tokens
        if "prefix" in self.parts:
            need = max(need, self.system_tokens + self.turn_tokens + self.new_tokens)
        return need + 1

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
        positions = max(512, 2 * (config.prompt_tokens + config.new_tokens), config.context)
        dirs = [models.write(root, config.arch, config.size, i, seed=config.seed + i, max_positions=positions,
                             device=device) for i in range(count)]
        result: dict = {"config": asdict(config), "environment": describe(device),
                        "models": [models.describe(d) for d in dirs]}
        if {"wake", "decode", "prefix", "structured"} & set(config.parts):
            result["modes"] = {mode: _resident(config, device, dirs[0], result["models"][0], progress,
                                               config.workers if mode == "workers" else 0)
                               for mode in config.modes}
            if "wake" in config.parts:  # once, after the runtimes let their memory go
                skipped = config.baseline_skipped
                if skipped is None:
                    progress("wake: load then generate")
                baseline = None if skipped else _load_then_generate(config, device, dirs[0], models.prompt(
                    dirs[0], config.prompt_tokens))
                for r in result["modes"].values():
                    r["wake"].update({"load_then_generate_s": baseline, "baseline_skipped": skipped,
                                      "speedup_vs_load_then_generate": None if baseline is None
                                      else baseline / r["wake"]["cold_ttft_s"]})
            if "decode" in config.parts and len(config.modes) == 2:
                result["decode_modes"] = compare_modes(result["modes"])
        if "fleet" in config.parts:
            result["fleet"] = run_fleet(config, device, dirs, progress)
        if "adapters" in config.parts:  # NOTE [Adapters in slots]
            for mode in config.modes:
                result.setdefault("modes", {}).setdefault(mode, {})["adapters"] = run_adapters(
                    config, device, dirs[0], config.workers if mode == "workers" else 0, root / "adapters", progress)
            progress("adapters: plain PEFT's generate of the same mixed batches")
            paths = write_adapters(dirs[0], root / "adapters", max(config.adapters), config.lora_rank, config.seed)
            result["adapters_peft"] = plain_peft(config, device, dirs[0], paths, max(config.concurrent))
    return result


def compare_modes(modes: dict) -> list[dict]:
    """Decode in the two modes, count by count: each mode's tokens/s, workers over
    in-process, and the same normalized by each mode's own transformers' rate (the two
    modes ran one after the other: a drift of the machine between them falls out)."""
    rows = []
    for a, b in zip(modes["in-process"]["decode"]["rows"], modes["workers"]["decode"]["rows"]):
        rows.append({"sequences": a["sequences"], "in_process_tokens_per_s": a["ours_tokens_per_s"],
                     "workers_tokens_per_s": b["ours_tokens_per_s"],
                     "workers_over_in_process": b["ours_tokens_per_s"] / a["ours_tokens_per_s"],
                     "workers_over_in_process_normalized": b["ours_over_plain"] / a["ours_over_plain"]})
    return rows


def _resident(config: LLMBenchConfig, device: torch.device, path: Path, described: dict, progress,
              workers: int) -> dict:
    """The wake, decode and prefix parts in one mode (``workers`` worker processes, or 0:
    in-process), on one runtime that registers the model once (twice with prefix)."""
    mode = "workers" if workers else "in-process"
    prompt = models.prompt(path, config.prompt_tokens)
    weights = described["parameters"] * torch.empty((), dtype=parse_dtype(config.dtype)).element_size()
    sequences = max(8, *config.concurrent)
    context = config.context
    pool = lm.own_pool_bytes(path, config.dtype, sequences, context)  # its key/value pages, in the arena too
    copies = 2 if "prefix" in config.parts else 1  # the prefix part's second registration, without caching
    memory = _arena(device, copies * weights, copies * pool)
    # NOTE [Conversions the weights do not need]: weights already in the run's dtype are
    # registered as the directory has them. (lm.load's dtype once converted the rotary
    # embedding's float32 inv_freq with the weights, and the bf16 greedy tokens parted from
    # transformers' after some tens of positions; computed constants now keep their dtype.)
    convert = described["dtype"] == "mixed" or parse_dtype(config.dtype) != parse_dtype(described["dtype"])
    out: dict = {"workers": workers,
                 "memory": {"weights_bytes": weights, "kv_pool_bytes": pool, "copies": copies, "arena": memory},
                 "converted_to": config.dtype if convert else None}
    with Runtime(device, memory, poison_evicted=True, workers=workers) as rt:
        progress(f"{mode}: registering the model ({format_bytes(weights)})")
        before = _reserved(device)
        load = functools.partial(lm.load, rt, path=path, dtype=config.dtype if convert else None,
                                 max_sequences=sequences, max_context=context, compile=config.compile)
        with _without_initialisation():
            model = load(name="m")
        snap = model.engine.snapshot()
        # What registration took beside the arena (allocated before it; the page pool is a
        # region of the arena): the graphs' memory, the compiled step's and the allocator's
        # cache (None off CUDA; in the controller's process: a worker's own is not seen).
        after = _reserved(device)
        out["graphs"] = {"captures": snap.graph_captures, "compiled": snap.graphs_compiled,
                         "capture_s": snap.capture_s,
                         "registration_reserved_bytes": None if after is None or before is None else after - before}
        plain = None
        try:
            if "prefix" in config.parts:
                with _without_initialisation():
                    plain = load(name="m-plain", prefix_caching=False)
            if "wake" in config.parts:
                progress(f"{mode}: wake: warm and cold time to first token")
                out["wake"] = _wake(config, rt, model, path)
            if "decode" in config.parts:
                progress(f"{mode}: decode: tokens per second at {', '.join(map(str, config.concurrent))} sequences")
                out["decode"] = _decode(config, device, model, path, prompt, weights)
            if plain is not None:
                progress(f"{mode}: prefix: a {config.system_tokens}-token system prompt, cached and not")
                out["prefix"] = _prefix_part(config, model, plain, path)
            if "structured" in config.parts:
                progress(f"{mode}: structured: decode held to JSON schemas, and not")
                out["structured"] = _structured(config, model, prompt)
        finally:
            model.close()
            if plain is not None:
                plain.close()
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
def _wake(config: LLMBenchConfig, rt: Runtime, model: Any, path: Path) -> dict:
    """Warm and cold time to first token of a prompt none of whose pages is cached (a new
    one for every request: NOTE [Prefix caching] would otherwise spare the cold prefill
    its first pages); a cold request's greedy tokens are compared with those of the same
    prompt asked again, warm (which then finds its pages cached)."""
    one = SamplingParams(max_tokens=1, temperature=0)
    greedy = SamplingParams(max_tokens=config.new_tokens, temperature=0)
    seen: list[CallRecord] = []
    rt.subscribe(lambda r: seen.append(r) if isinstance(r, CallRecord) else None)
    link_Bps = rt.profile("m").link.bandwidth_Bps
    model.generate(models.prompt(path, config.prompt_tokens, variant=-1), greedy).result(600)
    warm, cold, moved, exact, replayed = [], [], [], 0, 0
    for i in range(config.repeats):
        seq = model.generate(models.prompt(path, config.prompt_tokens, variant=2 * i + 1), one)
        seq.result(600)
        warm.append(_ttft(seq))
        rt.evict("m")
        before = len(seen)
        counts = model.engine.snapshot()
        prompt = models.prompt(path, config.prompt_tokens, variant=2 * i + 2)
        seq = model.generate(prompt, greedy)
        got = seq.result(600).tokens
        cold.append(_ttft(seq))
        # The load's record reaches listeners after the runtime's lock is let go, by the
        # thread delivering then: under load, possibly after the answer (NOTE [Records
        # outside the lock]). Waited for, a few seconds at most.
        deadline = time.monotonic() + 10
        while not any(r.loaded for r in seen[before:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        moved += [r.moved_bytes for r in seen[before:] if r.loaded and r.moved_bytes]
        # NOTE [Decode graphs]: every decode step after the wake, the first included, replayed.
        after = model.engine.snapshot()
        replayed += (after.eager_steps == counts.eager_steps
                     and after.graph_replays - counts.graph_replays >= len(got) - 1)
        exact += got == model.generate(prompt, greedy).result(600).tokens
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
            ours[c].append(batch_rate(seqs))
            after = model.engine.snapshot()
            replays[c] += after.graph_replays - before.graph_replays
            eager[c] += after.eager_steps - before.eager_steps
            plain[c].append(plain_rate(module, device, prompt, c, n))
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
             # Each repeat ran ours then transformers' at once: the median of those pairs'
             # ratios, which a drift of the machine over the run moves less.
             "ours_over_plain_paired": _median([a / b for a, b in zip(ours[c], plain[c])]),
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


def _prefix_part(config: LLMBenchConfig, model: Any, plain: Any, path: Path) -> dict:
    """NOTE [Prefix caching]: requests made of one system prompt and a turn of their own,
    to the model and to its registration without prefix caching, alternating (each
    request's time to first token, and whether the two give the same greedy tokens); then
    decode tokens/s at a 0% hit rate (every prompt new) with and without prefix caching,
    alternating, at the largest count of ``concurrent``."""
    system = models.prompt(path, config.system_tokens, variant=-2)
    params = SamplingParams(max_tokens=min(8, config.new_tokens), temperature=0)
    turn = functools.partial(models.prompt, path, config.turn_tokens)
    for m in (model, plain):  # warm, and the system prompt's pages published (in the cached model)
        m.generate(system + turn(variant=0), params).result(600)
    before = model.engine.snapshot()
    cached: list[float] = []
    uncached: list[float] = []
    equal = 0
    for i in range(config.repeats):
        prompt = system + turn(variant=1 + i)
        order = (model, plain) if i % 2 == 0 else (plain, model)
        got = {}
        for m in order:
            seq = m.generate(prompt, params)
            got[m.name] = seq.result(600).tokens
            (cached if m is model else uncached).append(_ttft(seq))
        equal += got[model.name] == got[plain.name]
    after = model.engine.snapshot()
    c = max(config.concurrent)
    decode = SamplingParams(max_tokens=config.new_tokens, temperature=0)
    rates: dict[str, list[float]] = {"cached": [], "plain": []}
    for i in range(config.repeats):
        order = (model, plain) if i % 2 == 0 else (plain, model)
        for m in order:  # prompts no request asked before: every page a miss
            seqs = [m.generate(models.prompt(path, config.prompt_tokens, variant=10_000 + 100 * i + j
                                             + (50 if m is plain else 0)), decode) for j in range(c)]
            for seq in seqs:
                seq.result(600)
            rates["cached" if m is model else "plain"].append(batch_rate(seqs))
    pairs = [a / b for a, b in zip(rates["cached"], rates["plain"])]
    t_cached, t_plain = _median(cached), _median(uncached)
    return {"system_tokens": config.system_tokens, "turn_tokens": config.turn_tokens,
            "ttft_cached_s": t_cached, "ttft_uncached_s": t_plain, "cached_over_uncached": t_cached / t_plain,
            "ttft_cached_samples_s": cached, "ttft_uncached_samples_s": uncached,
            "tokens_equal": equal, "requests_compared": config.repeats,
            "hits": after.prefix_hits - before.prefix_hits, "misses": after.prefix_misses - before.prefix_misses,
            "miss_decode_sequences": c, "miss_decode_cached_tokens_per_s": _median(rates["cached"]),
            "miss_decode_plain_tokens_per_s": _median(rates["plain"]),
            "miss_decode_cached_over_plain": _median(pairs), "miss_decode_samples": rates}


def _structured(config: LLMBenchConfig, model: Any, prompt: list[int]) -> dict:
    """NOTE [Constrained decoding]: at the largest count of ``concurrent``, greedy answers
    held to drawn JSON schemas (``bench/json_schemas.py``), then greedy answers of the same
    lengths unconstrained, round after round: each one's decode tokens/s, and what the
    grammars' masks cost per token (the engine's count of the host time they took)."""
    from timeshare.bench.json_schemas import schemas
    from timeshare.llm.constrained import OutputFormat

    c = max(config.concurrent)
    drawn = schemas(config.repeats * c, seed=config.seed)
    rates: dict[str, list[float]] = {"constrained": [], "plain": []}
    tokens = 0
    before = model.engine.snapshot()
    for i in range(config.repeats):
        held = [SamplingParams(max_tokens=config.new_tokens, temperature=0,
                               output=OutputFormat.json_schema(s)) for s in drawn[i * c:(i + 1) * c]]
        seqs = [model.generate(prompt, p) for p in held]
        lengths = [len(s.result(600).tokens) for s in seqs]
        tokens += sum(lengths)
        rates["constrained"].append(batch_rate(seqs))
        # The same lengths unconstrained: the batch shrinks as the constrained one did.
        seqs = [model.generate(prompt, SamplingParams(max_tokens=max(2, n), temperature=0))
                for n in lengths]
        for s in seqs:
            s.result(600)
        rates["plain"].append(batch_rate(seqs))
    after = model.engine.snapshot()
    masks, mask_s = after.masks - before.masks, after.mask_s - before.mask_s
    return {"sequences": c, "constrained_tokens_per_s": _median(rates["constrained"]),
            "plain_tokens_per_s": _median(rates["plain"]),
            "constrained_over_plain": _median([a / b for a, b in zip(rates["constrained"], rates["plain"])]),
            "mask_us_per_token": 1e6 * mask_s / masks if masks else None, "masks": masks,
            "constrained_tokens": tokens, "samples": rates}


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


def _plain_tokens(module: Any, device: torch.device, prompt: list[int], c: int, n: int) -> list[list[int]]:
    """``transformers``' greedy tokens for a batch of ``c`` prompts, each row up to and with
    its first end-of-sequence token (as ours stop there)."""
    eos = module.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows = []
    for row in plain_generate(module, device, prompt, c, n, exactly=False)[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


# ---------------------------------------------------------------------- plot
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result.get("modes", {})
    plotters: tuple[tuple[str, Callable[[Any, dict], None]], ...] = (
        ("wake", _plot_wake), ("decode", _plot_decode), ("prefix", _plot_prefix),
        ("fleet", lambda ax, r: _plot_fleet(ax, r["fleet"])), ("adapters", _plot_adapters))
    whole = ("fleet", "adapters")  # their plotters read the whole result
    panels = [(part, plotter) for part, plotter in plotters
              if (part == "fleet" and "fleet" in result) or any(part in r for r in modes.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (part, plotter) in zip(axes[0], panels):
        plotter(ax, result if part in whole else modes)
    fig.suptitle(f"bench llm on {result['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_adapters(ax, result: dict) -> None:
    """Decode tokens/s mixing N adapters against the base, per mode, and plain PEFT's."""
    modes = {m: r for m, r in result.get("modes", {}).items() if "adapters" in r}
    peft = {row["adapters"]: row["tokens_per_s"] for row in result.get("adapters_peft", [])}
    bars = 2 * len(modes) + (1 if peft else 0)
    width = 0.8 / max(1, bars)
    counts = []
    for k, (mode, r) in enumerate(modes.items()):
        rows = r["adapters"]["decode"]
        counts = [row["adapters"] for row in rows]
        for j, (key, label) in enumerate((("adapters_tokens_per_s", "mixed"), ("base_tokens_per_s", "base"))):
            ax.bar([x + (2 * k + j) * width for x in range(len(rows))], [row[key] for row in rows], width,
                   label=f"{mode} {label}")
    if peft:
        ax.bar([x + 2 * len(modes) * width for x in range(len(counts))], [peft.get(n, 0.0) for n in counts], width,
               label="PEFT mixed")
    ax.set_xticks([x + width * (bars - 1) / 2 for x in range(len(counts))], [str(n) for n in counts])
    ax.set_xlabel("adapters mixed in the batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("LoRA adapters")
    ax.legend(fontsize="small")


def _plot_wake(ax, modes: dict) -> None:
    labels, values, colors = [], [], []
    for mode, r in modes.items():
        w = r["wake"]
        for what, key, color in (("warm", "warm_ttft_s", "#999"), ("cold", "cold_ttft_s", "#1f77b4"),
                                 ("floor", "floor_s", "#2ca02c")):
            labels.append(f"{what}\n{mode}")
            values.append(w[key] * 1e3)
            colors.append(color)
    first = next(iter(modes.values()))["wake"]
    if first["load_then_generate_s"] is not None:
        labels.append("load then\ngenerate")
        values.append(first["load_then_generate_s"] * 1e3)
        colors.append("#d62728")
    ax.bar(labels, values, color=colors)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"wake: {first['bytes'] / 2**20:.0f} MiB model")


def _plot_decode(ax, modes: dict) -> None:
    first = next(iter(modes.values()))["decode"]["rows"]
    x = range(len(first))
    bars = [(mode, [row["ours_tokens_per_s"] for row in r["decode"]["rows"]]) for mode, r in modes.items()]
    bars.append(("transformers", [row["plain_tokens_per_s"] for row in first]))
    bars.append(("memory-bandwidth floor", [row.get("floor_tokens_per_s", float("nan")) for row in first]))
    width = 0.8 / len(bars)
    for k, (label, values) in enumerate(bars):
        ax.bar([i + (k - (len(bars) - 1) / 2) * width for i in x], values, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [str(row["sequences"]) for row in first])
    ax.set_xlabel("sequences together")
    ax.set_ylabel("tokens per second")
    ax.set_title("decode, model resident")
    ax.legend(fontsize=7)


def _plot_prefix(ax, modes: dict) -> None:
    x = range(len(modes))
    rows = [r["prefix"] for r in modes.values()]
    ax.bar([i - 0.2 for i in x], [p["ttft_uncached_s"] * 1e3 for p in rows], 0.4, label="system prompt computed")
    ax.bar([i + 0.2 for i in x], [p["ttft_cached_s"] * 1e3 for p in rows], 0.4, label="system prompt cached")
    ax.set_xticks(list(x), list(modes))
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"prefix: {rows[0]['system_tokens']}-token system prompt")
    ax.legend(fontsize=7)


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
