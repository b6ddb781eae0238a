"""The scheduler step function, driven by hand with explicit times: each policy's
decisions on small timelines worked out in advance, the bookkeeping (batching, hold,
withdraw, service), and a seeded random run checking invariants after every step."""

import math
import random

import pytest

from timeshare.errors import ConfigError, MemoryBudgetError
from timeshare.scheduler import (
    POLICIES,
    Failed,
    Finished,
    Kind,
    Preempt,
    Priority,
    Progress,
    Run,
    Scheduler,
    State,
    Stopped,
    Task,
    make_policy,
)

LC, BE = Priority.LATENCY_CRITICAL, Priority.BEST_EFFORT


def train(i, work=10.0, unit_s=1.0, **kw) -> Task:
    return Task(i, Kind.TRAINING, "train", 0.0, work, unit_s, **kw)


def infer(i, model="m", unit_s=0.1, **kw) -> Task:
    return Task(i, Kind.INFERENCE, model, 0.0, 1.0, unit_s, **kw)


def step(s: Scheduler, now: float) -> list:
    """Decisions as ("run", id) / ("run", (ids of a batch)) / ("preempt", id)."""
    out = []
    for d in s.schedule(now):
        if isinstance(d, Run):
            ids = tuple(t.id for t in d.tasks)
            out.append(("run", ids if len(ids) > 1 else ids[0]))
        else:
            assert isinstance(d, Preempt)
            out.append(("preempt", d.task.id))
    return out


def submit(s: Scheduler, now: float, *tasks: Task) -> None:
    for t in tasks:
        s.submit(t, now)


# ---------------------------------------------------------------------- FIFO
def test_fifo_runs_in_arrival_order_without_preemption():
    s = Scheduler("fifo")
    submit(s, 0.0, train(1), train(2))
    submit(s, 0.5, train(3, work=1))
    assert step(s, 0.5) == [("run", 1)]
    assert step(s, 0.5) == []
    assert step(s, 100.0) == []  # no time slice: 1 keeps the device however long 2 and 3 wait
    assert s.next_wakeup(100.0) is None
    s.update(Finished(1, 101.0))
    assert step(s, 101.0) == [("run", 2)]
    s.update(Finished(2, 111.0))
    assert step(s, 111.0) == [("run", 3)]
    s.update(Finished(3, 112.0))
    assert step(s, 112.0) == [] and s.tasks == {} and s.preemptions == 0


def test_fifo_time_slice_preempts_only_after_the_slice_and_only_if_someone_waits():
    s = Scheduler("fifo", quantum_s=2.0)
    submit(s, 0.0, train(1))
    assert step(s, 0.0) == [("run", 1)]
    assert s.next_wakeup(0.0) is None  # nobody waits
    assert step(s, 3.0) == []  # slice over, but nobody waits
    s2 = Scheduler("fifo", quantum_s=2.0)
    submit(s2, 0.0, train(1))
    assert step(s2, 0.0) == [("run", 1)]
    submit(s2, 1.0, train(2))
    assert step(s2, 1.0) == []
    # The end of the running slice, strictly after now (also at a boundary).
    assert s2.next_wakeup(1.0) == 2.0
    assert s2.next_wakeup(2.0) == 4.0
    assert s2.next_wakeup(3.0) == 4.0
    assert step(s2, 1.999) == []
    assert step(s2, 2.0) == [("preempt", 1), ("run", 2)]
    assert s2.next_wakeup(2.0) is None  # 1 is stopping, nobody waits yet
    s2.update(Stopped(1, 2.5, done=2))
    assert s2.next_wakeup(2.5) == 4.0  # 2's slice began at 2.0
    assert step(s2, 3.9) == []
    assert step(s2, 4.0) == [("preempt", 2), ("run", 1)]
    s2.update(Stopped(2, 4.0, done=2))
    assert s2.tasks[1].done == 2 and s2.tasks[1].preemptions == 1 and s2.preemptions == 2


