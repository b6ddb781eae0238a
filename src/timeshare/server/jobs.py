"""The training jobs of the admin plane (``/admin/training``): submitted under the admin
section's bounds, listed, paused, resumed or cancelled, and the finished ones forgotten
beyond ``admin.max_finished_jobs``. Runs in the server's process, on the event loop; the
runtime's blocking calls go through the service's thread pool.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from timeshare.cluster.snapshots import ClusterSnapshot
from timeshare.config import AdminConfig, TrainingConfig
from timeshare.errors import BadRequest, Conflict, DuplicateModelError, Unavailable, UnknownModelError
from timeshare.server.admission import check_training
from timeshare.server.backend import Backend, JobHandle


@dataclass
class _Job:
    cfg: TrainingConfig
    handle: JobHandle
    submitted: float = field(default_factory=time.time)


class TrainingJobs:
    """The jobs by name, in submission order. ``runtime`` gives the open runtime;
    ``call`` runs a blocking function in the service's thread pool and awaits it."""

    def __init__(self, admin: AdminConfig, *, runtime: Callable[[], Backend],
                 call: Callable[..., Awaitable[Any]]):
        self.admin = admin
        self._runtime = runtime
        self._call = call
        self._jobs: dict[str, _Job] = {}  # in submission order; finished ones pruned (_prune)
        self._submitting = asyncio.Lock()  # one submission at a time: the running-jobs count holds

    async def submit(self, cfg: TrainingConfig, *, from_config: bool = False) -> dict:
        """Start a training job. One submitted through the admin plane is held to the
        admin section's bounds (``server/admission.py``): batch, iterations, memory
        (400), and the number of jobs running (409); one ``from_config`` is not."""
        from timeshare.models.workloads import TrainingWorkload, sgd

        admin = self.admin
        async with self._submitting:
            job = self._jobs.get(cfg.name)
            if job is not None and not job.handle.wait(0):
                raise Conflict(f"a training job named {cfg.name!r} is running")
            if not from_config:
                snap = self._runtime().snapshot()  # on a cluster, a job has one replica's budget
                budget = snap.replica_capacity_bytes if isinstance(snap, ClusterSnapshot) else snap.capacity_bytes
                if budget is None:
                    raise Unavailable("no replica of the cluster has reported its memory yet")
                check_training(cfg, admin, budget_bytes=budget)
                running = [n for n, j in self._jobs.items() if not j.handle.wait(0)]
                if len(running) >= admin.max_training_jobs:
                    raise Conflict(f"{len(running)} training jobs are running ({', '.join(running)}), the limit "
                                   f"(admin.max_training_jobs); cancel one or wait for one to finish")
            args = TrainingWorkload(cfg.model, cfg.batch).train_args()
            args["optimizer"] = functools.partial(sgd, lr=cfg.lr)
            try:
                handle = await self._call(self._runtime().train, cfg.name, iterations=cfg.iterations,
                                          offload=cfg.offload, seed=cfg.seed, **args)
            except DuplicateModelError as exc:
                raise Conflict(str(exc)) from None
            self._jobs.pop(cfg.name, None)  # a resubmitted name is the newest
            await self._prune()
            self._jobs[cfg.name] = _Job(cfg, handle)
        return self.status(cfg.name)

    async def _prune(self) -> None:
        """Forget the oldest finished jobs beyond ``admin.max_finished_jobs``, here and in
        the runtime (whose workers hold their state). Only submissions add jobs, so pruning
        before each keeps the count bounded (by the limit plus the jobs that were running then)."""
        finished = [n for n, j in self._jobs.items() if j.handle.wait(0)]
        for name in finished[:max(0, len(finished) - self.admin.max_finished_jobs)]:
            del self._jobs[name]
            try:
                await self._call(self._runtime().forget_job, name)
            except (UnknownModelError, DuplicateModelError):
                pass  # resubmitted under that name meanwhile: the runtime's job is the new one

    def names(self) -> list[str]:
        return list(self._jobs)

    def status(self, name: str) -> dict:
        job = self._job(name)
        h = job.handle
        s = h.stats
        return {
            "name": name, "model": job.cfg.model, "batch": job.cfg.batch, "status": h.status,
            "iterations": s.iterations, "target_iterations": job.cfg.iterations, "preemptions": s.preemptions,
            "step_seconds": round(s.step_seconds, 6), "preempted_seconds": round(s.preempted_seconds, 6),
            "loss": s.losses[-1] if s.losses else None,
            "ephemeral_bytes": s.ephemeral_bytes, "persistent_bytes": s.persistent_bytes,
            "error": None if h.error is None else f"{type(h.error).__name__}: {h.error}",
        }

    def control(self, name: str, action: str) -> dict:
        h = self._job(name).handle
        if action == "pause":
            h.pause()
        elif action == "resume":
            h.resume()
        elif action == "cancel":
            h.cancel()
        else:
            raise BadRequest(f"unknown action {action!r}; known: pause, resume, cancel")
        return self.status(name)

    def iterations(self) -> dict[str, int]:
        """Iterations per job, for the metrics (other threads scrape)."""
        return {n: j.handle.stats.iterations for n, j in list(self._jobs.items())}

    def _job(self, name: str) -> _Job:
        try:
            return self._jobs[name]
        except KeyError:
            raise UnknownModelError(f"no training job named {name!r}; known: {sorted(self._jobs)}") from None
