"""What one call gives back: its output and its own record, with no side channel
(``Runtime.call``); what an executor hands the facade is ``executor.interface.Ran``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from timeshare.runtime.events import CallRecord


@dataclass(frozen=True)
class Call:
    """One inference through ``Runtime.call``: the output (as ``infer`` returns it) and
    the call's record (the same one listeners receive): when it ran, how long it waited,
    whether it loaded the model, what it switched from, and its timings."""

    output: Any
    record: CallRecord