# ---------------------------------------------------------------------- SRTF
def test_srtf_shorter_arrival_preempts_in_the_same_step():
    s = Scheduler("srtf")
    submit(s, 0.0, train(1, work=10))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 2.0, train(2, work=3))  # 3 s left against 10 - 2 = 8
    assert step(s, 2.0) == [("preempt", 1), ("run", 2)]
    assert s.tasks[1].state is State.STOPPING
    submit(s, 2.5, train(3, work=1))  # shorter still, but one preemption at a time
    assert step(s, 2.5) == []
    s.update(Stopped(1, 3.0, done=3))
    # Now 3 (1 s) beats the running 2 (3 - (3.0 - 2.0) = 2 s left).
    assert step(s, 3.0) == [("preempt", 2), ("run", 3)]
    s.update([Stopped(2, 3.0, done=1), Finished(3, 4.0)])
    # Remaining: 2 has 3 - 1 = 2 s, 1 has 10 - 3 = 7 s.
    assert step(s, 4.0) == [("run", 2)]
    s.update(Finished(2, 6.0))
    assert step(s, 6.0) == [("run", 1)]
    assert s.tasks[1].remaining_s(6.0) == 7.0


@pytest.mark.parametrize("slots", [math.inf, 2])
def test_srtf_with_lanes_preempts_the_holder_of_the_lane_the_best_task_waits_for(slots):
    # Packed SRTF: 1 holds lane 0, 3 lane 1; 2 (shortest) joins lane 0. Preempting 3 (the
    # longest) would not let 2 start (with two slots, it frees a slot 2 cannot use), and 3
    # would start again at once: a livelock at one instant. The victim is 1, which holds
    # 2's lane.
    s = Scheduler("srtf", capacity=12, slots=slots)
    submit(s, 0.0, train(1, work=100, persistent=1, ephemeral=8), train(3, work=200, persistent=1, ephemeral=1))
    assert sorted(step(s, 0.0)) == [("run", 1), ("run", 3)]
    submit(s, 1.0, train(2, work=5, persistent=1, ephemeral=3))
    for _ in range(3):  # whatever is reported at this instant, 3 is never the victim
        decisions = step(s, 1.0)
        assert s.tasks[2].lane == 0  # admitted, joining 1's lane
        assert ("preempt", 3) not in decisions
        for kind, task_id in decisions:
            if kind == "preempt":
                s.update(Stopped(task_id, 1.0, done=1))
    assert s.tasks[2].state is State.RUNNING and s.tasks[3].state is State.RUNNING
    assert s.tasks[1].state is State.WAITING and s.tasks[1].preemptions == 1


def test_srtf_equal_remaining_does_not_preempt_and_startup_counts():
    s = Scheduler("srtf")
    submit(s, 0.0, train(1, work=10))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 2.0, train(2, work=8))  # 8 against 10 - 2 = 8: a tie keeps the runner
    assert step(s, 2.0) == []
    submit(s, 2.0, train(3, work=5, startup_s=4.0))  # 5 + 4 = 9 > 8
    assert step(s, 2.0) == []
    assert step(s, 2.5) == []  # the runner's remaining time only shrinks: 7.5 < 8
    s.update(Finished(1, 10.0))
    assert step(s, 10.0) == [("run", 2)]  # 8 s before 5 iterations + 4 s start-up
    s.update(Finished(2, 18.0))
    assert step(s, 18.0) == [("run", 3)]


# ---------------------------------------------------------------------- PACK
def test_pack_runs_what_the_lanes_allow_and_starts_the_rest_as_tasks_finish():
    s = Scheduler("pack", capacity=10)
    assert s.slots == math.inf
    submit(s, 0.0, *(train(i, persistent=2, ephemeral=3) for i in (1, 2, 3)))
    decisions = s.schedule(0.0)
    assert [(d.task.id, d.lane) for d in decisions] == [(1, 0), (2, 1)]  # 3: 6 + 6 + 3 > 10
    assert s.waiting == 1 and s.tasks[3].state is State.WAITING
    assert step(s, 1.0) == []
    s.update(Finished(1, 5.0))
    decisions = s.schedule(5.0)
    assert [(d.task.id, d.lane) for d in decisions] == [(3, 2)]
    assert s.lanes.used == 10 and s.lanes.safe()


