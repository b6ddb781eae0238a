"""How much of its replica's device each training job has had, as the server's poller
samples it, and the jobs as the pure decision of moving starved ones sees them (NOTE
[Migration of starved jobs] in ``scheduler/migration.py``). Runs in the server's process."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from timeshare.cluster.remote_job import ENDED
from timeshare.scheduler.migration import JobSeen

HISTORY_S = 600.0  # how far back a job's samples of device time go


@dataclass
class JobTrack:
    """Where a job is, since when, where it came from, and samples of its device time
    (``step_seconds``) to measure its share of the device (NOTE [Migration of starved jobs])."""

    replica: str
    arrived_at: float
    came_from: str | None = None
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def sample(self, now: float, step_seconds: float) -> None:
        self.samples.append((now, step_seconds))
        while len(self.samples) > 2 and self.samples[1][0] <= now - HISTORY_S:
            self.samples.popleft()

    def share(self, now: float, window_s: float) -> float | None:
        """Of the device since the newest sample at least ``window_s`` old; None before
        there is one."""
        base = None
        for t, seconds in self.samples:
            if t > now - window_s:
                break
            base = (t, seconds)
        if base is None:
            return None
        t1, s1 = self.samples[-1]
        return max(0.0, s1 - base[1]) / max(t1 - base[0], 1e-9)


def jobs_seen(views: dict[str, dict], tracks: dict[str, JobTrack], unmovable: dict[str, str], now: float,
              after_s: float) -> tuple[list[JobSeen], list[str]]:
    """The jobs that may move, each with its share of the device over a window of
    ``after_s`` at least; and the replica of every job not ended, once per job."""
    seen = []
    for n, v in views.items():
        track = tracks.get(n)
        if track is None or track.replica != v["replica"] or n in unmovable:
            continue
        # A window of several iterations at least: device time shows when an iteration ends.
        step_s = v["step_seconds"] / max(1, v["iterations"])
        seen.append(JobSeen(n, v["replica"], v["status"], track.share(now, max(after_s, 3 * step_s)),
                            track.arrived_at, track.came_from))
    running = [v["replica"] for v in views.values() if v["status"] not in ENDED]
    return seen, running
