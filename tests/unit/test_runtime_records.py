"""NOTE [Records outside the lock]: the runtime's records reach its listeners once its lock
is let go for the last time, in order, in the thread that let it go; a listener may take
its time or ask the runtime something without holding up anyone else's call."""

from __future__ import annotations

import threading

import pytest
import torch

import timeshare
from tests import models
from timeshare.runtime import events
from timeshare.runtime.events import CallRecord, EvictionRecord, Outbox, RuntimeLock


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


def test_a_caller_finds_its_record_delivered_though_another_thread_was_delivering():
    """Another thread is in a listener on this thread's record when this thread lets the
    lock go: the release waits until that record is through."""
    outbox = Outbox()
    lock = RuntimeLock(outbox)
    seen: list[str] = []
    made, handling = threading.Event(), threading.Event()

    def listener(record) -> None:
        if record.model == "m1":
            assert made.wait(10)  # the first deliverer is still at work when m2 is made
        else:
            handling.set()
            threading.Event().wait(0.3)
        seen.append(record.model)

    outbox.subscribe(listener)
    first = threading.Thread(target=lambda: (lock.acquire(), outbox.emit(_record(1)), lock.release()))
    first.start()
    with lock:
        outbox.emit(_record(2))
        made.set()
        assert handling.wait(10)  # m2 is out of the queue, in the other thread's listener
    assert seen == ["m1", "m2"]  # delivered, in order, by the time this thread's release returned
    first.join(10)


@pytest.mark.timeout(60)
def test_a_listener_holds_neither_the_lock_nor_the_device():
    """A listener that waits for another thread's inference is not waiting on itself:
    neither the runtime's lock nor the device's turn is held while it runs."""
    x = torch.randn(2, 8)
    with timeshare.Runtime(device="cpu", memory="16MiB") as rt:
        rt.register("a", models.out_of_order, None, (x,))
        rt.register("b", models.out_of_order, None, (x,))
        answered: list[bool] = []
        seen: list[str] = []

        def listener(record) -> None:
            seen.append(record.model)
            if isinstance(record, CallRecord) and record.model == "a" and not answered:
                done = threading.Event()
                other = threading.Thread(target=lambda: (rt.infer("b", x), done.set()))
                other.start()
                answered.append(done.wait(20))  # under the lock or the device's turn: never
                other.join(20)

        rt.subscribe(listener)
        rt.infer("a", x)
        assert answered == [True] and seen == ["a", "b"]


@pytest.mark.timeout(30)
def test_a_listener_may_call_the_runtime_from_its_own_thread(monkeypatch):
    """Its call's record comes after the one it handles, without the call waiting for a
    delivery its own thread is in the middle of (the wait for another deliverer is made
    far longer than the test may take)."""
    monkeypatch.setattr(events, "DELIVERY_WAIT_S", 600.0)
    x = torch.randn(2, 8)
    with timeshare.Runtime(device="cpu", memory="16MiB") as rt:
        rt.register("a", models.out_of_order, None, (x,))
        rt.register("b", models.out_of_order, None, (x,))
        seen: list[str] = []

        def listener(record) -> None:
            seen.append(record.model)
            if isinstance(record, CallRecord) and record.model == "a":
                rt.infer("b", x)

        rt.subscribe(listener)
        rt.infer("a", x)
        assert seen == ["a", "b"]