def test_pack_task_in_a_busy_lane_waits_and_later_arrivals_may_start():
    s = Scheduler("pack", capacity=12)
    submit(s, 0.0, train(1, persistent=1, ephemeral=8))
    submit(s, 0.0, train(2, persistent=1, ephemeral=3))  # joins 1's lane (new: 2 + 8 + 3 > 12)
    submit(s, 0.0, train(3, persistent=1, ephemeral=1))  # new lane: 3 + 8 + 1 = 12
    assert [(d.task.id, d.lane) for d in s.schedule(0.0)] == [(1, 0), (3, 1)]
    assert s.tasks[2].lane == 0 and s.lanes.lanes[0].busy == 1
    s.update(Finished(3, 1.0))
    assert step(s, 1.0) == []  # lane 0 is still busy
    s.update(Finished(1, 2.0))
    assert [(d.task.id, d.lane) for d in s.schedule(2.0)] == [(2, 0)]
    assert s.lanes.lanes[0].size == 3


@pytest.mark.parametrize("slots", [None, 2])  # 2: worker processes
def test_pack_an_inference_in_a_training_jobs_lane_makes_the_job_yield_at_its_next_iteration(slots):
    # An endless job holds lane 0; the request fits no new lane and joins it: the job
    # yields (at its next iteration boundary), the request runs, then the job again.
    s = Scheduler("pack", capacity=10, slots=slots)
    submit(s, 0.0, train(1, work=math.inf, persistent=2, ephemeral=6))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 1.0, infer(2, ephemeral=4))  # new lane: 2 + 6 + 4 > 10; joins lane 0
    assert step(s, 1.0) == [("preempt", 1)]
    s.update(Stopped(1, 1.5, done=3.0))
    assert step(s, 1.5) == [("run", 2)] and s.tasks[2].lane == 0
    s.update(Finished(2, 1.6))
    assert step(s, 1.6) == [("run", 1)] and s.lanes.safe()


# ---------------------------------------------------------------------- FAIR
def test_fair_round_robin():
    s = Scheduler("fair")
    assert s.quantum_s == 1.0
    submit(s, 0.0, train(1), train(2), train(3))
    assert step(s, 0.0) == [("run", 1)]
    order = [1]
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        assert s.next_wakeup(now - 0.5) == now
        d = step(s, now)
        assert d[0] == ("preempt", order[-1]) and d[1][0] == "run" and len(d) == 2
        s.update(Stopped(order[-1], now, done=s.tasks[order[-1]].done + 1))
        order.append(d[1][1])
    assert order == [1, 2, 3, 1, 2, 3]
    assert [s.tasks[i].service for i in (1, 2, 3)] == [2.0, 2.0, 1.0]


# ---------------------------------------------------------------------- priority
def test_priority_latency_critical_preempts_best_effort_training_in_one_step():
    s = Scheduler("priority")
    submit(s, 0.0, train(1, priority=BE))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 1.0, infer(2, priority=LC))
    assert step(s, 1.0) == [("preempt", 1), ("run", 2)]
    s.update(Stopped(1, 1.5, done=1))
    submit(s, 1.5, train(3, priority=BE))
    assert step(s, 1.5) == []
    s.update(Finished(2, 2.0))
    assert step(s, 2.0) == [("run", 1)]  # 1 rejoined at 1.5, before 3
    s.update(Finished(1, 3.0))
    assert step(s, 3.0) == [("run", 3)]


def test_priority_never_preempts_inference():
    s = Scheduler("priority")
    submit(s, 0.0, infer(1, priority=BE))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 0.1, infer(2, priority=LC), train(3, priority=LC))
    assert step(s, 0.1) == []
    s.update(Finished(1, 0.2))
    assert step(s, 0.2) == [("run", 2)]  # LC inference, then LC training (arrival order)
    s.update(Finished(2, 0.3))
    assert step(s, 0.3) == [("run", 3)]


# ---------------------------------------------------------------------- EDF
def test_edf_earliest_deadline_first_and_preemption():
    s = Scheduler("edf")
    submit(s, 0.0, train(1, work=2), infer(2, deadline=10.0), infer(3, deadline=5.0), infer(4, deadline=7.0))
    got = []
    now = 0.0
    while s.tasks:
        d = step(s, now)
        assert len(d) == 1 and d[0][0] == "run"
        got.append(d[0][1])
        now += 1.0
        s.update(Finished(d[0][1], now))
    assert got == [3, 4, 2, 1]
    # Training without a deadline yields to a request with one; a later deadline does not preempt.
    submit(s, 10.0, train(5, deadline=30.0))
    assert step(s, 10.0) == [("run", 5)]
    submit(s, 11.0, infer(6, deadline=40.0))
    assert step(s, 11.0) == []
    submit(s, 12.0, infer(7, deadline=20.0))
    assert step(s, 12.0) == [("preempt", 5), ("run", 7)]


