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

from timeshare.errors import ModelTooLargeError, TimeshareError
from timeshare.runtime.events import EvictionRecord
from timeshare.runtime.executor import Executor, Packed
from timeshare.runtime.residency import ModelEntry, Residency
from timeshare.runtime.sharing import Member, SharedSet, SharedTensors
from timeshare.transfer.host_store import HostStore

log = logging.getLogger(__name__)


class SharedPlacement:
    """``sharing``'s sets in ``residency``'s arena and in ``executor``, for the models of
    ``entries`` (the table's own dictionary). ``evict`` and ``emit`` are the table's;
    ``placing()`` names the model being placed now, whose sets must not be freed."""

    def __init__(self, sharing: SharedTensors, entries: dict[str, ModelEntry], residency: Residency,
                 executor: Executor, *, evict: Callable[[ModelEntry], object],
                 emit: Callable[[EvictionRecord], None], placing: Callable[[], str | None]):
        self.sharing = sharing
        self.entries = entries
        self.residency = residency
        self.executor = executor
        self._evict = evict
        self._emit = emit
        self._placing = placing
        self.wait_idle: Callable[[ModelEntry], None] = lambda m: None  # the runtime's (lanes)
        residency.on_leave = self.left
        residency.spare = self.free_spare

    # ------------------------------------------------------------------ registration
    def prepare(self, name: str, member: Member, digests: dict[str, str]) -> Packed:
        """A new model's tensors matched against the registered ones: other models'
        matching tensors move to new sets (each laid out again), ``member`` keeps the rest
        in its store, and its packed form is returned for the table to add. Then
        ``committed`` or ``abandoned``."""
        sharing = self.sharing
        while True:
            split = sharing.split(member.store, digests)
            # With lanes a model to lay out again may be running outside the runtime's lock:
            # wait for its call (the lock is released meanwhile, so anything may have
            # changed: match again), until none is; from then on the lock is held.
            busy = [self.entries[other] for other in split.moved if self.entries[other].running]
            if not busy:
                break
            for entry in busy:
                self.wait_idle(entry)
        made: dict[tuple[str, str], tuple[str, str]] = {}
        for other, keys in split.moved.items():
            sset = self._relayout(other, keys)
            made.update({(other, k): (sset.sid, d) for k, d in keys.items()})
        refs = split.refs | {key: made[owner] for key, owner in split.claims.items()}
        rest = [e for e in member.store.entries if e.key not in refs]
        member.store = HostStore.pack(rest, {e.key: member.store.tensor(e.key) for e in rest})
        member.refs = refs
        member.digests = {k: d for k, d in digests.items() if k not in refs}
        packed = self._packed(member)
        for sid, _ in refs.values():
            sharing.sets[sid].users.add(name)  # held while the table adds the model
        return packed

    def committed(self, name: str, member: Member, packed: Packed) -> None:
        """The table added the model ``prepare`` made ready."""
        assert packed.view is not None
        member.store = packed.view  # the pages the executor reads: compared and moved from later
        self.sharing.add(name, member)

    def abandoned(self, name: str, member: Member) -> None:
        """The table could not add it: the sets it would have used are not held for it."""
        for sid, _ in member.refs.values():
            sset = self.sharing.sets.get(sid)
            if sset is not None:
                sset.users.discard(name)

    def _relayout(self, name: str, keys: dict[str, str]) -> SharedSet:
        """Move ``name``'s tensors ``keys`` (key -> digest) into a new shared set: the set
        and the new store are made and handed to the executor first; then the model leaves
        the arena and the executor's copy is replaced. On failure nothing changed, or, if
        the executor had already let go of the old copy, it gets it back (or, failing
        that too, the model is unregistered, saying so)."""
        sharing, entry = self.sharing, self.entries[name]
        old = sharing.members[name]
        sset, own = sharing.new_set(name, keys)
        sset.store = self.executor.add_shared(sset.sid, sset.store)
        try:
            new = replace(old, store=own, refs=old.refs | {k: (sset.sid, d) for k, d in keys.items()})
            packed = self._packed(new, {sset.sid: sset})
        except BaseException:
            self.executor.remove_shared(sset.sid)
            raise
        self._evict(entry)
        self.executor.remove(name)
        try:
            self.executor.add(packed)
        except BaseException:
            self.executor.discard(packed)
            self.executor.remove_shared(sset.sid)
            self._restore(name, old)
            raise
        assert packed.view is not None
        sharing.moved_out(name, sset, keys, packed.view)
        entry.nbytes = packed.nbytes
        return sset

    def _restore(self, name: str, member: Member) -> None:
        """Give the executor ``name``'s previous layout back after a failed relayout; if
        that fails too, forget the model rather than keep one the executor does not know."""
        try:
            packed = self._packed(member)
            try:
                self.executor.add(packed)
            except BaseException:
                self.executor.discard(packed)
                raise
        except Exception:
            log.exception("model %s could not be laid out again nor restored: it is unregistered", name)
            self.remove(name)
            del self.entries[name]

    def _packed(self, member: Member, new_sets: dict[str, SharedSet] | None = None) -> Packed:
        sets = self.sharing.sets | (new_sets or {})
        return self.executor.pack_shared(member.spec, member.module, member.layout, member.store, member.order,
                                         member.shared_entries(sets))

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
        """``m`` left the arena: its sets lose a reader (``Residency.on_leave``)."""
        for sset in self.sharing.sets_of(m.name):
            sset.resident.discard(m.name)

    def free_spare(self) -> bool:
        """Free one set in the arena that no resident model reads and the model being
        placed does not need; False if there is none (``Residency.spare``)."""
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
