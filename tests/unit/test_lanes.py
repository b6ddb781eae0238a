"""Salus's lanes and Algorithm 1 (NOTE [Salus lanes]): placements worked out by hand
with small integer capacities, and a seeded random sequence checked against a
reference written from the paper's description."""

import random

import pytest

from timeshare.scheduler.lanes import LaneManager


def _sizes(lm: LaneManager) -> dict[int, int]:
    return {i: lane.size for i, lane in lm.lanes.items()}


def test_new_lane_when_it_fits():
    lm = LaneManager(10)
    assert lm.choose(2, 3) == ("new", None)
    assert lm.admit(1, 2, 3) == 0
    # 2 + 2 + 3 + 3 = 10 <= 10: a second lane, exactly at capacity.
    assert lm.admit(2, 2, 3) == 1
    assert _sizes(lm) == {0: 3, 1: 3}
    assert (lm.persistent, lm.lane_total, lm.used) == (4, 6, 10)
    assert lm.lane_of(1) == 0 and lm.lane_of(2) == 1 and lm.lane_of(3) is None


def test_best_fit_join_takes_the_smallest_lane_that_is_large_enough():
    lm = LaneManager(20)
    assert [lm.admit(t, 0, e) for t, e in ((1, 8), (2, 6), (3, 3))] == [0, 1, 2]  # lanes 8, 6, 3: 17
    # New lane: 1 + 17 + 5 = 23 > 20. Join: 1 + 17 = 18 <= 20; lanes >= 5 are 8 and 6.
    assert lm.choose(1, 5) == ("join", 1)
    assert lm.admit(4, 1, 5) == 1
    assert _sizes(lm) == {0: 8, 1: 6, 2: 3}
    assert (lm.persistent, lm.lane_total) == (1, 17)
    assert lm.lanes[1].tasks == {2: 6, 4: 5}


def test_join_ties_go_to_the_lower_lane_id():
    lm = LaneManager(13)
    lm.admit(1, 0, 6)
    lm.admit(2, 0, 6)  # lanes 6, 6
    # New lane: 1 + 12 + 4 = 17 > 13; join: 13 <= 13; both lanes fit, lane 0 first.
    assert lm.admit(3, 1, 4) == 0


def test_grow_the_smallest_lane_that_can_grow():
    lm = LaneManager(25)
    for t, e in ((1, 4), (2, 6), (3, 8)):
        lm.admit(t, 0, e)  # lanes 4, 6, 8: 18
    # New lane 1 + 18 + 9 = 28 > 25; no lane >= 9; growing lane 0 (4 -> 9): 1 + 18 - 4 + 9 = 24 <= 25.
    assert lm.choose(1, 9) == ("grow", 0)
    assert lm.admit(4, 1, 9) == 0
    assert _sizes(lm) == {0: 9, 1: 6, 2: 8}
    assert (lm.persistent, lm.lane_total, lm.used) == (1, 23, 24)


def test_grow_skips_lanes_that_cannot_grow_enough():
    lm = LaneManager(26)
    lm.admit(1, 5, 4)
    lm.admit(2, 0, 6)
    lm.admit(3, 0, 8)  # P 5, lanes 4, 6, 8: 23
    # Base 5 + 1 = 6. Lane 0: 6 + 18 - 4 + 9 = 29; lane 1: 27; lane 2: 25 <= 26.
    assert lm.choose(1, 9) == ("grow", 2)
    assert lm.admit(4, 1, 9) == 2
    assert _sizes(lm) == {0: 4, 1: 6, 2: 9}
    assert lm.used == 6 + 19


def test_wait_when_nothing_works_and_nothing_changes():
    lm = LaneManager(10)
    lm.admit(1, 4, 4)
    # New: 4 + 3 + 4 + 1 = 12; join: 4 + 3 + 4 = 11; growing only adds: wait.
    assert lm.choose(3, 1) is None
    assert lm.admit(2, 3, 1) is None
    assert not lm.admitted(2)
    assert (lm.persistent, lm.lane_total, _sizes(lm)) == (4, 4, {0: 4})


