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
from timeshare.errors import BatchLostError, GenerationError
from timeshare.worker.batch import DecodeBatch, decode, new_cache, prefill


class Batches:
    """The decode batches this worker is home to, by key."""

    def __init__(self, device: torch.device):
        self.device = device
        self._batches: dict[str, DecodeBatch] = {}
        self._rows: dict[str, list[int]] = {}  # each batch's row ids, in order (``KVStep.rows``)
        self._out: set[str] = set()  # batches whose caches are in host memory

    def offload(self, key: str) -> int:
        """Move a batch's caches to host memory (page-locked on CUDA) until its next
        step; the bytes moved (NOTE [Key/value caches off the device])."""
        batch = self._batches.get(key)
        if batch is None or not batch.kv or key in self._out:
            return 0
        moved = batch.to_host()
        self._out.add(key)
        return moved

    def _back(self, key: str, batch: DecodeBatch) -> None:
        if key in self._out:
            batch.to_device(self.device)
            self._out.discard(key)

    def step(self, step: P.KVStep, module: nn.Module, forward: Callable[[tuple, dict], Any]) -> tuple[dict, int]:
        """Run ``step`` with ``forward`` (the model's call here, loading it if need be);
        its output (the logits to choose tokens from) and the bytes of the batch's caches
        after it. The rows the controller no longer holds go first, whatever the step's
        fate: it has dropped them too. A prefill that fails joins nothing; a decode step
        that fails loses the batch (the controller fails all its rows), as does a batch
        that cannot be brought back or lacks a row the controller holds."""
        batch = self._batches.get(step.batch)
        if step.fresh or batch is None:
            if not step.fresh:
                raise BatchLostError(f"the caches of {step.batch!r} are not in this worker: its home was replaced "
                                     "or dropped them")
            batch = self._batches[step.batch] = DecodeBatch()
            self._rows[step.batch] = []
            self._out.discard(step.batch)
        held = self._rows[step.batch]
        try:
            self._back(step.batch, batch)  # failing (out of memory), the caches stay in host memory
            if list(step.rows) != held:
                where = {row: i for i, row in enumerate(held)}
                missing = [row for row in step.rows if row not in where]
                if missing:
                    self.drop(step.batch)
                    raise BatchLostError(f"the caches of {step.batch!r} lack rows {missing} here (they held "
                                         f"{held}): the batch is dropped")
                batch.keep([where[row] for row in step.rows])
                held[:] = step.rows
        except BatchLostError:
            raise
        except BaseException:
            if step.kind != "prefill":  # a decode step's failure loses the batch; a prefill's is its own
                self.drop(step.batch)
            raise
        if step.kind == "prefill":
            if step.new is None or step.new in held:
                raise GenerationError(f"a prefill of {step.batch!r} needs a new row id, not {step.new!r}")
            logits = prefill(batch, forward, list(step.tokens), self.device)
            held.append(step.new)
        elif step.kind == "decode":
            try:
                config = getattr(module, "config", None)
                logits = decode(batch, forward, list(step.tokens), lambda kv: new_cache(config, kv))
            except BaseException:
                self.drop(step.batch)
                raise
        else:
            raise ValueError(f"unknown step {step.kind!r}")
        if not len(batch):
            self.drop(step.batch)
        return {"logits": logits}, batch.nbytes

    def drop(self, key: str) -> None:
        self._batches.pop(key, None)
        self._rows.pop(key, None)
        self._out.discard(key)

