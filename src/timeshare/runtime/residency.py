"""Placement and residency: which models hold blocks of the arena, where, and which
leave to make room. Integers and policy only; it never touches a tensor but through
the arena's ``poison`` diagnostic. Runs in the controller, under the runtime's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from timeshare.errors import MemoryBudgetError, ModelTooLargeError
from timeshare.memory import Arena, Block
from timeshare.models.spec import ModelSpec
from timeshare.scheduler.eviction import EvictionPolicy
from timeshare.scheduler.task import Priority
from timeshare.scheduler.thrashing import NothingToEvict, ThrashingDetector, make_room
from timeshare.transfer.copy import LoadHandle
from timeshare.units import format_bytes

log = logging.getLogger(__name__)

Release = Callable[[str], LoadHandle | None]  # a model leaves: the load still copying into its block, if any


@dataclass
class ModelEntry:
    """What the controller knows of a registered model: its size and where it lives."""

    spec: ModelSpec
    nbytes: int
    block: Block | None = None
    last_offset: int | None = None
    pinned: bool = False
    loads: int = 0
    priority: Priority = Priority.LATENCY_CRITICAL
    slo_s: float | None = None
    # With lanes (NOTE [Lanes in the runtime]): calls running it outside the runtime's
    # lock (its block cannot move meanwhile), the one-at-a-time lock of those calls,
    # and the peak ephemeral bytes measured per input shape.
    running: int = 0
    alone: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    ephemeral: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


class Departures(Protocol):
    """What the residency's owner (the model table) hears as models leave the arena."""

    def keep_bytes(self, m: ModelEntry, block: Block) -> None:
        """``m`` leaves with its bytes intact in ``block``, before the block is poisoned or
        reused: the host tier may keep them (NOTE [Host tier])."""

    def left(self, m: ModelEntry) -> None:
        """``m`` left: its shared sets lose a reader (NOTE [Shared tensors])."""

    def free_spare(self) -> bool:
        """Free one spare block (a shared set no resident model reads) before a model is
        evicted for room; False if there is none (NOTE [Shared tensors])."""


