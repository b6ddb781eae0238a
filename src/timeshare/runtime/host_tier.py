"""The host tier: which models' host stores are in memory under the host budget, and which
go back to disk to make room (NOTE [Host tier]). Runs in the controller, under the
runtime's lock; the eviction policy and the make-room loop are the device tier's.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from timeshare.errors import ConfigError, MemoryBudgetError, WeightsError
from timeshare.executor.interface import ModelPath, Packed
from timeshare.executor.packing import build_tiered
from timeshare.models.spec import ModelSpec
from timeshare.scheduler.eviction import EvictionPolicy, make_eviction_policy
from timeshare.scheduler.thrashing import NothingToEvict, make_room
from timeshare.transfer.backing import Backing, HostPages
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.host_store import HostStore
from timeshare.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

Hook = Callable[[str], None]  # the executor, told that a model's store is about to go / to be written


@dataclass
class Stored:
    """A model's host store as the host tier sees it."""

    store: HostStore  # the controller's view of its bytes
    pages: HostPages
    backing: Backing
    filled: bool
    failed: WeightsError | None = None  # the latest fill's error, shown until a fill succeeds
    streaming: bool = False  # a load is reading it from disk now (NOTE [Disk to device])


@dataclass(frozen=True, slots=True)
class StoreView:
    """One model's host store: its size, whether it is in memory, the memory its pages
    hold now (measured), its backing file, and the latest fill's error."""

    nbytes: int
    filled: bool
    resident_bytes: int
    backing: str
    error: str | None


@dataclass(frozen=True, slots=True)
class HostTierSnapshot:
    """The host tier's counters and levels (NOTE [Host tier]): its budget, the bytes of
    stores in memory and of shared sets outside them, how many stores there are and how
    many are in memory, the drops, fills (streamed ones too) and demotions so far, and
    what was read from disk or spilled to it."""

    budget: int
    used: int
    shared_bytes: int
    models: int
    filled: int
    drops: int
    fills: int
    streamed_fills: int
    demotions: int
    bytes_read: int
    read_seconds: float
    spilled_bytes: int


