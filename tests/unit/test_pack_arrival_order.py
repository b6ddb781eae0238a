"""PACK serves requests waiting for a lane in arrival order (NOTE [Requests wait in
arrival order]): a request is admitted only to a lane it can run in at once, so no later
request overtakes it, and closed-loop clients get equal shares."""

from __future__ import annotations

import collections
import itertools
import random

import pytest

from timeshare.scheduler import Scheduler
from timeshare.scheduler.task import Finished, Kind, Run, State, Stopped, Task

E = 100  # every request's ephemeral bytes


def request(i: int, client: int, now: float) -> Task:
    return Task(i, Kind.INFERENCE, f"m{client}", now, 1.0, 0.001, ephemeral=E)


@pytest.mark.parametrize("lanes", [2, 3, 7])
def test_closed_loop_clients_each_get_their_share_when_fewer_lanes_fit_than_clients(lanes):
    """Eight clients, each with one request in flight, a new one as soon as the last
    finished; lanes for ``lanes`` of them; requests finish in a random order. Before,
    requests that joined a busy lane waited for it while later ones took the lanes that
    freed: one client got 214 requests served, another 1,503."""
    rnd = random.Random(lanes)
    s = Scheduler("pack", capacity=lanes * E + E // 2)
    ids = itertools.count(1)
    owner: dict[int, int] = {}
    served: collections.Counter[int] = collections.Counter()
    running: list[Task] = []
    now = 0.0

    def arrive(client: int) -> None:
        t = request(next(ids), client, now)
        owner[t.id] = client
        s.submit(t, now)

    for c in range(8):
        arrive(c)
    for _ in range(3000):
        running.extend(d.task for d in s.schedule(now) if isinstance(d, Run))
        assert len(running) <= lanes and s.lanes is not None and s.lanes.safe()
        done = running.pop(rnd.randrange(len(running)))
        now += 0.001
        s.update(Finished(done.id, now))
        served[owner[done.id]] += 1
        arrive(owner[done.id])
    mean = sum(served.values()) / 8
    assert all(mean / 2 <= served[c] <= 2 * mean for c in range(8)), served


def test_a_request_that_cannot_start_is_not_admitted_and_later_ones_wait_behind_it():
    s = Scheduler("pack", capacity=250)  # two lanes of 100 fit, not three
    first, second = request(1, 0, 0.0), request(2, 1, 0.0)
    s.submit(first, 0.0)
    s.submit(second, 0.0)
    assert [d.task.id for d in s.schedule(0.0)] == [1, 2]
    waiting = request(3, 2, 1.0)
    s.submit(waiting, 1.0)
    assert s.schedule(1.0) == [] and waiting.lane is None  # not admitted to a busy lane
    assert s.lanes is not None and not s.lanes.admitted(3)
    later = request(4, 3, 2.0)
    s.submit(later, 2.0)
    s.update(Finished(1, 3.0))
    assert [d.task.id for d in s.schedule(3.0)] == [3]  # the lane that freed goes to the first in line
    assert later.state is State.WAITING
    s.update(Finished(2, 4.0))
    assert [d.task.id for d in s.schedule(4.0)] == [4]


def test_a_request_bound_for_a_training_jobs_lane_still_makes_the_job_yield():
    s = Scheduler("pack", capacity=10)
    job = Task(1, Kind.TRAINING, "train", 0.0, float("inf"), 1.0, persistent=2, ephemeral=6)
    s.submit(job, 0.0)
    assert [d.task.id for d in s.schedule(0.0)] == [1]
    req = Task(2, Kind.INFERENCE, "m", 1.0, 1.0, 0.1, ephemeral=4)  # no new lane fits: the job's lane
    s.submit(req, 1.0)
    decisions = s.schedule(1.0)
    assert [(type(d).__name__, d.task.id) for d in decisions] == [("Preempt", 1)]
    assert req.lane is None  # waits unadmitted while the job stops
    s.update(Stopped(1, 1.5, done=3.0))
    assert [d.task.id for d in s.schedule(1.5)] == [2] and req.lane == job.lane