# ---------------------------------------------------------------------- configuration and errors
def test_unknown_policy_lists_the_known_ones():
    assert sorted(POLICIES) == ["edf", "fair", "fifo", "pack", "priority", "srtf"]
    with pytest.raises(ConfigError) as info:
        make_policy("nope")
    for name in POLICIES:
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="nope"):
        Scheduler("nope")
    assert make_policy("SRTF").name == "srtf"
    for field, value in (("capacity", 0), ("slots", 0), ("quantum_s", 0.0), ("max_batch", 0)):
        with pytest.raises(ConfigError, match=rf"^{field} must be .*, got {value}$"):
            Scheduler("fifo", **{field: value})


def test_task_larger_than_the_device_is_refused():
    s = Scheduler("fifo", capacity=10)
    with pytest.raises(MemoryBudgetError, match="task 1"):
        s.submit(train(1, persistent=6, ephemeral=5), 0.0)
    assert s.tasks == {} and s.waiting == 0
    s.submit(train(2, persistent=5, ephemeral=5), 0.0)  # exactly the capacity
    assert step(s, 0.0) == [("run", 2)]
    with pytest.raises(ConfigError, match="already scheduled"):
        s.submit(train(2), 0.0)


def test_batches_waiting_requests_of_one_model_in_arrival_order():
    s = Scheduler("fifo", max_batch=3)
    submit(s, 0.0, train(0, work=1))
    assert step(s, 0.0) == [("run", 0)]
    for i, model in enumerate("abaaa", start=1):  # 1 a, 2 b, 3 a, 4 a, 5 a
        s.submit(infer(i, model), float(i))
    s.update(Finished(0, 6.0))
    d = s.schedule(6.0)
    assert len(d) == 1 and [t.id for t in d[0].tasks] == [1, 3, 4]
    assert all(s.tasks[i].state is State.RUNNING for i in (1, 3, 4))
    assert s.waiting == 2
    s.update([Finished(i, 7.0) for i in (1, 3, 4)])
    assert step(s, 7.0) == [("run", 2)]  # b arrived before the last a, and alone
    s.update(Finished(2, 8.0))
    assert step(s, 8.0) == [("run", 5)]
    s.update(Finished(5, 9.0))
    assert s.tasks == {} and s.waiting == 0


def test_no_batching_by_default():
    s = Scheduler("fifo")
    submit(s, 0.0, infer(1), infer(2))
    assert step(s, 0.0) == [("run", 1)]


def test_hold_and_release_a_waiting_task():
    s = Scheduler("fifo")
    submit(s, 0.0, train(1), train(2), train(3))
    assert step(s, 0.0) == [("run", 1)]
    s.hold(2)
    assert s.tasks[2].state is State.HELD and s.waiting == 1
    with pytest.raises(ConfigError, match="running"):
        s.hold(1)
    s.update(Finished(1, 1.0))
    assert step(s, 1.0) == [("run", 3)]
    assert step(s, 1.5) == []
    s.release(2, 2.0)
    assert s.waiting == 1 and s.tasks[2].ready_at == 2.0
    s.update(Finished(3, 3.0))
    assert step(s, 3.0) == [("run", 2)]
    s.release(2, 3.5)  # not held: nothing happens
    assert s.waiting == 0 and s.tasks[2].state is State.RUNNING


def test_withdraw_a_held_task():
    s = Scheduler("fifo")
    submit(s, 0.0, train(1), train(2), train(3))
    assert step(s, 0.0) == [("run", 1)]
    s.hold(2)
    s.withdraw(2)
    assert s.waiting == 1 and 2 not in s.tasks
    s.update(Finished(1, 1.0))
    assert step(s, 1.0) == [("run", 3)] and s.waiting == 0


def test_withdraw():
    s = Scheduler("fifo", capacity=20)
    submit(s, 0.0, train(1, persistent=4, ephemeral=4), train(2, persistent=3, ephemeral=3))
    assert step(s, 0.0) == [("run", 1)]
    with pytest.raises(ConfigError, match="running"):
        s.withdraw(1)
    s.withdraw(2)
    s.withdraw(99)  # unknown: nothing to forget
    assert 2 not in s.tasks and s.waiting == 0
    s.update(Finished(1, 1.0))
    assert step(s, 1.0) == [] and s.lanes.used == 0


