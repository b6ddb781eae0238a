"""A training job on a cluster's replica as a server sees one of its runtime's jobs
(``RemoteJob``), read from the views the front end's poller keeps (NOTE [A cluster behind
the server] in ``cluster/backend.py``). Runs in the server's process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from timeshare.errors import TimeshareError

if TYPE_CHECKING:
    from timeshare.cluster.backend import ClusterRuntime

ENDED = ("finished", "failed", "cancelled")


class ReplicaJobError(TimeshareError):
    """A training job that failed on its replica (the replica's error, as text), or whose replica was lost."""


@dataclass
class RemoteStats:
    """A remote job's statistics as its replica last reported them (``TrainingStats``'s fields)."""

    iterations: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0
    preempted_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    ephemeral_bytes: int | None = None
    persistent_bytes: int | None = None


class RemoteJob:
    """A training job on a replica, as a server sees one of its runtime's jobs."""

    def __init__(self, owner: ClusterRuntime, name: str):
        self._owner, self.name = owner, name

    @property
    def status(self) -> str:
        return self._owner.job_view(self.name)["status"]

    @property
    def stats(self) -> RemoteStats:
        v = self._owner.job_view(self.name)
        return RemoteStats(v["iterations"], v["preemptions"], v["step_seconds"], v["preempted_seconds"],
                           [] if v["loss"] is None else [v["loss"]], v["ephemeral_bytes"], v["persistent_bytes"])

    @property
    def error(self) -> BaseException | None:
        text = self._owner.job_view(self.name)["error"]
        return None if text is None else ReplicaJobError(text)

    @property
    def replica(self) -> str:
        return self._owner.job_view(self.name)["replica"]

    def pause(self) -> None:
        self._owner.control_job(self.name, "pause")

    def resume(self) -> None:
        self._owner.control_job(self.name, "resume")

    def cancel(self) -> None:
        self._owner.control_job(self.name, "cancel")

    def wait(self, timeout: float | None = None) -> bool:
        """True once the job has ended (as last reported), waiting up to ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status not in ENDED:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(min(self._owner.poll_s, 0.05) if deadline is None else
                       max(0.0, min(self._owner.poll_s, 0.05, deadline - time.monotonic())))
        return True
