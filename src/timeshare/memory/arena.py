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
import mmap
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from timeshare.errors import MemoryBudgetError
from timeshare.memory.allocator import DEFAULT_ALIGNMENT, Allocator, Block

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Region:
    """A region of the arena held by ``owner`` (NOTE [Regions of the arena]): ``nbytes`` at
    ``offset``, and those bytes as a uint8 tensor (a view of the arena's buffer)."""

    owner: str
    offset: int
    nbytes: int
    memory: torch.Tensor


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
            reserve_shared_memory(self._shm, "a CPU arena", "use a smaller Runtime(memory=...) or a larger /dev/shm")
            self.buffer = map_shared_memory(self._shm.name, self.capacity)
            self._shm.close()  # its own mapping: NOTE [Mappings outlive close]
        else:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.buffer}

    def poison(self, block: Block) -> None:
        """Overwrite ``block`` with 0xFF bytes: NaN in every floating type, -1 in the
        integer ones (a diagnostic: NOTE [Poisoned reloads]). Done when this returns."""
        self.buffer[block.offset:block.offset + block.size].fill_(0xFF)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # before any worker's next copy lands there

    def share(self):
        """What another process needs to map this arena, as plain picklable data, sent
        once when a worker starts: the segment's name on the CPU; on CUDA the IPC handle
        of the one allocation (PyTorch's own CUDA tensor sharing, so the driver maps the
        same device memory). The arena must stay open while workers use it."""
        if self._shm is not None:
            return ("shm", self._shm.name)
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.buffer)
        return ("cuda_ipc", rebuild, args)

    @classmethod
    def attach(cls, handle, capacity: int, device: torch.device) -> Arena:
        """Map an arena that another process created and shared (``share()``): a
        worker's view of the controller's arena. Closing it unmaps; only the creator
        unlinks or frees."""
        self = cls.__new__(cls)
        self.device = device
        self.allocator = Allocator(capacity)
        self.capacity = capacity
        self._owner = False
        self._shm = None
        kind = handle[0]
        if kind == "shm" and device.type == "cpu":
            self.buffer = map_shared_memory(handle[1], capacity)
        elif kind == "cuda_ipc" and device.type == "cuda":
            _, rebuild, args = handle
            self.buffer = rebuild(*args)
            if self.buffer.device != device or self.buffer.numel() != capacity:
                raise MemoryBudgetError(
                    f"the shared arena is {self.buffer.numel():,} bytes on {self.buffer.device}, "
                    f"expected {capacity:,} on {device}"
                )
        else:
            raise MemoryBudgetError(f"cannot attach a {kind!r} arena on {device}")
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
        """Drop the buffer and give the memory back: the creator unlinks the segment (CPU)
        or empties the cache (CUDA). On the CPU the mapping itself goes when the last
        view of it does (NOTE [Mappings outlive close])."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._typed.clear()
        if self.device.type == "cuda" and self._owner:  # hand the bytes back to the driver
            torch.cuda.empty_cache()
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.unlink()


# NOTE [Mappings outlive close]
# A CPU arena (and a host store) is a shared-memory segment mapped by a tensor made with
# ``torch.frombuffer`` over an ``mmap`` of its own; the tensor and every view of it keep
# that ``mmap`` alive, and it is unmapped when the last of them is freed. Nothing here
# ever closes a mapping explicitly, so closing an arena while a module's stale view, an
# output or a copy thread still holds part of it is not an error to handle: the bytes
# stay valid for them, and unlinking only removes the name (the memory goes back once
# the last mapping does). ``SharedMemory`` is kept for creating and naming the segment
# (and its resource tracker, which unlinks what a killed creator left behind); its own
# mapping is closed at once, before anything could export it.
def map_shared_memory(name: str, size: int) -> torch.Tensor:
    """The segment ``name`` as a uint8 tensor of ``size`` bytes, mapped on its own."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=size)


def reserve_shared_memory(shm: shared_memory.SharedMemory, what: str, hint: str) -> None:
    """Back the whole segment now, or close and unlink it and raise MemoryBudgetError
    naming ``what``, its size and the free space. A tmpfs smaller than the segment
    (Docker's /dev/shm is 64 MB by default) would otherwise crash the process with SIGBUS
    at the first touch of a page past its end; this turns that into a clear error."""
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
        raise MemoryBudgetError(f"cannot reserve {what} of {shm.size:,} bytes in /dev/shm "
                                f"({exc.strerror or exc}); {hint}") from exc
    finally:
        os.close(fd)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
