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
