"""Tensors held once across models (NOTE [Shared tensors]): which registered models have
tensors of identical content, the shared sets that hold those tensors once in host memory
and once in the arena, and what registering or unregistering a model changes. Runs in the
controller: digests are computed outside the runtime's lock, the rest under it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from timeshare.errors import ConfigError
from timeshare.executor.packing import build_and_pack, trace_on_host
from timeshare.memory import Block
from timeshare.models.binding import TensorLayout
from timeshare.models.spec import ModelSpec
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder

# NOTE [Shared tensors]
# Fine-tuned variants of one base model have most of their bytes in common. With
# ``Runtime(dedup=True)`` each tensor of at least ``MIN_SHARED_BYTES`` is identified at
# registration by a digest of its dtype, shape and bytes (BLAKE2b), and a match is
# confirmed by comparing the bytes. Tensors found in another model are moved into a
# *shared set*: one host store (entries keyed by digest, in the execution order of the
# model they came from) and, while any model using it is resident or until its room is
# needed, one block of the arena. A model's own store then holds only its other tensors,
# still in execution order, so a group of layers is one range of it plus a few runs of
# its sets' stores (``LoadPlan.pieces``, copied in the same group by the copy engine,
# ``SharedCopies``). The first model whose tensors match is laid out again: it is
# evicted, its store repacked without the moved tensors, and re-added to the executor
# (its profiles go: the next load profiles again; a pinned model is loaded again at
# once). A load copies the sets that are not in the arena yet with the model's own
# bytes; a switch between two variants whose sets are resident copies only what differs.
# A set with no resident user stays in the arena and is the first thing freed when room
# is needed, except while a model that uses it is being placed. Inference never writes
# its weights, so sharing them is safe; training jobs build their own modules and never
# hold a registered model's tensors, so no job can change another model's outputs (there
# is nothing to copy on write). With workers a set's store is a shared-memory segment
# taught to every worker before the models using it (``AddShared``), and each call names
# where the model's sets are (``RunModel.shared``). With lanes (``pack``) a model laid
# out again may be running in a lane outside the runtime's lock: it is laid out once its
# call has ended (``SharedPlacement.wait_idle``, which releases the lock while it
# waits); from then until the new layout is in place the lock is held, and a call takes
# it before it runs. Under a host budget, see NOTE [Shared tensors under a host budget];
# with direct host access, NOTE [Direct host access].
MIN_SHARED_BYTES = 1 << 10  # smaller tensors stay with their model: a piece of a few bytes is not worth a copy call


def digest(t: torch.Tensor) -> str:
    """A tensor's identity by content: dtype, shape and a BLAKE2b of its bytes."""
    raw = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
    h = hashlib.blake2b(raw.data, digest_size=16)
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{h.hexdigest()}"


def digests_of(store: HostStore, min_bytes: int = MIN_SHARED_BYTES) -> dict[str, str]:
    """The digest of every tensor of ``store`` large enough to share, by key."""
    return {e.key: digest(store.tensor(e.key)) for e in store.entries if e.nbytes >= min_bytes}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaNs included)."""
    return a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@dataclass
class SharedSet:
    """Tensors held once for several models: a host store, and a block while in the arena."""

    sid: str
    store: HostStore
    users: set[str] = field(default_factory=set)  # registered models that refer to it
    block: Block | None = None
    last_offset: int | None = None  # NOTE [Sticky placement]: the set goes back there when it can
    loaded: bool = False  # its bytes are in ``block`` (a load that placed it succeeded)
    resident: set[str] = field(default_factory=set)  # resident models that read it

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


@dataclass
class Member:
    """A registered model under deduplication: what laying it out again needs."""

    spec: ModelSpec
    module: nn.Module
    layout: TensorLayout
    order: ExecutionOrder
    store: HostStore  # its own tensors, in execution order
    refs: dict[str, tuple[str, str]]  # key -> (shared set, digest)
    digests: dict[str, str]  # key -> digest, of its own tensors large enough to share

    def shared_entries(self, sets: Mapping[str, SharedSet]) -> dict[str, tuple[str, TensorEntry]]:
        """key -> (set, the tensor's entry in that set's store), for the executor."""
        return {k: (sid, sets[sid].store.by_key[d]) for k, (sid, d) in self.refs.items()}

    @property
    def logical_bytes(self) -> int:
        return sum(e.nbytes for e in self.layout.entries)


@dataclass
class Split:
    """How a new model's tensors divide: ``refs`` to sets that exist, ``moved`` tensors of
    other models that form new sets (model -> its key -> digest), ``claims`` the new
    model's keys that those new sets will hold (key -> (model, its key))."""

    refs: dict[str, tuple[str, str]]
    moved: dict[str, dict[str, str]]
    claims: dict[str, tuple[str, str]]


