"""Lanes in the runtime: what a call in a lane runs with beside its memory bound.

# NOTE [Lanes in the runtime]
With ``scheduling="pack"`` the dispatcher's scheduler holds Salus's lanes (NOTE [Salus
lanes]) over ``lane_memory`` bytes; the arena is the persistent region, so an inference
task asks only for ephemeral bytes: its model's measured peak for that input shape with
headroom, or until measured all the lane memory free at that moment (all of it when the
device is idle). That first call of a shape runs under the lock and unbounded (a first
load also traces and profiles), and the model is then profiled for the shape (the
profile counts the peak; a first load profiles anyway). A training job asks for what is
free too, measures its state and one iteration's peak at its second iteration, stops at
its next preemption point and, once stopped, is re-admitted with them
(``Dispatcher._resize``, ``_swap``: its first admission counts until its iteration has
ended), as Salus resizes lanes at iteration boundaries; sizes that can never fit fail
the job, its admission still held. Its first iterations are bounded by what was free,
and fail with ``LaneExceededError`` if they need more. A lane another task leaves does
not shrink while a task runs in it: that task's bound is the lane's size. Tasks of
different lanes run at the same time: a call whose model is resident runs its forward
without the runtime's lock, metered and bounded by its lane (NOTE [Counting ephemeral
bytes]), on its share of the cores; loads, placement, eviction and records stay under
the lock, and a running model cannot be evicted (``ModelEntry.running``). Calls of one
model run one at a time (``ModelEntry.alone``), as Salus runs one iteration per lane;
an inference that joins a lane a training job runs in makes the job yield at its next
iteration boundary (``scheduler/preemption.py``'s ``lane_holder``), or an endless job would hold it forever.

# NOTE [Turns in lanes]
A turn (``Runtime.turn``: a language model's prefills and decode steps) holds one lane for
all its calls: it asks for the bytes its caller declares (a language model: its key/value
caches at ``max_sequences`` times ``max_context`` positions, and its profiled prefill's
peak, each with headroom; at most the lanes' capacity), or what is free when it declares
nothing. Every call of the turn runs bounded by that lane, whatever its shape, so the
whole cache a step builds counts against it; a call that asks for more fails alone with
``LaneExceededError`` (a prefill: its sequence; a decode step: the batch). Its forwards
run without the runtime's lock beside the other lanes' tasks; its caches between turns
are the model's own (NOTE [Key/value caches under pressure]).

On the CPU a lane's forward uses a fixed number of cores (``lane_threads``), never one
that depends on how many lanes are busy: kernels pick their blocking by thread count,
so a share that followed the load would change a model's output bits with the load.
With workers, each lane's call runs in a worker process of its own (at most one per
worker at a time), so lanes do not share an interpreter lock; in-process, they are
threads, and the metering of every operator serialises on the lock (so only the calls
of NOTE [Measured shapes run unmetered] are metered).

# NOTE [Measured shapes run unmetered]
Metering a forward costs Python per operator (NOTE [Counting ephemeral bytes]); in
lanes that share an interpreter lock it was most of PACK's cost. So a model's calls of
an input shape are metered only until the shape's peak is known: its first call
(alone, unbounded, profiled) and then ``CONFIRMING_CALLS`` calls bounded by their lanes
whose peaks do not raise the measured one. After those, its calls run unmetered
(``LaneBound.metered`` False): the lane it is admitted to (its measured peak with
headroom) is its bound, kept by admission, and on CUDA checked by the allocator's pool
(NOTE [Lane pools]). A model whose memory depends on its inputs' values, not only their
shapes, raises its peak or fails its lane while confirming, which starts the count
again: such a shape stays metered and bounded per operator. A turn's calls are always
metered: their shapes change at every step.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

from timeshare.decode.step import Step
from timeshare.errors import LaneExceededError, TimeshareError
from timeshare.memory.ephemeral import LaneBound, lane_bytes
from timeshare.runtime.calls import Call
from timeshare.runtime.events import RuntimeLock
from timeshare.runtime.residency import ModelEntry
from timeshare.runtime.table import ModelTable
from timeshare.runtime.turns import Grant
from timeshare.tree import shape_key


def lane_ask(m: ModelEntry, key: str, free: Callable[[], int]) -> int:
    """The bytes a call of ``m`` on inputs of shape ``key`` asks its lane for: its
    measured peak with headroom, or until measured all the lane memory ``free()`` says
    is free now (asked only then: it takes the dispatcher's lock)."""
    peak = m.ephemeral.get(key)
    return free() if peak is None else lane_bytes(peak)


def lanes_call(table: ModelTable, m: ModelEntry, args: tuple, kwargs: dict, strategy: str | None, grant: Grant,
               switched: str | None, lock: RuntimeLock, idle: threading.Condition, threads: int,
               key: str | None = None) -> Call:
    """An inference given its lane (``grant``), with ``lock`` held: metered and bounded by
    the lane; a resident model's forward runs without the lock. Waiters on ``idle`` hear
    when it ends. ``key``: the inputs' shape key, when the caller has it."""
    try:
        key = shape_key(args, kwargs) if key is None else key
        known = m.ephemeral.get(key)
        if known is None:
            # Its first call of this shape, under the lock, on the lane's cores but not
            # bounded: a first load also traces and profiles. The profile measures it.
            first = LaneBound(m.name, grant.lane, None, threads)
            call = table.call(m, args, kwargs, strategy, waited_s=grant.waited_s, switched_from=switched, lane=first)
            table.profile(m, args, kwargs)  # cached if the load profiled
            return call
        seen = confirmed.of(m)
        metered = seen.get(key, 0) < CONFIRMING_CALLS  # NOTE [Measured shapes run unmetered]
        lane = LaneBound(m.name, grant.lane, grant.lane_bytes, threads, metered)
        try:
            call = table.call(m, args, kwargs, strategy, waited_s=grant.waited_s, switched_from=switched, lane=lane,
                              unlocked=None if grant.nested else unlocked(lock))
        except LaneExceededError:
            seen[key] = 0
            raise
        if metered:
            seen[key] = seen.get(key, 0) + 1 if m.ephemeral.get(key, 0) <= known else 0
        return call
    finally:
        idle.notify_all()


CONFIRMING_CALLS = 2  # bounded, metered calls whose peaks confirm a shape's measured one


class Confirmations:
    """Per model, how many metered calls of each input shape have confirmed its measured
    peak in a row (NOTE [Measured shapes run unmetered]). Read and written with the
    runtime's lock held; a model's counts go with its entry (a model registered again
    under the same name starts over)."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[weakref.ref, dict[str, int]]] = {}

    def of(self, m: ModelEntry) -> dict[str, int]:
        found = self._of.get(id(m))
        if found is not None and found[0]() is m:
            return found[1]
        counts: dict[str, int] = {}
        key = id(m)
        self._of[key] = (weakref.ref(m, lambda _ref: self._of.pop(key, None)), counts)
        return counts

    def trusted(self, m: ModelEntry, key: str) -> bool:
        """Whether ``m``'s calls on inputs of shape ``key`` run unmetered now."""
        return self.of(m).get(key, 0) >= CONFIRMING_CALLS


confirmed = Confirmations()


def turn_call(table: ModelTable, m: ModelEntry, args: tuple, kwargs: dict, grant: Grant, lock: RuntimeLock,
              idle: threading.Condition, threads: int, step: Step | None = None) -> Call:
    """A call inside a turn that holds a lane (a language model's step, NOTE [Turns in
    lanes]), with ``lock`` held: bounded by the turn's lane whatever its shape; a resident
    model's forward runs without the lock."""
    try:
        lane = LaneBound(m.name, grant.lane, grant.lane_bytes, threads)
        return table.call(m, args, kwargs, None, waited_s=0.0, switched_from=None, lane=lane,
                          unlocked=unlocked(lock), keep_peak=False, step=step)
    finally:
        idle.notify_all()


def unlocked(lock: RuntimeLock) -> Callable[[], AbstractContextManager]:
    """A lane's forward without the runtime's ``lock`` (held once by this thread)."""
    return _Outside(lock).again


class _Outside:
    """The runtime's lock released for a block, taken back after it."""

    __slots__ = ("lock",)

    def __init__(self, lock: RuntimeLock) -> None:
        self.lock = lock

    def again(self) -> _Outside:
        return self

    def __enter__(self) -> None:
        self.lock.release()

    def __exit__(self, *exc) -> None:
        self.lock.acquire()


def wait_idle(idle: threading.Condition, m: ModelEntry, timeout_s: float) -> None:
    """With ``idle``'s lock held: wait until no call runs ``m`` outside the lock."""
    deadline = time.monotonic() + timeout_s
    while m.running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeshareError(f"model {m.name!r} is still running after {timeout_s:g} s",
                                 where=f"waiting for {m.name} to go idle")
        idle.wait(min(left, 0.05))
