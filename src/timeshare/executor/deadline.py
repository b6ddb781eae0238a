"""How long a worker may take to answer before it is called hung: pure logic, used by
the pool in the controller.

# NOTE [Call deadlines]
A worker that stops answering (SIGSTOP, a deadlock in native code, a livelocked
driver) must cost the requests that wait on it at most one deadline, and the pool a
replacement. A single fixed deadline is either too short for the first load of a large
model or far too long for a resident one: the server's request timeout (60 s) would
stall every model for a minute. So each kind of call is timed, and its deadline is

    clamp(factor * slowest of its recent calls, min_s, cap_s)

where a kind is (model, resident or loading, input shapes) for an inference and (job,
"iteration") for a training iteration. A kind never seen gets ``cap_s`` (the request timeout by
default): a first call may profile, compile or load, and nothing is known of it. The
history keeps the slowest of the last few calls, so one fast call does not shrink a
deadline that a slow one needed, and the table is bounded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable


class Deadlines:
    def __init__(self, cap_s: float, *, factor: float = 10.0, min_s: float = 5.0, history: int = 16,
                 kinds: int = 1024):
        if not (cap_s > 0 and factor >= 1 and min_s > 0 and history >= 1 and kinds >= 1):
            raise ValueError("Deadlines needs cap_s > 0, factor >= 1, min_s > 0, history >= 1, kinds >= 1")
        self.cap_s = cap_s
        self.factor = factor
        self.min_s = min(min_s, cap_s)
        self._history = history
        self._kinds = kinds
        self._seen: OrderedDict[Hashable, deque[float]] = OrderedDict()
        self._lock = threading.Lock()  # a training segment's thread and a task's thread both observe

    def of(self, kind: Hashable) -> float:
        """Seconds a call of ``kind`` may take before its worker is called hung."""
        with self._lock:
            times = self._seen.get(kind)
            slowest = max(times) if times else None
        if slowest is None:
            return self.cap_s
        return min(self.cap_s, max(self.min_s, self.factor * slowest))

    def last(self, kind: Hashable) -> float | None:
        """How long the latest call of ``kind`` took (None: none seen)."""
        with self._lock:
            times = self._seen.get(kind)
            return times[-1] if times else None

    def observe(self, kind: Hashable, seconds: float) -> None:
        """A call of ``kind`` answered after ``seconds``."""
        with self._lock:
            times = self._seen.get(kind)
            if times is None:
                times = self._seen[kind] = deque(maxlen=self._history)
                while len(self._seen) > self._kinds:
                    self._seen.popitem(last=False)  # the kind least recently seen
            else:
                self._seen.move_to_end(kind)
            times.append(max(0.0, seconds))

    def forget(self, model: str) -> None:
        """Drop every kind that names ``model`` first (a model unregistered, a job ended)."""
        with self._lock:
            for kind in [k for k in self._seen if isinstance(k, tuple) and k and k[0] == model]:
                del self._seen[kind]
