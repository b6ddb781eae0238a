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

# NOTE [Logit processing]
What a row asks beyond its sampling parameters is done here, on the device, in this
order: its log-probabilities are taken from the raw logits (as vLLM's V1 reports them:
before any change below, and before temperature); then its ``logit_bias`` is added; the
tokens it may not choose yet (its end tokens before ``min_tokens``) are masked; its
repetition penalty divides the logits of every token in its prompt and output that are
positive and multiplies those that are negative (transformers'
``RepetitionPenaltyLogitsProcessor``); its frequency penalty times each generated
token's count and its presence penalty for each generated token are subtracted
(OpenAI's definitions); tokens outside a constrained row's mask are masked (NOTE
[Constrained decoding]); then greedy rows take the argmax and the others are drawn as
above. A row's history crosses with its step (``Penalties.history``): nothing lives
between steps, so a step may run in any process. Within a burst the counts grow with
each token chosen. A step whose rows ask for none of this builds none of it.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Processing:
    """The logit processing of one step's rows (NOTE [Logit processing]), on the device:
    made once per step or burst from its ``Draw``, applied before each choice, and told
    each choice (``advance``) so that the counts of a burst's later steps include it."""

    def __init__(self, draw: Draw, vocab: int, device: torch.device):
        rows = len(draw.temperature)
        self.bias: torch.Tensor | None = None
        self.banned: torch.Tensor | None = None
        self.ban_steps: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # generated tokens, per row and token
        self.seen: torch.Tensor | None = None  # tokens in the prompt or generated
        self.allowed: torch.Tensor | None = None  # per row and token: may be chosen next (constrained rows)
        if any(draw.allowed):
            self.allowed = _allowed(draw.allowed, vocab, device)
        if any(draw.bias):
            at = [(r, t, b) for r, pairs in enumerate(draw.bias) for t, b in pairs]
            self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
            self.bias.index_put_(_index(at, device), to_device([b for _, _, b in at], device, torch.float32),
                                 accumulate=True)  # a token given twice: its biases add up
        if any(steps > 0 for _, steps in draw.banned):
            at = [(r, t, 0) for r, (tokens, steps) in enumerate(draw.banned) if steps > 0 for t in tokens]
            self.banned = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            if at:
                self.banned[_index(at, device)] = True
            self.ban_steps = to_device([steps for _, steps in draw.banned], device)
        if any(p is not None for p in draw.penalties):
            pens = draw.penalties
            self.presence, self.frequency, self.repetition = to_device(
                [*(p.presence if p else 0.0 for p in pens), *(p.frequency if p else 0.0 for p in pens),
                 *(p.repetition if p else 1.0 for p in pens)], device, torch.float32).view(3, rows, 1)
            self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            made = [(r, t, 0) for r, p in enumerate(pens) if p is not None for t in p.history[p.prompt:]]
            every = [(r, t, 0) for r, p in enumerate(pens) if p is not None for t in p.history]
            if made:
                self.counts.index_put_(_index(made, device), torch.ones(len(made), device=device), accumulate=True)
            if every:
                self.seen[_index(every, device)] = True

    def apply(self, logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        """``logits`` ([rows, vocab]) processed for the ``step``-th token of a burst, in float32."""
        scores = logits.float()
        if self.bias is not None:
            scores = scores + self.bias
        if self.banned is not None and self.ban_steps is not None:
            scores = scores.masked_fill(self.banned & (self.ban_steps > step)[:, None], float("-inf"))
        if self.counts is not None and self.seen is not None:
            repeated = torch.where(scores < 0, scores * self.repetition, scores / self.repetition)
            scores = torch.where(self.seen, repeated, scores)
            scores = scores - self.frequency * self.counts - self.presence * (self.counts > 0)
        if self.allowed is not None:
            if step:
                raise ValueError("a constrained row's mask holds for its next token only, not a burst's later ones")
            scores = scores.masked_fill(~self.allowed, float("-inf"))
        return scores

    def advance(self, chosen: torch.Tensor) -> None:
        """Each row chose ``chosen`` (-1: none, its logits held NaN)."""
        if self.counts is None or self.seen is None:
            return
        rows = torch.arange(chosen.shape[0], device=chosen.device)
        valid = (chosen >= 0).float()
        self.counts[rows, chosen.clamp_min(0)] += valid
        self.seen[rows, chosen.clamp_min(0)] |= valid.bool()


def _allowed(masks: Sequence[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab]: True where a row may choose the token (every token, for a row with
    no mask; none past its mask's words). Only the constrained rows' words cross, queued
    from page-locked memory on CUDA (NOTE [No waiting on the device]), and are unpacked
    there."""
    rows = [r for r, mask in enumerate(masks) if mask]
    width = max(len(masks[r]) for r in rows) // 4
    host = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        words = torch.frombuffer(bytearray(masks[r]), dtype=torch.int32)
        host[i, :words.numel()] = words
    words = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    bits = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1).bool().flatten(1)
    out = torch.ones(len(masks), vocab, dtype=torch.bool, device=device)
    picked = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    n = min(vocab, bits.shape[1])
    picked[:, :n] = bits[:, :n]
    out[to_device(rows, device)] = picked
    return out


def _index(at: Sequence[tuple[int, int, object]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) of ``at``'s (row, token, value) triples, on ``device``."""
    both = to_device([*(r for r, _, _ in at), *(t for _, t, _ in at)], device).view(2, len(at))
    return both[0], both[1]


def log_probabilities(logits: torch.Tensor, chosen: torch.Tensor, top: int,
                      chunk: int = 256) -> tuple[torch.Tensor, ...]:
    """The raw log-probabilities (NOTE [Logit processing]) of each row's ``chosen`` token
    (a NaN row's -1 reads token 0; its token is never used) and, with ``top`` > 0, its
    ``top`` most likely tokens and theirs: (chosen [rows], ids [rows, top], values).
    Rows are taken ``chunk`` at a time (a prompt's positions: one float32 copy of a
    chunk's logits at a time, not of the whole prompt's)."""
    if logits.shape[0] > chunk:
        parts = [log_probabilities(logits[i:i + chunk], chosen[i:i + chunk], top, chunk)
                 for i in range(0, logits.shape[0], chunk)]
        return tuple(torch.cat([p[k] for p in parts]) for k in range(3))
    logp = torch.log_softmax(logits.float(), dim=-1)
    mine = logp.gather(1, chosen.clamp_min(0)[:, None])[:, 0]
    if top <= 0:
        return mine, torch.empty(logp.shape[0], 0, dtype=torch.int64, device=logp.device), \
            torch.empty(logp.shape[0], 0, device=logp.device)
    values, ids = logp.topk(min(top, logp.shape[1]), dim=-1)
    return mine, ids, values


def choose(logits: torch.Tensor, draw: Draw, processing: Processing | None = None, step: int = 0) -> torch.Tensor:
    """Each row's next token from ``logits`` ([rows, vocab]) on their device (NOTE [One
    sampler]), after ``processing`` for the ``step``-th token of a burst (NOTE [Logit
    processing]); -1 for a row whose logits hold a NaN."""
    broken = logits.isnan().any(dim=-1)
    if processing is not None:
        logits = processing.apply(logits, step)
    best = logits.argmax(dim=-1)
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
