"""What one call gives back: its output and its own record, with no side channel
(``Runtime.call``), and what an executor hands the facade (``Ran``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from timeshare.protocol import CallTimings
from timeshare.runtime.events import CallRecord


@dataclass(frozen=True)
class Ran:
    """What one forward gave: its output on the host, and with workers where its time
    went (``round_trip_s``, ``worker_s`` and the worker's own parts; None in-process)."""

    output: Any
    timings: CallTimings | None = None
    load_s: float | None = None  # the copies of a load, first start to last arrival, when measured
    ephemeral_peak: int | None = None  # in a lane: the forward's peak ephemeral bytes
    read_s: float | None = None  # a load from disk: its reads, first to last (NOTE [Disk to device])
    moved_bytes: int | None = None  # a load: the bytes it copied to the device (shared sets included)


@dataclass(frozen=True)
class Call:
    """One inference through ``Runtime.call``: the output (as ``infer`` returns it) and
    the call's record (the same one listeners receive): when it ran, how long it waited,
    whether it loaded the model, what it switched from, and its timings."""

    output: Any
    record: CallRecord
