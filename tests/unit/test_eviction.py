"""Eviction policies and the thrashing detector: orders worked out by hand."""

import math
import random

import pytest

from timeshare.errors import ConfigError
from timeshare.scheduler.eviction import (
    EVICTION_POLICIES,
    ClockPolicy,
    CostAwarePolicy,
    LRUPolicy,
    SecondChancePolicy,
    WorkingSetPolicy,
    make_eviction_policy,
)
from timeshare.scheduler.thrashing import ThrashingDetector, victims


def test_lru_order_and_protection():
    p = LRUPolicy()
    for t, m in enumerate("abc"):
        p.admitted(m, t)
    p.touched("a", 3)
    assert p.candidates(4) == ["b", "c", "a"]
    assert p.candidates(4, protected={"b"}) == ["c", "a"]
    p.removed("c")
    assert p.candidates(5) == ["b", "a"]


def test_clock_sweep_by_hand():
    p = make_eviction_policy("clock")
    assert isinstance(p, ClockPolicy)
    for t, m in enumerate("abcd"):
        p.admitted(m, t)  # ring a b c d, hand at a, every bit set
    # The hand clears a b c d, comes back to a (clear now): a, then b c d in turn.
    assert p.candidates(4) == ["a", "b", "c", "d"]
    p.removed("a")  # hand at b; b c d clear
    p.admitted("e", 5)  # just behind the hand: ring b c d e(set)
    p.touched("c", 6)  # c set
    # b clear: first; c set: cleared, passed; d clear; e set: cleared; then c, e.
    assert p.candidates(7) == ["b", "d", "c", "e"]
    assert p.candidates(7) == ["b", "d", "c", "e"]  # the hand already sits on b
    lru = LRUPolicy()
    for t, m in enumerate("abcd"):
        lru.admitted(m, t)
    lru.removed("a"), lru.admitted("e", 5), lru.touched("c", 6)
    assert lru.candidates(7) == ["b", "d", "e", "c"]  # CLOCK is not LRU here
    # b protected: the hand skips it, clears c, stops on d.
    assert p.candidates(8, protected={"b"}) == ["d", "c", "e"]
    p.removed("d")  # ring e(set) b(clear) c(clear), hand at e
    assert p.candidates(9) == ["b", "c", "e"]
    p.touched("b", 10)
    assert p.candidates(11, protected=["c"]) == ["e", "b"]  # e cleared before; b set again


def test_second_chance_two_chances_by_hand():
    p = make_eviction_policy("second_chance", chances=2)
    assert isinstance(p, SecondChancePolicy) and p.chances == 2
    for t, m in enumerate("abc"):
        p.admitted(m, t)  # (ref, count): a(1,0) b(1,0) c(1,0)
    # Pass 1 clears the bits, pass 2 counts 1 each, pass 3 takes a, then b, c.
    assert p.candidates(3) == ["a", "b", "c"]
    p.removed("a")  # b(0,1) c(0,1), hand at b
    p.admitted("d", 4)  # b(0,1) c(0,1) d(1,0)
    p.touched("b", 5)  # b(1,1)
    # c needs 1 more visit, b and d 3 (bit, then two counts); b sits before d.
    assert p.candidates(6) == ["c", "b", "d"]
    p.removed("c")  # the hand cleared b on the way: d(1,0) b(0,0), hand at d
    assert p.candidates(7) == ["b", "d"]
    lru = LRUPolicy()
    for t, m in enumerate("abc"):
        lru.admitted(m, t)
    lru.removed("a"), lru.admitted("d", 4), lru.touched("b", 5), lru.removed("c")
    assert lru.candidates(7) == ["d", "b"]
    clock = ClockPolicy()  # one chance: b (used) goes after d (only admitted) after all
    for t, m in enumerate("abc"):
        clock.admitted(m, t)
    clock.candidates(3), clock.removed("a"), clock.admitted("d", 4), clock.touched("b", 5)
    assert clock.candidates(6) == ["c", "b", "d"]
    clock.removed("c")
    assert clock.candidates(7) == ["b", "d"]
    p.touched("b", 8)
    p.admitted("e", 9)
    assert p.candidates(10) == ["d", "b", "e"]  # d(0,1) b(1,1) e(1,0), hand at b


