"""Thrashing: too much of the device's time goes to loading models rather than running
them. Runs in the controller's process (and in the simulator). Pure logic with an
injected clock: no torch, no I/O, no clock reads.

Like page-fault-frequency control: the executor reports the seconds each model spent
loading (switching in) and the seconds of useful compute, and the detector watches
the share of loading over a sliding window. While it is above the threshold, the
models used in the window (the hot ones) are kept resident where another victim
exists (:func:`victims`), and the scheduler holds per-model batches longer
(:meth:`ThrashingDetector.batch_factor`), trading latency for fewer switches.

Use at an eviction::

    for name in victims(policy, detector, now, protected={incoming, *pinned}):
        ...evict name, retry the allocation...
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

from timeshare.errors import ConfigError
from timeshare.scheduler.eviction import EvictionPolicy

__all__ = ["NothingToEvict", "ThrashingDetector", "make_room", "victims"]

T = TypeVar("T")

MAX_BATCH_FACTOR = 5.0


class ThrashingDetector:
    """Share of load time over the last ``window_s`` seconds, and the models used there.

    An event reported at ``now`` counts, whole, while ``now_query - window_s < now``;
    a load that straddles the window's start is not cut. The load share is
    ``load / (load + useful)`` over the window, 0.0 when nothing was reported, and
    the runtime is thrashing while it is above ``threshold``. Reports are expected in
    time order; one earlier than the latest report is filed at the latest one's time.

    Every report and query is amortized O(1) (``hot`` is O(hot models)): events wait in
    a deque beside running sums and leave it lazily, when a later call's window has
    passed them.
    """

    def __init__(self, window_s: float = 5.0, threshold: float = 0.5) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not (
            math.isfinite(window_s) and window_s > 0
        ):
            raise ConfigError(f"thrashing window_s must be a positive number of seconds, got {window_s!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ConfigError(f"thrashing threshold must be a load share in [0, 1), got {threshold!r}")
        self.window_s = float(window_s)
        self.threshold = float(threshold)
        self._events: deque[tuple[float, str, float, float]] = deque()  # (time, model, load s, useful s)
        self._load = 0.0
        self._work = 0.0
        self._uses: dict[str, int] = {}  # model -> events in the window
        self._latest = -math.inf

    def loaded(self, model: str, now: float, seconds: float) -> None:
        """``model`` spent ``seconds`` loading (switching in), ending at ``now``."""
        self._add(model, now, seconds, 0.0)

    def worked(self, model: str, now: float, seconds: float) -> None:
        """``model`` spent ``seconds`` of useful compute, ending at ``now``."""
        self._add(model, now, 0.0, seconds)

    def _add(self, model: str, now: float, load: float, work: float) -> None:
        seconds = load + work
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"seconds reported for model {model!r} must be a finite number >= 0, got {seconds!r}")
        if now > self._latest:
            self._latest = now
        self._events.append((self._latest, model, load, work))
        self._load += load
        self._work += work
        self._uses[model] = self._uses.get(model, 0) + 1
        self._expire(self._latest)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        while events and events[0][0] <= horizon:
            _, model, load, work = events.popleft()
            self._load -= load
            self._work -= work
            left = self._uses[model] - 1
            if left:
                self._uses[model] = left
            else:
                del self._uses[model]
        if not events:  # no drift left over from the running sums
            self._load = self._work = 0.0

    def ratio(self, now: float) -> float:
        """Load time / (load time + useful time) over the window; 0.0 when empty."""
        self._expire(now)
        total = self._load + self._work
        return max(0.0, min(1.0, self._load / total)) if total > 0 else 0.0

    def thrashing(self, now: float) -> bool:
        return self.ratio(now) > self.threshold

    def hot(self, now: float) -> set[str]:
        """Models that loaded or worked within the window."""
        self._expire(now)
        return set(self._uses)

    def batch_factor(self, now: float) -> float:
        """How much longer to hold per-model batches: 1.0 when not thrashing, then
        ``1 + 4 * (ratio - threshold) / (1 - threshold)``, reaching 5.0 when the window
        is all loading."""
        r = self.ratio(now)
        if r <= self.threshold:
            return 1.0
        return min(MAX_BATCH_FACTOR, 1.0 + (MAX_BATCH_FACTOR - 1.0) * (r - self.threshold) / (1.0 - self.threshold))


def victims(
    policy: EvictionPolicy,
    detector: ThrashingDetector | None,
    now: float,
    protected: Iterable[str] = (),
    need_one: bool = True,
) -> list[str]:
    """The policy's candidates, first to evict first. While ``detector`` says the
    runtime thrashes, the hot models are protected too; if that leaves no victim and
    ``need_one``, the plain candidates are returned instead (making room beats
    keeping the hot set whole). ``protected`` should hold the model being admitted,
    which is hot by then. The policy is asked with the full protected set, so a CLOCK
    hand sweeps past the hot models (NOTE [Clock sweep on candidates])."""
    protected = set(protected)
    if detector is not None and detector.thrashing(now):
        cold = policy.candidates(now, protected | detector.hot(now))
        if cold or not need_one:
            return cold
    return policy.candidates(now, protected)


class NothingToEvict(LookupError):
    """``make_room`` ran out of victims: every resident model is protected."""


def make_room(
    policy: EvictionPolicy,
    detector: ThrashingDetector | None,
    now: float,
    protected: Iterable[str],
    attempt: Callable[[], T | None],
    evict: Callable[[str], object],  # its return value, if any, is not used
) -> tuple[T, list[str]]:
    """The make-room loop of every model cache (the runtime's residency and the
    simulator's): ``attempt()`` the placement; while it gives None, ``evict`` the first
    of ``victims``. Returns the placement and the models evicted, in order. Raises
    NothingToEvict when no unprotected model is left. Pure: the clock is ``now``."""
    evicted: list[str] = []
    placed = attempt()
    while placed is None:
        order = victims(policy, detector, now, protected)
        if not order:
            raise NothingToEvict(f"every resident model is protected: {sorted(set(protected))}")
        evict(order[0])
        evicted.append(order[0])
        placed = attempt()
    return placed, evicted
