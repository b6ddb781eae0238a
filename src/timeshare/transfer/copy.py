"""Copy engines: move byte ranges of a host store into the arena, group by group,
with one completion signal per group. Run in the process that owns the arena.

- CUDA: every group's copy is queued back-to-back on a dedicated copy stream from
  pinned memory, each followed by an event. The compute side waits with
  ``stream.wait_event``: a device-side dependency, no host synchronize.
- CPU: a copy thread takes loads from a FIFO queue, copies each group and sets a
  ``threading.Event``; the compute side waits on it with a deadline.

# NOTE [Arena reuse ordering]
A load may overwrite bytes that an evicted model's kernels are still reading (CUDA
runs asynchronously). Before queuing a load, the copy stream waits on the current
stream, so the copies start only after all compute queued there, and on the last-use
event of every model evicted since the previous load, which covers forwards run on
other streams. Copies on the one copy stream (or the one copy thread) run in FIFO
order, so a later load never races an earlier one's tail. On the CPU backend a copy
that missed its deadline may still be writing: its block is quarantined until done.

# NOTE [Events made once per plan]
Making a CUDA event costs host time on the switch path, once per group. So a caller
that loads the same ranges again (a model's load plan) passes a ``LoadEvents`` that
the first load fills and every later load re-records. This is safe because
``stream.wait_event`` (and the cudaStreamWaitEvent under it) waits for the record
that was latest *when it was called*: a wait already queued for an earlier load is not
moved by a later record. And a plan is loaded again only after its previous load was
waited for in full (the model was released in between, and a load is per model), so no
one still needs the old records. What a later record does change is ``done()`` and
``copy_seconds()`` of an earlier handle of the same plan: they describe the latest load
of that plan, and only the latest handle is ever asked. The CPU engine makes its
``threading.Event``s per load (a load that missed its deadline may still be setting
them) and ignores ``LoadEvents``; its per-group host cost is a microsecond.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from timeshare.errors import PipelineError

log = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, end) in bytes
Piece = tuple[int, int, int]  # (source, start, end): those bytes of a shared source, see SharedCopies
Ready = Callable[[int], None]  # blocks until the source's bytes before the given one are in

CYCLES_PER_S = 2e9  # torch.cuda._sleep spins for clock cycles; 2 GHz is about an H100's


@dataclass(frozen=True)
class SharedCopies:
    """The bytes of a load that come from host stores other than the model's own
    (NOTE [Shared tensors]): ``sources`` are (host buffer, arena region) pairs laid out
    alike, ``pieces[k]`` the ranges of them group k copies before its own range, so that
    group k's completion covers both."""

    sources: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    pieces: tuple[tuple[Piece, ...], ...]

    def copy(self, k: int, non_blocking: bool = False) -> None:
        for i, a, b in self.pieces[k]:
            src, dst = self.sources[i]
            dst[a:b].copy_(src[a:b], non_blocking=non_blocking)


class LoadEvents:
    """Device events of one plan's loads, made by its first CUDA load and re-recorded by
    every later one (see NOTE [Events made once per plan]). Unused on the CPU backend."""

    def __init__(self) -> None:
        self.begin: torch.cuda.Event | None = None  # recorded before the first copy; times the load
        self.groups: list[torch.cuda.Event] = []  # one per group, recorded after its copy

    def fit(self, n_groups: int) -> None:
        """Make the events if this is the first load (or the ranges changed in number)."""
        if self.begin is None or len(self.groups) != n_groups:
            self.begin = torch.cuda.Event(enable_timing=True)
            # Only the last group's event times the load: timing makes events slower.
            self.groups = [torch.cuda.Event(enable_timing=k == n_groups - 1) for k in range(n_groups)]


class LoadHandle:
    """One in-flight load: ``wait(k)`` makes the compute side wait for group k."""

    n_groups: int
    where: str

    def wait(self, k: int) -> None:
        raise NotImplementedError

    def wait_all(self) -> None:
        self.wait(self.n_groups - 1)

    def done(self) -> bool:
        raise NotImplementedError

    def copy_seconds(self) -> float | None:
        """How long the copies took from the first start to the last arrival, once done."""
        return None


