"""What ``transformers`` alone generates from a model directory: the reference that the
language-model tests compare timeshare's greedy tokens with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


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
