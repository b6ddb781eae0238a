"""A request's sampling parameters and stopping (``llm/sampling.py``), and the key/value
budget's choices (``llm/kv_budget.py``): pure pieces, checked against direct computation.
Choosing tokens is ``decode/sampler.py``'s (``test_paged_units.py``)."""

from __future__ import annotations

import pytest

from timeshare.errors import ConfigError
from timeshare.llm.sampling import SamplingParams, find_stop, held_back


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