class CopyEngine:
    """Starts loads; one engine per arena."""

    host_waits: bool = True  # whether the compute side waits on the host (vs. on the device)
    device_timed: bool = False  # whether copy_seconds() is read from device events (no host time in it)

    def start(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        ranges: Sequence[Range],
        where: str,
        fences: Sequence = (),
        events: LoadEvents | None = None,
        ready: Ready | None = None,
        shared: SharedCopies | None = None,
        deadline_s: float | None = None,
    ) -> LoadHandle:
        """Queue the copies of ``ranges`` from ``src`` to ``dst``; ``fences`` are CUDA events
        the copies must wait for (the last uses of evicted models); ``events`` are kept
        across loads of the same ranges (NOTE [Events made once per plan]); ``ready(b)``
        returns once ``src`` holds its bytes before ``b`` (NOTE [Disk to device]);
        ``shared``: each group's pieces of other stores, copied before its range;
        ``deadline_s``: how long a host wait for one group may take, where not the
        engine's own (a load the user's ``load_timeout_s`` does not govern)."""
        raise NotImplementedError

    def hold(self, seconds: float) -> None:
        """The copies queued next start no earlier than ``seconds`` from now, so that a
        probe can queue many groups before the first one runs. A no-op where copies
        cannot be held (the CPU copy thread)."""

    def close(self) -> None:
        pass


def make_copy_engine(device: torch.device, deadline_s: float = 60.0, delay_s: float = 0.0) -> CopyEngine:
    """The copy engine of ``device``. ``delay_s`` is a diagnostic (NOTE [Poisoned
    reloads]): every group's copy starts that much later, on the copy thread or on the
    device's copy stream, so that a compute that does not wait for its group surely
    runs before the group arrives."""
    if delay_s < 0:
        raise ValueError(f"delay_s must not be negative, got {delay_s}")
    if device.type == "cuda":
        return CudaCopyEngine(device, delay_s)
    return CpuCopyEngine(deadline_s, delay_s)


# --- CPU -------------------------------------------------------------------------------


class CpuLoad(LoadHandle):
    """One load on the CPU copy thread. ``copy_group`` is its one copy step (tests
    replace it to inject a failed or a stuck copy)."""

    def __init__(self, src, dst, ranges: Sequence[Range], where: str, deadline_s: float, delay_s: float = 0.0,
                 ready: Ready | None = None, shared: SharedCopies | None = None):
        self.src, self.dst, self.ranges = src, dst, list(ranges)
        self.ready = ready
        self.shared = shared
        self.delay_s = delay_s
        self.n_groups = len(self.ranges)
        self.where = where
        self.deadline_s = deadline_s
        self.events = [threading.Event() for _ in self.ranges]
        self.error: BaseException | None = None
        self.failed_group: int | None = None
        self._started = self._ended = 0.0

    def run(self) -> None:
        """Executed on the copy thread."""
        self._started = time.perf_counter()
        for k in range(self.n_groups):
            try:
                self.copy_group(k)
            except BaseException as exc:  # handed to the waiter, which re-raises it
                self.error, self.failed_group = exc, k
                self.src = self.dst = self.shared = None
                for ev in self.events[k:]:
                    ev.set()
                return
            if k == self.n_groups - 1:
                self._ended = time.perf_counter()
            self.events[k].set()
        self.src = self.dst = self.shared = None  # drop references once everything is copied

    def copy_seconds(self) -> float | None:
        return self._ended - self._started if self._ended else None

    def copy_group(self, k: int) -> None:
        a, b = self.ranges[k]
        if self.ready is not None:
            self.ready(b)  # NOTE [Disk to device]: the source bytes are read from disk up to here
        if self.delay_s:
            time.sleep(self.delay_s)  # diagnostic: NOTE [Poisoned reloads]
        if self.shared is not None:
            self.shared.copy(k)
        self.dst[a:b].copy_(self.src[a:b])

    def wait(self, k: int) -> None:
        if not self.events[k].wait(self.deadline_s):
            raise PipelineError(
                f"group {k} of {self.n_groups} did not arrive within {self.deadline_s:g} s", where=self.where
            )
        if self.error is not None and self.failed_group is not None and self.failed_group <= k:
            raise PipelineError(
                f"copying group {self.failed_group} failed: {self.error!r}",
                where=f"{self.where}, group {self.failed_group}",
            ) from self.error

    def done(self) -> bool:
        return self.events[-1].is_set() if self.events else True


