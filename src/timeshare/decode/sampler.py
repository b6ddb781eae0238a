"""Choosing each row's next token from a step's logits, on their device: the one sampler
of every language model, in-process and in workers. Tensors only; runs where the model's
weights are (``runner.py``).

# NOTE [One sampler]
Greedy rows take the argmax. The others take a Gumbel-max draw over the logits divided by
the temperature, cut to the top-k and to the smallest set whose probability reaches
top-p: the noise of a row is a hash of its request's seed and the token's index in its
sequence, so that a seeded request gets the same tokens whatever batch it is in, in
whichever process its model runs, and no generator state lives anywhere between steps.
A row whose logits hold a NaN gets -1 (a token made up from them would be a wrong
answer; the engine fails that sequence alone).
"""

from __future__ import annotations

import torch

from timeshare.decode.pages import to_device
from timeshare.decode.step import Draw


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (each product stays below 2**63 in int64)."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    return x ^ (x >> 16)


def choose(logits: torch.Tensor, draw: Draw) -> torch.Tensor:
    """Each row's next token from ``logits`` ([rows, vocab]) on their device (NOTE [One
    sampler]); -1 for a row whose logits hold a NaN."""
    best = logits.argmax(dim=-1)
    broken = logits.isnan().any(dim=-1)
    if draw.greedy:
        return torch.where(broken, -1, best)
    device, rows, vocab = logits.device, logits.shape[0], logits.shape[1]
    # Two copies in, queued without waiting (NOTE [No waiting on the device]).
    top_k, seed, index = to_device([*(k if 0 < k < vocab else vocab for k in draw.top_k), *draw.seed, *draw.index],
                                   device).view(3, rows)
    temperature, top_p = to_device([*draw.temperature, *draw.top_p], device, torch.float32).view(2, rows)
    scores = logits.float() / temperature.clamp_min(1e-6)[:, None]
    if any(0 < k < vocab for k in draw.top_k) or any(p < 1.0 for p in draw.top_p):
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # the first token is always kept
        cut = (rank >= top_k[:, None]) | (before >= top_p[:, None])
        scores = scores.scatter(1, order, ordered.masked_fill(cut, float("-inf")))
    key = _mix(_mix(seed) ^ _mix(index * 0x9E3779B1 + 1))
    bits = _mix(key[:, None] ^ _mix(torch.arange(vocab, device=device, dtype=torch.int64)[None, :] + 0x632BE5AB))
    uniform = (bits.double() + 0.5) / 4294967296.0
    gumbel = -torch.log(-torch.log(uniform))
    sampled = (scores.double() + gumbel).argmax(dim=-1)
    return torch.where(broken, -1, torch.where(temperature == 0.0, best, sampled)).view(rows)
