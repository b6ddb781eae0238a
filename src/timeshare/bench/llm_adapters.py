"""``timeshare bench llm --parts adapters``: LoRA adapters of one base (NOTE [Adapters in
slots], NOTE [Adapter residency]), in each deployment mode. Runs in the CLI's process.

- **mixed decode**: for each count N of ``adapters``, decode tokens/s of a batch of the
  largest count of ``concurrent`` rows whose rows use N adapters (row i adapter
  ``(round * rows + i) mod N``), against the same batch of base rows, round after round;
  beside them plain PEFT's ``generate`` of the same mixed batch (``adapter_names``).
- **cold adapter**: time to first token of a request whose adapter is in host memory and
  not on the device (it is copied into a slot before its prefill), of one whose adapter is
  on the device, and of one of the base, each on a prompt no page of which is cached;
  against the floor ``base warm + adapter bytes / measured link bandwidth``, and against
  serving the same fine-tune as a merged full model that is not resident (loaded,
  pipelined, while its prefill runs: what serving fine-tunes without adapters costs).

Adapters are written by PEFT itself with seeded factors (``rank`` on every projection).
Both parts run their steps as ``timeshare serve`` does (``as_served``: NOTE [A core for
the front end]), the base's and the adapters' alike: adapters are what a server serves.
"""

from __future__ import annotations