class _RefNthChance:
    """The textbook algorithm, one hand step at a time, to check the policy against."""

    def __init__(self, chances):
        self.n, self.ring, self.ref, self.count, self.hand = chances, [], {}, {}, 0

    def admit(self, m):
        if m in self.ref:
            self.ref[m] = True
            return
        self.ring.insert(self.hand, m)  # just behind the hand
        self.hand = (self.hand + 1) % len(self.ring)
        self.ref[m], self.count[m] = True, 0

    def touch(self, m):
        if m in self.ref:
            self.ref[m] = True

    def remove(self, m):
        i = self.ring.index(m)
        del self.ring[i], self.ref[m], self.count[m]
        if i < self.hand:
            self.hand -= 1
        if self.hand >= len(self.ring):
            self.hand = 0

    def evict(self, protected):
        if all(m in protected for m in self.ring):
            return None
        while True:
            m = self.ring[self.hand]
            if m not in protected:
                if self.ref[m]:
                    self.ref[m], self.count[m] = False, 0
                else:
                    self.count[m] += 1
                    if self.count[m] >= self.n:
                        self.remove(m)
                        return m
            self.hand = (self.hand + 1) % len(self.ring)

    def order(self, protected):
        import copy

        sim, out = copy.deepcopy(self), []
        while (m := sim.evict(protected)) is not None:
            out.append(m)
        return out


@pytest.mark.parametrize("chances", [1, 2, 3])
def test_nth_chance_matches_step_by_step_hand(chances):
    rng = random.Random(chances)
    p, ref = SecondChancePolicy(chances=chances), _RefNthChance(chances)
    names = [f"m{i}" for i in range(8)]
    for step in range(3000):
        op, m = rng.random(), rng.choice(names)
        if op < 0.3:
            p.admitted(m, step), ref.admit(m)
        elif op < 0.6:
            p.touched(m, step), ref.touch(m)
        elif op < 0.7:
            p.removed(m)
            if m in ref.ref:
                ref.remove(m)
        else:  # an eviction: candidates, then the first one goes
            protected = set(rng.sample(names, rng.randint(0, 3)))
            expected = ref.order(protected)
            assert p.candidates(step, protected) == expected, step
            if expected:
                assert ref.evict(protected) == expected[0]
                p.removed(expected[0])
        assert [m for m, _ in p.ring()] == ref.ring[ref.hand:] + ref.ring[: ref.hand]


def test_working_set_window_boundary():
    p = make_eviction_policy("working_set")
    assert isinstance(p, WorkingSetPolicy) and p.window_s == 10.0
    p.admitted("a", 0.0), p.admitted("b", 1.0), p.admitted("c", 2.0)
    p.touched("a", 5.0)
    # At 15 a was used exactly window_s ago: still in the working set.
    assert p.working_set(15.0) == {"a"}
    assert p.outside(15.0) == ["b", "c"]
    assert p.candidates(15.0) == ["b", "c", "a"]
    assert p.outside(15.5) == ["b", "c", "a"] and p.working_set(15.5) == set()
    assert p.candidates(15.0, protected={"c"}) == ["b", "a"]
    p.touched("c", 14.0)
    assert p.outside(15.0) == ["b"] and p.working_set(15.0) == {"a", "c"}
    assert p.candidates(15.0) == ["b", "a", "c"]
    short = make_eviction_policy("working_set", window_s=1)
    short.admitted("x", 0.0), short.admitted("y", 3.0)
    assert short.outside(4.0) == ["x"] and short.working_set(4.0) == {"y"}


