"""A decode batch kept in a worker (``worker/generation.py``, NOTE [Generation in worker
processes]) maps rows to sequences by the ids the controller sends with every step: a
step the home never saw (a prefill that failed before it got there, a keep lost with it)
cannot shift one sequence's cache under another's tokens."""

from __future__ import annotations

import pytest
import torch

from timeshare import protocol as P
from timeshare.errors import BatchLostError
from timeshare.worker.batch import cache_key
from timeshare.worker.generation import Batches

pytest.importorskip("transformers")


class _Layer:
    def __init__(self, keys: torch.Tensor):
        self.keys, self.values = keys, keys.clone()


class _Cache:
    def __init__(self, keys: torch.Tensor):
        self.layers = [_Layer(keys)]


def forward(args: tuple, kwargs: dict) -> dict:
    """A one-layer stand-in for a model: a prefill's cache holds its first token at every
    position; a decode step appends each row's token. Each row's logits are one-hot on
    the first token its cache holds, so they say whose cache a row reads."""
    (ids,) = args
    past = kwargs.get(cache_key())
    if past is None or not past.layers:
        keys = ids[:, :1, None, None].float().expand(1, ids.shape[1], 1, 1).permute(0, 2, 1, 3).contiguous()
    else:
        old = past.layers[0].keys
        keys = torch.cat([old, ids[:, None, :, None].float()], dim=2)
    k = keys[:, 0, :, 0]
    first = (k != 0).float().argmax(dim=1)  # left padding is zeros: the row's first position
    owner = k[torch.arange(k.shape[0]), first].long()
    logits = torch.nn.functional.one_hot(owner, 16).float()[:, None, :]
    return {cache_key(): _Cache(keys), "logits": logits}


def prefill(batches: Batches, rows: tuple[int, ...], new: int, token: int) -> torch.Tensor:
    step = P.KVStep("b", "prefill", (token, token), rows=rows, new=new, fresh=not rows)
    return batches.step(step, torch.nn.Module(), forward)[0]["logits"]


def decode(batches: Batches, rows: tuple[int, ...], tokens: tuple[int, ...]) -> list[int]:
    out, _ = batches.step(P.KVStep("b", "decode", tokens, rows=rows), torch.nn.Module(), forward)
    return out["logits"].argmax(dim=-1).tolist()


def test_each_step_keeps_exactly_the_rows_the_controller_holds():
    batches = Batches(torch.device("cpu"))
    prefill(batches, (), 1, token=5)
    prefill(batches, (1,), 2, token=6)
    prefill(batches, (1, 2), 3, token=7)
    assert decode(batches, (1, 2, 3), (5, 6, 7)) == [5, 6, 7]
    # Row 2 left, and a keep of it was never seen here (its step failed on the way):
    # the next step names rows 1 and 3, and they read their own caches.
    assert decode(batches, (1, 3), (5, 7)) == [5, 7]
    # A prefill that the home never saw leaves nothing to shift: row 4 never existed here.
    prefill(batches, (1, 3), 5, token=9)
    assert decode(batches, (3, 5), (7, 9)) == [7, 9]


def test_a_row_the_home_lacks_loses_the_batch_rather_than_reading_another_cache():
    batches = Batches(torch.device("cpu"))
    prefill(batches, (), 1, token=5)
    prefill(batches, (1,), 2, token=6)
    with pytest.raises(BatchLostError, match=r"lack rows \[4\]"):
        decode(batches, (1, 4), (5, 8))
    with pytest.raises(BatchLostError, match="not in this worker"):  # dropped: nothing is left to misread
        decode(batches, (1,), (5,))
    prefill(batches, (), 1, token=3)  # a fresh batch starts anew under the same key
    assert decode(batches, (1,), (3,)) == [3]


def test_a_lost_batch_is_known_as_such_once_it_has_crossed_the_pipe():
    # The controller turns it into "the caches were lost" (its rows fail, the next
    # sequence starts afresh) by the type the worker reported.
    exc = P.ErrorInfo.capture(BatchLostError("gone"), "worker 1, running llama").to_exception()
    assert isinstance(exc, BatchLostError) and exc.where == "worker 1, running llama"
