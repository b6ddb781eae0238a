"""The registered models and what happens to them on the device: a forward (loading the
model first if needed), placement and eviction, and the records each makes for the
runtime's listeners. Runs in the controller, under the runtime's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from timeshare.decode.step import Step
from timeshare.errors import ConfigError, DuplicateModelError, MemoryBudgetError, ModelTooLargeError, UnknownModelError
from timeshare.executor.interface import ModelPath, Packed, Ran
from timeshare.memory import Arena, Block
from timeshare.memory.ephemeral import LaneBound
from timeshare.runtime.calls import Call
from timeshare.runtime.events import CallRecord, EvictionRecord, Outbox
from timeshare.runtime.host_tier import HostTier, Stored
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.shared_placement import SharedPlacement
from timeshare.runtime.sharing import Member, SharedTensors
from timeshare.scheduler.eviction import EvictionPolicy
from timeshare.scheduler.thrashing import ThrashingDetector
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.profiler import ModelProfile
from timeshare.tree import shape_key
from timeshare.units import format_bytes

Unlocked = Callable[[], AbstractContextManager]  # runs a block without the runtime's lock

log = logging.getLogger(__name__)


class ModelTable:
    def __init__(self, arena: Arena, policy: EvictionPolicy, executor: ModelPath, strategy: str, *,
                 host: HostTier | None = None, sharing: SharedTensors | None = None, outbox: Outbox | None = None,
                 wait_idle: Callable[[ModelEntry], None] = lambda m: None, poison: bool = False,
                 detector: ThrashingDetector | None = None):
        """``wait_idle``: the runtime's wait for a model's calls outside its lock to end
        (lanes); ``poison``: NOTE [Poisoned reloads]; ``detector``: thrashing control."""
        self.entries: dict[str, ModelEntry] = {}
        # The arena's blocks; it tells this table of models leaving (``Departures``).
        self.residency = Residency(arena, policy, self, poison=poison, detector=detector)
        self.executor = executor
        self.host = host  # with a host budget: the host stores under it (NOTE [Host tier])
        self._placing: str | None = None  # the model whose placement is evicting others now
        self._leaving = False  # evictions of models leaving host memory too: nothing to keep
        # With deduplication: the shared sets in the arena and the executor (NOTE [Shared tensors]).
        self.shared = None if sharing is None else SharedPlacement(
            sharing, self.entries, self.residency, executor, evict=self.evict, emit=self.emit,
            placing=lambda: self._placing, wait_idle=wait_idle, host=host, readers=self.host_readers)
        self.strategy = strategy  # the runtime's grouping, when a call names none
        self.outbox = outbox or Outbox()  # the listeners, who get its records once the lock is let go
        self.failures = 0  # calls that raised
        self.regions: dict[str, Block] = {}  # NOTE [Regions of the arena], by owner

    def get(self, name: str) -> ModelEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModelError(f"no model named {name!r} is registered; known: {sorted(self.entries)}") from None

    def check_free(self, name: str) -> None:
        if name in self.entries:
            raise DuplicateModelError(f"a model named {name!r} is already registered")

    def add(self, entry: ModelEntry, packed: Packed, stored: Stored | None = None) -> None:
        """Hand ``packed`` to the executor and list ``entry`` (``stored``: its store under
        the host budget); on failure the executor discards what it was handed, so a
        refused registration leaves nothing behind."""
        hosted = False
        try:
            self.check_free(entry.name)
            capacity = self.residency.arena.capacity
            if packed.nbytes > capacity:
                log.warning("model %s (%s) is larger than the arena (%s)", entry.name,
                            format_bytes(packed.nbytes), format_bytes(capacity))
            if stored is not None:
                assert self.host is not None, "a tiered registration needs the host tier"
                self.host.add(entry.name, stored, self.host_readers())
                hosted = True
            self.executor.add(packed)
        except BaseException:
            if hosted:
                assert self.host is not None
                self.host.remove(entry.name)
            self.executor.discard(packed)
            raise
        self.entries[entry.name] = entry

    def add_deduped(self, entry: ModelEntry, member: Member, digests: dict[str, str]) -> None:
        """Register ``entry`` with its tensors found in other models held once (NOTE
        [Shared tensors], ``SharedPlacement.prepare``)."""
        assert self.shared is not None
        self.check_free(entry.name)
        packed, stored = self.shared.prepare(entry.name, member, digests)
        entry.nbytes = packed.nbytes
        try:
            self.add(entry, packed, stored)
        except BaseException:
            self.shared.abandoned(entry.name, member)
            raise
        self.shared.committed(entry.name, member, packed)
        for name in self.shared.reload:  # a pinned model stays resident: loaded again at once
            m = self.entries.get(name)
            if m is None or m.block is not None:
                continue
            try:
                self.run(m, self.executor.inputs(m.spec.example_inputs), self.executor.inputs(m.spec.example_kwargs),
                         None)
            except Exception:  # its next call loads it, and says why if it cannot
                log.exception("could not load pinned model %s again after laying it out anew", name)

    @property
    def sharing(self) -> SharedTensors | None:
        """With dedup: the content index and the shared sets (for observers)."""
        return self.shared.sharing if self.shared is not None else None

    def shared_at(self, m: ModelEntry) -> dict[str, tuple[int, bool]] | None:
        """Each of ``m``'s shared sets: its arena offset and whether its bytes are there."""
        return self.shared.at(m) if self.shared is not None else None

    def _sets_loaded(self, m: ModelEntry) -> None:
        if self.shared is not None:
            self.shared.loaded(m)

    def _drop_unloaded_sets(self, m: ModelEntry) -> None:
        if self.shared is not None:
            self.shared.drop_unloaded(m)

    # ------------------------------------------------------------------ departures (the residency's)
    def keep_bytes(self, m: ModelEntry, block: Block) -> None:
        """``m`` leaves the device: the host tier may keep its bytes (``HostTier.demote``),
        dropping only second copies of models still on the device."""
        if self.host is not None and m.name in self.host.models and not self._leaving:
            readers = self.host_readers()
            cheap = {n for n, e in self.entries.items() if e.block is not None} - readers
            keep = readers | ({self._placing} if self._placing else set())  # the store about to be loaded
            self.host.demote(m.name, self.residency.arena.region(block), cheap, keep)

    def left(self, m: ModelEntry) -> None:
        if self.shared is not None:
            self.shared.left(m)

    def free_spare(self) -> bool:
        return self.shared is not None and self.shared.free_spare()

    def host_readers(self) -> set[str]:
        """Resident models that compute from their host stores: those stores stay
        (NOTE [Direct host access])."""
        return {n for n, e in self.entries.items() if e.block is not None and self.executor.reads_host(n)}

    def remove(self, m: ModelEntry) -> None:
        """Forget ``m``: out of device memory, its host memory and spill file given back."""
        self.evict(m, keep_host_copy=False)
        self.executor.remove(m.name)
        if self.host is not None:
            self.host.remove(m.name)
        del self.entries[m.name]
        if self.shared is not None:
            self.shared.remove(m.name)  # the sets no model uses any more go

    # NOTE [Regions of the arena]
    # Device memory that lives apart from any model's weights but as long as a part of the
    # runtime needs it (a language model's key/value pages: llm/pages.py) is a region of
    # the arena, not an allocation of its own beside it: the arena stays the one owner of
    # the device memory timeshare holds, ``memory`` bounds weights and pages together, and
    # a region never moves while held, so a captured graph may read its addresses. A region
    # is placed as a model is (idle unpinned models evicted for it, an error naming it if
    # pinned or running ones leave no room), at the arena's top end when that is free, away
    # from the low offsets models return to (NOTE [Sticky placement]); no placement takes or
    # evicts it until its owner gives it back.
    def reserve_region(self, owner: str, nbytes: int, what: str) -> Block:
        """NOTE [Regions of the arena]: ``nbytes`` of the arena for ``owner`` (``what`` in
        errors), at its top end if that is free, evicting unpinned idle models as a load
        does; no placement takes or evicts it until ``release_region``."""
        if owner in self.regions:
            raise ConfigError(f"{owner!r} already holds memory in the arena")
        alloc = self.residency.arena.allocator
        if alloc.rounded(nbytes) > alloc.capacity:  # never fits: permanent, as a model too large
            raise ModelTooLargeError(owner, nbytes, alloc.capacity, what)
        top = (alloc.capacity - alloc.rounded(nbytes)) // alloc.alignment * alloc.alignment

        def allocate() -> Block | None:
            return alloc.allocate_at(top, nbytes, owner) or alloc.allocate(nbytes, owner)

        block, evicted = self.residency.reserve(owner, nbytes, allocate, self.entries, self.executor.release,
                                                what=what)
        for victim in evicted:
            self.emit(EvictionRecord(victim.name, victim.nbytes, time.monotonic()))
        self.regions[owner] = block
        return block

    def release_region(self, owner: str) -> None:
        """Give ``owner``'s region back (poisoned first under the diagnostic)."""
        block = self.regions.pop(owner, None)
        if block is not None:
            self.residency.free(block)

    def run(self, m: ModelEntry, args: tuple, kwargs: dict, strategy: str | None, *,
            lane: LaneBound | None = None, unlocked: Unlocked | None = None, step: Step | None = None) -> Ran:
        """Forward ``m`` on executor-ready inputs, loading it first if it is not resident.
        ``unlocked``: a resident model's forward runs inside it, without the runtime's
        lock (NOTE [Lanes in the runtime]); its block stays put meanwhile."""
        resident = m.block is not None
        fill = None
        if not resident:
            fill = self.place(m, stream=True)
        assert m.block is not None
        t0 = time.monotonic()
        offset, strategy = m.block.offset, strategy or self.strategy
        shared = self.shared_at(m)
        try:
            if resident and unlocked is not None:
                m.running += 1
                try:
                    with unlocked(), m.alone:
                        ran = self.executor.run(m.name, offset, True, args, kwargs, strategy, lane, shared=shared,
                                                step=step)
                finally:
                    m.running -= 1
            else:
                ran = self.executor.run(m.name, offset, resident, args, kwargs, strategy, lane, fill, shared, step=step)
        except BaseException as exc:
            if not resident:
                self.evict(m)  # a failed load leaves nothing behind
                if fill is not None and self.host is not None:
                    self.host.abandon(m.name, exc)
                self._drop_unloaded_sets(m)  # nor do the sets it was copying
            raise
        self._sets_loaded(m)
        if fill is not None and self.host is not None:
            self.host.streamed(m.name, fill, ran.read_s)
        if not resident:
            m.loads += 1
        self.residency.ran(m, loaded=not resident, seconds=time.monotonic() - t0, load_s=ran.load_s)
        return ran

    def call(self, m: ModelEntry, args: tuple, kwargs: dict, strategy: str | None, *, waited_s: float,
             switched_from: str | None, lane: LaneBound | None = None,
             unlocked: Unlocked | None = None, keep_peak: bool = True, step: Step | None = None) -> Call:
        """One inference on caller inputs: ``run`` with its record, emitted to the listeners
        whether it succeeded or raised, and counted in ``failures`` if it raised. In a
        ``lane``, the call's peak ephemeral bytes are kept per input shape (unless not
        ``keep_peak``: the calls of a turn, whose shapes change at every step)."""
        t0 = time.monotonic()
        loaded = m.block is None
        try:
            ran = self.run(m, self.executor.inputs(args), self.executor.inputs(kwargs), strategy,
                           lane=lane, unlocked=unlocked, step=step)
            if ran.ephemeral_peak is not None and lane is not None and lane.limit is not None and keep_peak:
                key = shape_key(args, kwargs)
                m.ephemeral[key] = max(m.ephemeral.get(key, 0), ran.ephemeral_peak)
        except BaseException as exc:
            self.failures += 1
            self.emit(CallRecord(m.name, t0, time.monotonic() - t0, waited_s, loaded, switched_from,
                                 type(exc).__name__))
            raise
        record = CallRecord(m.name, t0, time.monotonic() - t0, waited_s, loaded, switched_from, None, ran.timings,
                            ran.moved_bytes)
        self.emit(record)
        return Call(ran.output, record)

    def profile(self, m: ModelEntry, args: tuple, kwargs: dict) -> ModelProfile:
        """Profile ``m`` on caller inputs, loading it first if it is not resident."""
        args, kwargs = self.executor.inputs(args), self.executor.inputs(kwargs)
        if m.block is None:
            self.run(m, args, kwargs, None)
        assert m.block is not None
        profile = self.executor.profile(m.name, m.block.offset, args, kwargs, self.shared_at(m))
        m.ephemeral[profile.shape_key] = max(m.ephemeral.get(profile.shape_key, 0), profile.ephemeral_bytes)
        return profile

    def run_in_new_process(self, m: ModelEntry, args: tuple, kwargs: dict):
        """Load ``m`` from its host store into a worker started for this call and run it
        there; its block is given back afterwards."""
        self.evict(m)
        self.place(m)
        assert m.block is not None
        try:
            out = self.executor.run_in_new_process(m.name, m.block.offset, self.executor.inputs(args),
                                                   self.executor.inputs(kwargs), self.strategy, self.shared_at(m))
        except BaseException:
            self.evict(m)
            self._drop_unloaded_sets(m)
            raise
        self._sets_loaded(m)
        self.evict(m)
        return out

    def place(self, m: ModelEntry, *, stream: bool = False) -> FillSpec | None:
        """Give ``m`` a block in the arena, its bytes in host memory first (NOTE [Host
        tier]), or with ``stream`` the reads its load makes from disk (NOTE [Disk to device])."""
        fill = None
        if self.host is not None:
            fill = self._ensure_host(m, stream)
        self._placing = m.name
        try:
            if self.shared is not None:
                self.shared.place(m)
            for victim in self.residency.place(m, self.entries, self.executor.release):
                self.emit(EvictionRecord(victim.name, victim.nbytes, time.monotonic()))
        except BaseException as exc:
            if fill is not None and self.host is not None:
                self.host.abandon(m.name, exc)
            self._drop_unloaded_sets(m)
            raise
        finally:
            self._placing = None
        return fill

    def _ensure_host(self, m: ModelEntry, stream: bool) -> FillSpec | None:
        """``m``'s bytes in host memory (or the reads that bring them). When only the stores
        of resident models that compute from them stand in the way (NOTE [Direct host
        access]), those models leave the device, as they would for ``m``'s block, and
        their stores become droppable."""
        assert self.host is not None
        for attempt in (0, 1):
            resident = {n for n, e in self.entries.items() if e.block is not None}
            try:
                return self.host.ensure(m.name, self.host_readers(), stream=stream, cheap=resident)
            except MemoryBudgetError as exc:
                if isinstance(exc, ModelTooLargeError):  # no eviction makes room for it
                    raise
                readers = [self.entries[n] for n in self.host_readers()
                           if n != m.name and not self.entries[n].pinned and not self.entries[n].running]
                if attempt or not readers:
                    raise
                for reader in readers:
                    self.evict(reader)
        raise AssertionError("unreachable")

    def evict(self, m: ModelEntry, *, keep_host_copy: bool = True) -> bool:
        """``m`` out of the arena; ``keep_host_copy=False``: it is leaving host memory too
        (unregistered, closed, evicted with ``host=True``), so its bytes are not kept."""
        self._leaving = not keep_host_copy
        try:
            evicted = self.residency.evict(m, self.executor.release)
        finally:
            self._leaving = False
        if not evicted:
            return False
        self.emit(EvictionRecord(m.name, m.nbytes, time.monotonic()))
        return True

    def evict_all(self) -> None:
        for m in self.entries.values():
            self.evict(m, keep_host_copy=False)
        self.entries.clear()

    def emit(self, record: CallRecord | EvictionRecord) -> None:
        """``record`` for the listeners, delivered once the runtime's lock is let go
        (NOTE [Records outside the lock])."""
        self.outbox.emit(record)