def test_cost_aware_differs_from_lru():
    p = make_eviction_policy("cost", half_life_s=30.0)
    assert isinstance(p, CostAwarePolicy)
    p.admitted("a", 0.0, reload_s=1.0)
    p.admitted("b", 0.0, reload_s=0.1)
    p.admitted("c", 0.0, reload_s=0.5)
    p.touched("a", 0.0)
    for t in range(5):
        p.touched("b", float(t))
    p.touched("c", 10.0)
    # At 10: a 1.0 x 2^(-1/3) = 0.794; b 0.1 x sum 2^(-(10-t)/30) = 0.424; c 0.5 x 1 = 0.5.
    assert p.candidates(10.0) == ["b", "c", "a"]  # LRU: a, b, c
    assert p.rate("c", 10.0) == pytest.approx(math.log(2) / 30)
    b_count = sum(2 ** (-(10 - t) / 30) for t in range(5))
    assert p.rate("b", 10.0) == pytest.approx(b_count * math.log(2) / 30)
    assert p.rate("never", 10.0) == 0.0
    assert p.candidates(500.0) == ["b", "c", "a"]  # decay keeps the ratios; no underflow tie
    # No reload cost, or no use yet: score zero, least recently used first.
    p.admitted("d", 11.0, reload_s=0.0)
    p.admitted("e", 11.0, reload_s=0.0)
    p.touched("e", 12.0)
    p.touched("d", 13.0)
    p.admitted("f", 14.0, reload_s=9.0)
    assert p.candidates(15.0) == ["e", "d", "f", "b", "c", "a"]
    # The rate outlives an eviction.
    p.removed("a")
    assert "a" not in p and p.candidates(15.0, protected={"d", "e", "f"}) == ["b", "c"]
    p.admitted("a", 20.0, reload_s=1.0)
    assert p.rate("a", 20.0) == pytest.approx(2 ** (-20 / 30) * math.log(2) / 30)
    assert p.candidates(20.0, protected={"d", "e", "f"}) == ["b", "c", "a"]


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_removed_and_protected_models_are_never_candidates(name):
    p = make_eviction_policy(name)
    for t, m in enumerate("abcd"):
        p.admitted(m, float(t), reload_s=1.0)
        p.touched(m, float(t))
    p.removed("b")
    p.removed("b")  # twice: no error
    p.touched("b", 5.0)  # not resident: ignored
    assert "b" not in p and "a" in p and len(p) == 3
    assert sorted(p.candidates(6.0)) == ["a", "c", "d"]
    assert sorted(p.candidates(7.0, protected={"a", "zz"})) == ["c", "d"]
    assert p.candidates(8.0, protected="acd") == []


def test_factory_names_and_options():
    assert isinstance(make_eviction_policy("LRU"), LRUPolicy)
    known = r"\['clock', 'cost', 'lru', 'second_chance', 'working_set'\]"
    with pytest.raises(ConfigError, match=rf"unknown eviction policy 'mru'; known: {known}"):
        make_eviction_policy("mru")
    with pytest.raises(ConfigError, match="unknown eviction policy None"):
        make_eviction_policy(None)
    with pytest.raises(ConfigError, match=r"'lru' has no option 'window_s'; its options: \[\]"):
        make_eviction_policy("lru", window_s=3.0)
    with pytest.raises(ConfigError, match="'clock' has no option 'chances'"):
        make_eviction_policy("clock", chances=2)


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("second_chance", {"chances": 0}, "chances must be an integer >= 1, got 0"),
        ("second_chance", {"chances": 1.5}, "got 1.5"),
        ("second_chance", {"chances": True}, "got True"),
        ("working_set", {"window_s": -1}, "window_s must be a positive number of seconds, got -1"),
        ("working_set", {"window_s": float("nan")}, "got nan"),
        ("cost", {"half_life_s": 0}, "half_life_s must be a positive number of seconds, got 0"),
        ("cost", {"half_life_s": "30"}, "got '30'"),
    ],
)
def test_bad_options_refused(name, options, message):
    with pytest.raises(ConfigError, match=message):
        make_eviction_policy(name, **options)


