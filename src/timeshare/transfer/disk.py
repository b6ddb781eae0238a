"""Reading weights from disk: the chunked, multi-threaded reads that fill a host store,
whole (``read_ranges``) or streamed while a load copies it (``StreamFill``, NOTE [Disk to
device]), directly where the file system allows (``FileReader``, NOTE [Direct reads]).
Runs where a store is filled: the controller, or the worker that loads. The index of a
safetensors file, read from its header, is ``safetensors_index.py``'s (its names are
importable from here too).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from timeshare.errors import WeightsError
from timeshare.transfer.safetensors_index import SAFETENSORS_DTYPES, FileTensor, Fingerprint, SafetensorsIndex

__all__ = [
    "DIRECT_ALIGN", "READ_CHUNK", "READ_THREADS", "SAFETENSORS_DTYPES", "FileReader", "FileTensor", "FillSpec",
    "Fingerprint", "SafetensorsIndex", "StreamFill", "forget_cached", "read_ranges",
]

READ_CHUNK = 4 << 20  # bytes per read call: large enough for the disk, small enough that the first group arrives early
READ_THREADS = 4


# ---------------------------------------------------------------------- reads
# NOTE [Direct reads]
# The host tier is the cache of these bytes: a second copy in the page cache would only
# take memory from it. With ``direct_io`` files are read with O_DIRECT where the file
# system allows it: the disk writes into page-aligned memory of ours, and the page cache
# is neither needed nor filled. O_DIRECT wants the file offset, the length and the memory address aligned
# (to the device's logical block, 512 or 4096 bytes), which a safetensors tensor at an
# arbitrary offset is not: each read covers the aligned range around the bytes wanted, in
# a bounce buffer per reading thread, and the bytes wanted are copied to the store (a
# memory copy, an order of magnitude faster than the disk). Where the file system refuses
# (EINVAL: tmpfs, some network file systems) the reads fall back to buffered ones. Buffered
# reads (the default) drop their pages from the page cache after each read, so it holds
# them only for a moment. On the development VM (virtio disk, 2 cores) buffered reads were
# the faster, 1.3-1.5 GB/s against 1.0-1.3 direct for BERT-base's file over 4 MiB chunks
# and 4-8 threads (the kernel's read-ahead, and no bounce copy); hence the default. A
# machine whose disk outruns its page cache (NVMe arrays) may prefer ``direct_io``.
DIRECT_ALIGN = 4096


def forget_cached(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Drop the page cache's copy of a file's range (0 bytes: to its end) once it is read or
    written: the host tier is the cache of these bytes (NOTE [Direct reads])."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


class FileReader:
    """One file open for reading by several threads, directly where possible (NOTE
    [Direct reads]); ``direct`` says whether the reads so far bypassed the page cache."""

    def __init__(self, path: str | os.PathLike, *, direct: bool):
        self.path = str(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise WeightsError(f"weights file {self.path!r} cannot be opened: {exc.strerror or exc}") from None
        self._dfd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self._dfd = -1
        # Cleared (never the descriptor closed, which another thread may be reading) when
        # the file system refuses a direct read.
        self.direct = self._dfd >= 0
        self._local = threading.local()

    def read(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``offset``; a file that ends before
        raises ``WeightsError`` (truncated after registration)."""
        if self.direct:
            try:
                if self._read_direct(self._dfd, offset, view):
                    return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # the file system refuses: buffered from now on
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise self._truncated(offset + done)
            done += got
        forget_cached(self._fd, offset, len(view))

    def _read_direct(self, dfd: int, offset: int, view: memoryview) -> bool:
        """Whether ``view`` was filled; False on a short read before the bytes wanted (the
        file's end, or a file system that returns short reads: the buffered read decides)."""
        start = offset - offset % DIRECT_ALIGN
        end = -(-(offset + len(view)) // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce = self._bounce(end - start)
        got_all = 0
        while got_all < end - start:
            got = os.preadv(dfd, [bounce[got_all:end - start]], start + got_all)
            if got <= 0:
                break
            got_all += got
            if got % DIRECT_ALIGN:
                break  # the file's end
        need = offset - start + len(view)
        if got_all < need:
            return False
        view[:] = bounce[offset - start:need]
        return True

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer of at least ``nbytes``."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            size = max(nbytes, READ_CHUNK + 2 * DIRECT_ALIGN)
            buf = self._local.buf = memoryview(mmap.mmap(-1, size))
        return buf

    def _truncated(self, at: int) -> WeightsError:
        return WeightsError(f"weights file {self.path!r} ended at byte {at} while reading the model's weights: "
                            "truncated after registration")

    def close(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1


def read_ranges(path: Path, jobs: Iterable[tuple[int, torch.Tensor]], threads: int = READ_THREADS, *,
                direct: bool = False) -> int:
    """Read each ``(file offset, uint8 destination)`` pair, chunked, over ``threads``
    threads, into the destinations (``direct``: with O_DIRECT where possible, NOTE [Direct reads]).
    Returns the bytes read; a short read (the file shrank meanwhile) raises ``WeightsError``."""
    chunks: list[tuple[int, memoryview]] = []
    for offset, dest in jobs:
        view = dest.numpy().data.cast("B")
        for pos in range(0, len(view), READ_CHUNK):
            chunks.append((offset + pos, view[pos: pos + READ_CHUNK]))
    if not chunks:
        return 0
    reader = FileReader(path, direct=direct)
    try:
        if len(chunks) == 1 or threads <= 1:
            for offset, view in chunks:
                reader.read(offset, view)
        else:
            with ThreadPoolExecutor(min(threads, len(chunks)), thread_name_prefix="timeshare-read") as pool:
                for _ in pool.map(lambda c: reader.read(*c), chunks):
                    pass
    finally:
        reader.close()
    return sum(len(v) for _, v in chunks)


@dataclass(frozen=True)
class FillSpec:
    """A store's bytes to stream from its files while a load copies them on (NOTE [Disk
    to device]): ``pieces`` of ``(file, file offset, store offset, bytes)``, ``file`` an
    index into ``paths``, every byte of the store that comes from the files. Picklable:
    it travels to the worker that loads."""

    paths: tuple[str, ...]
    pieces: tuple[tuple[int, int, int, int], ...]
    nbytes: int  # of the whole store
    direct: bool = False  # read with O_DIRECT where possible (NOTE [Direct reads])

    @classmethod
    def one(cls, path: str, pieces: Iterable[tuple[int, int, int]], nbytes: int, direct: bool = False) -> FillSpec:
        """The spec of a store whose bytes come from one file: ``(file offset, store offset, bytes)``."""
        return cls((path,), tuple((0, f, s, n) for f, s, n in pieces), nbytes, direct)

    @property
    def file_bytes(self) -> int:
        return sum(p[3] for p in self.pieces)

    def chunks(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """The pieces cut into reads of at most ``chunk`` bytes, in store order."""
        out = []
        for file, f_off, s_off, n in sorted(self.pieces, key=lambda p: p[2]):
            for pos in range(0, n, chunk):
                out.append((file, f_off + pos, s_off + pos, min(chunk, n - pos)))
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
                 chunk: int | None = None, deadline_s: float = 600.0):
        self.spec = spec
        self.deadline_s = deadline_s
        self._chunks = spec.chunks(chunk or READ_CHUNK)
        self._views = [buffer[s: s + n] for _, _, s, n in self._chunks]
        # Where each prefix of the store is covered: the store bytes below chunk i's end
        # that come from the file are all in once chunks 0..i are done.
        self._done = [False] * len(self._chunks)
        self._prefix = 0  # chunks done in a row from the first
        self._error: BaseException | None = None
        self._failed_at: int | None = None  # store offset of the first chunk that failed (0: closed)
        self._cv = threading.Condition()
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._readers: list[FileReader] = []
        self.read_s = 0.0
        self.bytes_read = 0
        self.direct = False  # after close: whether the reads bypassed the page cache (NOTE [Direct reads])

    def start(self) -> StreamFill:
        try:
            for path in self.spec.paths:
                self._readers.append(FileReader(path, direct=self.spec.direct))
        except BaseException:
            self.close()
            raise
        self._t0 = time.perf_counter()
        if not self._chunks:
            self._finish()
            return self
        try:
            self._pool = ThreadPoolExecutor(min(self._threads, len(self._chunks)), thread_name_prefix="timeshare-read")
            for i in range(len(self._chunks)):
                self._pool.submit(self._read, i)
        except BaseException:
            self.close()  # no thread may be left reading, and the file goes back
            raise
        return self

    def _read(self, i: int) -> None:
        file, f_off, s_off, n = self._chunks[i]
        view = self._views[i].numpy().data.cast("B")
        try:
            failed = self._failed_at
            if failed is not None and s_off >= failed:
                return  # past a failed read (or closed): no one can wait for it
            self._readers[file].read(f_off, view)
        except BaseException as exc:
            with self._cv:
                if self._failed_at is None or s_off < self._failed_at:
                    self._error, self._failed_at = exc, s_off
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
        self.bytes_read = sum(c[3] for c in self._chunks)

    def _covered(self) -> int:
        """Store bytes below which everything from the file is in."""
        if self._prefix == len(self._chunks):
            return self.spec.nbytes
        return self._chunks[self._prefix][2]

    def wait_until(self, byte: int) -> None:
        deadline = time.monotonic() + self.deadline_s
        with self._cv:
            while self._covered() < byte:
                # Only a failure below ``byte`` concerns this wait: the reads before it
                # still complete (a later chunk may fail first, on another thread).
                if self._error is not None and self._failed_at is not None and self._failed_at < byte:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightsError(f"reading {list(self.spec.paths)!r} did not reach byte {byte} within "
                                       f"{self.deadline_s:g} s")
                self._cv.wait(min(left, 1.0))

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
            if self._covered() < self.spec.nbytes:
                self._error = self._error or WeightsError("the load that was reading this file ended")
                self._failed_at = 0
            self._cv.notify_all()  # a copy waiting for bytes that will not come stops now
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._readers:
            self.direct = all(r.direct for r in self._readers)
            for reader in self._readers:
                reader.close()
            self._readers = []
