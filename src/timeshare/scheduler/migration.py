"""Which training jobs of a cluster move, and where: a pure function of what the front end
last saw of its replicas and jobs, with the time passed in. Used by the cluster's front
end (``cluster/backend.py``); tested alone.

NOTE [Migration of starved jobs]
SwitchFlow's point: a training job preempted on a busy device need not wait there while
another device idles. A job is *starved* when it is meant to run (queued or running, not
paused or ended) and over the last ``after_s`` it had less than ``STARVED_SHARE`` of its
device: the seconds its iterations ran (its ``step_seconds``) grew by less than that
share of the wall time, because the device kept giving its time to inference. A job
that has not been where it is for ``after_s`` yet is not judged. A replica is *idle*
when it is alive, runs no training job and has no request in flight. The most starved
job moves first, one job per idle replica per decision, and never back to the replica
it came from within ``BOUNCE_FACTOR`` times ``after_s`` of arriving (so that two
replicas that take turns being busy do not bounce a job between them). The move itself
is ``Cluster.migrate``: pause, checkpoint, resume there (NOTE [Checkpoints]); the job
ends bitwise as if never moved.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNNABLE = ("queued", "running")
STARVED_SHARE = 0.25
BOUNCE_FACTOR = 4.0


@dataclass(frozen=True)
class JobSeen:
    name: str
    replica: str
    status: str
    share: float | None  # of its device over the last after_s; None: not there that long yet
    arrived_at: float  # when it started on ``replica``
    came_from: str | None = None  # the replica it last moved from


@dataclass(frozen=True)
class ReplicaSeen:
    name: str
    alive: bool
    outstanding: int  # requests in flight there
    jobs: int  # training jobs there (running or not)


def plan_migrations(jobs: list[JobSeen], replicas: list[ReplicaSeen], now: float,
                    after_s: float) -> list[tuple[str, str]]:
    """(job, replica to move it to) for every starved job that has an idle replica to go to."""
    idle = [r.name for r in replicas if r.alive and r.jobs == 0 and r.outstanding == 0]
    starved = sorted((j for j in jobs if j.status in RUNNABLE and j.share is not None and j.share < STARVED_SHARE),
                     key=lambda j: (j.share, j.name))
    moves = []
    for job in starved:
        options = [r for r in idle if not (r == job.came_from and now - job.arrived_at < BOUNCE_FACTOR * after_s)]
        if not options:
            continue
        target = options[0]
        idle.remove(target)
        moves.append((job.name, target))
    return moves
