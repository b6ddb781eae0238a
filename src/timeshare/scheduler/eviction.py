"""Which resident model leaves device memory when another needs room.

Runs in the controller's process (and in the simulator). Pure logic: no torch, no
I/O, no clock reads; every event carries ``now``, from whichever clock the caller
runs on (``time.monotonic()`` in the runtime, virtual time in the simulator).

A policy sees events (a model became resident, ran a request, left device memory)
and, asked for victims, returns the resident models in the order they should go.
Pinned models and models with work in flight are excluded by the caller through
``protected``. The simulator calls these for every request, so ``admitted``,
``touched`` and ``removed`` are O(1) and ``candidates`` is O(n log n) in the number
of resident models.

NOTE [Eviction events]: ``touched`` and ``removed`` of a model that is not resident
are ignored, and ``admitted`` of a resident one counts as a use. Callers need not
track residency twice.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from timeshare.errors import ConfigError

__all__ = [
    "EVICTION_POLICIES",
    "ClockPolicy",
    "CostAwarePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "SecondChancePolicy",
    "WorkingSetPolicy",
    "make_eviction_policy",
]


class EvictionPolicy:
    """Interface of an eviction policy. ``options``: the keyword options its
    constructor takes (checked by :func:`make_eviction_policy`)."""

    name = "base"
    options: tuple[str, ...] = ()

    def admitted(self, model: str, now: float, *, reload_s: float = 0.0) -> None:
        """``model`` became resident; ``reload_s``: seconds to load it again (profiled)."""
        raise NotImplementedError

    def touched(self, model: str, now: float) -> None:
        """A request ran on ``model``."""
        raise NotImplementedError

    def removed(self, model: str) -> None:
        """``model`` left device memory."""
        raise NotImplementedError

    def candidates(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        """Resident models not in ``protected``, the first to evict first."""
        raise NotImplementedError

    def __contains__(self, model: object) -> bool:
        """Resident, as far as this policy's bookkeeping goes."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first (admission counts as a use)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # least recent first

    def admitted(self, model: str, now: float, *, reload_s: float = 0.0) -> None:
        self._order[model] = None
        self._order.move_to_end(model)

    def touched(self, model: str, now: float) -> None:
        if model in self._order:
            self._order.move_to_end(model)

    def removed(self, model: str) -> None:
        self._order.pop(model, None)

    def candidates(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        keep = set(protected)
        return [m for m in self._order if m not in keep]

    def __contains__(self, model: object) -> bool:
        return model in self._order

    def __len__(self) -> int:
        return len(self._order)


class _Slot:
    __slots__ = ("ref", "count")

    def __init__(self) -> None:
        self.ref = True  # admitted models start referenced
        self.count = 0


class SecondChancePolicy(EvictionPolicy):
    """N-th chance (generalized CLOCK): a model is evicted once the hand has passed it
    ``chances`` times in a row without it being used.

    The resident models sit on a circular list with a hand. Each has a reference bit
    (set by ``admitted`` and ``touched``) and a counter. The hand, looking for a victim,
    visits models in circular order, skipping protected ones (their state unchanged):
    a model with its bit set gets the bit cleared and the counter zeroed and is
    passed; otherwise its counter goes up by one, and when it reaches ``chances`` the
    model is the victim (the hand stays on it; once removed, the hand is on the next
    one). So a model needs ``1 + chances`` visits after its last use, or
    ``chances - counter`` visits if it was not used since the hand last cleared its
    bit. A newly admitted model goes just behind the hand: the last one it visits.
    ``chances=1`` is CLOCK.

    ``candidates`` returns the order in which the hand would evict every unprotected
    model if nothing else happened: by visits needed, then by position from the hand
    (evicting one model does not change when the hand reaches the others).

    NOTE [Clock sweep on candidates]: ``candidates`` is called when an eviction is
    about to happen, and it performs the sweep up to its first victim: it clears the
    bits and counts the visits of the models the hand passes and leaves the hand on
    the victim. Removing that victim then leaves exactly the state of the textbook
    algorithm; calling ``candidates`` again before any other event returns the same
    order. A call that evicts nothing still advances the hand.

    Representation: an ordered dict in sweep order, the hand always at its front;
    moving the hand past a model is ``move_to_end``.
    """

    name = "second_chance"
    options: tuple[str, ...] = ("chances",)

    def __init__(self, chances: int = 2) -> None:
        if isinstance(chances, bool) or not isinstance(chances, int) or chances < 1:
            raise ConfigError(f"eviction policy {self.name!r}: chances must be an integer >= 1, got {chances!r}")
        self.chances = chances
        self._ring: OrderedDict[str, _Slot] = OrderedDict()  # sweep order; the hand at the front

    def admitted(self, model: str, now: float, *, reload_s: float = 0.0) -> None:
        slot = self._ring.get(model)
        if slot is None:
            self._ring[model] = _Slot()  # just behind the hand
        else:
            slot.ref = True

    def touched(self, model: str, now: float) -> None:
        slot = self._ring.get(model)
        if slot is not None:
            slot.ref = True

    def removed(self, model: str) -> None:
        self._ring.pop(model, None)

    def candidates(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        keep = set(protected)
        n = self.chances
        order: list[tuple[int, int, str]] = []  # (visits until evicted, position from the hand, model)
        for m, slot in self._ring.items():
            if m not in keep:
                order.append((1 + n if slot.ref else n - slot.count, len(order), m))
        if not order:
            return []
        order.sort()
        # NOTE [Clock sweep on candidates]: sweep to the first victim. It is evicted on
        # its visits-th visit, so every model gets visits-1 visits, plus one if it sits
        # before the victim; no other model reaches its own count on the way.
        visits, where, victim = order[0]
        for _, pos, m in order:
            v = visits - 1 + (pos < where)
            if v:
                slot = self._ring[m]
                if slot.ref:
                    slot.ref, slot.count = False, v - 1
                else:
                    slot.count += v
        ring = self._ring
        while True:  # the hand to the victim; it passes protected models as they are
            first = next(iter(ring))
            if first == victim:
                break
            ring.move_to_end(first)
        return [m for _, _, m in order]

    def ring(self) -> list[tuple[str, bool]]:
        """The resident models in sweep order, the hand's first, with their reference bits."""
        return [(m, slot.ref) for m, slot in self._ring.items()]

    def __contains__(self, model: object) -> bool:
        return model in self._ring

    def __len__(self) -> int:
        return len(self._ring)


class ClockPolicy(SecondChancePolicy):
    """CLOCK: resident models on a circular list with a reference bit, set on admission
    and on use. The hand clears set bits as it passes and evicts the first model whose
    bit is already clear. ``candidates`` returns the order the hand would evict them
    and advances the hand to the first one (NOTE [Clock sweep on candidates]).
    This is :class:`SecondChancePolicy` with one chance."""

    name = "clock"
    options = ()

    def __init__(self) -> None:
        super().__init__(chances=1)


def _positive_seconds(policy: str, option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"eviction policy {policy!r}: {option} must be a positive number of seconds, got {value!r}")
    return float(value)


class WorkingSetPolicy(EvictionPolicy):
    """Denning's working set with window ``window_s``: the models used (admitted or
    touched) within the last ``window_s`` seconds, ``now - last_use <= window_s``,
    are the working set. Models outside it go first, oldest first, then the models in
    it, least recently used first.

    With a clock that never goes back, the models outside the window are a prefix of
    the LRU order, so the order is LRU's; what the window adds is :meth:`outside`, the
    models that can be evicted ahead of need, and :meth:`working_set`.
    """

    name = "working_set"
    options = ("window_s",)

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = _positive_seconds(self.name, "window_s", window_s)
        self._last: OrderedDict[str, float] = OrderedDict()  # model -> last use, least recent first

    def admitted(self, model: str, now: float, *, reload_s: float = 0.0) -> None:
        self._last[model] = now
        self._last.move_to_end(model)

    def touched(self, model: str, now: float) -> None:
        if model in self._last:
            self._last[model] = now
            self._last.move_to_end(model)

    def removed(self, model: str) -> None:
        self._last.pop(model, None)

    def outside(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        """Resident unprotected models not used within the window, oldest first."""
        keep = set(protected)
        horizon = now - self.window_s
        return [m for m, t in self._last.items() if t < horizon and m not in keep]

    def working_set(self, now: float) -> set[str]:
        """Resident models used within the last ``window_s`` seconds."""
        horizon = now - self.window_s
        return {m for m, t in self._last.items() if t >= horizon}

    def candidates(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        keep = set(protected)
        horizon = now - self.window_s
        out: list[str] = []
        inside: list[str] = []
        for m, t in self._last.items():
            if m not in keep:
                (out if t < horizon else inside).append(m)
        return out + inside

    def __contains__(self, model: object) -> bool:
        return model in self._last

    def __len__(self) -> int:
        return len(self._last)


class CostAwarePolicy(EvictionPolicy):
    """Cost-aware: the model with the least ``reload_s x expected use rate`` goes
    first, ties least recently used first.

    The expected use rate is an exponentially decayed request count with half-life
    ``half_life_s``: each ``touched`` adds one, and the count halves every
    ``half_life_s`` seconds. A steady rate of r requests per second converges to a
    count of ``r * half_life_s / ln 2``, so :meth:`rate` is the count times
    ``ln 2 / half_life_s``. The count and the time it was last brought up to date are
    stored per model and decayed lazily: O(1) per touch. The count outlives an
    eviction (a request rate is the model's, not its residency's) and counts every
    ``touched``, resident or not; ``reload_s`` is the one given at the last admission.
    With every ``reload_s`` zero (or no use yet) the order is LRU's.

    Scores are compared in the log domain, so long-idle models do not all underflow
    to a tie.
    """

    name = "cost"
    options = ("half_life_s",)

    def __init__(self, half_life_s: float = 30.0) -> None:
        self.half_life_s = _positive_seconds(self.name, "half_life_s", half_life_s)
        self._decay = math.log(2.0) / self.half_life_s  # per second, natural log
        self._count: dict[str, tuple[float, float]] = {}  # model -> (decayed count, as of time)
        self._reload: dict[str, float] = {}  # resident models -> reload_s
        self._used: dict[str, int] = {}  # resident models -> sequence number of the last use
        self._seq = 0

    def admitted(self, model: str, now: float, *, reload_s: float = 0.0) -> None:
        if not (isinstance(reload_s, (int, float)) and math.isfinite(reload_s) and reload_s >= 0):
            raise ConfigError(f"reload_s of model {model!r} must be a finite number >= 0, got {reload_s!r}")
        self._reload[model] = float(reload_s)
        self._seq += 1
        self._used[model] = self._seq

    def touched(self, model: str, now: float) -> None:
        c = self._count.get(model)
        self._count[model] = (1.0 if c is None else c[0] * math.exp(-self._decay * (now - c[1])) + 1.0, now)
        if model in self._used:
            self._seq += 1
            self._used[model] = self._seq

    def removed(self, model: str) -> None:
        self._reload.pop(model, None)
        self._used.pop(model, None)

    def rate(self, model: str, now: float) -> float:
        """Expected requests per second of ``model`` at ``now`` (0.0 if never used)."""
        c = self._count.get(model)
        if c is None:
            return 0.0
        return c[0] * math.exp(-self._decay * (now - c[1])) * self._decay

    def _log_score(self, model: str, now: float) -> float:
        reload_s = self._reload[model]
        c = self._count.get(model)
        if c is None or reload_s == 0.0:
            return -math.inf
        return math.log(reload_s) + math.log(c[0]) - self._decay * (now - c[1])

    def candidates(self, now: float, protected: Iterable[str] = ()) -> list[str]:
        keep = set(protected)
        keyed = [(self._log_score(m, now), seq, m) for m, seq in self._used.items() if m not in keep]
        keyed.sort()
        return [m for _, _, m in keyed]

    def __contains__(self, model: object) -> bool:
        return model in self._used

    def __len__(self) -> int:
        return len(self._used)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, ClockPolicy, SecondChancePolicy, WorkingSetPolicy, CostAwarePolicy)
}


def make_eviction_policy(name: str, **options: object) -> EvictionPolicy:
    """Create a policy by name (case-insensitive) with its options; unknown names and
    options, and bad option values, raise :class:`ConfigError` naming them."""
    cls = EVICTION_POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}")
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ConfigError(
            f"eviction policy {cls.name!r} has no option {unknown[0]!r}; its options: {list(cls.options)}"
        )
    return cls(**options)
