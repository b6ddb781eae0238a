"""What the runtime tells its observers (metrics, the server, the demo): one record per
inference call and per eviction. Runs in the controller; listeners are called in the
thread that made the call, while it still holds the runtime, so they must be quick
(a histogram observation, an append).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from timeshare.protocol import CallTimings


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