def test_release_shrinks_to_the_largest_remaining_and_drops_empty_lanes():
    lm = LaneManager(12)
    assert lm.admit(1, 1, 8) == 0
    assert lm.admit(2, 1, 3) == 0  # new lane 2 + 8 + 3 = 13 > 12; join lane 0
    assert lm.admit(3, 1, 5) == 0  # new 3 + 8 + 5 = 16 > 12; join lane 0
    lm.lanes[0].busy = 1
    lm.release(1)
    assert _sizes(lm) == {0: 5} and lm.lanes[0].busy is None
    assert (lm.persistent, lm.lane_total) == (2, 5)
    lm.release(3)
    assert _sizes(lm) == {0: 3}
    lm.release(2)
    assert lm.lanes == {} and (lm.persistent, lm.lane_total, lm.used) == (0, 0, 0)
    # Freed memory is usable again: a fresh lane gets a fresh id.
    assert lm.admit(4, 4, 8) == 1


def test_a_lane_does_not_shrink_under_the_task_running_in_it():
    lm = LaneManager(12)
    assert lm.admit(1, 1, 8) == 0
    assert lm.admit(2, 1, 3) == 0  # joins lane 0 (8 bytes)
    lm.lanes[0].busy = 2  # task 2 runs, bounded by the lane's 8 bytes
    lm.release(1)  # task 1 leaves: the lane keeps its 8 while task 2 may use them
    assert _sizes(lm) == {0: 8} and lm.lane_total == 8 and lm.choose(0, 4) == ("join", 0)
    lm.idle(0)  # task 2 stopped: now the lane fits it
    assert _sizes(lm) == {0: 3} and lm.lane_total == 3 and lm.choose(0, 4) == ("new", None)
    lm.idle(5)  # a lane that is gone: nothing to do
    assert lm.safe()


def test_admit_twice_raises_and_bad_capacity():
    lm = LaneManager(10)
    lm.admit(1, 1, 1)
    with pytest.raises(ValueError, match="already admitted"):
        lm.admit(1, 1, 1)
    with pytest.raises(ValueError, match="capacity must be positive, got 0"):
        LaneManager(0)
    assert lm.fits_alone(5, 5) and not lm.fits_alone(5, 6)


def _reference(capacity, admitted, lanes, p, e):
    """Algorithm 1 from REFERENCES.md, written independently: lanes maps id -> size."""
    base = sum(admitted.values()) + p
    total = sum(lanes.values())
    if base + total + e <= capacity:
        return ("new", None)
    if base + total <= capacity:
        fits = sorted((size, i) for i, size in lanes.items() if size >= e)
        if fits:
            return ("join", fits[0][1])
    for size, i in sorted((size, i) for i, size in lanes.items()):
        if size < e and base + total - size + e <= capacity:
            return ("grow", i)
    return None


def test_random_admits_and_releases_keep_the_safety_condition():
    rng = random.Random(1234)
    capacity = 100
    lm = LaneManager(capacity)
    persist: dict[int, int] = {}
    eph: dict[int, int] = {}
    outcomes = {"new": 0, "join": 0, "grow": 0, None: 0}
    next_id = 0
    for _ in range(3000):
        if persist and rng.random() < 0.45:
            t = rng.choice(sorted(persist))
            lm.release(t)
            del persist[t], eph[t]
        else:
            p, e = rng.randint(0, 25), rng.randint(1, 40)
            expected = _reference(capacity, persist, _sizes(lm), p, e)
            assert lm.choose(p, e) == expected
            lane = lm.admit(next_id, p, e)
            outcomes[expected[0] if expected else None] += 1
            if expected is None:
                assert lane is None
            else:
                assert lane == (expected[1] if expected[0] != "new" else max(lm.lanes))
                persist[next_id], eph[next_id] = p, e
            next_id += 1
        # The bookkeeping matches a recount, and the safety condition holds.
        assert lm.persistent == sum(persist.values())
        assert lm.lane_total == sum(_sizes(lm).values())
        assert lm.persistent + lm.lane_total <= capacity and lm.safe()
        for lane in lm.lanes.values():
            assert lane.tasks and lane.size == max(lane.tasks.values())
            assert all(eph[t] == size for t, size in lane.tasks.items())
        assert sorted(t for lane in lm.lanes.values() for t in lane.tasks) == sorted(persist)
    assert all(outcomes.values()), outcomes  # every branch of Algorithm 1 was taken