def test_withdraw_releases_an_admitted_task_memory():
    s = Scheduler("srtf", capacity=20)
    submit(s, 0.0, train(1, work=10, persistent=4, ephemeral=4))
    assert step(s, 0.0) == [("run", 1)]
    submit(s, 1.0, train(2, work=1, persistent=4, ephemeral=4))
    assert step(s, 1.0) == [("preempt", 1), ("run", 2)]
    s.update(Stopped(1, 1.5, done=1))
    assert s.lanes.used == 16
    s.withdraw(1)
    assert s.lanes.used == 8 and s.waiting == 0


def test_results_for_unknown_or_idle_tasks_raise():
    s = Scheduler("fifo")
    submit(s, 0.0, train(1), train(2))
    assert step(s, 0.0) == [("run", 1)]
    with pytest.raises(ConfigError, match="unknown task 99"):
        s.update(Finished(99, 1.0))
    with pytest.raises(ConfigError, match="waiting"):
        s.update(Finished(2, 1.0))
    with pytest.raises(ConfigError, match="waiting"):
        s.update(Stopped(2, 1.0, done=0))
    s.update(Progress(2, 1.0, done=5))  # progress of an idle task is ignored
    assert s.tasks[2].done == 0
    s.update(Failed(1, 1.0, "boom"))
    assert 1 not in s.tasks and step(s, 1.0) == [("run", 2)]


def test_update_takes_any_iterable_of_results():
    s = Scheduler("fifo")
    submit(s, 0.0, train(1), train(2))
    step(s, 0.0)
    s.update(r for r in [Finished(1, 1.0)])
    assert 1 not in s.tasks


def test_stopped_task_keeps_its_progress_and_service_is_device_time():
    s = Scheduler("fifo", quantum_s=2.0)
    submit(s, 0.0, train(1, work=10), train(2, work=10))
    assert step(s, 0.0) == [("run", 1)]
    s.update(Progress(1, 1.0, done=1, unit_s=0.5))
    assert s.tasks[1].service == 1.0 and s.tasks[1].unit_s == 0.5
    assert s.tasks[1].remaining_s(1.5) == 9 * 0.5 - 0.5
    assert step(s, 2.0) == [("preempt", 1), ("run", 2)]
    s.update(Stopped(1, 2.5, done=4))  # ran on to its iteration boundary
    t1 = s.tasks[1]
    assert (t1.state, t1.done, t1.service, t1.ready_at) == (State.WAITING, 4, 2.5, 2.5)
    assert step(s, 4.0) == [("preempt", 2), ("run", 1)]
    s.update(Stopped(2, 4.2, done=2))
    assert s.tasks[2].service == pytest.approx(2.2)
    assert t1.done == 4 and t1.remaining_s() == 6 * 0.5
    s.update(Finished(1, 7.0))
    assert t1.service == 5.5 and t1.done == 10 and t1.finished_at == 7.0
    assert t1.started_at == 0.0 and t1.preemptions == 1


def test_batched_requests_are_accounted_each():
    s = Scheduler("fifo", max_batch=4)
    submit(s, 0.0, infer(1), infer(2))
    assert step(s, 0.0) == [("run", (1, 2))]
    t1, t2 = s.tasks[1], s.tasks[2]
    s.update([Finished(1, 0.25), Finished(2, 0.25)])
    assert (t1.service, t2.service) == (0.25, 0.25)
    assert t2.started_at == 0.0