def test_bad_reload_time_refused():
    with pytest.raises(ConfigError, match="reload_s of model 'a' must be a finite number >= 0, got -1"):
        CostAwarePolicy().admitted("a", 0.0, reload_s=-1)


def test_thrashing_timeline():
    d = ThrashingDetector(window_s=5.0, threshold=0.5)
    assert not d.thrashing(0.0) and d.batch_factor(0.0) == 1.0 and d.hot(0.0) == set()
    d.loaded("a", 1.0, 2.0)  # load 2 / work 0
    assert d.thrashing(1.0) and d.batch_factor(1.0) == 5.0
    d.worked("a", 2.0, 1.0)  # 2 / 1
    assert d.ratio(2.0) == pytest.approx(2 / 3) and d.thrashing(2.0)
    assert d.batch_factor(2.0) == pytest.approx(1 + 4 * (2 / 3 - 0.5) / 0.5)
    d.worked("b", 3.0, 1.0)  # 2 / 2: at the threshold, not above
    assert not d.thrashing(3.0) and d.batch_factor(3.0) == 1.0
    d.loaded("c", 4.0, 1.0)  # 3 / 2
    assert d.thrashing(4.0) and d.hot(4.0) == {"a", "b", "c"}
    assert d.thrashing(5.999)  # the load at 1.0 is still in (0.999, 5.999]
    assert not d.thrashing(6.0) and d.ratio(6.0) == pytest.approx(1 / 3)  # it left: 1 / 2
    assert d.hot(6.0) == {"a", "b", "c"}  # a still worked at 2.0
    assert not d.thrashing(7.5) and d.hot(7.5) == {"b", "c"}  # 1 / 1
    assert d.thrashing(8.5) and d.hot(8.5) == {"c"}  # 1 / 0
    assert not d.thrashing(9.0) and d.ratio(9.0) == 0.0 and d.hot(9.0) == set()
    d.loaded("a", 20.0, 1.0)
    d.worked("a", 19.0, 3.0)  # out of order: filed at 20.0
    assert d.ratio(24.9) == 0.25 and d.ratio(25.0) == 0.0


def test_thrashing_detector_refuses_bad_settings():
    with pytest.raises(ConfigError, match=r"threshold must be a load share in \[0, 1\), got 1.0"):
        ThrashingDetector(threshold=1.0)
    with pytest.raises(ConfigError, match="window_s must be a positive number of seconds, got 0"):
        ThrashingDetector(window_s=0)
    with pytest.raises(ConfigError, match="got -1.0"):
        ThrashingDetector().worked("a", 0.0, -1.0)


def test_victims_spare_hot_models_while_thrashing():
    p = LRUPolicy()
    for t, m in enumerate("abcd"):
        p.admitted(m, float(t))
    d = ThrashingDetector(window_s=5.0, threshold=0.5)
    assert victims(p, d, 4.0, protected={"d"}) == ["a", "b", "c"]  # not thrashing
    d.loaded("a", 4.0, 1.0)
    d.loaded("c", 4.0, 1.0)
    d.loaded("d", 4.0, 1.0)
    assert d.thrashing(4.0)
    assert victims(p, d, 4.0, protected={"d"}) == ["b"]
    d.loaded("b", 4.0, 1.0)  # every unprotected model hot: fall back, or nothing
    assert victims(p, d, 4.0, protected={"d"}) == ["a", "b", "c"]
    assert victims(p, d, 4.0, protected={"d"}, need_one=False) == []
    assert victims(p, None, 4.0, protected={"d"}) == ["a", "b", "c"]
    assert victims(p, d, 10.0, protected={"d"}) == ["a", "b", "c"]  # the window passed


