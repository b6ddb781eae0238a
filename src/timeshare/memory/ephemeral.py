"""Ephemeral memory: the bytes one request or training iteration allocates beyond its
persistent weights and state, counted as it runs, and the bound of a memory lane.

# NOTE [Counting ephemeral bytes]
A meter is a dispatch mode: every operator's outputs pass through it. An output whose
storage is new (not one of the operator's inputs: views and in-place results share
theirs) is counted live until its storage is freed, through a weak reference to it.
The peak of the live count is the task's ephemeral memory. Temporaries that a kernel
allocates and frees inside one operator are not seen, and neither is the caching
allocator's rounding: on CUDA, profiling also reads the allocator's peak, and lanes
leave headroom (``LANE_HEADROOM``). Dispatch modes are per thread, so each lane's
thread counts only its own task.

A meter with a ``limit`` is a lane's guard: the operator that takes the live count
over the limit raises :class:`~timeshare.errors.LaneExceededError` naming the task, the
lane's size and what the task had asked for, in the task's own thread, so only that
task fails. The operator's output exists by then (it is freed as the error unwinds):
the guard bounds what a task may hold, one operator's worth of overshoot aside.

A meter costs tens of microseconds of Python per operator, under the interpreter lock
that concurrent lanes share. So only what is not known yet is metered: a shape's first
calls (``LaneBound.metered``, NOTE [Measured shapes run unmetered] in
``runtime/lanes.py``), a turn's calls and training iterations. A call of a measured
shape runs unmetered: admission keeps its lane (it asks for its measured peak with
headroom) and, on CUDA, the allocator's pool checks it (NOTE [Lane pools]).

The runtime's own scratch memory is not a task's: a worker's one-off probe of the link
(64 MiB, at its first profile, which may happen inside a call in a lane: a replacement
worker's first load) runs ``unmetered()``, so no meter of its thread counts it.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from timeshare.errors import LaneExceededError, MemoryBudgetError
from timeshare.memory.lane_pool import CudaLanePool, LanePools, pool_allowance
from timeshare.units import format_bytes

LANE_HEADROOM = 1.25  # a lane is the profiled peak times this (allocator rounding, small variations)
_paused = threading.local()  # ``unmetered`` blocks running in this thread


@contextmanager
def unmetered() -> Iterator[None]:
    """Run a block of the runtime's own work whose tensors no meter of this thread counts."""
    _paused.depth = getattr(_paused, "depth", 0) + 1
    try:
        yield
    finally:
        _paused.depth -= 1


class EphemeralMeter(TorchDispatchMode):
    """Counts live bytes of tensors created while active, in this thread; ``peak`` is
    the highest count seen. ``limit``: raise when the count goes over (a lane's guard)."""

    def __init__(self, limit: int | None = None, *, task: str = "", lane: int | None = None):
        super().__init__()
        self.limit = limit
        self.task = task
        self.lane = lane
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, tuple[int, weakref.ref]] = {}  # storage -> its bytes, a ref that reports its end
        self._lock = threading.Lock()  # finalizers run in whichever thread frees the storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(_paused, "depth", 0):
            return out
        if type(out) is torch.Tensor:  # the common case first: this runs for every operator
            self._count(out, args)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if type(t) is torch.Tensor:
                    self._count(t, args)
        return out

    def _count(self, t: torch.Tensor, args: tuple) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._sizes:
            return
        for a in args:  # a view or an in-place result shares its input's storage
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == key:
                return
            if isinstance(a, (tuple, list)) and any(
                    isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == key for x in a):
                return
        nbytes = storage.nbytes()
        if not nbytes:
            return
        with self._lock:
            self._sizes[key] = (nbytes, weakref.ref(storage, functools.partial(self._freed, key)))
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
            over = self.limit is not None and self.live > self.limit
        if over:
            assert self.limit is not None
            raise LaneExceededError(self.task, self.lane, self.limit, self.live)

    def _freed(self, key: int, _ref: object = None) -> None:
        with self._lock:
            entry = self._sizes.pop(key, None)
            if entry is not None:
                self.live -= entry[0]


@dataclass(frozen=True)
class LaneBound:
    """What a call in a lane runs with, in whichever process runs it: its task's name,
    the lane and its size in bytes (None: metered, not bounded), and the cores it may
    use (None: all). ``metered``: counted per operator by an :class:`EphemeralMeter`;
    False for a shape whose peak is known, which admission keeps within the lane (on
    CUDA the allocator's pool checks it: NOTE [Lane pools])."""

    task: str
    lane: int | None
    limit: int | None
    threads: int | None = None
    metered: bool = True


