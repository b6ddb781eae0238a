"""One replica: a timeshare runtime on one device, the body of a Ray actor. Plain Python
(no Ray here), so it is tested and used without a cluster too."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from timeshare.errors import ConfigError, ModelTooLargeError
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
