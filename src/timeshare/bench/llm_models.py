"""The model directories of ``timeshare bench llm``, written from code with seeded weights
(nothing may be downloaded), and what the bench reads from them before it measures: their
parameters and bytes, a prompt. Runs in the CLI's process.

A size names the shapes of its models. Two writers, by how a shape is given:
- **by hidden size, layers and heads** (tiny, small, 1b): ``hfdir.write_model_dir``, the
  module built by ``transformers`` on the CPU, initialised as ``transformers`` does, saved
  in fp32;
- **in full** (8b: Llama-3-8B's shape): the tokenizer, chat template and generation config
  as ``hfdir`` writes them; the config the shape's, saying bf16; the weights drawn tensor by
  tensor on the bench's device (NOTE [Drawn weights]) and saved as safetensors shards.

A directory is written under a temporary name and renamed once whole, so that
``--workdir`` reuses only complete ones.
"""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from timeshare.errors import ConfigError
from timeshare.llm import hfdir

TEXTS = ("the model switch fast load weights layer token", "a gpu share time memory host device cache",
         "group stream copy wake sleep serve request answer", "fast slow memory the a model gpu time")
DRAWN_ARCHITECTURES = ("llama", "qwen2", "mistral")  # those whose config takes a shape in full
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Shape:
    """A decoder's shape. Given by ``hidden``, ``layers`` and ``heads`` alone, the rest is
    ``hfdir``'s (heads / 2 key/value heads, a 2 x hidden MLP, the tokenizer's ~320 tokens);
    given in full, it is the config's as it stands."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    intermediate: int | None = None
    vocab: int | None = None

    @property
    def in_full(self) -> bool:
        return self.kv_heads is not None and self.intermediate is not None and self.vocab is not None


@dataclass(frozen=True)
class Size:
    """The models of one ``--size``: the fleet cycles through ``shapes``."""

    shapes: tuple[Shape, ...]
    baseline_skipped: str | None = None  # why the wake's load-then-generate baseline is off by default
    fleet: bool = True  # whether the fleet part may run (it writes a model per fleet member)

    @property
    def drawn(self) -> bool:
        return all(s.in_full for s in self.shapes)


LLAMA3_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
SIZES = {
    "tiny": Size((Shape(64, 2, 4), Shape(96, 2, 4))),
    # about 64M to 113M parameters
    "small": Size((Shape(768, 12, 12), Shape(832, 12, 8), Shape(896, 12, 14), Shape(1024, 12, 16))),
    "1b": Size((Shape(2048, 24, 32),)),  # about 0.9B parameters (a GPU's size: 1.8 GB in bf16)
    # 8.03B parameters, 16.1 GB in bf16
    "8b": Size((LLAMA3_8B,), fleet=False,
               baseline_skipped="from_pretrained of 16 GB then the prefill, once per repeat, takes minutes; "
                                "the floor (bytes / link bandwidth, warm TTFT) is the reference"),
}


def write(root: Path, arch: str, size: str, i: int, *, seed: int, max_positions: int,
          device: torch.device) -> Path:
    """The ``i``-th model directory of ``size`` under ``root`` for ``max_positions``
    positions: reused when whole, else written."""
    shapes = SIZES[size].shapes
    shape = shapes[i % len(shapes)]
    path = root / f"{arch}-{size}-{i}-{max_positions}"
    if (path / "config.json").exists():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted write's
    if shape.in_full:
        write_drawn(partial, arch, shape, seed=seed, max_positions=max_positions, device=device)
    else:
        hfdir.write_model_dir(partial, arch, seed=seed, hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                              max_positions=max_positions, max_shard_size="100MB")
    shutil.rmtree(path, ignore_errors=True)  # a directory of ours left without its config
    partial.rename(path)
    return path


def shape_config(arch: str, shape: Shape, max_positions: int, tokens: tuple[int, int, int] = (1, 2, 3)) -> Any:
    """The ``transformers`` config of a shape given in full, its weights in bf16 and not
    tied; ``tokens``: its bos, eos and pad token ids."""
    from transformers import AutoConfig

    if arch not in DRAWN_ARCHITECTURES or not shape.in_full:
        raise ConfigError(f"a shape given in full is one of {list(DRAWN_ARCHITECTURES)}'s, got {arch!r} {shape}")
    bos, eos, pad = tokens
    return AutoConfig.for_model(arch, vocab_size=shape.vocab, hidden_size=shape.hidden,
                                intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                max_position_embeddings=max_positions, tie_word_embeddings=False,
                                bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype="bfloat16")


def meta_tensors(config: Any) -> dict[str, torch.Tensor]:
    """The module's state, by name, on the meta device: names, shapes and dtypes without a
    byte of memory (8B parameters in about two seconds)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    return dict(module.state_dict())


