"""What the server needs of a runtime: the typed seam between the serving layer and what
runs the models. :class:`~timeshare.Runtime` is one (a device in this process and its
workers); :class:`~timeshare.cluster.backend.ClusterRuntime` is the other (replicas on
Ray, NOTE [A cluster behind the server]). Structural: neither imports this module."""

from __future__ import annotations

from typing import Any, Protocol

from timeshare.cluster.snapshots import ClusterSnapshot
from timeshare.runtime.calls import Call
from timeshare.runtime.events import Listener
from timeshare.runtime.observe import RuntimeSnapshot


class JobStats(Protocol):
    iterations: int
    preemptions: int
    step_seconds: float
    preempted_seconds: float
    losses: list[float]
    ephemeral_bytes: int | None
    persistent_bytes: int | None


class JobHandle(Protocol):
    """A training job as the admin plane sees it (``runtime.training.TrainingJob``)."""

    @property
    def status(self) -> str: ...

    @property
    def stats(self) -> JobStats: ...

    @property
    def error(self) -> BaseException | None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def cancel(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Backend(Protocol):
    def register(self, name: str, build: Any, weights: Any = None, example_inputs: tuple = (), *,
                 example_kwargs: dict | None = None, dtype: Any = None, pin: bool = False, priority: Any = ...,
                 slo_s: float | None = None) -> None: ...

    def unregister(self, name: str) -> None: ...

    def models(self) -> list[str]: ...

    def pin(self, name: str, pinned: bool = True) -> None: ...

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None, *, strategy: str | None = None,
             arrived_at: float | None = None) -> Call: ...

    def infer(self, name: str, *args, **kwargs) -> Any: ...

    def is_resident(self, name: str) -> bool: ...

    def thrashing_factor(self) -> float: ...

    def snapshot(self) -> RuntimeSnapshot | ClusterSnapshot: ...

    def subscribe(self, listener: Listener) -> None: ...

    def train(self, name: str, model: Any, optimizer: Any, data: Any, step: Any, iterations: int | None = None, *,
              offload: bool = False, seed: int | None = None, resume: dict | None = None) -> JobHandle: ...

    def forget_job(self, name: str) -> None: ...

    def close(self) -> None: ...