def test_victims_let_the_clock_hand_pass_hot_models():
    p = ClockPolicy()
    p.admitted("b", 0.0), p.admitted("c", 1.0)  # both bits set, hand at b
    d = ThrashingDetector()
    d.loaded("b", 2.0, 1.0)
    assert victims(p, d, 2.0) == ["c"]
    assert p.ring() == [("c", False), ("b", True)]  # the hand passed hot b as a protected model: bit kept


class _Ops:
    """A tally of the work a policy does on its resident models, in operations: a hash
    or a comparison of a model's name (every dictionary lookup hashes its key; every
    search of a list compares) and an element visited by iterating one of the
    policy's dictionaries (a sweep over the residents). Counted, not timed, so the
    tally is the same on a loaded machine (speed itself is the benchmarks' business)."""

    def __init__(self) -> None:
        self.n = 0

    def name(self, text: str) -> str:
        ops = self

        class Name(str):
            __slots__ = ()

            def __hash__(self) -> int:
                ops.n += 1
                return str.__hash__(self)

            def __eq__(self, other: object) -> bool:
                ops.n += 1
                return str.__eq__(self, other)

            def __lt__(self, other: str) -> bool:
                ops.n += 1
                return str.__lt__(self, other)

            def __gt__(self, other: str) -> bool:
                ops.n += 1
                return str.__gt__(self, other)

        return Name(text)

    def watch(self, policy) -> None:
        """Replaces each dictionary the policy keeps (whatever its names, so a policy
        that changes representation is still counted) by a copy that counts the
        elements its iterations visit."""
        ops = self

        def counted(items):
            for item in items:
                ops.n += 1
                yield item

        for attr, value in vars(policy).items():
            if isinstance(value, dict):
                cls = type(value)
                counting = type(
                    f"Counting{cls.__name__}",
                    (cls,),
                    {
                        "__iter__": lambda d, _c=cls: counted(_c.__iter__(d)),
                        "keys": lambda d, _c=cls: counted(_c.keys(d)),
                        "values": lambda d, _c=cls: counted(_c.values(d)),
                        "items": lambda d, _c=cls: counted(_c.items(d)),
                    },
                )
                setattr(policy, attr, counting(value))


def _touch_ops(name: str, resident: int, touches: int, most_per_touch: float = math.inf) -> float:
    """Operations (see :class:`_Ops`) per touch of ``touches`` touches spread over
    ``resident`` models. Fails as soon as a thousand touches average more than
    ``most_per_touch`` (a policy that scans would take hours to finish)."""
    ops = _Ops()
    p = make_eviction_policy(name)
    models = [ops.name(f"m{i}") for i in range(resident)]
    for m in models:
        p.admitted(m, 0.0, reload_s=1.0)
    ops.watch(p)
    touch, now, chunk = p.touched, 0.0, 1_000
    ops.n = 0
    for done in range(0, touches, chunk):
        for i in range(done, min(done + chunk, touches)):
            now += 1e-3
            touch(models[i % resident], now)
        per_touch = ops.n / min(done + chunk, touches)
        assert per_touch <= most_per_touch, (
            f"{name}: {per_touch:.1f} operations per touch over {min(done + chunk, touches)} touches of "
            f"{resident} models, against {most_per_touch:.1f} allowed"
        )
    assert sorted(p.candidates(now + 1.0)) == sorted(models)  # every touch was of a resident model
    return ops.n / touches


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_touches_stay_cheap(name):
    """O(1) per touch, in operations: a touch does as much work with 100 times more
    resident models and over 100 times more touches (a scan of the residents
    per touch, or of the touches so far, would make it hundreds of times dearer)."""
    few = _touch_ops(name, resident=50, touches=1_000)
    assert 0 < few <= 10, f"{name}: {few:.1f} operations per touch with 50 models"
    _touch_ops(name, resident=5_000, touches=100_000, most_per_touch=2 * few)
