"""The arena: the one device buffer that holds every resident model's weights.
Lives in the process that computes (the in-process runtime; the memory owner in the
multi-process runtime).

One allocation is made when the arena opens and none afterwards: models get byte
ranges from the integer :class:`~timeshare.memory.allocator.Allocator` and their
tensors are views into the buffer. On the CPU the buffer lives in POSIX shared
memory so that worker processes can map the same bytes; on CUDA it is a single
device allocation.
"""

from __future__ import annotations

import logging
import os
from multiprocessing import shared_memory

import torch

from timeshare.errors import MemoryBudgetError
from timeshare.memory.allocator import DEFAULT_ALIGNMENT, Allocator, Block

log = logging.getLogger(__name__)


class Arena:
    """Owns ``capacity`` bytes on ``device`` and the allocator that places blocks in it."""

    def __init__(self, device: torch.device, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        self.device = device
        self.allocator = Allocator(capacity, alignment)
        self.capacity = self.allocator.capacity
        self._shm: shared_memory.SharedMemory | None = None
        self._owner = True
        if device.type == "cpu":
            self._shm = shared_memory.SharedMemory(create=True, size=self.capacity)
            _reserve(self._shm)
            self.buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.capacity)
        else:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.buffer}

    @classmethod
    def attach(cls, name: str, capacity: int, device: torch.device) -> "Arena":
        """Map an arena that another process created (a worker's view of the controller's
        CPU arena). Closing it unmaps; only the creator unlinks."""
        if device.type != "cpu":
            raise MemoryBudgetError(f"attaching to an arena by name is only available on the CPU, not {device}")
        self = cls.__new__(cls)
        self.device = device
        self.allocator = Allocator(capacity)
        self.capacity = capacity
        self._shm = attach_shared_memory(name)
        self._owner = False
        self.buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=capacity)
        self._typed = {torch.uint8: self.buffer}
        return self

    @property
    def shm_name(self) -> str | None:
        """Name of the shared-memory segment behind a CPU arena (None on CUDA)."""
        return self._shm.name if self._shm is not None else None

    def allocate(self, size: int, owner: str) -> Block | None:
        return self.allocator.allocate(size, owner)

    def release(self, block: Block) -> None:
        self.allocator.release(block)

    def views(self, offset: int, entries) -> dict[str, torch.Tensor]:
        """Tensors laid out as ``entries`` (key, shape, dtype, relative offset), starting
        at byte ``offset`` of the arena: one ``as_strided`` each, no allocation."""
        out = {}
        for e in entries:
            typed = self._typed.get(e.dtype)
            if typed is None:
                typed = self._typed[e.dtype] = self.buffer.view(e.dtype)
            start = offset + e.offset
            out[e.key] = typed.as_strided(e.shape, _contiguous_strides(e.shape), start // e.dtype.itemsize)
        return out

    def region(self, block: Block) -> torch.Tensor:
        """The bytes of ``block`` as a uint8 view of the arena."""
        return self.buffer[block.offset : block.offset + block.size]

    def close(self) -> None:
        """Drop the buffer and give the memory back (unlinks the shared-memory segment)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._typed.clear()
        if self.device.type == "cuda":  # hand the bytes back to the driver, not just to the cache
            torch.cuda.empty_cache()
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:
                # Views of the buffer are still alive somewhere; the mapping goes away with
                # them. Unlinking below still returns the segment's name and, once the last
                # view dies, its memory.
                log.debug("arena %s closed while views were alive", shm.name)
            if self._owner:
                shm.unlink()


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open a segment another process created. Workers are spawned by the creator and
    share its resource tracker, where registration is a set: attaching adds nothing,
    and the creator's unlink clears it. So a worker must not unregister the name."""
    return shared_memory.SharedMemory(name=name)


def _reserve(shm: shared_memory.SharedMemory) -> None:
    """Back the whole segment now. A tmpfs smaller than the arena (Docker's /dev/shm is
    64 MB by default) would otherwise crash the process with SIGBUS at the first touch
    of a page past its end; this turns that into an error at start-up."""
    path = f"/dev/shm/{shm.name.lstrip('/')}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return  # not a Linux tmpfs: nothing to reserve through
    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if shm.size > free:  # fail at once rather than fill the tmpfs first
            raise OSError(28, f"only {free:,} bytes are free")
        os.posix_fallocate(fd, 0, shm.size)
    except OSError as exc:
        shm.close()
        shm.unlink()
        raise MemoryBudgetError(
            f"cannot reserve a CPU arena of {shm.size:,} bytes in /dev/shm ({exc.strerror or exc}); "
            "use a smaller Runtime(memory=...) or a larger /dev/shm"
        ) from exc
    finally:
        os.close(fd)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