class HostTier:
    """Host memory as a cache over disk: at most ``budget`` bytes of stores filled."""

    def __init__(self, budget: int, policy: EvictionPolicy, *, dropping: Hook, filling: Hook,
                 spill_dir: Path, own_spill_dir: bool = False, direct_io: bool = False,
                 outside: Callable[[], int] = lambda: 0):
        if budget <= 0:
            raise ValueError(f"host budget must be positive, got {budget}")
        self.budget = budget
        self.policy = policy
        self.spill_dir = spill_dir
        self.direct_io = direct_io  # NOTE [Direct reads]: the backings read with O_DIRECT
        self._own_spill_dir = own_spill_dir  # made for this runtime: removed at close
        # NOTE [Locked host tier]: told before a store's pages go, and once they are back,
        # before they are written.
        self._dropping = dropping
        self._filling = filling
        self.models: dict[str, Stored] = {}
        self.drops = 0
        self.fills = 0
        self.streamed_fills = 0  # fills made by a load reading from disk as it went
        self.demotions = 0  # stores filled from the device's copy at its eviction (``demote``)
        self.bytes_read = 0
        self.read_s = 0.0
        self.spill_bytes = 0
        # Host memory held under the budget outside these stores, never dropped: the
        # shared sets with deduplication (NOTE [Shared tensors under a host budget]).
        self.outside = outside

    @property
    def used(self) -> int:
        # read without the lock too
        return self.outside() + sum(s.store.nbytes for s in list(self.models.values()) if s.filled)

    def check_fits(self, name: str, nbytes: int) -> None:
        outside = self.outside()
        if nbytes + outside > self.budget:
            held = f" beside the {format_bytes(outside)} of shared tensors held" if outside else ""
            raise MemoryBudgetError(f"model {name!r} needs {format_bytes(nbytes)} of host memory{held}, more than "
                                    f"the whole host budget ({format_bytes(self.budget)}); raise host_memory")

    def add(self, name: str, stored: Stored, protected: Iterable[str] = ()) -> None:
        """A registered model's store; a filled one is made room for (others dropped)."""
        self.check_fits(name, stored.store.nbytes)
        stored.backing.direct = self.direct_io
        self.models[name] = stored
        if stored.filled:
            try:
                self._make_room(name, stored.store.nbytes, protected)
            except BaseException:
                del self.models[name]
                raise
            self.policy.admitted(name, time.monotonic())

    def remove(self, name: str) -> None:
        s = self.models.pop(name, None)
        if s is not None:
            self.policy.removed(name)
            s.backing.discard()

    def ensure(self, name: str, protected: Iterable[str] = (), *, stream: bool = False,
               cheap: Iterable[str] = ()) -> FillSpec | None:
        """``name``'s store in memory, dropping others (not ``protected``) first if the
        budget needs it. With ``stream``, a store the next load can read from disk as it
        goes (NOTE [Disk to device]) is not filled here: its reads are returned, and the
        caller reports ``streamed`` or ``abandon``. A file that is no longer the one
        registered raises ``WeightsError`` and leaves the store empty."""
        s = self.models[name]
        now = time.monotonic()
        if s.filled:
            self.policy.touched(name, now)
            return None
        self._make_room(name, s.store.nbytes, protected, cheap)
        s.pages.reserve()  # MemoryBudgetError now rather than a fault at a write into a full tmpfs
        t0 = time.perf_counter()
        try:
            self._filling(name)
            spec = s.backing.stream(s.store) if stream else None
            n = 0 if spec is not None else s.backing.fill(s.store)
        except BaseException as exc:  # the pages reserved (and maybe locked) go back
            self.abandon(name, exc)
            raise
        s.filled, s.failed = True, None  # counted from now: the load writes it
        self.policy.admitted(name, time.monotonic())
        if spec is not None:
            s.streaming = True
            return spec
        self._done(name, n, time.perf_counter() - t0)
        return None

    def streamed(self, name: str, spec: FillSpec, read_s: float | None) -> None:
        """The load that streamed ``name``'s store from disk succeeded: it is whole."""
        self.models[name].streaming = False
        self.streamed_fills += 1
        self._done(name, spec.file_bytes, read_s or 0.0)

    def abandon(self, name: str, exc: BaseException) -> None:
        """A fill or the load streaming it failed: the store's pages go, and a file
        that changed is remembered as the reason."""
        s = self.models.get(name)
        if s is None:
            return
        try:  # filled or not, the store may be locked (NOTE [Locked host tier])
            self._dropping(name)
        except Exception:  # the failure being handled is the one to report
            log.exception("host tier: settling %s after a failed fill", name)
        s.pages.drop()
        s.filled = s.streaming = False
        self.policy.removed(name)
        if isinstance(exc, WeightsError):
            s.failed = exc

    def _done(self, name: str, nbytes: int, seconds: float) -> None:
        self.read_s += seconds
        self.bytes_read += nbytes
        self.fills += 1

    def drop(self, name: str) -> bool:
        """Give ``name``'s host memory back (its bytes are on disk); True if it was filled."""
        s = self.models[name]
        if not s.filled:
            return False
        if not s.backing.ready():
            t0 = time.perf_counter()
            s.backing.save(s.store)
            self.spill_bytes += s.store.nbytes
            log.info("host tier: wrote %s of %s to %s in %.2f s", format_bytes(s.store.nbytes), name,
                     s.backing.path, time.perf_counter() - t0)
        self._dropping(name)
        s.pages.drop()
        s.filled = False
        self.policy.removed(name)
        self.drops += 1
        return True

    def close(self) -> None:
        """Remove every spill file (and the spill folder, if the runtime made it)."""
        for name in list(self.models):
            self.remove(name)
        if self._own_spill_dir:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def snapshot(self) -> HostTierSnapshot:
        return HostTierSnapshot(
            budget=self.budget,
            used=self.used,
            shared_bytes=self.outside(),
            models=len(self.models),
            filled=sum(1 for s in list(self.models.values()) if s.filled),
            drops=self.drops,
            fills=self.fills,
            streamed_fills=self.streamed_fills,
            demotions=self.demotions,
            bytes_read=self.bytes_read,
            read_seconds=round(self.read_s, 6),
            spilled_bytes=self.spill_bytes,
        )

    def models_view(self) -> dict[str, StoreView]:
        """Each model's store as the diagnostics show it."""
        return {n: StoreView(s.store.nbytes, s.filled, s.pages.resident_bytes(), str(s.backing.path),
                             None if s.failed is None else str(s.failed))
                for n, s in self.models.items()}

    def demote(self, name: str, source: torch.Tensor, cheap: Iterable[str] = (),
               protected: Iterable[str] = ()) -> bool:
        """``name`` leaves the device with its bytes whole in ``source`` (its arena block):
        if its store is not in memory, it is filled from there, so its next load needs no
        disk. Room is made as for a fill: ``cheap`` stores first (second copies of models
        still on the device), then the others in the policy's order, which left the device
        before this one (so the two tiers age models as one LRU would). Host memory then
        holds what the device does not, as a victim cache. True if it did."""
        s = self.models.get(name)
        if s is None or s.filled or s.streaming:
            return False
        if s.store.nbytes > self.budget - self._undroppable_bytes(name, protected):
            return False  # not even without every droppable store: drop nothing in vain
        try:
            self._make_room(name, s.store.nbytes, protected, cheap)
            s.pages.reserve()
        except MemoryBudgetError:
            return False
        n = s.store.nbytes
        try:
            self._filling(name)
            s.store.buffer.copy_(source[:n])
        except Exception as exc:  # the pages reserved (and maybe locked) go back; the eviction goes on
            log.warning("host tier: could not keep %s in host memory: %s", name, exc)
            self.abandon(name, exc)
            return False
        s.filled, s.failed = True, None
        self.demotions += 1
        self.policy.admitted(name, time.monotonic())
        return True

    def _make_room(self, name: str, nbytes: int, protected: Iterable[str], cheap: Iterable[str] = ()) -> None:
        """Drop stores until ``name``'s fits: first those in ``cheap`` (models resident on
        the device, whose bytes are in the arena and on disk), then the others, each in
        the policy's order."""
        keep = set(protected) | {name} | {n for n, s in self.models.items() if s.streaming}

        def drop(victim: str) -> None:
            """A victim whose drop fails (its spill file cannot be written: a full disk)
            is kept and passed over: the failure is not the caller's."""
            try:
                self.drop(victim)
            except Exception:
                log.exception("host tier: could not drop %s; keeping it", victim)
                keep.add(victim)  # ``make_room`` reads ``keep`` again for every victim

        cheap = set(cheap) - keep
        if cheap and self._used_without(name) + nbytes > self.budget:
            for victim in [n for n in self.policy.candidates(time.monotonic(), keep) if n in cheap]:
                drop(victim)
                if self._used_without(name) + nbytes <= self.budget:
                    break
        try:
            make_room(self.policy, None, time.monotonic(), keep,
                      lambda: True if self._used_without(name) + nbytes <= self.budget else None, drop)
        except NothingToEvict:
            raise MemoryBudgetError(
                f"cannot bring model {name!r} ({format_bytes(nbytes)}) into host memory: "
                f"{format_bytes(self.budget - self._used_without(name))} of the host budget "
                f"({format_bytes(self.budget)}) is free and every other store in memory is in use"
            ) from None

    def _undroppable_bytes(self, name: str, protected: Iterable[str]) -> int:
        """Bytes that would stay in use if every store that may be dropped were."""
        keep = set(protected) | {name}
        return self.outside() + sum(s.store.nbytes for n, s in self.models.items()
                                    if s.filled and (n in keep or s.streaming))

    def _used_without(self, name: str) -> int:
        return self.outside() + sum(s.store.nbytes for n, s in self.models.items() if s.filled and n != name)