class Residency:
    """Blocks for models: sticky placement (NOTE [Sticky placement]), eviction in the
    policy's order through the make-room loop the simulator runs too (``make_room``,
    with the thrashing detector when there is one), and quarantine of blocks a stuck
    copy may still write.

    # NOTE [Measured reload times]
    The policy learns a model's reload time when its load has been measured: a model is
    admitted to the policy once its loading call succeeded, with that call's load time
    (the copies, from the worker's timings, or the whole call in-process), so the
    cost-aware policy ranks by real costs. The detector hears of every loading call
    (load time) and every resident one (useful time)."""

    def __init__(self, arena: Arena, policy: EvictionPolicy, departures: Departures, *, poison: bool = False,
                 detector: ThrashingDetector | None = None):
        self.arena = arena
        self.policy = policy
        self.detector = detector
        self.poison = poison  # NOTE [Poisoned reloads]
        self.evictions = 0
        self.reload_s: dict[str, float] = {}  # the latest measured load of each model
        self._quarantine: list[tuple[Block, LoadHandle]] = []
        self.departures = departures  # its owner, told of each model leaving (``Departures``)

    def place(self, m: ModelEntry, models: Mapping[str, ModelEntry], release: Release) -> list[ModelEntry]:
        """Give ``m`` a block, evicting unpinned models in policy order until it fits;
        returns the models it evicted."""
        block, evicted = self.reserve(m.name, m.nbytes, self.sticky(m.name, m.nbytes, m.last_offset), models,
                                      release, m)
        m.block = block
        m.last_offset = block.offset
        return evicted

    def reserve(self, owner: str, need: int, allocate: Callable[[], Block | None], models: Mapping[str, ModelEntry],
                release: Release, placing: ModelEntry | None = None,
                what: str | None = None) -> tuple[Block, list[ModelEntry]]:
        """A block of ``need`` bytes from ``allocate`` for ``owner`` (``what`` in errors),
        evicting unpinned models (never ``placing``) in policy order until it fits, after
        the spare blocks (``spare``); returns it and the models evicted."""
        if self.arena.allocator.rounded(need) > self.arena.capacity:
            raise ModelTooLargeError(owner, need, self.arena.capacity)
        self.reclaim()
        protected = {n for n, x in models.items() if x.pinned or x is placing or x.block is None or x.running}

        def attempt() -> Block | None:
            block = allocate()
            while block is None and self.departures.free_spare():
                block = allocate()
            return block

        try:
            block, evicted = make_room(self.policy, self.detector, time.monotonic(), protected,
                                       attempt, lambda name: self.evict(models[name], release))
        except NothingToEvict:
            alloc = self.arena.allocator
            raise MemoryBudgetError(
                f"cannot place {what or f'model {owner!r}'} ({format_bytes(need)}): {format_bytes(alloc.free)} free, "
                f"largest free range {format_bytes(alloc.largest_free)}, and every resident model is pinned"
            ) from None
        return block, [models[name] for name in evicted]

    def free(self, block: Block, still_copying: LoadHandle | None = None) -> None:
        """Give ``block`` back (poisoned first under the diagnostic), or quarantine it
        while ``still_copying`` may write it."""
        if still_copying is not None:
            self._quarantine.append((block, still_copying))
            return
        if self.poison:  # NOTE [Poisoned reloads]
            self.arena.poison(block)
        self.arena.release(block)

    def ran(self, m: ModelEntry, *, loaded: bool, seconds: float, load_s: float | None = None) -> None:
        """A call on ``m`` succeeded in ``seconds``; ``loaded``: it loaded the model first
        (``load_s``: the copies' share, when measured). NOTE [Measured reload times]."""
        now = time.monotonic()
        if loaded:
            self.reload_s[m.name] = seconds if load_s is None else load_s
            self.policy.admitted(m.name, now, reload_s=self.reload_s[m.name])
            if self.detector is not None:
                self.detector.loaded(m.name, now, self.reload_s[m.name])
        elif self.detector is not None:
            self.detector.worked(m.name, now, seconds)
        self.policy.touched(m.name, now)

    def evict(self, m: ModelEntry, release: Release) -> bool:
        """Make ``m`` non-resident; True if it was. Never raises: a block a copy may
        still be writing (its deadline passed) is quarantined until the copy ends."""
        if m.block is None:
            return False
        block, m.block = m.block, None
        self.policy.removed(m.name)
        self.evictions += 1
        still_copying = release(m.name)
        if still_copying is None:
            try:
                self.departures.keep_bytes(m, block)
            except Exception:  # keeping a copy is an optimisation: the eviction goes on
                log.exception("keeping %s's bytes on eviction", m.name)
        self.free(block, still_copying)  # the module keeps stale views: NOTE [Sticky placement]
        self.departures.left(m)
        return True

    def order(self, models: Mapping[str, ModelEntry]) -> list[str]:
        """The resident models, the first to evict first under the policy."""
        return [n for n in self.policy.candidates(time.monotonic()) if models[n].block is not None]

    def quarantined(self) -> int:
        """Blocks held back because a copy may still be writing them."""
        self.reclaim()
        return len(self._quarantine)

    def reclaim(self) -> None:
        still = []
        for block, handle in self._quarantine:
            if handle.done():
                self.arena.release(block)
            else:
                still.append((block, handle))
        self._quarantine = still

    def clear(self) -> None:
        self._quarantine.clear()

    def sticky(self, owner: str, nbytes: int, last_offset: int | None) -> Callable[[], Block | None]:
        """An allocation of ``nbytes`` for ``owner``: at ``last_offset`` first (NOTE
        [Sticky placement]), else anywhere it fits; None when nothing fits."""
        def allocate() -> Block | None:
            block = None
            if last_offset is not None:
                block = self.arena.allocator.allocate_at(last_offset, nbytes, owner)
            return block or self.arena.allocate(nbytes, owner)

        return allocate