@dataclass(frozen=True, slots=True)
class SetView:
    """One shared set: its bytes and tensors, the models using it, its arena offset (None:
    not on the device), whether its bytes are there, and the resident models reading it."""

    nbytes: int
    tensors: int
    users: list[str]
    offset: int | None
    loaded: bool
    resident_users: list[str]


@dataclass(frozen=True, slots=True)
class SharingSnapshot:
    """Tensors held once (NOTE [Shared tensors]): the models and sets, the bytes of the
    models' own tensors and of the sets, what separate copies would hold (logical), the
    sets' bytes in the arena, the sets resident with no reader resident, and the bytes
    saved against separate copies."""

    models: int
    sets: int
    own_bytes: int
    shared_bytes: int
    logical_bytes: int
    resident_shared_bytes: int
    spare_sets: int
    saved_bytes: int


class SharedTensors:
    """The content index and the shared sets (NOTE [Shared tensors])."""

    def __init__(self) -> None:
        self.sets: dict[str, SharedSet] = {}
        self.members: dict[str, Member] = {}
        self._set_of: dict[str, str] = {}  # digest -> the set holding it
        self._own: dict[str, tuple[str, str]] = {}  # digest -> (model, key) holding it alone
        self._ids = itertools.count(1)

    def nbytes(self) -> int:
        """The host bytes of every set (read without the runtime's lock too)."""
        return sum(s.nbytes for s in list(self.sets.values()))

    def split(self, store: HostStore, digests: Mapping[str, str], skip: Set[str] = frozenset()) -> Split:
        """Match a new model's tensors (``store``, its ``digests``) against what is
        registered, bytes compared, except the tensors held alone by the models in
        ``skip``; changes nothing."""
        refs: dict[str, tuple[str, str]] = {}
        moved: dict[str, dict[str, str]] = {}
        claims: dict[str, tuple[str, str]] = {}
        for key, d in digests.items():
            mine = store.tensor(key)
            sid = self._set_of.get(d)
            if sid is not None and same_bytes(mine, self.sets[sid].store.tensor(d)):
                refs[key] = (sid, d)
                continue
            owner = self._own.get(d)
            if owner is not None and owner[0] not in skip and \
                    same_bytes(mine, self.members[owner[0]].store.tensor(owner[1])):
                moved.setdefault(owner[0], {})[owner[1]] = d
                claims[key] = owner
        return Split(refs, moved, claims)

    def owners(self, digests: Mapping[str, str]) -> set[str]:
        """The registered models holding, alone, a tensor with one of these digests."""
        return {self._own[d][0] for d in digests.values() if d in self._own}

    def new_set(self, name: str, keys: Mapping[str, str]) -> tuple[SharedSet, HostStore]:
        """The set made of ``name``'s tensors ``keys`` (key -> digest), and ``name``'s own
        store without them (both in its execution order); neither is recorded yet."""
        member = self.members[name]
        entries = [replace(e, key=keys[e.key], names=()) for e in member.store.entries if e.key in keys]
        tensors = {keys[k]: member.store.tensor(k) for k in keys}
        sset = SharedSet(f"shared-{next(self._ids)}", HostStore.pack(entries, tensors))
        rest = [e for e in member.store.entries if e.key not in keys]
        own = HostStore.pack(rest, {e.key: member.store.tensor(e.key) for e in rest})
        return sset, own

    def moved_out(self, name: str, sset: SharedSet, keys: Mapping[str, str], own: HostStore) -> None:
        """Record that ``name``'s tensors ``keys`` now live in ``sset``, its store ``own``."""
        member = self.members[name]
        self.sets[sset.sid] = sset
        sset.users.add(name)
        for k, d in keys.items():
            member.refs[k] = (sset.sid, d)
            member.digests.pop(k, None)
            self._set_of[d] = sset.sid
            if self._own.get(d) == (name, k):
                del self._own[d]
        member.store = own

    def add(self, name: str, member: Member, prefer_over: Set[str] = frozenset()) -> None:
        """Record a new model whose ``refs`` are all to recorded sets; its tensors become
        the ones matched for their digests in place of those of ``prefer_over``."""
        self.members[name] = member
        for sid, _ in member.refs.values():
            self.sets[sid].users.add(name)
        for k, d in member.digests.items():
            if d not in self._own or self._own[d][0] in prefer_over:
                self._own[d] = (name, k)

    def remove(self, name: str) -> list[SharedSet]:
        """Forget ``name``; returns the sets no model refers to any more (forgotten too)."""
        member = self.members.pop(name)
        for d, owner in list(self._own.items()):
            if owner[0] == name:
                del self._own[d]
        gone = []
        for sid in {sid for sid, _ in member.refs.values()}:
            sset = self.sets[sid]
            sset.users.discard(name)
            sset.resident.discard(name)
            if not sset.users:
                gone.append(self.sets.pop(sid))
                for e in sset.store.entries:
                    self._set_of.pop(e.key, None)
        # Another model holding one of ``name``'s digests alone becomes the one to match.
        for other, m in self.members.items():
            for k, d in m.digests.items():
                self._own.setdefault(d, (other, k))
        return gone

    def sets_of(self, name: str) -> list[SharedSet]:
        member = self.members.get(name)
        if member is None:
            return []
        return [self.sets[sid] for sid in dict.fromkeys(sid for sid, _ in member.refs.values())]

    def view(self) -> dict[str, SetView]:
        """Each set as the diagnostics show it."""
        return {sid: SetView(s.nbytes, len(s.store.entries), sorted(s.users),
                             s.block.offset if s.block is not None else None, s.loaded, sorted(s.resident))
                for sid, s in self.sets.items()}

    def snapshot(self) -> SharingSnapshot:
        """Bytes held, against what separate copies would hold."""
        own = sum(m.store.nbytes for m in self.members.values())
        shared = sum(s.nbytes for s in self.sets.values())
        logical = sum(m.logical_bytes for m in self.members.values())
        return SharingSnapshot(
            models=len(self.members),
            sets=len(self.sets),
            own_bytes=own,
            shared_bytes=shared,
            logical_bytes=logical,
            resident_shared_bytes=sum(s.nbytes for s in self.sets.values() if s.block is not None),
            spare_sets=sum(1 for s in self.sets.values() if s.block is not None and not s.resident),
            saved_bytes=max(0, logical - own - shared),
        )


def prepare(spec: ModelSpec) -> tuple[Member, dict[str, str]]:
    """A registration under deduplication, outside the runtime's lock: the module built,
    its weights packed in execution order (traced on the host from the example inputs),
    and the digests of its tensors large enough to share."""
    if not spec.example_inputs and not spec.example_kwargs:
        raise ConfigError(f"model {spec.name!r}: with dedup, register() needs example_inputs (the execution "
                          "order is traced at registration, so that shared sets follow it)")
    module, layout, store = build_and_pack(spec)
    order = trace_on_host(module, layout, store, spec)
    by_key = {e.key: e for e in store.entries}
    store = HostStore.pack([by_key[k] for k in order.key_order()], store.state())
    return Member(spec, module, layout, order, store, {}, {}), digests_of(store)
