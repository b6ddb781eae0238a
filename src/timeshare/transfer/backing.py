"""The disk tier under the host stores: where a store's bytes come from when they are not
in memory, and host memory that can be given back without moving. Runs in the controller.

# NOTE [Host tier]
With a host budget (``Runtime(host_memory=...)``), host memory is a cache over disk, as
device memory is a cache over host memory. A model's host store keeps its address for
the model's whole life, so workers' mappings and the module's bindings never change;
what comes and goes are its pages:
- ``HostPages``: the store's memory, a mapping of its own (a memory file in this
  process, or the shared-memory segment the workers map). ``drop()`` gives the pages back
  to the operating system (``madvise``); the range stays mapped and reads as zeros until
  the store is filled again.
- a ``Backing`` refills a dropped store: ``FileBacking`` from the safetensors file the
  model was registered from (its tensor index read from the header only, so a model
  registered from a file is not read until it is needed), ``SpillBacking`` from a file
  of the store's own bytes that the runtime writes the first time a store with no file
  behind it (a builder's weights, a state dict, converted dtypes) is dropped.
- Every fill first checks that the file is still the one registered (size, modification
  time and the header's bytes; ``Fingerprint``): a file changed, truncated or gone fails
  that model's call with ``WeightsError`` and touches nothing else.
- Which stores go (``runtime/host_tier.py``): first the host copies of models resident
  on the device (a second copy: their bytes are in the arena and on disk), then the
  others, each in the eviction policy's order; and a model leaving the device leaves its
  bytes in its store, making room the same way (``HostTier.demote``), but never by
  dropping the store of the model whose placement evicted it. So host memory holds
  what the device does not, as a victim cache, and the two tiers together age models
  as one cache of their summed size would.
Reads (``transfer/disk.py``) are chunked and spread over a few threads, each reading
straight into the store (``os.preadv`` into its bytes), with no staging copy on the CPU.

# NOTE [Locked host tier]
On CUDA a store under the budget is page-locked (``cudaHostRegister``, NOTE [Exact host
pinning] in timeshare/device.py) while its pages hold bytes, in the process that copies
from it, so that a load read back from disk copies asynchronously and overlaps compute
as without a budget. A registration holds for the process that made it, and locked pages
cannot be given back: dropped while locked, they would stay in memory, out of the
budget's count, and the device would go on reading them after the store was refilled.
So a store is unlocked, after the copies that read it, in every process that locked it
before ``drop()`` (``Executor.host_dropping``), and locked again before its bytes are
written:
- in-process, when the host tier has reserved its pages for a fill or a demotion
  (``Executor.host_filling``), so that reads from disk land in locked memory;
- in a worker process, by each load of it that finds it unlocked (``Worker.run``), before
  the load's reads from disk; the worker's ``Result`` says it holds the lock
  (``store_pinned``, and ``lock_s``), the controller keeps which workers do, and before a
  drop sends those, and only those, an ``UnpinStore``. A call that locked and then failed,
  wherever it failed, unlocks again, so that the record made from results stays exact; a
  worker that dies takes its locks with it, so one that fails to unlock is replaced.
A lock is best effort: where ``cudaHostRegister`` fails, the store stays pageable (one
warning per model) and its loads copy from there, reported as not locked.
The bytes are counted once: against the budget (the store's pages) and in
``host_pinned_bytes`` (what is registered). On the CPU nothing is locked.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from pathlib import Path

import torch

from timeshare.errors import MemoryBudgetError, WeightsError
from timeshare.transfer.disk import FileTensor, FillSpec, SafetensorsIndex, forget_cached, read_ranges
from timeshare.transfer.host_store import HostStore


# ---------------------------------------------------------------------- host pages
class HostPages:
    """A mapping of ``nbytes`` whose pages can be given back (NOTE [Host tier]): a memory
    file of its own (``memfd``), or the shared-memory segment ``/dev/shm/<shared_name>``
    that workers map too. Both are shared memory files, so ``drop()`` punches the pages
    out of the file itself (``MADV_REMOVE``): the memory goes for every process that
    maps it, and the file's allocated blocks say exactly what is held."""

    def __init__(self, nbytes: int, *, shared_name: str | None = None):
        self.nbytes = nbytes
        self.shared = shared_name is not None
        self.name = shared_name
        size = max(nbytes, 1)
        if shared_name is None:
            fd = os.memfd_create("timeshare-host-store", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        else:
            fd = os.open(f"/dev/shm/{shared_name.lstrip('/')}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=size)[:nbytes]

    def drop(self) -> None:
        """Give the pages back; the range reads as zeros until written again."""
        if self.nbytes:
            self._map.madvise(mmap.MADV_REMOVE)

    def reserve(self) -> None:
        """Allocate every page now (``posix_fallocate``), so that writing the store later
        cannot fault on a full tmpfs (SIGBUS); MemoryBudgetError if it is full."""
        if not self.nbytes:
            return
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as exc:
            raise MemoryBudgetError(f"cannot allocate {self.nbytes:,} bytes of host memory for a model's host copy "
                                    f"({exc.strerror or exc}): shared memory is full") from exc

    def resident_bytes(self) -> int:
        """Bytes of memory the pages hold now: the file's allocated blocks."""
        return os.fstat(self._fd).st_blocks * 512


class Backing:
    """Where a dropped store's bytes come back from; ``direct``: read with O_DIRECT where
    the file system allows (NOTE [Direct reads]; set by the host tier)."""

    path: Path
    direct: bool = False

    def fill(self, store: HostStore) -> int:
        """Write the store's bytes from disk; the bytes read."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the store can be dropped now (a spill file written, or a file behind it)."""
        return True

    def save(self, store: HostStore) -> None:
        """Make the store droppable (write a spill file); nothing for a file backing."""

    def stream(self, store: HostStore) -> FillSpec | None:
        """Check the file and write what does not come from it; then the reads a load
        streams (NOTE [Disk to device]), or None when the store must be filled whole
        first (``fill``)."""
        return None

    def discard(self) -> None:
        """The model is gone: remove what the runtime wrote for it."""


class FileBacking(Backing):
    """A store filled from the safetensors file (or shards) its model was registered
    from. ``sources``: store key -> the file's tensor name; ``kept``: store key -> a
    tensor held in memory (a buffer the file does not have: the module's own value)."""

    def __init__(self, index: SafetensorsIndex, sources: dict[str, str], kept: dict[str, torch.Tensor],
                 tied: dict[str, tuple[str, ...]] | None = None):
        self.index = index
        self.path = index.path  # the first shard: what status shows
        self.paths = index.paths
        self.sources = sources
        self.kept = kept
        self.tied = tied or {}  # store key -> other file names of the same tensor, checked equal

    def fill(self, store: HostStore) -> int:
        self.index.check()
        direct: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.paths]
        converted: list[tuple[str, FileTensor]] = []
        for e in store.entries:
            if e.key in self.kept:
                HostStore.view(store.buffer, e).copy_(self.kept[e.key])
                continue
            ft = self.index.tensors[self.sources[e.key]]
            if ft.dtype == e.dtype:
                direct[ft.file].append((ft.start, store.buffer[e.offset: e.offset + e.nbytes]))
            else:
                converted.append((e.key, ft))
        n = sum(read_ranges(path, ranges, direct=self.direct) for path, ranges in zip(self.paths, direct) if ranges)
        for key, ft in converted:  # floating tensors stored in another dtype: read, then convert
            tmp = torch.empty(ft.nbytes, dtype=torch.uint8)
            n += read_ranges(self.paths[ft.file], [(ft.start, tmp)], threads=1, direct=self.direct)
            store.tensor(key).copy_(tmp.view(ft.dtype).view(ft.shape))
        n += self._check_tied(store)
        return n

    def stream(self, store: HostStore) -> FillSpec | None:
        by_key = store.by_key
        if self.tied or any(self.index.tensors[self.sources[k]].dtype != by_key[k].dtype for k in self.sources):
            return None  # converted or tied tensors: read whole, then converted or compared
        self.index.check()
        for key, t in self.kept.items():
            store.tensor(key).copy_(t)
        pieces = tuple((self.index.tensors[name].file, self.index.tensors[name].start, by_key[key].offset,
                        by_key[key].nbytes) for key, name in self.sources.items() if by_key[key].nbytes)
        return FillSpec(tuple(str(p) for p in self.paths), pieces, store.nbytes, self.direct)

    def _check_tied(self, store: HostStore) -> int:
        n = 0
        for key, others in self.tied.items():
            for name in others:
                ft = self.index.tensors[name]
                tmp = torch.empty(ft.nbytes, dtype=torch.uint8)
                n += read_ranges(self.paths[ft.file], [(ft.start, tmp)], threads=1, direct=self.direct)
                if not torch.equal(tmp.view(ft.dtype).view(ft.shape).to(store.tensor(key).dtype), store.tensor(key)):
                    raise WeightsError(f"tied tensors {self.sources[key]!r} and {name!r} have different values in "
                                       f"weights file {str(self.paths[ft.file])!r}")
        return n


SPILL_MAGIC = b"TSSPILL1"
SPILL_HEADER = 4096  # the bytes start page-aligned in the file


class SpillBacking(Backing):
    """A store with no file behind it, written once to ``path`` (a small header, then its
    own bytes, page-aligned) the first time it is dropped, and read back whole. A store
    under a host budget never moves (``build_tiered``), so the bytes go back where they were."""

    def __init__(self, path: Path):
        self.path = path
        self._nbytes: int | None = None
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return self._nbytes is not None

    def save(self, store: HostStore) -> None:
        with self._lock:
            if self._nbytes is not None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with open(tmp, "wb") as f:
                f.write(self._header(store.nbytes))
                f.write(store.buffer.numpy().data)
                f.flush()
                os.fdatasync(f.fileno())  # on disk, so that its pages can leave the page cache:
                forget_cached(f.fileno())
            os.replace(tmp, self.path)
            self._nbytes = store.nbytes

    @staticmethod
    def _header(nbytes: int) -> bytes:
        head = SPILL_MAGIC + struct.pack("<Q", nbytes)
        return head + bytes(SPILL_HEADER - len(head))

    def _check(self, store: HostStore) -> None:
        where = f"spill file {str(self.path)!r}"
        try:
            size = os.stat(self.path).st_size
            with open(self.path, "rb") as f:
                header = f.read(SPILL_HEADER)
        except FileNotFoundError:
            raise WeightsError(f"{where} of this model disappeared") from None
        if header != self._header(store.nbytes) or size != SPILL_HEADER + store.nbytes:
            raise WeightsError(f"{where} is damaged ({size} bytes for a store of {store.nbytes})")

    def fill(self, store: HostStore) -> int:
        self._check(store)
        return read_ranges(self.path, [(SPILL_HEADER, store.buffer)], direct=self.direct)

    def stream(self, store: HostStore) -> FillSpec | None:
        self._check(store)
        return FillSpec.one(str(self.path), ((SPILL_HEADER, 0, store.nbytes),), store.nbytes, self.direct)

    def discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
