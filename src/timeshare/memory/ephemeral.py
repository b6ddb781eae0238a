"""Ephemeral memory: the bytes one request or training iteration allocates beyond its
persistent weights and state, counted as it runs, and the bound of a memory lane.

# NOTE [Counting ephemeral bytes]
A meter is a dispatch mode: every operator's outputs pass through it. An output whose
storage is new (not one of the operator's inputs: views and in-place results share
theirs) is counted live until its storage is freed, through a finalizer on the storage.
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
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from timeshare.errors import LaneExceededError

LANE_HEADROOM = 1.25  # a lane is the profiled peak times this (allocator rounding, small variations)


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
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()  # finalizers run in whichever thread frees the storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = storage.data_ptr()
            if nbytes == 0 or key in self._sizes:
                continue
            if inputs is None:
                inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, torch.Tensor)}
            if key in inputs:
                continue
            with self._lock:
                self._sizes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                over = self.limit is not None and self.live > self.limit
            weakref.finalize(storage, self._freed, key)
            if over:
                assert self.limit is not None
                raise LaneExceededError(self.task, self.lane, self.limit, self.live)
        return out

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)


def lane_bytes(peak: int) -> int:
    """The lane a task with this measured peak asks for."""
    return int(peak * LANE_HEADROOM)