class CpuCopyEngine(CopyEngine):
    """A copy thread standing in for CUDA's copy engine."""

    def __init__(self, deadline_s: float = 60.0, delay_s: float = 0.0):
        self.deadline_s = deadline_s
        self.delay_s = delay_s
        self._queue: queue.Queue[CpuLoad | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="timeshare-copy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            load = self._queue.get()
            if load is None:
                return
            load.run()

    def start(self, src, dst, ranges, where, fences=(), events=None, ready=None, shared=None, deadline_s=None):
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        load = CpuLoad(src, dst, ranges, where, deadline_s, self.delay_s, ready, shared)
        if not self._thread.is_alive():
            raise PipelineError("the copy thread is not running (engine closed?)", where=where)
        self._queue.put(load)
        return load

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.deadline_s)
            if self._thread.is_alive():
                log.warning("copy thread did not stop within %.0f s", self.deadline_s)


# --- CUDA ------------------------------------------------------------------------------


class _CudaLoad(LoadHandle):
    def __init__(self, device, events, where: str, keep, begin=None):
        self.device = device
        self.events = events
        self.n_groups = len(events)
        self.where = where
        self._keep = keep  # the source and destination must outlive the queued copies
        self._begin = begin

    def wait(self, k: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[k])

    def done(self) -> bool:
        finished = self.events[-1].query() if self.events else True
        if finished:  # the copies are over: give the source and destination back
            self._keep = None
        return finished

    def copy_seconds(self) -> float | None:
        if self._begin is None or not self.done():
            return None
        return self._begin.elapsed_time(self.events[-1]) / 1e3


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated stream; per-group events for device-side waits."""

    host_waits = False
    device_timed = True

    def __init__(self, device: torch.device, delay_s: float = 0.0):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # Diagnostic (NOTE [Poisoned reloads]): a device-side spin before each group's copy.
        self._delay_cycles = int(delay_s * CYCLES_PER_S)

    def hold(self, seconds: float) -> None:
        # A spin on the current stream, which the next load's copy stream waits for
        # (NOTE [Arena reuse ordering]); its begin event is recorded after the spin.
        if seconds > 0:
            with torch.cuda.device(self.device):
                torch.cuda._sleep(int(seconds * CYCLES_PER_S))

    def start(self, src, dst, ranges, where, fences=(), events=None, ready=None, shared=None, deadline_s=None):
        if ready is not None and ranges:
            # NOTE [Disk to device]: on CUDA the reads are waited for in full before the
            # copies are queued (queueing each group behind its read needs a feeder
            # thread and device-side waits that have not run on a GPU yet).
            ready(ranges[-1][1])
        if not src.is_pinned():
            log.warning("%s: host store is not pinned; copies will not overlap compute", where)
        events = LoadEvents() if events is None else events
        events.fit(len(ranges))  # see NOTE [Events made once per plan]
        groups = events.groups
        # See NOTE [Arena reuse ordering].
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for fence in fences:
            self.stream.wait_event(fence)
        # The device too: leaving a stream context sets the previous device back, and for
        # a runtime on cuda:N whose caller is on another device that must be the caller's.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            events.begin.record(self.stream)
            for k, (a, b) in enumerate(ranges):
                if self._delay_cycles:
                    torch.cuda._sleep(self._delay_cycles)
                if shared is not None:
                    shared.copy(k, non_blocking=True)
                dst[a:b].copy_(src[a:b], non_blocking=True)
                groups[k].record(self.stream)
        return _CudaLoad(self.device, groups, where, (src, dst, shared), events.begin)
