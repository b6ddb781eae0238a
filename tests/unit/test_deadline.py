"""NOTE [Call deadlines]: the rule, without processes."""

import pytest

from timeshare.executor.deadline import Deadlines


def test_a_kind_never_seen_gets_the_cap():
    d = Deadlines(60.0, factor=10, min_s=2)
    assert d.of(("m", "load", "4x64")) == 60.0


def test_a_seen_kind_gets_factor_times_its_slowest_recent_call_within_floor_and_cap():
    d = Deadlines(60.0, factor=10, min_s=2)
    d.observe(("m", "resident", "a"), 0.01)
    assert d.of(("m", "resident", "a")) == 2.0  # the floor
    d.observe(("m", "resident", "a"), 0.5)
    d.observe(("m", "resident", "a"), 0.1)
    assert d.of(("m", "resident", "a")) == pytest.approx(5.0)  # the slowest, not the latest
    d.observe(("m", "resident", "a"), 30.0)
    assert d.of(("m", "resident", "a")) == 60.0  # the cap
    assert d.of(("m", "load", "a")) == 60.0  # another kind: its own history


def test_only_recent_calls_count():
    d = Deadlines(60.0, factor=10, min_s=0.1, history=3)
    d.observe("k", 1.0)
    for _ in range(3):
        d.observe("k", 0.1)
    assert d.of("k") == pytest.approx(1.0)  # the slow call left the window


def test_the_table_is_bounded_and_forgets_a_model():
    d = Deadlines(60.0, factor=10, min_s=0.1, kinds=2)
    d.observe(("a", 1), 1.0)
    d.observe(("b", 1), 1.0)
    d.observe(("a", 1), 1.0)  # a is now the most recent
    d.observe(("c", 1), 1.0)  # b, the least recent, leaves
    assert d.of(("b", 1)) == 60.0 and d.of(("a", 1)) == pytest.approx(10.0)
    d.forget("a")
    assert d.of(("a", 1)) == 60.0 and d.of(("c", 1)) == pytest.approx(10.0)


def test_a_floor_above_the_cap_is_the_cap():
    d = Deadlines(3.0, factor=10, min_s=5.0)
    d.observe("k", 0.001)
    assert d.of("k") == 3.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="Deadlines needs cap_s > 0, factor >= 1"):
        Deadlines(0)
    with pytest.raises(ValueError, match="Deadlines needs cap_s > 0, factor >= 1"):
        Deadlines(10, factor=0.5)


def test_the_latest_call_of_a_kind_decides_whether_its_reply_is_awaited_spinning():
    """NOTE [Spin before sleeping]: the pool spins for a kind whose latest call answered
    within SPIN_S, read from ``last``; the slowest recent one still sets the deadline."""
    d = Deadlines(60.0, factor=10, min_s=0.01)
    kind = ("m", "resident", "(1, 32)")
    assert d.last(kind) is None
    d.observe(kind, 0.5)
    d.observe(kind, 0.001)
    assert d.last(kind) == 0.001 and d.of(kind) == pytest.approx(5.0)
    d.forget("m")
    assert d.last(kind) is None
