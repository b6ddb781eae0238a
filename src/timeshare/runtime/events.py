"""What the runtime tells its observers (metrics, the server, the demo): one record per
inference call and per eviction, and how they reach them (NOTE [Records outside the lock]).
Runs in the controller.
"""

from __future__ import annotations

import logging
import threading
import time
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
# use, a bench's list): called there, a listener would run inside the runtime's state and
# hold its lock for as long as it takes, and one that waits for another thread's use of
# the runtime would wait forever. So a record goes into the ``Outbox`` while the lock is
# held, and the thread that lets the lock go for the last time (``RuntimeLock``: its
# outermost release, or a condition's wait) delivers what is waiting, the lock no longer
# held, before it returns to its caller: a caller finds its call's records delivered when
# the call returns. One thread delivers at a time, in the order the records were made;
# another thread that lets the lock go meanwhile waits until its own records are through
# (so a slow listener still delays the callers whose calls make records, never the
# runtime itself), at most ``DELIVERY_WAIT_S``: past it, a listener is waiting for that
# very thread, and its records come when the listener is done. A listener that calls the
# runtime back gets its call's records after the one it is handling. A listener that
# raises is logged and the others still get the record. Where a call also holds the
# dispatcher (the device's turn), the records wait for the end of that hold too
# (``RuntimeLock.records_after``): a listener holds neither the lock nor the device.
DELIVERY_WAIT_S = 1.0


class Outbox:
    """The runtime's listeners and the records waiting for them."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self._waiting: deque[CallRecord | EvictionRecord] = deque()  # appended with the runtime's lock held
        self._made = 0  # records made so far (counted with the runtime's lock held)
        self._delivered = 0  # of those, the ones every listener has had
        self._cond = threading.Condition()  # guards the deliverer and the count delivered
        self._deliverer: int | None = None  # the thread delivering now

    def subscribe(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def emit(self, record: CallRecord | EvictionRecord) -> None:
        if self.listeners:
            self._made += 1
            self._waiting.append(record)

    @property
    def pending(self) -> bool:
        """Whether records made so far have not all reached the listeners."""
        return self._delivered < self._made

    def deliver(self) -> None:
        """Every record made so far to every listener, in order: by this thread, or by the
        one delivering now, waited for (NOTE [Records outside the lock])."""
        me = threading.get_ident()
        deadline = time.monotonic() + DELIVERY_WAIT_S  # read each time: a test lengthens it
        with self._cond:
            if self._deliverer == me:  # a listener's own call: the loop below it goes on to its records
                return
            target = self._made
            while self._delivered < target and self._deliverer is not None:
                left = deadline - time.monotonic()
                if left <= 0:  # the deliverer's listener waits for this thread
                    return
                self._cond.wait(left)
            if self._delivered >= target:
                return
            self._deliverer = me
        try:
            while True:
                with self._cond:
                    if not self._waiting:
                        return
                    record = self._waiting.popleft()
                for listener in self.listeners:
                    try:
                        listener(record)
                    except Exception:
                        log.exception("runtime listener %r failed on %r", listener, record)
                with self._cond:
                    self._delivered += 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._deliverer = None
                self._cond.notify_all()


class RuntimeLock:
    """The runtime's re-entrant lock; letting it go for the last time delivers the records
    made while it was held (NOTE [Records outside the lock]). Usable with
    ``threading.Condition``: a wait lets it go whole, delivering first."""

    def __init__(self, outbox: Outbox) -> None:
        self._lock = threading.RLock()
        self._outbox = outbox
        self._depth = 0  # how many times its owner holds it (only the owner changes it)
        self._scope = threading.local()  # ``records_after``: how deep this thread is in it
        self._after = RecordsAfter(self._scope, outbox)

    def records_after(self) -> RecordsAfter:
        """A scope, around a dispatcher's hold and this lock, at whose end the records made
        in it are delivered, instead of at the lock's release: listeners then hold neither
        (NOTE [Records outside the lock]). Re-entrant in a thread."""
        return self._after

    def _delivers(self) -> bool:
        """Whether letting the lock go for the last time delivers now (not inside a scope)."""
        return self._outbox.pending and not getattr(self._scope, "depth", 0)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        return True

    def release(self) -> None:
        self.__exit__()

    # ``with`` on every call: the same as acquire and release, a frame shorter each.
    def __enter__(self) -> bool:
        self._lock.acquire()
        self._depth += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        last = self._depth == 0
        self._lock.release()
        if last and self._delivers():
            self._outbox.deliver()

    # What ``threading.Condition`` calls on a re-entrant lock: let it go whole for a wait,
    # and take it back as deep as it was.
    def _release_save(self) -> int:
        depth, self._depth = self._depth, 0
        for _ in range(depth):
            self._lock.release()
        try:
            if self._delivers():
                self._outbox.deliver()
        except BaseException:  # the wait will not happen: the lock as it was, for the caller's release
            self._acquire_restore(depth)
            raise
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


class RecordsAfter:
    """``RuntimeLock.records_after``'s scope: one object for every thread, its depth in each
    thread kept thread-local (a ``with`` on every call: no generator to make each time)."""

    __slots__ = ("_scope", "_outbox")

    def __init__(self, scope: threading.local, outbox: Outbox) -> None:
        self._scope, self._outbox = scope, outbox

    def __enter__(self) -> None:
        scope = self._scope
        scope.depth = getattr(scope, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        scope = self._scope
        scope.depth -= 1
        if not scope.depth and self._outbox.pending:
            self._outbox.deliver()
