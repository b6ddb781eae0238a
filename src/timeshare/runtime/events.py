"""What the runtime tells its observers (metrics, the server, the demo): one record per
inference call and per eviction, and how they reach them (NOTE [Records outside the lock]).
Runs in the controller.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from timeshare.protocol import CallTimings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallRecord:
    """One inference call on the device.

    ``started``: ``time.monotonic()`` when the call was given the device;
    ``seconds``: from then until its outputs were on the host; ``waited_s``: how long
    it waited for its turn; ``loaded``: the model was not resident, so the call loaded
    it (pipelined); ``switched_from``: the task that used the device before, when it
    was another one (a model name or a training job's name), else None; ``error``:
    the exception's type name when the call failed; ``timings``: with workers, where
    the call's time went (a ``CallTimings``: ``round_trip_s`` from sending the task to
    its reply, ``worker_s`` the worker's share, and its parts), else None; ``moved_bytes``:
    what a loading call copied to the device, shared sets included (NOTE [Shared
    tensors]; None when the call did not load)."""

    model: str
    started: float
    seconds: float
    waited_s: float
    loaded: bool
    switched_from: str | None
    error: str | None = None
    timings: CallTimings | None = None
    moved_bytes: int | None = None

    @property
    def switched(self) -> bool:
        return self.switched_from is not None


@dataclass(frozen=True)
class EvictionRecord:
    """A model left device memory (to make room, by request, or at unregister)."""

    model: str
    nbytes: int
    at: float


Listener = Callable[[CallRecord | EvictionRecord], None]


# NOTE [Records outside the lock]
# The runtime makes its records while it holds its lock (a call, a placement's evictions),
# and a listener is someone else's code (the server's metrics, ``timeshare ps``'s last
# use, a bench's list): called there, a slow or blocking listener would hold every other
# caller of the runtime, and one that calls the runtime back would run inside its state.
# So a record goes into the ``Outbox`` while the lock is held, and the thread that lets
# the lock go for the last time (``RuntimeLock``: its outermost release, or a condition's
# wait) delivers what is waiting, the lock no longer held, before it returns to its
# caller: a caller still finds its call's record delivered when the call returns. One
# thread delivers at a time, in the order the records were made; a listener that raises
# is logged and the others still get the record.
class Outbox:
    """The runtime's listeners and the records waiting for them."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self._waiting: deque[CallRecord | EvictionRecord] = deque()
        self._delivering = threading.Lock()  # one deliverer at a time: records in order

    def subscribe(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def emit(self, record: CallRecord | EvictionRecord) -> None:
        if self.listeners:
            self._waiting.append(record)

    @property
    def waiting(self) -> bool:
        """Whether records wait for delivery."""
        return bool(self._waiting)

    def deliver(self) -> None:
        """Every waiting record to every listener, in order, in this thread."""
        if not self._waiting:
            return
        with self._delivering:
            while self._waiting:
                record = self._waiting.popleft()
                for listener in self.listeners:
                    try:
                        listener(record)
                    except Exception:
                        log.exception("runtime listener %r failed on %r", listener, record)


class RuntimeLock:
    """The runtime's re-entrant lock; letting it go for the last time delivers the records
    made while it was held (NOTE [Records outside the lock]). Usable with
    ``threading.Condition``: a wait lets it go whole, delivering first."""

    def __init__(self, outbox: Outbox) -> None:
        self._lock = threading.RLock()
        self._outbox = outbox
        self._depth = 0  # how many times its owner holds it (only the owner changes it)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        last = self._depth == 0
        self._lock.release()
        if last:
            self._outbox.deliver()

    # ``with`` on every call: the same as acquire and release, a frame shorter each.
    def __enter__(self) -> bool:
        self._lock.acquire()
        self._depth += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        last = self._depth == 0
        self._lock.release()
        if last and self._outbox.waiting:
            self._outbox.deliver()

    # What ``threading.Condition`` calls on a re-entrant lock: let it go whole for a wait,
    # and take it back as deep as it was.
    def _release_save(self) -> int:
        depth, self._depth = self._depth, 0
        for _ in range(depth):
            self._lock.release()
        self._outbox.deliver()
        return depth

    def _acquire_restore(self, depth: int) -> None:
        for _ in range(depth):
            self._lock.acquire()
        self._depth = depth

    def _is_owned(self) -> bool:
        if self._lock.acquire(blocking=False):  # free, or ours: ours if it was held before
            owned = self._depth > 0
            self._lock.release()
            return owned
        return False
