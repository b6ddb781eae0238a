"""The dispatcher hands the device from one call to the next (NOTE [Hand-offs]) and lets
an uncontended call through without a scheduler task (NOTE [Uncontended calls])."""

from __future__ import annotations

import threading
import time

import pytest

from timeshare.runtime.dispatch import Dispatcher
from timeshare.scheduler.task import Kind, Priority


class _Counting:
    """Wraps the dispatcher's scheduler: counts submits and steps."""

    def __init__(self, gate: Dispatcher) -> None:
        self.submits = 0
        self.steps = 0
        sched = gate.scheduler
        submit, schedule = sched.submit, sched.schedule

        def counted_submit(task, now):
            self.submits += 1
            return submit(task, now)

        def counted_schedule(now):
            self.steps += 1
            return schedule(now)

        sched.submit = counted_submit  # type: ignore[method-assign]
        sched.schedule = counted_schedule  # type: ignore[method-assign]


def _wait_waiting(gate: Dispatcher, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while gate.scheduler.waiting < n:
        assert time.monotonic() < deadline, f"{n} calls never queued"
        time.sleep(0.002)


@pytest.mark.parametrize("policy", ["priority", "fifo", "edf", "fair", "srtf"])
def test_an_uncontended_call_takes_the_device_without_a_scheduler_task(policy):
    gate = Dispatcher(policy)
    counting = _Counting(gate)
    for _ in range(100):
        with gate.hold("m", Kind.INFERENCE) as turn:
            assert not gate.scheduler.tasks and turn.waited_s == 0.0
    assert counting.submits == 0
    with gate.hold("m", Kind.INFERENCE) as turn:  # the previous user is still reported
        assert turn.previous == (Kind.INFERENCE, "m")


def test_calls_queued_behind_a_holder_run_one_at_a_time_in_policy_order_each_woken_once():
    """16 calls wait behind a holder; each end of a call runs the step once and wakes the
    one call it starts: the steps grow with the calls, not with calls times waiters."""
    gate = Dispatcher("priority")
    order: list[str] = []
    running = [0]
    overlap = [False]

    def call(name: str, priority: Priority) -> None:
        with gate.hold(name, Kind.INFERENCE, priority=priority):
            running[0] += 1
            overlap[0] |= running[0] > 1
            order.append(name)
            time.sleep(0.001)
            running[0] -= 1

    counting = _Counting(gate)
    threads = []
    with gate.hold("holder", Kind.INFERENCE):
        for i in range(16):
            prio = Priority.LATENCY_CRITICAL if i % 2 else Priority.BEST_EFFORT
            t = threading.Thread(target=call, args=(f"c{i}", prio))
            t.start()
            threads.append(t)
            _wait_waiting(gate, i + 1)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert not overlap[0]
    # Latency-critical calls first, each class in arrival order.
    assert order == [f"c{i}" for i in range(1, 16, 2)] + [f"c{i}" for i in range(0, 16, 2)]
    assert counting.submits == 16
    # One step per arrival and one per end: at most 2 per call and the holder's end.
    assert counting.steps <= 2 * 16 + 1, counting.steps
    assert not gate.scheduler.tasks and not gate.sleeping


def test_a_call_arriving_while_an_uncontended_call_holds_waits_for_its_end():
    gate = Dispatcher("fifo")
    entered = threading.Event()
    times: dict[str, float] = {}

    def second() -> None:
        with gate.hold("b", Kind.INFERENCE) as turn:
            times["b_in"] = time.monotonic()
            times["b_waited"] = turn.waited_s
            entered.set()

    with gate.hold("a", Kind.INFERENCE):
        t = threading.Thread(target=second)
        t.start()
        _wait_waiting(gate, 1)
        assert not entered.wait(0.05)  # deferred: nothing starts beside the holder
        times["a_out"] = time.monotonic()
    t.join(30)
    assert entered.is_set() and times["b_in"] >= times["a_out"] and times["b_waited"] > 0.0


def test_an_interrupted_waiter_leaves_no_task_or_waker_behind():
    gate = Dispatcher("priority")

    class Stop(BaseException):
        pass

    def interrupted(task, waiter, timeout):
        raise Stop

    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            with gate.hold("w", Kind.INFERENCE):
                pass
        except Stop as exc:
            raised.append(exc)

    with gate.hold("holder", Kind.INFERENCE):
        gate._wait = interrupted  # type: ignore[method-assign]
        t = threading.Thread(target=waiter)
        t.start()
        t.join(30)
        del gate._wait
        assert len(raised) == 1
        assert not gate.scheduler.tasks and not gate.sleeping
    with gate.hold("after", Kind.INFERENCE) as turn:  # the device is free again
        assert turn.previous == (Kind.INFERENCE, "holder")
