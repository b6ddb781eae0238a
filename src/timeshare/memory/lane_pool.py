"""A lane's memory bound from the device's allocator rather than from Python per
operator: each call of a measured shape runs with its allocations routed to a pool of
the allocator's own (on CUDA, a ``torch.cuda.MemPool``), and the pool's footprint is
checked against the lane once the call's work is queued. Runs where the compute
happens (the controller in-process, or a worker process).

# NOTE [Lane pools]
An inference's lane lives for one call (it is admitted and released with it), so lane
ids do not repeat and a pool per lane id would never be used twice. Pools are lent
instead: a call takes an idle pool that already holds at most what its lane allows
(the fullest such one: it has the room cached already), or a new one, and gives it
back afterwards. A pool is used by one call at a time, so what it holds beyond the
lane's allowance after a call was taken by that call: the call fails with
:class:`~timeshare.errors.LaneExceededError` (only it: its thread raises), and the pool
is dropped rather than lent again, so that its memory returns to the device once the
call's tensors are gone. The allowance is the lane rounded up to the allocator's
granularity, plus one of its large segments (``POOL_SLACK``): the allocator serves
allocations from segments it rounds up, and a pool holds whole segments.

This is a check after the fact, as the meter's is one operator late (NOTE [Counting
ephemeral bytes]): the call may have held more than its lane for the time of its
forward. What keeps lanes apart beforehand is admission (NOTE [Salus lanes]): a
measured shape asks for its measured peak with headroom. Idle pools keep what they
cached; at most ``idle_max`` are kept, the fullest dropped first.

NOTE [Library workspaces outside pools]: cuBLAS keeps a workspace per handle and stream
(32 MiB on Hopper, with CUBLAS_WORKSPACE_CONFIG=:4096:8 too), allocated from the caching
allocator at the first matrix product a thread issues on a stream, and kept. Made inside
a pool, it stays there: on the H200 every pooled call of a fresh lane stream held 34-36
MiB against a lane of 1 MiB and failed with LaneExceededError. So a pool, before it is
activated, has the thread's current stream make its library state outside it, once per
(thread, stream): a tiny product and a product with a bias (cuBLASLt's path), in the
default pool. ``Once`` is that bookkeeping, tested on the CPU.

The pure logic (``LanePools``, ``pool_allowance``) takes any object with the
``LanePool`` interface, so it is tested on the CPU with fakes; ``CudaLanePool`` is the
one real pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

POOL_GRANULE = 2 << 20  # the CUDA caching allocator rounds segments of large blocks to 2 MiB
POOL_SLACK = 20 << 20  # ... and serves 1-10 MiB blocks from 20 MiB segments: one of those beyond the lane


class LanePool(Protocol):
    """The allocator's pool one call of a lane allocates from."""

    def activate(self) -> AbstractContextManager[None]:
        """While active, this thread's allocations on the device come from the pool."""
        ...

    def held_bytes(self) -> int:
        """The device bytes the pool holds now (its segments, in use or cached)."""
        ...


def pool_allowance(limit: int) -> int:
    """The most a pool may hold after a call in a lane of ``limit`` bytes (NOTE [Lane pools])."""
    return -(-max(0, limit) // POOL_GRANULE) * POOL_GRANULE + POOL_SLACK


class LanePools:
    """The pools of one device, lent to one call at a time (NOTE [Lane pools]).
    ``make``: a new, empty pool."""

    def __init__(self, make: Callable[[], LanePool], *, idle_max: int = 8):
        if idle_max < 0:
            raise ValueError(f"idle_max must be at least 0, got {idle_max}")
        self._make = make
        self.idle_max = idle_max
        self._idle: list[tuple[int, LanePool]] = []  # (bytes it held when given back, the pool)
        self._lock = threading.Lock()
        self.made = 0
        self.dropped = 0

    @property
    def idle(self) -> int:
        return len(self._idle)

    def acquire(self, limit: int) -> LanePool:
        """A pool for a call in a lane of ``limit`` bytes: the fullest idle one within
        its allowance, else a new one."""
        allowance = pool_allowance(limit)
        with self._lock:
            best = None
            for i, (held, _) in enumerate(self._idle):
                if held <= allowance and (best is None or held > self._idle[best][0]):
                    best = i
            if best is not None:
                return self._idle.pop(best)[1]
            self.made += 1
        return self._make()

    def give_back(self, pool: LanePool, held: int) -> None:
        """The call ended within its lane; the pool held ``held`` bytes then."""
        with self._lock:
            self._idle.append((held, pool))
            if len(self._idle) > self.idle_max:
                fullest = max(range(len(self._idle)), key=lambda i: self._idle[i][0])
                del self._idle[fullest]
                self.dropped += 1

    def drop(self, pool: LanePool) -> None:
        """The call went over its lane: the pool is not lent again."""
        with self._lock:
            self.dropped += 1


class Once:
    """Runs ``fn`` the first time a key is seen; remembers at most ``limit`` keys (a key
    forgotten is warmed again: harmless, only a repeat)."""

    def __init__(self, fn: Callable[[], None], limit: int = 4096):
        self._fn = fn
        self._seen: set[object] = set()
        self._lock = threading.Lock()
        self.limit = limit
        self.runs = 0

    def __call__(self, key: object) -> None:
        with self._lock:
            if key in self._seen:
                return
        self._fn()
        with self._lock:
            if len(self._seen) >= self.limit:
                self._seen.clear()
            self._seen.add(key)
            self.runs += 1


class CudaLanePool:
    """A ``torch.cuda.MemPool`` of one device (NOTE [Lane pools]). Made on first use in
    a call on CUDA, never at import."""

    def __init__(self, device) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.pool = torch.cuda.MemPool()

    def activate(self) -> AbstractContextManager[None]:
        torch = self._torch
        stream = torch.cuda.current_stream(self.index)
        _warm_libraries(self.index)((threading.get_ident(), self.index, stream.cuda_stream))
        return torch.cuda.use_mem_pool(self.pool, self.index)  # an index: torch wants no bare "cuda"

    def held_bytes(self) -> int:
        return sum(int(s["total_size"]) for s in self.pool.snapshot(include_traces=False)
                   if s.get("device", self.index) == self.index)


_warmers: dict[int, Once] = {}
_warmers_lock = threading.Lock()


def _warm_libraries(index: int) -> Once:
    """The device's NOTE [Library workspaces outside pools] bookkeeping."""
    with _warmers_lock:
        once = _warmers.get(index)
        if once is None:
            once = _warmers[index] = Once(lambda: _touch_blas(index))
        return once


def _touch_blas(index: int) -> None:
    """A product on this thread's current stream, plain and with a bias, in each floating
    type a lane computes in: cuBLAS and cuBLASLt make their handle and workspace now."""
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(16, 16, device=torch.device("cuda", index), dtype=dtype)
        torch.mm(a, a)
        torch.addmm(a[0], a, a)
