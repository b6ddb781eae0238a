"""What ``transformers`` alone generates from a model directory: the reference that the
language-model tests compare timeshare's greedy tokens with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from timeshare.bench.llm_adapters import quiet_peft, write_adapter

__all__ = ["greedy_tokens", "peft_greedy", "with_pools", "write_adapter"]  # write_adapter: the tests' adapters


def greedy_tokens(path: str | Path, device: str = "cpu") -> Callable[[str, int], list[int]]:
    """``generate(prompt, n)``: the ``n`` greedy tokens after ``prompt`` (no special tokens
    added), from ``transformers``' own model and ``generate`` on the directory's weights,
    on ``device``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).to(device).eval()

    def generate(prompt: str, n: int) -> list[int]:
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device=device)
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    return generate


def with_pools(weights: str, paths: list[str | Path], *, max_sequences: int = 8, max_context: int | None = None,
               dtype: str | None = None) -> int:
    """A runtime's ``memory``: ``weights`` of room for models, and the regions of the arena
    that the page pools of their own of the language models in ``paths`` take (NOTE
    [Regions of the arena]), so that a test's premise ("room for one of the two") is of
    the weights alone."""
    from timeshare.llm import model as lm
    from timeshare.units import parse_bytes

    return parse_bytes(weights, what="memory") + sum(lm.own_pool_bytes(p, dtype, max_sequences, max_context)
                                                     for p in paths)


def peft_greedy(base: str | Path, adapter: str | Path | None,
                device: str = "cpu") -> Callable[[list[int], int], list[int]]:
    """``generate(ids, n)``: PEFT's ``PeftModel.generate`` greedy tokens after ``ids`` with
    ``adapter`` (None: the base alone), on ``device``."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base).to(device).eval()
    if adapter is not None:
        with quiet_peft():
            model = peft.PeftModel.from_pretrained(model, adapter).eval()

    def generate(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x),
                                 pad_token_id=0)
        return out[0, len(ids):].tolist()

    return generate
