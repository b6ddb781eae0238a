"""The registered models and what happens to them on the device: a forward (loading the
model first if needed), placement and eviction, and the records each makes for the
runtime's listeners. Runs in the controller, under the runtime's lock.
"""

from __future__ import annotations

import logging
import time

from timeshare.errors import UnknownModelError
from timeshare.runtime.calls import Ran
from timeshare.runtime.events import CallRecord, EvictionRecord, Listener
from timeshare.runtime.executor import Executor
from timeshare.runtime.residency import ModelEntry, Residency

log = logging.getLogger(__name__)


class ModelTable:
    def __init__(self, residency: Residency, executor: Executor, strategy: str):
        self.entries: dict[str, ModelEntry] = {}
        self.residency = residency
        self.executor = executor
        self.strategy = strategy  # the runtime's grouping, when a call names none
        self.listeners: list[Listener] = []
        self.failures = 0  # calls that raised

    def get(self, name: str) -> ModelEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModelError(f"no model named {name!r} is registered; known: {sorted(self.entries)}") from None

    def run(self, m: ModelEntry, args: tuple, kwargs: dict, strategy: str | None) -> Ran:
        """Forward ``m`` on executor-ready inputs, loading it first if it is not resident."""
        resident = m.block is not None
        if not resident:
            self.place(m)
        assert m.block is not None
        t0 = time.monotonic()
        try:
            ran = self.executor.run(m.name, m.block.offset, resident, args, kwargs, strategy or self.strategy)
        except BaseException:
            if not resident:
                self.evict(m)  # a failed load leaves nothing behind
            raise
        if not resident:
            m.loads += 1
        self.residency.ran(m, loaded=not resident, seconds=time.monotonic() - t0, load_s=ran.load_s)
        return ran

    def place(self, m: ModelEntry) -> None:
        for victim in self.residency.place(m, self.entries, self.executor.release):
            self.emit(EvictionRecord(victim.name, victim.nbytes, time.monotonic()))

    def evict(self, m: ModelEntry) -> bool:
        if not self.residency.evict(m, self.executor.release):
            return False
        self.emit(EvictionRecord(m.name, m.nbytes, time.monotonic()))
        return True

    def evict_all(self) -> None:
        for m in self.entries.values():
            self.evict(m)
        self.entries.clear()

    def emit(self, record: CallRecord | EvictionRecord) -> None:
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("runtime listener %r failed on %r", listener, record)
