"""One replica: a timeshare runtime on one device, the body of a Ray actor. Plain Python
(no Ray here), so it is tested and used without a cluster too."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from timeshare.errors import ConfigError, ModelTooLargeError
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.runtime.facade import Runtime


@dataclass(frozen=True)
class ModelDef:
    """A model every replica can build: a zoo architecture, its seeded weights file, the
    batch of its example inputs."""

    name: str
    zoo: str
    weights: str  # a safetensors path every replica can read
    batch: int = 1

    def example_inputs(self) -> tuple:
        return zoo_get(self.zoo).example_inputs(self.batch)


@dataclass(frozen=True)
class Reply:
    """A request's answer from a replica: the outputs, whether the model had to be loaded
    for it, and the seconds the replica spent on it."""

    outputs: object
    loaded: bool
    seconds: float
    replica: str


class Replica:
    """A runtime on ``device`` with ``memory`` bytes of model memory, every model of
    ``models`` registered (none loaded until asked for)."""

    def __init__(self, name: str, models: list[ModelDef], *, device: str = "cpu", memory: int | str = "64MiB",
                 fail_start: bool = False):
        if fail_start:  # for tests and drills: a replica that cannot start
            raise ConfigError(f"replica {name} was told not to start")
        self.name = name
        self.rt = Runtime(device=device, memory=memory)
        self.models = {m.name: m for m in models}
        self._resumed_at: dict[str, int] = {}  # training job -> the iterations it was resumed at here
        for m in models:
            self.rt.register(m.name, zoo_get(m.zoo).builder, m.weights, m.example_inputs())

    def ping(self) -> dict:
        """Who answers, and where: the host and the shared-memory segments this replica
        owns (its arena), so that whoever sees it die on the same host can unlink them."""
        return {"replica": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "segments": [self.rt.diagnostics()["arena"]["name"]]}

    def echo(self, args: tuple) -> tuple:
        """The arguments back: a round trip of tensors through the cluster's transport."""
        return args

    def infer(self, model: str, args: tuple) -> Reply:
        t0 = time.perf_counter()
        before = self.rt.is_resident(model)
        outputs = self.rt.infer(model, *args)
        return Reply(outputs, not before, time.perf_counter() - t0, self.name)

    def profile(self, model: str, repeats: int = 3) -> dict:
        """Warm the model up (its first load here profiles it), then measure its cold time
        (evicted, then one request), its ready time (the median of ``repeats`` more) and
        its bytes; it is left evicted."""
        args = self.models[model].example_inputs()
        try:
            self.rt.infer(model, *args)
        except ModelTooLargeError as exc:  # served by no replica of this size; the rest serve
            return {"too_large": True, "bytes": exc.needed, "cold_s": 0.0, "ready_s": 0.0}
        self.rt.evict(model)
        t0 = time.perf_counter()
        self.rt.infer(model, *args)
        cold = time.perf_counter() - t0
        ready = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.rt.infer(model, *args)
            ready.append(time.perf_counter() - t0)
        nbytes = int(self.rt.snapshot()["resident"][model])
        self.rt.evict(model)
        return {"too_large": False, "cold_s": cold, "ready_s": sorted(ready)[len(ready) // 2], "bytes": nbytes}

    # Training jobs (NOTE [Checkpoints]): started here, paused, checkpointed, dropped.
    def train(self, name: str, workload: str, iterations: int, seed: int, resume: dict | None = None) -> None:
        self.rt.train(name, **TrainingWorkload.parse(workload).train_args(), iterations=iterations, seed=seed,
                      resume=resume)
        self._resumed_at[name] = 0 if resume is None else int(resume["iterations"])

    def job(self, name: str) -> dict:
        j = self._job(name)
        return {"status": j.status, "iterations": j.stats.iterations, "resumed_at": self._resumed_at.get(name, 0),
                "error": None if j.error is None else f"{type(j.error).__name__}: {j.error}"}

    def pause_job(self, name: str, timeout_s: float = 60.0) -> dict:
        """Pause the job and wait (up to ``timeout_s``) until it stands at a preemption point."""
        j = self._job(name)
        j.pause()
        deadline = time.monotonic() + timeout_s
        while j.status not in ("paused", "finished", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise ConfigError(f"training job {name!r} did not pause within {timeout_s:g} s")
            time.sleep(0.002)
        return self.job(name)

    def checkpoint(self, name: str) -> dict:
        return self._job(name).checkpoint()

    def drop_job(self, name: str, timeout_s: float = 60.0) -> None:
        j = self._job(name)
        j.cancel()
        j.wait(timeout_s)
        self.rt.forget_job(name)

    def job_weights(self, name: str, timeout_s: float = 600.0) -> dict:
        """The job's final parameters and buffers once it has ended; its error if it failed."""
        j = self._job(name)
        if not j.wait(timeout_s):
            raise ConfigError(f"training job {name!r} did not end within {timeout_s:g} s")
        if j.error is not None:
            raise j.error
        return j.state_dict()

    def _job(self, name: str):
        job = self.rt.jobs().get(name)
        if job is None:
            raise ConfigError(f"no training job {name!r} on replica {self.name}")
        return job

    def evict_all(self) -> None:
        """Nothing resident: a fresh start for the next run over the same replica."""
        for name in self.rt.resident():
            self.rt.evict(name)

    def stats(self) -> dict:
        s = self.rt.stats()
        return {"replica": self.name, "resident": s["resident"], "loads": sum(s["loads"].values()),
                "evictions": s["evictions"], "capacity_bytes": s["capacity_bytes"]}

    def close(self) -> None:
        self.rt.close()
