"""A cluster's training jobs: which replica runs each, their start and control there, and
their move to another replica from a checkpoint (SwitchFlow; NOTE [Checkpoints] in
``worker/trainer.py``). Runs in the front end's process."""

from __future__ import annotations

import logging

from timeshare.cluster.actors import OBSERVE, cause
from timeshare.cluster.replicas import ReplicaSet
from timeshare.errors import ConfigError, Conflict, UnknownModelError
from timeshare.models.workloads import TrainingWorkload

log = logging.getLogger(__name__)


class Jobs:
    """The training jobs on ``replicas``, each by name on one replica at a time; its table
    is guarded by the replicas' lock."""

    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self._jobs: dict[str, int] = {}  # training job -> the slot it runs on
        self._job_specs: dict[str, dict] = {}  # training job -> Runtime.train's keyword arguments

    def train(self, name: str, workload: str, iterations: int, *, seed: int = 0, replica: str | None = None) -> str:
        """Start a training job (a zoo workload, "model:batch") on ``replica`` (default: the
        live replica running the fewest jobs); returns the replica's name."""
        kwargs = {**TrainingWorkload.parse(workload).train_args(), "iterations": iterations, "seed": seed}
        return self.start_job(name, kwargs, replica=replica)["replica"]

    def start_job(self, name: str, kwargs: dict, *, replica: str | None = None) -> dict:
        """``Runtime.train(name, **kwargs)`` on ``replica`` (default: the live replica
        running the fewest jobs); every argument must be picklable. The job's view, with
        its replica's name."""
        replicas = self.replicas
        slots, ray, timeout_s = replicas.slots, replicas.ray, replicas.call_timeout_s
        with replicas.lock:
            old = self._jobs.get(name)
        if old is not None:  # a name may be used again once its job has ended
            view = ray.get(slots[old].actor.job.options(concurrency_group=OBSERVE).remote(name), timeout=timeout_s)
            if view["status"] not in ("finished", "failed", "cancelled"):
                raise Conflict(f"a training job named {name!r} is {view['status']} on {slots[old].name}")
            self.forget_job(name)
        with replicas.lock:
            if name in self._jobs:
                raise Conflict(f"a training job named {name!r} was started meanwhile")
            i = self._replica_for_job(replica)
            self._jobs[name] = i  # reserved: a second start of the name is refused meanwhile
        try:
            view = ray.get(slots[i].actor.start_job.remote(name, kwargs), timeout=timeout_s)
        except BaseException:
            with replicas.lock:
                del self._jobs[name]
            raise
        with replicas.lock:
            self._job_specs[name] = dict(kwargs)
        return {"replica": slots[i].name, **view}

    def job_names(self) -> list[str]:
        with self.replicas.lock:
            return list(self._jobs)

    def job_replica(self, name: str) -> str:
        return self.replicas.slots[self._job_slot(name)].name

    def on(self, i: int) -> list[str]:
        """The jobs on replica ``i``, sorted; under the lock."""
        return sorted(n for n, j in self._jobs.items() if j == i)

    def drop_replica(self, i: int) -> None:
        """Replica ``i`` was lost, and its jobs died with it; under the lock."""
        for job in [n for n, j in self._jobs.items() if j == i]:
            del self._jobs[job]
            self._job_specs.pop(job, None)

    def _job_slot(self, name: str) -> int:
        with self.replicas.lock:
            i = self._jobs.get(name)
        if i is None:
            raise UnknownModelError(f"no training job named {name!r}; known: {sorted(self._jobs)}")
        return i

    def control_job(self, name: str, action: str) -> dict:
        """pause, resume or cancel the job where it runs (beside any inference there)."""
        i = self._job_slot(name)
        slot = self.replicas.slots[i]
        view = self.replicas.ray.get(slot.actor.control_job.options(concurrency_group=OBSERVE).remote(name, action),
                                     timeout=self.replicas.call_timeout_s)
        return {"replica": slot.name, **view}

    def forget_job(self, name: str) -> None:
        """Drop an ended job here and on its replica (which holds its final state until then)."""
        i = self._job_slot(name)
        slot = self.replicas.slots[i]
        if slot.alive:
            self.replicas.ray.get(slot.actor.forget_job.remote(name), timeout=self.replicas.call_timeout_s)
        with self.replicas.lock:
            if self._jobs.get(name) == i:
                del self._jobs[name]
                self._job_specs.pop(name, None)

    def migrate(self, name: str, to: str | None = None) -> dict:
        """Move a training job to another replica (SwitchFlow): paused where it is at its
        next iteration boundary, checkpointed, dropped there, and resumed on ``to``
        (default: the other live replica running the fewest jobs) from that checkpoint
        (NOTE [Checkpoints]); it ends as if never moved."""
        replicas = self.replicas
        ray, timeout_s = replicas.ray, replicas.call_timeout_s
        src = self._job_slot(name)
        with replicas.lock:
            dst = self._replica_for_job(to, avoid=src)
        source, target = replicas.slots[src], replicas.slots[dst]
        spec = ray.get(source.actor.job.remote(name), timeout=timeout_s)
        if spec["status"] not in ("queued", "running"):
            raise Conflict(f"training job {name!r} is {spec['status']}: only a job that runs can move "
                           "(resume a paused one first)")
        started = False
        try:  # the job runs on the target before it is dropped here: a move that fails leaves it where it was
            ray.get(source.actor.pause_job.remote(name), timeout=timeout_s)
            checkpoint = ray.get(source.actor.checkpoint.remote(name), timeout=timeout_s)
            ref = target.actor.start_job.remote(name, {**self._job_specs[name], "resume": checkpoint})
            started = True  # perhaps: a start that timed out may still happen there
            ray.get(ref, timeout=timeout_s)
        except BaseException:
            if started:  # whatever started there goes (best effort: the target may be the one failing)
                try:
                    ray.get(target.actor.drop_job.remote(name), timeout=timeout_s)
                except Exception as exc:
                    log.warning("training job %s: dropping its copy on %s failed: %s", name, target.name, cause(exc))
            ray.get(source.actor.control_job.options(concurrency_group=OBSERVE).remote(name, "resume"),
                    timeout=timeout_s)
            raise
        try:
            ray.get(source.actor.drop_job.remote(name), timeout=timeout_s)
        except Exception as exc:  # it was cancelled there at least; it runs on the target now
            log.warning("training job %s moved, but its old copy on %s did not go: %s", name, source.name, cause(exc))
        with replicas.lock:
            self._jobs[name] = dst
            replicas.stats.migrations += 1
        return {"job": name, "from": source.name, "to": target.name, "iterations": checkpoint["iterations"],
                "status_before": spec["status"]}

    def job(self, name: str) -> dict:
        i = self._job_slot(name)
        slot = self.replicas.slots[i]
        return {"replica": slot.name, **self.replicas.ray.get(slot.actor.job.remote(name),
                                                              timeout=self.replicas.call_timeout_s)}

    def job_weights(self, name: str, timeout_s: float = 600.0) -> dict:
        """The job's final parameters and buffers, once it has ended where it runs now."""
        i = self._job_slot(name)
        return self.replicas.ray.get(self.replicas.slots[i].actor.job_weights.remote(name, timeout_s),
                                     timeout=timeout_s + 30)

    def _replica_for_job(self, name: str | None, avoid: int | None = None) -> int:
        slots = self.replicas.slots
        live = [i for i, s in enumerate(slots) if s.alive and i != avoid]
        if name is not None:
            live = [i for i in live if slots[i].name == name]
        if not live:
            raise ConfigError(f"no live replica {name or 'to run the job'}" + (" other than its own" if avoid else ""))
        return min(live, key=lambda i: sum(1 for j in self._jobs.values() if j == i))
