"""Language models' decode batches kept in a worker process, their home (NOTE
[Generation in worker processes] in ``llm/caches.py``): the key/value caches stay here
between steps and turns, and each step's message says what to do with them. Runs in the
worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from timeshare import protocol as P
from timeshare.llm.batch import KV, DecodeBatch, GenerationError, decode, prefill


class Batches:
    """The decode batches this worker is home to, by key."""

    def __init__(self, device: torch.device):
        self.device = device
        self._batches: dict[str, DecodeBatch] = {}

    def step(self, step: P.KVStep, module: nn.Module, forward: Callable[[tuple, dict], Any]) -> tuple[dict, int]:
        """Run ``step`` with ``forward`` (the model's call here, loading it if need be);
        its output (the logits to choose tokens from) and the bytes of the batch's caches
        after it. The rows to keep go first, whatever the step's fate: the controller has
        dropped them too. A prefill that fails joins nothing; a decode step that fails
        loses the batch (the controller fails all its rows)."""
        batch = self._batches.get(step.batch)
        if step.fresh or batch is None:
            if not step.fresh:
                raise GenerationError(f"the caches of {step.batch!r} are not in this worker: its home was replaced")
            batch = self._batches[step.batch] = DecodeBatch()
        if step.keep is not None:
            batch.keep(list(step.keep))
        if step.kind == "prefill":
            logits = prefill(batch, forward, list(step.tokens), self.device)
        elif step.kind == "decode":
            try:
                logits = decode(batch, forward, list(step.tokens), lambda kv: _new_cache(module, kv))
            except BaseException:
                del self._batches[step.batch]
                raise
        else:
            raise ValueError(f"unknown step {step.kind!r}")
        if not len(batch):
            del self._batches[step.batch]
        return {"logits": logits}, batch.nbytes

    def drop(self, key: str) -> None:
        self._batches.pop(key, None)


def _new_cache(module: nn.Module, kv: KV):
    from transformers import DynamicCache

    config = getattr(module, "config", None)
    return DynamicCache(ddp_cache_data=kv, config=config) if kv else DynamicCache(config=config)