import shutil
import statistics
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from timeshare.bench import llm_models as models
from timeshare.bench.common import batch_rate, plain_rate
from timeshare.device import as_served
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@contextmanager
def quiet_peft() -> Iterator[None]:
    """PEFT 0.21 reads transformers' deprecated ``is_gradient_checkpointing``: its warning
    is not this bench's to print."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def write_adapter(base: str | Path, out: str | Path, *, rank: int, targets: list[str], alpha: int = 16,
                  rslora: bool = False, seed: int = 0, std: float = 0.02) -> Path:
    """A LoRA adapter of the model directory ``base`` in PEFT's format at ``out``, saved by
    PEFT itself: rank ``rank`` on the projections ``targets`` (PEFT's suffixes), its factors
    drawn from a seeded normal of ``std`` (PEFT starts B at zero: an adapter that changes
    nothing)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    with quiet_peft():
        adapted = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    with quiet_peft():
        adapted.save_pretrained(str(out))
    return Path(out)


def write_adapters(base: Path, root: Path, count: int, rank: int, seed: int) -> list[Path]:
    """``count`` adapters of ``base`` in PEFT's format under ``root`` (reused when there),
    seeded factors of ``rank`` on every projection (``write_adapter``)."""
    paths = [root / f"adapter-{rank}-{seed + i}" for i in range(count)]
    for i, path in enumerate(paths):
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(base, path, rank=rank, targets=TARGETS, alpha=2 * rank, seed=seed + i)
    return paths


def merged(base: Path, adapter: Path, out: Path) -> Path:
    """The base with ``adapter`` merged into its weights, as a model directory of its own."""
    import peft
    import transformers

    if not (out / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        with quiet_peft():
            full = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        full.save_pretrained(out)
        for f in base.iterdir():  # its tokenizer and template
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(f, out / f.name)
    return out


def run_adapters(config: Any, device: torch.device, base: Path, workers: int, root: Path,
                 progress: Callable[[str], None]) -> dict:
    """Both parts in one mode (``workers``: 0 in-process)."""
    mode = "workers" if workers else "in-process"
    rows = max(config.concurrent)
    most = max(config.adapters)
    paths = write_adapters(base, root, most + 2, config.lora_rank, config.seed)
    mixing, cold = paths[:most], paths[most:]
    slots = min(most, config.max_loras)  # every slot's factors are read by a step's products (NOTE [Adapters in slots])
    context = config.prompt_tokens + config.new_tokens + 1
    pool = lm.own_pool_bytes(base, config.dtype, rows, context)
    full = merged(base, cold[0], root / "merged")
    weights = 2 * models.describe(base)["bytes"]
    # Adapters are served: the steps compute as timeshare serve's (NOTE [A core for the
    # front end]), the base's and the adapters' alike.
    with as_served(), Runtime(device, weights + 2 * pool + (512 << 20), poison_evicted=True, workers=workers) as rt:
        progress(f"{mode}: adapters: registering the base with {slots} adapter slots of rank {config.lora_rank}")
        model = lm.load(rt, "m", base, max_sequences=rows, max_context=context, max_loras=slots,
                        max_lora_rank=config.lora_rank, compile=config.compile)
        assert model.adapters is not None
        try:
            for i, path in enumerate(mixing):
                model.adapters.add(f"a{i}", path)
            progress(f"{mode}: adapters: decode mixing {', '.join(map(str, config.adapters))} adapters over "
                     f"{rows} rows, and the base")
            decode = [_mixed(config, model, rows, n) for n in config.adapters]
            progress(f"{mode}: adapters: cold and warm first tokens, and a merged fine-tune's")
            first = _first_tokens(config, rt, model, cold, full)
        finally:
            model.close()
    return {"rows": rows, "slots": slots, "rank": config.lora_rank, "steps_as_served": True, "decode": decode,
            "first_token": first}


def _mixed(config: Any, model: Any, rows: int, n: int) -> dict:
    """Decode tokens/s of ``rows`` rows over ``n`` adapters and of ``rows`` base rows,
    alternating, round after round (each round's prompt new: none cached)."""
    greedy = SamplingParams(max_tokens=config.new_tokens, temperature=0)
    rates: dict[str, list[float]] = {"adapters": [], "base": []}
    loads = model.adapters.slots.loads
    for r in range(config.repeats + 1):  # the first round warms (loads the adapters)
        for kind in ("adapters", "base"):
            seqs = [model.generate(models.prompt(model.path, config.prompt_tokens, variant=1000 * r + i), greedy,
                                   adapter=f"a{(r * rows + i) % n}" if kind == "adapters" else None)
                    for i in range(rows)]
            for s in seqs:
                s.result(600)
            if r:
                rates[kind].append(batch_rate(seqs))
    ratios = [a / b for a, b in zip(rates["adapters"], rates["base"])]
    return {"adapters": n, "adapters_tokens_per_s": statistics.median(rates["adapters"]),
            "base_tokens_per_s": statistics.median(rates["base"]), "adapters_over_base": statistics.median(ratios),
            "slot_loads": model.adapters.slots.loads - loads, "samples": rates}


def _first_tokens(config: Any, rt: Runtime, model: Any, cold: list[Path], full: Path) -> dict:
    """Time to first token: the base warm, an adapter on the device, an adapter in host
    memory only (a new name each repeat: its first request copies it in), and then, in
    rounds of its own, the merged fine-tune registered as a model of its own and evicted
    before each request (its loads slowed the steps just after them on a worker it shared
    with the base: docs/results.md)."""
    one = SamplingParams(max_tokens=1, temperature=0)
    link_Bps = rt.profile("m").link.bandwidth_Bps
    merged_model = lm.load(rt, "merged", full, max_sequences=1, max_context=config.prompt_tokens + 2,
                           compile=config.compile)
    times: dict[str, list[float]] = {"base_warm": [], "adapter_warm": [], "adapter_cold": [], "merged_cold": []}
    nbytes = 0
    variant = iter(range(10_000, 20_000))

    def ttft(m: Any, adapter: str | None = None) -> float:
        seq = m.generate(models.prompt(m.path, config.prompt_tokens, variant=next(variant)), one, adapter=adapter)
        seq.result(600)
        assert seq.first_token_at is not None
        return seq.first_token_at - seq.arrived

    try:
        for i in range(config.repeats + 1):  # the first round warms every path up, and is not kept
            got = {"base_warm": ttft(model), "adapter_warm": ttft(model, "a0")}
            name = f"cold{i}"
            adapter = model.adapters.add(name, cold[i % len(cold)])
            nbytes = adapter.nbytes
            got["adapter_cold"] = ttft(model, name)
            model.adapters.remove(name)
            for k, v in got.items():
                if i:
                    times[k].append(v)
        for i in range(config.repeats + 1):
            rt.evict("merged")
            merged_s = ttft(merged_model)
            if i:
                times["merged_cold"].append(merged_s)
    finally:
        merged_model.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_s = nbytes / link_Bps
    floor = med["base_warm"] + copy_s
    return {"adapter_bytes": nbytes, "link_GBps": link_Bps / 1e9, "copy_s": copy_s,
            **{f"{k}_s": v for k, v in med.items()}, "floor_s": floor,
            "cold_over_floor": med["adapter_cold"] / floor,
            "cold_minus_base_warm_s": med["adapter_cold"] - med["base_warm"],
            "cold_bound_s": med["base_warm"] + 0.002 + 2 * copy_s,
            "merged_cold_over_adapter_cold": med["merged_cold"] / med["adapter_cold"], "samples": times}


def plain_peft(config: Any, device: torch.device, base: Path, paths: list[Path], rows: int) -> list[dict]:
    """Plain PEFT's ``generate`` of a batch of ``rows`` rows mixing N of ``paths`` (its
    ``adapter_names``), for each N of ``config.adapters``, and of the base alone: tokens/s."""
    import peft
    import transformers

    module: Any = transformers.AutoModelForCausalLM.from_pretrained(base)
    module = module.to(device).eval()
    most = max(config.adapters)
    with quiet_peft():
        adapted = peft.PeftModel.from_pretrained(module, paths[0], adapter_name="a0")
        for i in range(1, most):
            adapted.load_adapter(paths[i], adapter_name=f"a{i}")
    adapted.eval()
    prompt = models.prompt(base, config.prompt_tokens)
    out = []
    for n in config.adapters:
        names = [f"a{i % n}" for i in range(rows)]
        out.append({"adapters": n, "tokens_per_s": plain_rate(adapted, device, prompt, rows, config.new_tokens,
                                                              adapter_names=names)})
    out.append({"adapters": 0, "tokens_per_s": plain_rate(adapted, device, prompt, rows, config.new_tokens,
                                                          adapter_names=["__base__"] * rows)})
    return out
