"""The runtime's training jobs by name: at most one running per name; a finished job
is kept (with its state, in a worker) until it is forgotten or another takes its name.
Runs in the controller, under the runtime's lock but for ``stop_all``.
"""

from __future__ import annotations

import logging

import torch

from timeshare.errors import DuplicateModelError, UnknownModelError
from timeshare.runtime.training import TrainingJob, validate_training_args
from timeshare.worker.trainer import TrainSpec

log = logging.getLogger(__name__)


def training_spec(name: str, model, optimizer, data, step, iterations: int | None, offload: bool,
                  seed: int | None, resume: dict | None = None) -> TrainSpec:
    """The job as data, its arguments checked (``Runtime.train`` says what each is)."""
    validate_training_args(name, model, optimizer, data, step, iterations)
    return TrainSpec(name, model, optimizer, data, step, iterations, offload,
                     torch.initial_seed() if seed is None else int(seed), resume)


class JobTable:
    def __init__(self) -> None:
        self._jobs: dict[str, TrainingJob] = {}

    def check_free(self, name: str) -> None:
        if name in self._jobs and not self._jobs[name].wait(0):
            raise DuplicateModelError(f"a training job named {name!r} is running")

    def add(self, job: TrainingJob) -> TrainingJob:
        self._jobs[job.name] = job
        return job

    def all(self) -> dict[str, TrainingJob]:
        return dict(self._jobs)

    def forget(self, name: str) -> None:
        """Drop a finished job's handle; a running one must be cancelled first."""
        job = self._jobs.get(name)
        if job is None:
            raise UnknownModelError(f"no training job named {name!r}")
        if not job.wait(0):
            raise DuplicateModelError(f"training job {name!r} is still running; cancel it first")
        del self._jobs[name]

    def stop_all(self, timeout_s: float = 60.0) -> None:
        """Cancel every job and wait for each (without the runtime's lock: a job needs it
        to reach its preemption point)."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel()
        for job in jobs:
            if not job.wait(timeout_s):
                log.warning("training job %s did not stop within %.0f s", job.name, timeout_s)
