"""Which starved training jobs move, and where (NOTE [Migration of starved jobs])."""

from __future__ import annotations

from timeshare.scheduler.migration import BOUNCE_FACTOR, STARVED_SHARE, JobSeen, ReplicaSeen, plan_migrations


def replicas(*rows) -> list[ReplicaSeen]:
    return [ReplicaSeen(name, alive, outstanding, jobs) for name, alive, outstanding, jobs in rows]


def test_a_job_with_little_of_its_device_moves_to_an_idle_replica():
    fleet = replicas(("a", True, 3, 1), ("b", True, 0, 0))
    for share, moves in ((None, []), (STARVED_SHARE, []), (STARVED_SHARE - 0.01, [("j", "b")]), (0.0, [("j", "b")])):
        assert plan_migrations([JobSeen("j", "a", "running", share, 0.0)], fleet, now=5.0, after_s=2.0) == moves


def test_no_move_without_an_idle_replica_or_for_a_job_not_meant_to_run():
    starved = JobSeen("j", "a", "running", 0.0, 0.0)
    for fleet in (replicas(("a", True, 3, 1), ("b", True, 1, 0)),  # b busy with a request
                  replicas(("a", True, 3, 1), ("b", True, 0, 1)),  # b runs a job
                  replicas(("a", True, 3, 1), ("b", False, 0, 0))):  # b dead
        assert plan_migrations([starved], fleet, now=10.0, after_s=2.0) == []
    fleet = replicas(("a", True, 3, 1), ("b", True, 0, 0))
    for status in ("paused", "finished", "failed", "cancelled"):
        assert plan_migrations([JobSeen("j", "a", status, 0.0, 0.0)], fleet, now=10.0, after_s=2.0) == []
    assert plan_migrations([JobSeen("j", "a", "queued", 0.0, 0.0)], fleet, now=10.0, after_s=2.0) == [("j", "b")]


def test_the_most_starved_goes_first_one_per_idle_replica():
    jobs = [JobSeen("some", "a", "running", 0.2, 0.0), JobSeen("none", "a", "running", 0.0, 0.0),
            JobSeen("little", "a", "running", 0.1, 0.0)]
    fleet = replicas(("a", True, 2, 3), ("b", True, 0, 0), ("c", True, 0, 0))
    assert plan_migrations(jobs, fleet, now=10.0, after_s=2.0) == [("none", "b"), ("little", "c")]


def test_a_job_does_not_bounce_back_at_once():
    came = JobSeen("j", "b", "running", 0.0, arrived_at=10.0, came_from="a")
    fleet = replicas(("a", True, 0, 0), ("b", True, 2, 1))
    soon = 10.0 + BOUNCE_FACTOR * 2.0 - 0.1
    assert plan_migrations([came], fleet, now=soon, after_s=2.0) == []
    assert plan_migrations([came], fleet, now=soon + 0.2, after_s=2.0) == [("j", "a")]
    fleet = replicas(("a", True, 0, 0), ("b", True, 2, 1), ("c", True, 0, 0))
    assert plan_migrations([came], fleet, now=soon, after_s=2.0) == [("j", "c")]
