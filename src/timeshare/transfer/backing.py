"""The disk tier under the host stores: where a store's bytes come from when they are not
in memory, and host memory that can be given back without moving. Runs in the controller.

# NOTE [Host tier]
With a host budget (``Runtime(host_memory=...)``), host memory is a cache over disk, as
device memory is a cache over host memory. A model's host store keeps its address for
the model's whole life, so workers' mappings and the module's bindings never change;
what comes and goes are its pages:
- ``HostPages``: the store's memory, a mapping of its own (anonymous in this process, or
  the shared-memory segment the workers map). ``drop()`` gives the pages back to the
  operating system (``madvise``); the range stays mapped and reads as zeros until the
  store is filled again.
- a ``Backing`` refills a dropped store: ``FileBacking`` from the safetensors file the
  model was registered from (its tensor index read from the header only, so a model
  registered from a file is not read until it is needed), ``SpillBacking`` from a file
  of the store's own bytes that the runtime writes the first time a store with no file
  behind it (a builder's weights, a state dict, converted dtypes) is dropped.
- Every fill first checks that the file is still the one registered (size, modification
  time and the header's bytes; ``Fingerprint``): a file changed, truncated or gone fails
  that model's call with ``WeightsError`` and touches nothing else.
Reads are chunked and spread over a few threads, each reading straight into the store
(``os.preadv`` into its bytes), with no staging copy on the CPU.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from timeshare.errors import WeightsError
from timeshare.transfer.host_store import HostStore

READ_CHUNK = 4 << 20  # bytes per read call: large enough for the disk, small enough that the first group arrives early
READ_THREADS = 4

# safetensors' dtype names (its format specification) and torch's dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


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

    def resident_bytes(self) -> int:
        """Bytes of memory the pages hold now: the file's allocated blocks."""
        return os.fstat(self._fd).st_blocks * 512


# ---------------------------------------------------------------------- safetensors index
@dataclass(frozen=True)
class Fingerprint:
    """What identifies a weights file as the one registered."""

    size: int
    mtime_ns: int
    header: bytes

    @classmethod
    def of(cls, path: Path, header: bytes) -> Fingerprint:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, header)


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: absolute byte range in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsIndex:
    """A safetensors file's tensor index, from its header alone."""

    path: Path
    tensors: dict[str, FileTensor]
    fingerprint: Fingerprint

    @classmethod
    def read(cls, path: str | os.PathLike) -> SafetensorsIndex:
        """The header of ``path`` parsed and checked against the file's size; a file
        that is not safetensors, or is cut short, raises ``WeightsError``."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise WeightsError(f"weights file {str(path)!r} is too short for a safetensors header")
                (n,) = struct.unpack("<Q", head)
                size = os.fstat(f.fileno()).st_size
                if n > size - 8 or n > 100 << 20:
                    raise WeightsError(f"weights file {str(path)!r} has a header length of {n} bytes in a "
                                       f"file of {size}: not safetensors, or truncated")
                header = f.read(n)
        except FileNotFoundError:
            raise WeightsError(f"weights file {str(path)!r} does not exist") from None
        except OSError as exc:
            raise WeightsError(f"weights file {str(path)!r} cannot be read: {exc}") from exc
        try:
            meta = json.loads(header)
        except ValueError as exc:
            raise WeightsError(f"weights file {str(path)!r} has a header that is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise WeightsError(f"weights file {str(path)!r} has a malformed header")
        base = 8 + n
        tensors: dict[str, FileTensor] = {}
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"weights file {str(path)!r}: tensor {name!r} has a malformed or "
                                   f"unsupported entry {info!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0 or base + end > size:
                raise WeightsError(f"weights file {str(path)!r}: tensor {name!r} spans bytes {begin}-{end}, "
                                   f"which do not fit its shape {list(shape)} or the file ({size} bytes)")
            tensors[name] = FileTensor(name, dtype, shape, base + begin, base + end)
        return cls(path, tensors, Fingerprint.of(path, header))

    def check(self) -> None:
        """Raise ``WeightsError`` unless the file is still the one indexed."""
        where = f"weights file {str(self.path)!r}"
        try:
            now = Fingerprint.of(self.path, b"")
        except FileNotFoundError:
            raise WeightsError(f"{where} disappeared after the model was registered") from None
        old = self.fingerprint
        if now.size != old.size:
            raise WeightsError(f"{where} changed size after the model was registered ({old.size} bytes, now "
                               f"{now.size}): truncated or rewritten; register the model again")
        if now.mtime_ns != old.mtime_ns:
            raise WeightsError(f"{where} was modified after the model was registered; register the model again")
        with open(self.path, "rb") as f:
            f.seek(8)
            if f.read(len(old.header)) != old.header:
                raise WeightsError(f"{where} has a different header than when the model was registered")


# ---------------------------------------------------------------------- reads
def _forget_cached(fd: int, offset: int, nbytes: int) -> None:
    """The page cache's copy of what was just read goes: the host tier is the cache of
    these bytes, and a second copy in the page cache would only take memory from it."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _read_ranges(path: Path, jobs: Iterable[tuple[int, torch.Tensor]], threads: int = READ_THREADS) -> int:
    """Read each ``(file offset, uint8 destination)`` pair, chunked, over ``threads``
    threads, straight into the destinations. Returns the bytes read; a short read (the
    file shrank meanwhile) raises ``WeightsError``."""
    chunks: list[tuple[int, memoryview]] = []
    for offset, dest in jobs:
        view = dest.numpy().data.cast("B")
        for pos in range(0, len(view), READ_CHUNK):
            chunks.append((offset + pos, view[pos: pos + READ_CHUNK]))
    if not chunks:
        return 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise WeightsError(f"weights file {str(path)!r} cannot be opened: {exc.strerror or exc}") from None
    try:
        def one(chunk: tuple[int, memoryview]) -> None:
            offset, view = chunk
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise WeightsError(f"weights file {str(path)!r} ended at byte {offset + done} while reading "
                                       "the model's weights: truncated after registration")
                done += got
            _forget_cached(fd, offset, len(view))

        if len(chunks) == 1 or threads <= 1:
            for c in chunks:
                one(c)
        else:
            with ThreadPoolExecutor(min(threads, len(chunks)), thread_name_prefix="timeshare-read") as pool:
                for _ in pool.map(one, chunks):
                    pass
    finally:
        os.close(fd)
    return sum(len(v) for _, v in chunks)