# ---------------------------------------------------------------------- random invariants
def _check(s: Scheduler) -> None:
    assert len(s.running) <= s.slots
    assert not set(s.running) & set(s.stopping)
    for t in s.running.values():
        assert t.state is State.RUNNING
        if s.lanes is not None and s.lanes.admitted(t.id):
            assert s.lanes.lanes[t.lane].busy == t.id
    for t in s.stopping.values():
        assert t.state is State.STOPPING
    waiting = [t for t in s.tasks.values() if t.state is State.WAITING]
    assert not {t.id for t in waiting} & (set(s.running) | set(s.stopping))
    assert s.waiting == len(waiting)
    assert len(s.stopping) <= 1  # one preemption outstanding at a time
    if s.lanes is not None:
        assert s.lanes.safe()
        busy = [lane.busy for lane in s.lanes.lanes.values() if lane.busy is not None]
        assert len(busy) == len(set(busy))


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_timelines_keep_the_invariants(policy, max_batch):
    rng = random.Random(f"{policy}-{max_batch}")
    s = Scheduler(policy, capacity=100, quantum_s=1.0 if policy in ("fifo", "fair") else None,
                  max_batch=max_batch)
    running: dict[int, Task] = {}  # what the executor runs: every task of every Run
    stopping: dict[int, Task] = {}
    submitted = finished = peak = 0
    now = 0.0

    def execute(decisions):
        for d in decisions:
            if isinstance(d, Run):
                for t in d.tasks:
                    assert t.id not in running and t.id not in stopping
                    running[t.id] = t
            else:
                t = running.pop(d.task.id)
                assert t.preemptible
                stopping[t.id] = t

    def finish(t, at):
        nonlocal finished
        running.pop(t.id, None)
        stopping.pop(t.id, None)
        s.update(Finished(t.id, at))
        finished += 1

    for _ in range(400):
        now += rng.choice((0.0, 0.1, 0.5, 1.0, 2.0))
        r = rng.random()
        if r < 0.3 and submitted < 80:
            kind = rng.random() < 0.5
            cls = dict(priority=rng.choice((LC, BE)),
                       deadline=now + rng.uniform(1, 20) if rng.random() < 0.5 else None,
                       persistent=rng.randint(0, 30), ephemeral=rng.randint(1, 30))
            t = train(submitted, work=rng.randint(1, 8), **cls) if kind else \
                infer(submitted, model=rng.choice("xyz"), **cls)
            s.submit(t, now)
            submitted += 1
        elif r < 0.6 and running:
            finish(running[rng.choice(sorted(running))], now)
        elif r < 0.75 and stopping:
            t = stopping.pop(rng.choice(sorted(stopping)))
            s.update(Stopped(t.id, now, done=min(t.work - 1, t.done + rng.randint(0, 2))))
        elif r < 0.85 and running:
            t = running[rng.choice(sorted(running))]
            if t.preemptible:
                s.update(Progress(t.id, now, done=min(t.work - 1, t.done + 1)))
        elif r < 0.9:
            idle = sorted(i for i, t in s.tasks.items() if t.state is State.WAITING)
            if idle:
                s.hold(rng.choice(idle))
        elif r < 0.95:
            for i in sorted(i for i, t in s.tasks.items() if t.state is State.HELD):
                s.release(i, now)
        execute(s.schedule(now))
        _check(s)
        peak = max(peak, len(s.running))
        w = s.next_wakeup(now)
        assert w is None or w > now
    # Drain: release what is held, then keep finishing whatever runs.
    for i in sorted(i for i, t in s.tasks.items() if t.state is State.HELD):
        s.release(i, now)
    for _ in range(10 * submitted + 10):
        if not s.tasks:
            break
        now += 1.0
        for t in list(stopping.values()):
            stopping.pop(t.id)
            s.update(Stopped(t.id, now, done=t.done))
        for t in list(running.values()):
            finish(t, now)
        execute(s.schedule(now))
        _check(s)
    assert s.tasks == {} and finished == submitted > 40
    assert s.waiting == 0 and not s.running and not s.stopping
    assert s.lanes.used == 0 and s.lanes.lanes == {}
    # The run exercised what the policy does: packing, or preemption.
    assert peak > 1 if policy == "pack" else (peak == 1 and s.preemptions > 0)


def test_expedite_brings_a_waiting_tasks_deadline_forward_and_nothing_else():
    s = Scheduler("priority")
    running = s.submit(Task(1, Kind.INFERENCE, "a", 0.0), 0.0)
    s.schedule(0.0)
    decode = s.submit(Task(2, Kind.INFERENCE, "b", 1.0), 1.0)  # no deadline: after due tasks of its class
    due = s.submit(Task(3, Kind.INFERENCE, "c", 2.0, deadline=2.0), 2.0)
    assert s.most_urgent_waiting() is due
    assert s.expedite(decode.id, 1.5)
    assert s.most_urgent_waiting() is decode and s.waiting == 2
    assert not s.expedite(decode.id, 1.8)  # already due as early
    assert not s.expedite(running.id, 0.0)  # not waiting
