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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from timeshare.errors import WeightsError
from timeshare.transfer.host_store import HostStore

READ_CHUNK = 16 << 20  # bytes per read call: large enough for the disk, small enough to spread
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
    """A mapping of ``nbytes`` whose pages can be given back (NOTE [Host tier]):
    anonymous memory, or a shared-memory segment (``/dev/shm/<name>``) mapped here too."""

    def __init__(self, nbytes: int, *, shared_name: str | None = None):
        self.nbytes = nbytes
        self.shared = shared_name is not None
        self.name = shared_name
        if shared_name is None:
            self._map = mmap.mmap(-1, max(nbytes, 1))
        else:
            fd = os.open(f"/dev/shm/{shared_name.lstrip('/')}", os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]

    def drop(self) -> None:
        """Give the pages back; the range reads as zeros until written again. For a
        shared segment the pages go for every process that maps it."""
        if self.nbytes:
            self._map.madvise(mmap.MADV_REMOVE if self.shared else mmap.MADV_DONTNEED)

    def resident_bytes(self) -> int | None:
        """Bytes of memory the pages hold now, as the kernel counts them (Linux; None
        elsewhere): the segment's allocated blocks, or this mapping's resident set."""
        try:
            if self.shared:
                return os.stat(f"/dev/shm/{str(self.name).lstrip('/')}").st_blocks * 512
            start = self.tensor.data_ptr()
            with open("/proc/self/smaps") as f:
                inside = False
                for line in f:
                    head = line.split(" ", 1)[0]
                    if "-" in head and ":" not in head:
                        lo = int(head.split("-")[0], 16)
                        inside = lo == start
                    elif inside and line.startswith("Rss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


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


class SpillBacking(Backing):
    """A store with no file behind it, written once to ``path`` (its own bytes, after a
    small header) the first time it is dropped, and read back whole."""

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
            header = SPILL_MAGIC + struct.pack("<Q", store.nbytes)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(store.buffer.numpy().data)
            os.replace(tmp, self.path)
            self._nbytes = store.nbytes

    def fill(self, store: HostStore) -> int:
        where = f"spill file {str(self.path)!r}"
        try:
            size = os.stat(self.path).st_size
            with open(self.path, "rb") as f:
                header = f.read(16)
        except FileNotFoundError:
            raise WeightsError(f"{where} of this model disappeared") from None
        if header != SPILL_MAGIC + struct.pack("<Q", store.nbytes) or size != 16 + store.nbytes:
            raise WeightsError(f"{where} is damaged ({size} bytes for a store of {store.nbytes})")
        return _read_ranges(self.path, [(16, store.buffer)])

    def discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


PagesFactory = Callable[[int], HostPages]
