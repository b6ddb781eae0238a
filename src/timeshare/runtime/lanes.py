"""Lanes in the runtime: what a call in a lane runs with beside its memory bound.

# NOTE [Lanes in the runtime]
With ``scheduling="pack"`` the dispatcher's scheduler holds Salus's lanes (NOTE [Salus
lanes]) over ``lane_memory`` bytes; the arena is the persistent region, so an inference
task asks only for ephemeral bytes: its model's measured peak for that input shape with
headroom, or the whole budget until measured: such a call runs alone, then the model is
profiled for its shape (the profile counts the peak; a first load profiles anyway). Tasks of
different lanes run at the same time: a call whose model is resident runs its forward
without the runtime's lock, metered and bounded by its lane (NOTE [Counting ephemeral
bytes]), on its share of the cores; loads, placement, eviction and records stay under
the lock, and a running model cannot be evicted (``ModelEntry.running``). Calls of one
model run one at a time (``ModelEntry.alone``), as Salus runs one iteration per lane.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from timeshare.errors import TimeshareError
from timeshare.memory.ephemeral import EphemeralMeter
from timeshare.runtime.calls import Call
from timeshare.runtime.dispatch import Turn
from timeshare.runtime.residency import ModelEntry
from timeshare.runtime.table import ModelTable
from timeshare.tree import shape_key


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def cpu_share(device: torch.device, running: int) -> Iterator[None]:
    """On the CPU, this thread's operators use its share of the cores while ``running``
    tasks run at once (the setting is per thread; it is put back afterwards)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, cores() // max(1, running)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lanes_call(table: ModelTable, m: ModelEntry, args: tuple, kwargs: dict, strategy: str | None, turn: Turn,
               switched: str | None, lock: threading.RLock, idle: threading.Condition, device: torch.device) -> Call:
    """An inference given its lane (``turn``), with ``lock`` held: metered and bounded by
    the lane; a resident model's forward runs without the lock. Waiters on ``idle`` hear
    when it ends."""
    try:
        if shape_key(args, kwargs) not in m.ephemeral:  # asked for every lane's bytes: it runs alone
            call = table.call(m, args, kwargs, strategy, waited_s=turn.waited_s, switched_from=switched)
            table.profile(m, args, kwargs)  # measures its ephemeral bytes (cached if the load profiled)
            return call
        meter = EphemeralMeter(turn.lane_bytes, task=m.name, lane=turn.lane)
        return table.call(m, args, kwargs, strategy, waited_s=turn.waited_s, switched_from=switched, meter=meter,
                          unlocked=None if turn.nested else unlocked(lock, device, turn.running))
    finally:
        idle.notify_all()


def unlocked(lock: threading.RLock, device: torch.device, running: int) -> Callable[[], AbstractContextManager]:
    """A lane's forward without the runtime's ``lock`` (held once by this thread), on
    its share of the cores."""
    @contextmanager
    def outside() -> Iterator[None]:
        lock.release()
        try:
            with cpu_share(device, running):
                yield
        finally:
            lock.acquire()
    return outside


def wait_idle(idle: threading.Condition, m: ModelEntry, timeout_s: float) -> None:
    """With ``idle``'s lock held: wait until no call runs ``m`` outside the lock."""
    deadline = time.monotonic() + timeout_s
    while m.running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeshareError(f"model {m.name!r} is still running after {timeout_s:g} s",
                                 where=f"waiting for {m.name} to go idle")
        idle.wait(min(left, 0.05))
