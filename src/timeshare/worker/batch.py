"""The decode batch of one language model: the key/value cache of every running
sequence, left-padded to one length so that one forward computes the next token of
all of them (continuous batching: sequences join and leave between steps). Tensors
only; runs where the model computes (the controller, for an in-process runtime).

NOTE [Decode batch]: rows are aligned on the right. A row's cache holds its own
tokens at the end and zeros before them, masked out by ``mask``; a row's next
position is its own length, not the batch's. A sequence joins by padding either
side on the left to the longer of the two (one copy of the cache, at a step
boundary), and leaves by dropping its row, after which columns that every row
masks are cut off. Between joins and leaves a step only appends one column, which
the model's cache does itself. A request alone in the batch is therefore computed
with no padding at all, exactly as ``transformers``' ``generate`` computes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from timeshare.errors import GenerationError
from timeshare.worker.paged import cache_key

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [batch, heads, length, dim]
Forward = Callable[[tuple, dict], Any]  # (args, kwargs) -> the model's output


def new_cache(config, kv: KV | None):
    """A ``transformers`` cache for a model of ``config`` holding ``kv`` (empty if none)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv, config=config) if kv else DynamicCache(config=config)


def cache_layers(cache, width: int) -> KV:
    """Keys and values of every layer of a model's cache, checked to hold ``width`` positions."""
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    if not kv or kv[0][0].shape[2] != width:
        got = kv[0][0].shape[2] if kv else 0
        raise GenerationError(f"the model's cache holds {got} positions after the step, not {width}")
    return kv


def prefill(batch: DecodeBatch, forward: Forward, prompt: list[int], device: torch.device) -> torch.Tensor:
    """Prefill ``prompt`` and join its cache to ``batch`` as the last row; the logits of
    its last position. No cache object goes in: the model makes its own, so a forward run
    twice (a model's first load also profiles it) cannot append twice."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    out = forward((ids,), {"attention_mask": torch.ones_like(ids), "use_cache": True, "logits_to_keep": 1})
    batch.join(cache_layers(out[cache_key()], len(prompt)), len(prompt))
    return out["logits"][0, -1]


def decode(batch: DecodeBatch, forward: Forward, tokens: list[int], new_cache: Callable[[KV], object]
           ) -> torch.Tensor:
    """One decode step of every row of ``batch`` (``tokens``: each row's last token); the
    rows' next-token logits. The batch takes the grown cache only if the step succeeds."""
    ids, mask, positions = batch.step_inputs(tokens)
    out = forward((ids,), {"attention_mask": mask, "position_ids": positions, cache_key(): new_cache(batch.kv),
                           "use_cache": True, "logits_to_keep": 1})
    batch.stepped(cache_layers(out[cache_key()], mask.shape[1]), mask)
    return out["logits"][:, -1]


def kv_bytes(kv: KV) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)


class DecodeBatch:
    """The running rows: ``kv`` and ``mask`` ([rows, length], 1 where a row has a token)
    and each row's length (its tokens in the cache)."""

    def __init__(self) -> None:
        self.kv: KV = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return kv_bytes(self.kv)

    def to_host(self) -> int:
        """Move the caches to host memory (page-locked when they were on CUDA) until
        ``to_device``; the bytes moved (NOTE [Key/value caches off the device])."""
        pin = bool(self.kv) and self.kv[0][0].device.type == "cuda"

        def out(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t)
            return host

        self.kv = [(out(k), out(v)) for k, v in self.kv]
        return self.nbytes

    def to_device(self, device: torch.device) -> None:
        """The caches back on ``device``, bit for bit."""
        self.kv = [(k.to(device, copy=True), v.to(device, copy=True)) for k, v in self.kv]

    def join(self, kv: KV, length: int) -> None:
        """Add a row whose cache (``kv``, one row of ``length`` tokens) was just
        prefilled."""
        if not self.lengths:
            self.kv = list(kv)
            self.mask = torch.ones(1, length, dtype=torch.long, device=kv[0][0].device)
            self.lengths = [length]
            return
        width = max(self.width, length)
        pad_old, pad_new = width - self.width, width - length
        self.kv = [(torch.cat([_left(k, pad_old), _left(k1, pad_new)]),
                    torch.cat([_left(v, pad_old), _left(v1, pad_new)])) for (k, v), (k1, v1) in zip(self.kv, kv)]
        row = torch.cat([torch.zeros(pad_new, dtype=torch.long, device=self.mask.device),
                         torch.ones(length, dtype=torch.long, device=self.mask.device)])
        self.mask = torch.cat([F.pad(self.mask, (pad_old, 0)), row[None]])
        self.lengths.append(length)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order), and cut the columns none of them uses."""
        if len(rows) == len(self.lengths):
            return
        if not rows:
            self.__init__()  # type: ignore[misc]
            return
        index = torch.tensor(rows, device=self.mask.device)
        cut = self.width - max(self.lengths[i] for i in rows)
        self.kv = [(_rows(k, index, cut), _rows(v, index, cut)) for k, v in self.kv]
        self.mask = self.mask.index_select(0, index)[:, cut:].contiguous()
        self.lengths = [self.lengths[i] for i in rows]

    def step_inputs(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of one decode step for each row's last token: ids, the mask with
        the new column, each row's position."""
        device = self.mask.device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long, device=device)], dim=1)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        return ids, mask, positions

    def stepped(self, kv: KV, mask: torch.Tensor) -> None:
        """Take the cache after a step (one more column for every row)."""
        self.kv, self.mask = kv, mask
        self.lengths = [n + 1 for n in self.lengths]


def _left(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, pad, 0)) if pad else t


def _rows(t: torch.Tensor, index: torch.Tensor, cut: int) -> torch.Tensor:
    return t.index_select(0, index)[:, :, cut:].contiguous()