def make_host_tier(host_memory: int | str | None, eviction: str, executor: ModelPath, *, workers: int,
                   spill_dir: str | os.PathLike | None, direct_io: bool = False,
                   outside: Callable[[], int] = lambda: 0) -> HostTier | None:
    """The host tier of a runtime (None without a budget). ``host_memory``: bytes, a
    string like "8GiB", or "auto" (half the RAM; with workers, at most nine tenths of
    what /dev/shm has free, where their stores live); ``direct_io``: NOTE [Direct reads];
    ``outside``: the bytes held under the budget outside its stores (the shared sets)."""
    if host_memory is None:
        return None
    shm_free = None
    if workers:
        try:
            st = os.statvfs("/dev/shm")
            shm_free = st.f_bavail * st.f_frsize
        except OSError:
            pass
    if host_memory == "auto":
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        if shm_free is not None:
            budget = min(budget, shm_free * 9 // 10)
    else:
        budget = parse_bytes(host_memory, what="host_memory")
        if budget <= 0:
            raise ConfigError(f"host_memory must be positive, got {host_memory!r}")
        if shm_free is not None and budget > shm_free:
            raise ConfigError(f"host_memory {format_bytes(budget)} is more than /dev/shm has free "
                              f"({format_bytes(shm_free)}), where workers' host stores live: lower it or "
                              "enlarge /dev/shm (Docker: --shm-size)")
    if spill_dir is None:
        path, own = Path(tempfile.mkdtemp(prefix="timeshare-spill-")), True
    else:
        path, own = Path(spill_dir), False
        path.mkdir(parents=True, exist_ok=True)
    return HostTier(budget, make_eviction_policy(eviction), dropping=executor.host_dropping,
                    filling=executor.host_filling, spill_dir=path, own_spill_dir=own, direct_io=direct_io,
                    outside=outside)


def pack(spec: ModelSpec, executor: ModelPath, tier: HostTier) -> tuple[Packed, Stored]:
    """A registration under the host budget (``build_tiered``), made ready for the
    executor; outside the runtime's lock."""
    tiered = build_tiered(spec, tier.spill_dir)
    tier.check_fits(spec.name, tiered.store.nbytes)
    packed = executor.pack_tiered(spec, tiered)
    assert packed.view is not None and packed.pages is not None
    return packed, Stored(packed.view, packed.pages, tiered.backing, tiered.filled)
