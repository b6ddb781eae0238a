"""Choosing tokens and stopping (``llm/sampling.py``), and the decode batch's padding
(``worker/batch.py``): pure pieces, checked against direct computation."""

from __future__ import annotations

import pytest
import torch

from timeshare.errors import ConfigError
from timeshare.llm.sampling import SamplingParams, find_stop, held_back, next_token
from timeshare.worker.batch import DecodeBatch


def test_greedy_takes_the_most_likely_token():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert next_token(logits, SamplingParams(temperature=0), None) == 1


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen_k, seen_p = set(), set()
    for seed in range(200):
        k = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        seen_k.add(next_token(logits, k, k.generator()))
        p = SamplingParams(temperature=1.0, top_p=0.7, seed=seed)  # 0.5 + 0.3 reach 0.7: two tokens
        seen_p.add(next_token(logits, p, p.generator()))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}
    one = SamplingParams(temperature=1.0, top_p=0.4, seed=0)  # the first token alone reaches it
    assert {next_token(logits, one, one.generator()) for _ in range(20)} == {0}


def test_a_seed_gives_the_same_draws_and_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    g1, g2 = params.generator(), params.generator()
    a = [next_token(logits, params, g1) for _ in range(50)]
    b = [next_token(logits, params, g2) for _ in range(50)]
    assert a == b
    g = params.generator()
    draws = [next_token(logits, params, g) for _ in range(3000)]
    assert abs(draws.count(0) / 3000 - 0.6) < 0.05
    cold = SamplingParams(temperature=0.05, seed=1)  # nearly greedy
    gc = cold.generator()
    assert {next_token(logits, cold, gc) for _ in range(50)} == {0}


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=True), dict(temperature=-0.1),
                                 dict(temperature=2.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(stop=("",)), dict(stop=("a", "b", "c", "d", "e"))])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_stop_strings_are_found_and_their_beginnings_held_back():
    assert find_stop("hello world", ("wor",)) == 6
    assert find_stop("hello world", ("xyz", "lo")) == 3
    assert find_stop("hello world", ("o w",), start=5) == 4  # a stop straddling the new text
    assert find_stop("hello", ("lo",), start=4) == 3  # the new "o" completes it
    assert find_stop("hello", ("lo",), start=5) is None  # wholly in text already looked at
    assert find_stop("hello", ("z",)) is None
    assert held_back("the end is ne", ("near",)) == 2
    assert held_back("the end", ("near",)) == 0
    assert held_back("abc\ufffd", ()) == 1


def test_the_batch_pads_on_the_left_and_cuts_columns_no_row_uses():
    def kv(n, fill):
        return [(torch.full((1, 2, n, 3), fill), torch.full((1, 2, n, 3), -fill))]

    batch = DecodeBatch()
    batch.join(kv(3, 1.0), 3)
    batch.join(kv(5, 2.0), 5)
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    k = batch.kv[0][0]
    assert k[0, :, :2].abs().sum() == 0 and torch.all(k[0, :, 2:] == 1.0) and torch.all(k[1] == 2.0)
    ids, mask, positions = batch.step_inputs([7, 8])
    assert ids.tolist() == [[7], [8]] and mask.shape == (2, 6) and positions.tolist() == [[3], [5]]
    batch.stepped([(torch.cat([k, k[:, :, :1]], 2), torch.cat([k, k[:, :, :1]], 2))], mask)
    assert batch.lengths == [4, 6]
    batch.keep([0])  # the long row leaves: the columns only it used go
    assert batch.lengths == [4] and batch.mask.tolist() == [[1, 1, 1, 1]] and batch.kv[0][0].shape == (1, 2, 4, 3)
    assert torch.all(batch.kv[0][0][0, :, :3] == 1.0)
    batch.keep([])
    assert len(batch) == 0 and batch.nbytes == 0


class FakeEngine:
    """What ``KVBudget`` asks of an engine: its caches on the device, its latest turn,
    and to move them out (between turns, or its own as its turn ends)."""

    def __init__(self, name: str, nbytes: int, last_turn: float, in_turn: bool = False):
        self.name, self.kv_device_bytes, self.last_turn, self.in_turn = name, nbytes, last_turn, in_turn
        self.moved: list[str] = []

    def move_kv_out(self) -> int:
        if self.in_turn:
            return 0
        moved, self.kv_device_bytes = self.kv_device_bytes, 0
        return moved

    def give_up_kv(self) -> int:
        moved, self.kv_device_bytes = self.kv_device_bytes, 0
        return moved


def test_the_kv_budget_moves_the_least_recent_caches_out_until_the_rest_fit():
    from timeshare.llm.kv_budget import KVBudget, KVBudgetSnapshot

    budget = KVBudget(100)
    old, mid, new, holder = (FakeEngine("old", 40, 1.0), FakeEngine("mid", 40, 2.0), FakeEngine("new", 40, 3.0),
                             FakeEngine("holder", 50, 4.0, in_turn=True))
    for e in (new, holder, old, mid):
        budget.join(e)
    budget.make_room(holder, keep=True)  # 170 on the device: the two oldest go, the holder's stay
    assert (old.kv_device_bytes, mid.kv_device_bytes, new.kv_device_bytes, holder.kv_device_bytes) == (0, 0, 40, 50)
    assert budget.snapshot() == KVBudgetSnapshot(capacity=100, on_device=90, moves=2, moved_bytes=80)
    holder.kv_device_bytes = 70  # its caches grew in its turn: as it ends, "new" goes first, then it
    budget.make_room(holder, keep=False)
    assert (new.kv_device_bytes, holder.kv_device_bytes) == (0, 70) and budget.on_device() == 70
    holder.kv_device_bytes = 130
    budget.make_room(holder, keep=False)
    assert holder.kv_device_bytes == 0 and budget.snapshot().moves == 4
    budget.leave(holder)
    assert budget.on_device() == 0
    with pytest.raises(ConfigError, match="kv_memory"):
        KVBudget(-1)
