"""NOTE [Records outside the lock]: the runtime's records reach its listeners once its lock
is let go for the last time, in order, in the thread that let it go; a listener may take
its time or ask the runtime something without holding up anyone else's call."""

from __future__ import annotations

import threading

import pytest
import torch

import timeshare
from tests import models
from timeshare.runtime.events import EvictionRecord, Outbox, RuntimeLock


def _record(i: int) -> EvictionRecord:
    return EvictionRecord(f"m{i}", i, float(i))


def test_records_wait_for_the_outermost_release_and_come_in_order():
    outbox = Outbox()
    seen: list[str] = []
    outbox.subscribe(lambda r: seen.append(r.model))
    lock = RuntimeLock(outbox)
    with lock:
        with lock:
            outbox.emit(_record(1))
        assert seen == []  # still held once: nothing delivered under it
        outbox.emit(_record(2))
    assert seen == ["m1", "m2"]


def test_a_condition_wait_lets_the_lock_go_whole_and_delivers_first():
    outbox = Outbox()
    lock = RuntimeLock(outbox)
    cond = threading.Condition(lock)  # type: ignore[arg-type]
    delivered = threading.Event()
    outbox.subscribe(lambda r: delivered.set())
    taken = threading.Event()

    def other() -> None:  # gets the lock while the first thread waits, though it held it twice
        with lock:
            taken.set()
            cond.notify_all()

    def free_elsewhere() -> bool:  # whether another thread can take the lock now
        got: list[bool] = []
        probe = threading.Thread(target=lambda: got.append(lock.acquire(blocking=False) and (lock.release() or True)))
        probe.start()
        probe.join(10)
        return got == [True]

    with lock, lock:
        outbox.emit(_record(1))
        worker = threading.Thread(target=other)
        worker.start()
        assert cond.wait_for(taken.is_set, timeout=10)
        assert delivered.is_set()  # the wait let the lock go: the record went then
        assert not free_elsewhere()  # held again after the wait
        lock.release()
        assert not free_elsewhere()  # still held once: as deep as it was
        lock.acquire()
    worker.join(10)
    assert free_elsewhere()


def test_a_failing_listener_is_logged_and_the_others_still_hear(caplog):
    outbox = Outbox()
    seen: list[str] = []
    outbox.subscribe(lambda r: 1 / 0)
    outbox.subscribe(lambda r: seen.append(r.model))
    with RuntimeLock(outbox):
        outbox.emit(_record(3))
    assert seen == ["m3"] and "runtime listener" in caplog.text


@pytest.mark.timeout(60)
def test_a_listener_runs_outside_the_runtimes_lock():
    """A listener that waits for another thread's use of the runtime is not waiting on
    itself: the runtime is not held while it runs. And the caller still finds its call's
    record delivered when the call returns."""
    x = torch.randn(2, 8)
    with timeshare.Runtime(device="cpu", memory="16MiB") as rt:
        rt.register("a", models.out_of_order, None, (x,))
        answered: list[bool] = []

        def listener(record) -> None:
            done = threading.Event()
            other = threading.Thread(target=lambda: (rt.diagnostics(), done.set()))
            other.start()
            answered.append(done.wait(5.0))  # under the lock this would wait out its 5 s
            other.join(10)

        rt.subscribe(listener)
        rt.infer("a", x)
        assert answered == [True]
        rt.evict("a")
        assert answered == [True, True]