@dataclass(frozen=True)
class FillSpec:
    """A store's bytes to stream from one file while a load copies them on (NOTE [Disk
    to device]): ``pieces`` of ``(file offset, store offset, bytes)``, every byte of the
    store that comes from the file. Picklable: it travels to the worker that loads."""

    path: str
    pieces: tuple[tuple[int, int, int], ...]
    nbytes: int  # of the whole store

    def chunks(self, chunk: int = READ_CHUNK) -> list[tuple[int, int, int]]:
        """The pieces cut into reads of at most ``chunk`` bytes, in store order."""
        out = []
        for f_off, s_off, n in sorted(self.pieces, key=lambda p: p[1]):
            for pos in range(0, n, chunk):
                out.append((f_off + pos, s_off + pos, min(chunk, n - pos)))
        return out


# NOTE [Disk to device]
# A load of a model whose host store is on disk need not wait for the whole store: its
# bytes are read in store order, which is execution order, by a few threads, straight
# into the store, and the copy of each group to the device waits only until the reads
# have covered that group (``StreamFill.wait_until``, the copy engine's ``ready``). So
# the disk, the link and the compute work on three different groups at once, and the
# load costs about the slowest of the three. The store is then filled as a side
# effect, and the host tier counts it as in memory. A read that fails (the file was cut
# short meanwhile) fails that load alone, with WeightsError naming the file; the
# fingerprint was checked just before the load began.
class StreamFill:
    """Reads ``spec`` into ``buffer`` on background threads; ``wait_until(byte)`` blocks
    until every byte before ``byte`` is in."""

    def __init__(self, spec: FillSpec, buffer: torch.Tensor, *, threads: int = READ_THREADS,
                 chunk: int = READ_CHUNK, deadline_s: float = 600.0):
        self.spec = spec
        self.deadline_s = deadline_s
        self._chunks = spec.chunks(chunk)
        self._views = [buffer[s: s + n] for _, s, n in self._chunks]
        # Where each prefix of the store is covered: the store bytes below chunk i's end
        # that come from the file are all in once chunks 0..i are done.
        self._done = [False] * len(self._chunks)
        self._prefix = 0  # chunks done in a row from the first
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._fd = -1
        self.read_s = 0.0
        self.bytes_read = 0

    def start(self) -> StreamFill:
        try:
            self._fd = os.open(self.spec.path, os.O_RDONLY)
        except OSError as exc:
            raise WeightsError(f"weights file {self.spec.path!r} cannot be opened: {exc.strerror or exc}") from None
        self._t0 = time.perf_counter()
        if not self._chunks:
            self._finish()
            return self
        self._pool = ThreadPoolExecutor(min(self._threads, len(self._chunks)), thread_name_prefix="timeshare-read")
        for i in range(len(self._chunks)):
            self._pool.submit(self._read, i)
        return self

    def _read(self, i: int) -> None:
        f_off, _, n = self._chunks[i]
        view = self._views[i].numpy().data.cast("B")
        try:
            if self._error is not None:
                return
            done = 0
            while done < n:
                got = os.preadv(self._fd, [view[done:]], f_off + done)
                if got <= 0:
                    raise WeightsError(f"weights file {self.spec.path!r} ended at byte {f_off + done} while a "
                                       "load read it: truncated after registration")
                done += got
            _forget_cached(self._fd, f_off, n)
        except BaseException as exc:
            with self._cv:
                self._error = self._error or exc
                self._cv.notify_all()
            return
        with self._cv:
            self._done[i] = True
            while self._prefix < len(self._done) and self._done[self._prefix]:
                self._prefix += 1
            if self._prefix == len(self._done):
                self._finish()
            self._cv.notify_all()

    def _finish(self) -> None:
        self.read_s = time.perf_counter() - self._t0
        self.bytes_read = sum(n for _, _, n in self._chunks)

    def _covered(self) -> int:
        """Store bytes below which everything from the file is in."""
        if self._prefix == len(self._chunks):
            return self.spec.nbytes
        _, s_off, _ = self._chunks[self._prefix]
        return s_off

    def wait_until(self, byte: int) -> None:
        deadline = time.monotonic() + self.deadline_s
        with self._cv:
            while self._covered() < byte:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightsError(f"reading {self.spec.path!r} did not reach byte {byte} within "
                                       f"{self.deadline_s:g} s")
                self._cv.wait(min(left, 1.0))
            if self._error is not None and self._covered() < self.spec.nbytes and byte > self._covered():
                raise self._error

    def wait_all(self) -> None:
        self.wait_until(self.spec.nbytes)

    @property
    def error(self) -> BaseException | None:
        """What stopped the reads, if a read failed before all were in."""
        with self._cv:
            return self._error if self._covered() < self.spec.nbytes else None

    def close(self) -> None:
        """Stop reading (what is queued is skipped) and give the file back."""
        with self._cv:
            self._error = self._error or WeightsError("the load that was reading this file ended")
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Backing:
    """Where a dropped store's bytes come back from."""

    path: Path

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
    """A store filled from the safetensors file its model was registered from.
    ``sources``: store key -> the file's tensor name; ``kept``: store key -> a tensor
    held in memory (a buffer the file does not have: the module's own value)."""

    def __init__(self, index: SafetensorsIndex, sources: dict[str, str], kept: dict[str, torch.Tensor],
                 tied: dict[str, tuple[str, ...]] | None = None):
        self.index = index
        self.path = index.path
        self.sources = sources
        self.kept = kept
        self.tied = tied or {}  # store key -> other file names of the same tensor, checked equal

    def fill(self, store: HostStore) -> int:
        self.index.check()
        direct: list[tuple[int, torch.Tensor]] = []
        converted: list[tuple[str, FileTensor]] = []
        for e in store.entries:
            if e.key in self.kept:
                HostStore.view(store.buffer, e).copy_(self.kept[e.key])
                continue
            ft = self.index.tensors[self.sources[e.key]]
            if ft.dtype == e.dtype:
                direct.append((ft.start, store.buffer[e.offset: e.offset + e.nbytes]))
            else:
                converted.append((e.key, ft))
        n = _read_ranges(self.path, direct)
        for key, ft in converted:  # floating tensors stored in another dtype: read, then convert
            tmp = torch.empty(ft.nbytes, dtype=torch.uint8)
            n += _read_ranges(self.path, [(ft.start, tmp)], threads=1)
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
        pieces = tuple((self.index.tensors[name].start, by_key[key].offset, by_key[key].nbytes)
                       for key, name in self.sources.items() if by_key[key].nbytes)
        return FillSpec(str(self.path), pieces, store.nbytes)

    def _check_tied(self, store: HostStore) -> int:
        n = 0
        for key, others in self.tied.items():
            for name in others:
                ft = self.index.tensors[name]
                tmp = torch.empty(ft.nbytes, dtype=torch.uint8)
                n += _read_ranges(self.path, [(ft.start, tmp)], threads=1)
                if not torch.equal(tmp.view(ft.dtype).view(ft.shape).to(store.tensor(key).dtype), store.tensor(key)):
                    raise WeightsError(f"tied tensors {self.sources[key]!r} and {name!r} have different values in "
                                       f"weights file {str(self.path)!r}")
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
        return _read_ranges(self.path, [(SPILL_HEADER, store.buffer)])

    def stream(self, store: HostStore) -> FillSpec | None:
        self._check(store)
        return FillSpec(str(self.path), ((SPILL_HEADER, 0, store.nbytes),), store.nbytes)

    def discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


PagesFactory = Callable[[int], HostPages]