def write_drawn(path: Path, arch: str, shape: Shape, *, seed: int, max_positions: int, device: torch.device,
                shard_bytes: int = 2 << 30) -> Path:
    """A model directory for a shape given in full, its weights drawn on ``device``."""
    from transformers import AutoConfig

    # The tokenizer, chat template and generation config of a placeholder model, whose
    # config and weights the shape's replace.
    hfdir.write_model_dir(path, arch, seed=seed, hidden=64, layers=1, heads=4, max_positions=max_positions)
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    placeholder = AutoConfig.from_pretrained(path)
    config = shape_config(arch, shape, max_positions,
                          (placeholder.bos_token_id, placeholder.eos_token_id, placeholder.pad_token_id))
    _draw(path, meta_tensors(config), config.initializer_range, seed, device, shard_bytes)
    config.save_pretrained(path)
    return path


# NOTE [Drawn weights]: on the CPU, transformers' initialisation of 8B parameters runs on
# one core (0.13 GB/s measured, minutes), so a shape given in full draws its own: every
# tensor from its own generator on the bench's device, seeded by the directory's seed and
# the tensor's place in the module's state (the same bytes whatever the shards), as
# transformers initialises a Llama (normal with the config's initializer_range, norms at
# one, biases at zero). A CUDA generator draws other numbers than the CPU's: a directory
# is reproducible on the kind of device that wrote it. Shards are written by threads while
# the next ones are drawn, at most ``_WRITERS`` of them waiting in host memory.
_WRITERS = 4


def _draw(path: Path, tensors: dict[str, torch.Tensor], std: float, seed: int, device: torch.device,
          shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    order = {name: k for k, name in enumerate(tensors)}
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    pending: list[Future] = []
    with ThreadPoolExecutor(_WRITERS, thread_name_prefix="timeshare-draw") as pool:
        for names, file in zip(shards, files):
            drawn = {n: _drawn(tensors[n], n, std, seed * 1_000_003 + order[n], device).cpu() for n in names}
            while len(pending) >= _WRITERS:
                pending.pop(0).result()
            pending.append(pool.submit(save_file, drawn, str(path / file), {"format": "pt"}))
        for f in pending:
            f.result()
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: file for names, file in zip(shards, files) for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _drawn(like: torch.Tensor, name: str, std: float, seed: int, device: torch.device) -> torch.Tensor:
    if name.endswith("bias"):
        return torch.zeros(like.shape, dtype=like.dtype, device=device)
    if like.dim() == 1:
        return torch.ones(like.shape, dtype=like.dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(like.shape, generator=g, dtype=like.dtype, device=device).mul_(std)


def describe(path: Path) -> dict:
    """The directory's parameters, bytes and floating dtype ("mixed" if more than one),
    read from its shards' headers."""
    from safetensors import safe_open

    parameters = nbytes = 0
    floats = set()
    for shard in hfdir.shard_files(path):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                n = 1
                for d in s.get_shape():
                    n *= int(d)
                parameters += n
                nbytes += n * _ITEMSIZE[s.get_dtype()]
                floats |= {_FLOATS[s.get_dtype()]} if s.get_dtype() in _FLOATS else set()
    return {"path": str(path), "parameters": parameters, "bytes": nbytes,
            "dtype": floats.pop() if len(floats) == 1 else "mixed"}


def prompt(path: Path, tokens: int, variant: int = 0) -> list[int]:
    """``tokens`` token ids of the directory's tokenizer, from seeded sentences; another
    ``variant`` is another prompt, of words drawn one by one (two variants begin with the
    same eight words with a chance of one in 25 to the 8th)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids: list[int] = []
    rng = random.Random(tokens if variant == 0 else f"{tokens}-{variant}")
    words = sorted({w for t in TEXTS for w in t.split()})
    while len(ids) < tokens:
        text = rng.choice(TEXTS) if variant == 0 else " ".join(rng.choice(words) for _ in range(6))
        ids += tok(" " + text, add_special_tokens=False)["input_ids"]
    return ids[:tokens]
