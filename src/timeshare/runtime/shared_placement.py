"""The shared sets on the device and in the executor (NOTE [Shared tensors]), for the model
table: a registration that moves other models' tensors into new sets, the sets' blocks
placed before their models' and freed when room is needed, and what a load, a failed load
and an unregistration change. Runs in the controller, under the runtime's lock; the content
index itself is ``runtime/sharing.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from timeshare.errors import MemoryBudgetError, ModelTooLargeError, TimeshareError, WeightsError
from timeshare.executor.interface import ModelPath, Packed
from timeshare.executor.packing import tiered_copy
from timeshare.runtime.events import EvictionRecord
from timeshare.runtime.host_tier import HostTier, Stored
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.sharing import Member, SharedSet, SharedTensors, Split
from timeshare.transfer.host_store import HostStore
from timeshare.units import format_bytes

log = logging.getLogger(__name__)

# NOTE [Shared tensors under a host budget]
# With ``host_memory`` and ``dedup`` together, the shared sets stay in host memory for as
# long as a model uses them: every variant's load reads them, so they are the hottest
# bytes there are. They count against the budget (``HostTier.outside``) and are never
# dropped. What the host tier drops and reads back are the models' own stores (the bytes
# that differ between variants), each in droppable pages of its own with a spill file
# written the first time it is dropped (``registration.tiered_copy``); a load of a dropped
# store reads it from disk while it copies, and copies the model's sets beside it. A
# registration compares its tensors with the stores of the models that hold the same
# digests, so those stores are read back first (``HostTier.ensure``) and kept until the
# models are laid out again. A registration after which some model's own store (its own
# included) would not fit beside the sets is refused before anything moves
# (``MemoryBudgetError``): that model could never be loaded again. A store that cannot be
# read back (its spill file damaged, or no room) is passed over: that model fails its own
# calls, the registration goes on, and its tensors are matched in the lost one's place.


class SharedPlacement:
    """``sharing``'s sets in ``residency``'s arena and in ``executor``, for the models of
    ``entries`` (the table's own dictionary). ``evict`` and ``emit`` are the table's;
    ``placing()`` names the model being placed now, whose sets must not be freed. With a
    host budget, ``host`` is the host tier and ``readers()`` the models whose stores it
    must keep (NOTE [Shared tensors under a host budget])."""

    def __init__(self, sharing: SharedTensors, entries: dict[str, ModelEntry], residency: Residency,
                 executor: ModelPath, *, evict: Callable[[ModelEntry], object],
                 emit: Callable[[EvictionRecord], None], placing: Callable[[], str | None],
                 wait_idle: Callable[[ModelEntry], None], host: HostTier | None = None,
                 readers: Callable[[], set[str]] = set):
        self.sharing = sharing
        self.entries = entries
        self.residency = residency
        self.executor = executor
        self._evict = evict
        self._emit = emit
        self._placing = placing
        self.host = host
        self._readers = readers
        self._passed_over: set[str] = set()  # models the registration being prepared could not compare with
        self.reload: list[str] = []  # pinned models the registration being prepared evicted
        self.wait_idle = wait_idle  # the runtime's: a model's calls outside its lock have ended (lanes)

    # ------------------------------------------------------------------ registration
    def prepare(self, name: str, member: Member, digests: dict[str, str]) -> tuple[Packed, Stored | None]:
        """A new model's tensors matched against the registered ones: other models'
        matching tensors move to new sets (each laid out again), ``member`` keeps the rest
        in its store, and its packed form (and under a host budget its store for the host
        tier) is returned for the table to add. Then ``committed`` or ``abandoned``."""
        sharing = self.sharing
        while True:
            owners, unreadable = sharing.owners(digests), set()
            if self.host is not None:
                # Their bytes are compared and moved from: in memory until laid out again.
                # One that cannot come back (its spill file damaged, no room) is not
                # matched: its own calls say why, and this registration goes on.
                for other in owners:
                    try:
                        self.host.ensure(other, owners | self._readers())
                    except (WeightsError, MemoryBudgetError) as exc:
                        log.warning("registering %s: not matched against %s, whose host copy cannot be read "
                                    "back (%s)", name, other, exc)
                        unreadable.add(other)
            split = sharing.split(member.store, digests, unreadable)
            # With lanes a model to lay out again may be running outside the runtime's lock:
            # wait for its call (the lock is released meanwhile, so anything may have
            # changed: match again), until none is; from then on the lock is held.
            busy = [self.entries[other] for other in split.moved if self.entries[other].running]
            if not busy:
                break
            for entry in busy:
                self.wait_idle(entry)
        if self.host is not None:
            self._check_host_room(name, member, split)
        self._passed_over = unreadable
        made: dict[tuple[str, str], tuple[str, str]] = {}
        # Pinned models that leave the arena to be laid out again are loaded again after.
        self.reload = [other for other in split.moved
                       if self.entries[other].pinned and self.entries[other].block is not None]
        for other, keys in split.moved.items():
            sset = self._relayout(other, keys, set(split.moved))
            made.update({(other, k): (sset.sid, d) for k, d in keys.items()})
        refs = split.refs | {key: made[owner] for key, owner in split.claims.items()}
        rest = [e for e in member.store.entries if e.key not in refs]
        member.store = HostStore.pack(rest, {e.key: member.store.tensor(e.key) for e in rest})
        member.refs = refs
        member.digests = {k: d for k, d in digests.items() if k not in refs}
        packed, stored = self._packed(member)
        for sid, _ in refs.values():
            sharing.sets[sid].users.add(name)  # held while the table adds the model
        return packed, stored

    def _check_host_room(self, name: str, member: Member, split: Split) -> None:
        """Under a host budget, refuse a registration before anything moves if, with the
        sets it makes, some model's own store (its own included) would no longer fit
        beside the sets in the budget: that model could never be loaded again."""
        assert self.host is not None
        by_key = {e.key: e for e in member.store.entries}
        moved = {other: sum(self.sharing.members[other].store.by_key[k].nbytes for k in keys)
                 for other, keys in split.moved.items()}
        held = self.host.outside() + sum(moved.values())
        own = sum(e.nbytes for k, e in by_key.items() if k not in split.refs and k not in split.claims)
        who, largest = name, own
        for other, stored in self.host.models.items():
            n = stored.store.nbytes - moved.get(other, 0)
            if n > largest:
                who, largest = other, n
        if largest + held > self.host.budget:
            beside = f" beside the {format_bytes(held)} of shared tensors held" if held else ""
            raise MemoryBudgetError(
                f"registering {name!r}: model {who!r} needs {format_bytes(largest)} of host memory{beside}, more "
                f"than the host budget ({format_bytes(self.host.budget)}); raise host_memory")

    def committed(self, name: str, member: Member, packed: Packed) -> None:
        """The table added the model ``prepare`` made ready."""
        assert packed.view is not None
        member.store = packed.view  # the pages the executor reads: compared and moved from later
        # Its tensors are matched from now on in place of those of models that were passed
        # over (their stores could not be read back), which may never come back.
        self.sharing.add(name, member, prefer_over=self._passed_over)
        self._passed_over = set()

    def abandoned(self, name: str, member: Member) -> None:
        """The table could not add it: the sets it would have used are not held for it."""
        self._passed_over = set()
        for sid, _ in member.refs.values():
            sset = self.sharing.sets.get(sid)
            if sset is not None:
                sset.users.discard(name)

    def _relayout(self, name: str, keys: dict[str, str], moving: set[str]) -> SharedSet:
        """Move ``name``'s tensors ``keys`` (key -> digest) into a new shared set: the set
        and the new store are made and handed to the executor first; then the model leaves
        the arena and the executor's copy is replaced. On failure nothing changed, or, if
        the executor had already let go of the old copy, it gets it back (or, failing
        that too, the model is unregistered, saying so). ``moving``: the models this
        registration lays out again, whose host stores stay in memory meanwhile."""
        sharing, entry = self.sharing, self.entries[name]
        old = sharing.members[name]
        sset, own = sharing.new_set(name, keys)
        sset.store = self.executor.add_shared(sset.sid, sset.store)
        try:
            new = replace(old, store=own, refs=old.refs | {k: (sset.sid, d) for k, d in keys.items()})
            packed, stored = self._packed(new, {sset.sid: sset})
        except BaseException:
            self.executor.remove_shared(sset.sid)
            raise
        self._evict(entry)
        self.executor.remove(name)
        if self.host is not None:
            self.host.remove(name)  # the old store's pages stay until ``old`` goes: a restore copies them
        try:
            self._add(name, packed, stored, moving)
        except BaseException:
            self.executor.remove_shared(sset.sid)
            self._restore(name, old, moving)
            raise
        assert packed.view is not None
        sharing.moved_out(name, sset, keys, packed.view)
        entry.nbytes = packed.nbytes
        return sset

    def _add(self, name: str, packed: Packed, stored: Stored | None, moving: set[str]) -> None:
        """Hand a model laid out again to the host tier and the executor; on failure
        neither holds it."""
        hosted = False
        try:
            if stored is not None:
                assert self.host is not None
                self.host.add(name, stored, moving | self._readers())
                hosted = True
            self.executor.add(packed)
        except BaseException:
            if hosted:
                assert self.host is not None
                self.host.remove(name)
            self.executor.discard(packed)
            raise

    def _restore(self, name: str, member: Member, moving: set[str]) -> None:
        """Give the executor ``name``'s previous layout back after a failed relayout; if
        that fails too, forget the model rather than keep one the executor does not know."""
        try:
            packed, stored = self._packed(member)
            self._add(name, packed, stored, moving)
            assert packed.view is not None
            member.store = packed.view  # the pages the executor reads now: the old ones go
        except Exception:
            log.exception("model %s could not be laid out again nor restored: it is unregistered", name)
            self.remove(name)
            del self.entries[name]

    def _packed(self, member: Member, new_sets: dict[str, SharedSet] | None = None) -> tuple[Packed, Stored | None]:
        """``member`` packed for the executor; under a host budget in droppable pages of
        its own, with the host tier's record of them (NOTE [Shared tensors under a host
        budget])."""
        shared = member.shared_entries(self.sharing.sets | (new_sets or {}))
        if self.host is None:
            return self.executor.pack_shared(member.spec, member.module, member.layout, member.store, member.order,
                                             shared), None
        tiered = tiered_copy(member.spec.name, member.module, member.layout, member.store, member.order,
                             self.host.spill_dir)
        packed = self.executor.pack_tiered(member.spec, tiered, shared)
        assert packed.view is not None and packed.pages is not None
        return packed, Stored(packed.view, packed.pages, tiered.backing, filled=True)

    def remove(self, name: str) -> None:
        """``name`` is unregistered (and out of the arena): the sets no model uses go."""
        if name in self.sharing.members:
            for sset in self.sharing.remove(name):
                try:
                    self._free(sset)
                    self.executor.remove_shared(sset.sid)
                except Exception:
                    log.exception("forgetting shared set %s", sset.sid)

    # ------------------------------------------------------------------ the arena
    def place(self, m: ModelEntry) -> None:
        """Blocks for ``m``'s sets not in the arena, before ``m``'s own; its load copies them."""
        sets = self.sharing.sets_of(m.name)
        total = m.nbytes + sum(s.nbytes for s in sets if s.block is None)
        if self.residency.arena.allocator.rounded(total) > self.residency.arena.capacity:
            raise ModelTooLargeError(m.name, total, self.residency.arena.capacity)
        for sset in sets:
            if sset.block is None:
                allocate = self.residency.sticky(sset.sid, sset.nbytes, sset.last_offset)
                sset.block, victims = self.residency.reserve(sset.sid, sset.nbytes, allocate,
                                                             self.entries, self.executor.release, m,
                                                             what=f"shared set {sset.sid!r}")
                sset.last_offset, sset.loaded = sset.block.offset, False
                for victim in victims:
                    self._emit(EvictionRecord(victim.name, victim.nbytes, time.monotonic()))

    def at(self, m: ModelEntry) -> dict[str, tuple[int, bool]]:
        """Each of ``m``'s sets: its arena offset and whether its bytes are there."""
        at = {}
        for sset in self.sharing.sets_of(m.name):
            if sset.block is None:
                raise TimeshareError(f"model {m.name!r} is placed but its shared set {sset.sid} is not")
            at[sset.sid] = (sset.block.offset, sset.loaded)
        return at

    def loaded(self, m: ModelEntry) -> None:
        """``m``'s load succeeded: its sets hold their bytes and ``m`` reads them."""
        for sset in self.sharing.sets_of(m.name):
            sset.loaded = True
            sset.resident.add(m.name)

    def drop_unloaded(self, m: ModelEntry) -> None:
        """``m``'s placement or load failed: the set blocks it took that were never filled go."""
        for sset in self.sharing.sets_of(m.name):
            if sset.block is not None and not sset.loaded:
                self._free(sset)

    def left(self, m: ModelEntry) -> None:
        """``m`` left the arena: its sets lose a reader (``Departures.left``)."""
        for sset in self.sharing.sets_of(m.name):
            sset.resident.discard(m.name)

    def free_spare(self) -> bool:
        """Free one set in the arena that no resident model reads and the model being
        placed does not need; False if there is none (``Departures.free_spare``)."""
        placing = self._placing()
        needed = {s.sid for s in self.sharing.sets_of(placing)} if placing else set()
        for sset in self.sharing.sets.values():
            if sset.block is not None and not sset.resident and sset.sid not in needed:
                self._free(sset)
                return True
        return False

    def _free(self, sset: SharedSet) -> None:
        block, sset.block, sset.loaded = sset.block, None, False
        if block is not None:
            self.residency.free(block, self.executor.release_shared(sset.sid))