@contextmanager
def in_lane(lane: LaneBound | None, device: torch.device) -> Iterator[EphemeralMeter | None]:
    """Run a block as a call in ``lane``, on the lane's CUDA stream or its share of the
    CPU's cores: metered and bounded (NOTE [Counting ephemeral bytes]), or, unmetered, in
    a pool of the allocator on CUDA (NOTE [Lane pools]). Without a lane: nothing
    changes, no meter. Yields the meter, None when unmetered."""
    if lane is None:
        yield None
        return
    with lane_stream(device, lane.lane), cpu_share(device, lane.threads):
        if lane.metered:
            with EphemeralMeter(lane.limit, task=lane.task, lane=lane.lane) as meter:
                yield meter
        elif device.type == "cuda" and lane.limit is not None:
            with pooled(cuda_pools(device), lane):
                yield None
        else:  # the CPU: admission alone keeps a measured shape in its lane
            yield None


@contextmanager
def pooled(pools: LanePools, lane: LaneBound) -> Iterator[None]:
    """Run a block with its allocations in a pool lent by ``pools``; fail it with
    :class:`LaneExceededError` if the pool holds more than the lane allows afterwards
    (NOTE [Lane pools]). An error of the block's own gives the pool back."""
    assert lane.limit is not None, "a pool bounds a lane of known size"
    pool = pools.acquire(lane.limit)
    try:
        with pool.activate():
            yield
    except BaseException:
        pools.give_back(pool, pool.held_bytes())
        raise
    held = pool.held_bytes()
    if held > pool_allowance(lane.limit):
        pools.drop(pool)
        raise LaneExceededError(lane.task, lane.lane, lane.limit, held)
    pools.give_back(pool, held)


_pools: dict[int, LanePools] = {}


def cuda_pools(device: torch.device) -> LanePools:
    """The lane pools of a CUDA device, made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        pools = _pools.get(index)
        if pools is None:
            where = torch.device("cuda", index)
            pools = _pools[index] = LanePools(lambda: CudaLanePool(where))
        return pools


LANE_STREAMS = 8  # lanes beyond this many share streams (lane id modulo): serialised, still correct
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


@contextmanager
def lane_stream(device: torch.device, lane: int | None) -> Iterator[None]:
    """On CUDA, the block's kernels go to a stream of the lane's own, so that lanes overlap
    on the device: the stream first waits for the work queued before (the inputs'
    upload), and the work queued after waits for it (the outputs' download)."""
    if device.type != "cuda" or lane is None:
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, lane % LANE_STREAMS)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device)
    before = torch.cuda.current_stream(device)
    stream.wait_stream(before)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        before.wait_stream(stream)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def cpu_share(device: torch.device, threads: int | None) -> Iterator[None]:
    """On the CPU, this thread's operators use ``threads`` cores (None: unchanged). The
    setting stays: part of it (MKL's) is process-wide, so putting it back after each call
    would change the thread count under a concurrent call of another lane, and with it
    that call's bits. Every lane sets the same count."""
    if device.type == "cpu":
        use_cores(threads)
    yield


def use_cores(threads: int | None) -> None:
    """``cpu_share`` for a thread known to compute on the CPU, without a block around it."""
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(max(1, threads))


def plain_on_cpu(lane: LaneBound, device: torch.device) -> bool:
    """Whether a call in ``lane`` runs as it would outside lanes, its cores aside: an
    unmetered call on the CPU (no meter, no stream, no pool: ``in_lane`` would only set
    its cores, NOTE [Measured shapes run unmetered])."""
    return not lane.metered and device.type == "cpu"


def lane_bytes(peak: int) -> int:
    """The lane a task with this measured peak asks for."""
    return int(peak * LANE_HEADROOM)


def job_lane_sizes(job: str, persistent: int, ephemeral: int, capacity: int) -> tuple[int, int]:
    """A training job's admission once its iterations have measured it, as Salus resizes
    lanes at iteration boundaries: its persistent state, and one iteration's peak with
    headroom where it fits beside it in ``capacity`` (the lanes' bytes). Sizes that can
    never fit are refused, naming them."""
    if persistent + ephemeral > capacity:
        raise MemoryBudgetError(
            f"training job {job!r} measured {format_bytes(persistent)} of state and "
            f"{format_bytes(ephemeral)} per iteration: more than the lanes' "
            f"{format_bytes(capacity)} together; raise lane_memory")
    return persistent, min(lane_bytes(ephemeral), capacity - persistent)
