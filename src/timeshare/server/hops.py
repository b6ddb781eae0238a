"""Where an inference request's time goes inside the server: a :class:`RequestTimes`
per request, stamped with ``time.perf_counter_ns()`` at each hop of its path (NOTE
[Request hops]), and :class:`HopTotals`, their sums over the answered requests, which
``/metrics`` shows (``timeshare_request_hop_seconds_total{hop=...}``) and ``bench
serve`` reads. Runs in the server's process: stamps are taken on the event loop and in
the serving pool's threads.

# NOTE [Request hops]
A request's stamps, in the order its path takes them (``docs/architecture.md``, "The
path of one inference"); each part of :data:`HOPS` is the time between two stamps, so
the parts are never negative and add up to the time from the first stamp to the last:
- ``route``: from the app's first middleware to the route (FastAPI's routing);
- ``read``: the body's bytes from the connection;
- ``parse``: JSON or the binary extension into the request and its tensors;
- ``check``: the endpoint's checks of the tensors, and the request queued;
- ``queue``: until the model's runner took it in a batch (waiting for the batches
  before it, or only the runner's wake-up when none);
- ``to_thread``: the hop from the event loop to a serving pool thread;
- ``prepare``: the batch's inputs concatenated;
- ``runtime``: ``Runtime.call`` itself (its wait for a turn, a load, the forward);
- ``split``: the outputs split per request and the replies made;
- ``to_loop``: the hop back to the event loop, until the route resumes;
- ``encode``: the response's JSON and bytes.
What comes before the first stamp (uvicorn reading the request's head) and after the
last (sending the response) is not counted: a client sees it in its latency.
Batch-wide stamps (``in_thread`` to ``replied``) are copied to each request of the
batch. Stamps cost about 60 ns each; a request takes 12 of them.
"""

from __future__ import annotations

import threading
from collections import deque
from time import perf_counter_ns

HOPS = ("route", "read", "parse", "check", "queue", "to_thread", "prepare", "runtime", "split", "to_loop", "encode")
STAMPS = ("arrived", "routed", "read", "parsed", "queued", "taken", "in_thread", "called", "returned", "replied",
          "resumed", "encoded")
RECENT = 256  # the last requests' own records, kept for tests and inspection


class RequestTimes:
    """One request's stamps (``perf_counter_ns``, NOTE [Request hops]); 0: not reached."""

    __slots__ = STAMPS

    def __init__(self, arrived: int, routed: int | None = None):
        self.arrived = arrived
        self.routed = perf_counter_ns() if routed is None else routed
        self.read = self.parsed = self.queued = self.taken = self.in_thread = self.called = 0
        self.returned = self.replied = self.resumed = self.encoded = 0

    def parts_ns(self) -> tuple[int, ...]:
        """Each hop's nanoseconds, in :data:`HOPS`' order."""
        s = self
        stamps = (s.arrived, s.routed, s.read, s.parsed, s.queued, s.taken, s.in_thread, s.called, s.returned,
                  s.replied, s.resumed, s.encoded)
        return tuple(b - a for a, b in zip(stamps, stamps[1:]))

    def total_ns(self) -> int:
        return self.encoded - self.arrived

    def parts(self) -> dict[str, float]:
        """Each hop's seconds, by name."""
        return {h: ns / 1e9 for h, ns in zip(HOPS, self.parts_ns())}


class HopTotals:
    """The answered requests' hops, summed (nanoseconds), and the last :data:`RECENT`
    records. :meth:`add` from the event loop; :meth:`snapshot` from anywhere."""

    def __init__(self) -> None:
        self.requests = 0
        self.sums = [0] * len(HOPS)
        self.recent: deque[RequestTimes] = deque(maxlen=RECENT)
        self._lock = threading.Lock()  # a scrape (metrics port) reads from another thread

    def add(self, times: RequestTimes) -> None:
        parts = times.parts_ns()
        with self._lock:
            sums = self.sums
            for i, ns in enumerate(parts):
                sums[i] += ns
            self.requests += 1
        self.recent.append(times)

    def snapshot(self) -> tuple[int, dict[str, float]]:
        """How many requests were counted, and each hop's seconds summed over them."""
        with self._lock:
            return self.requests, {h: ns / 1e9 for h, ns in zip(HOPS, self.sums)}
