"""Whether the server is ready (``/v2/health/ready``) and, when it is not, why: the state
of the whole (starting, stopping, no worker or replica to serve) and each configured
model or language model that cannot serve, with its cause. Also the models that failed
for good, which ``server.exit_on_error`` exits on. Runs in the server's process, on the
event loop; the service gathers what it reads (NOTE [Permanent and transient failures]).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from timeshare.cluster.snapshots import ClusterSnapshot
from timeshare.server.backend import Backend
from timeshare.server.endpoint import Endpoint, ModelState
from timeshare.server.llms import LanguageModels


@dataclass(frozen=True, slots=True)
class Readiness:
    """The server's readiness: ``reason`` None when ready; else why not, and ``models``:
    each model that keeps it from being ready, with its cause (optional models left out)."""

    reason: str | None = None
    models: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.reason is None

    def to_json(self) -> dict:
        """``{"ready": true}``, or ``{"ready": false, "reason": ..., "models": {name: cause}}``."""
        if self.reason is None:
            return {"ready": True}
        out: dict = {"ready": False, "reason": self.reason}
        if self.models:
            out["models"] = dict(self.models)
        return out


def assess(*, start_error: str | None, stopping: bool, started: bool, runtime: Backend | None,
           endpoints: Iterable[Endpoint], llms: LanguageModels) -> Readiness:
    """Ready: started, not stopping, a worker (or replica) ready to serve, every model that
    is not optional able to serve (a pinned one resident too) and every language model
    that is not optional loaded. An unloaded model does not count: unloading is the
    operator's choice."""
    endpoints = list(endpoints)
    if start_error:
        return Readiness(f"start-up failed: {start_error}")
    if stopping:
        return Readiness("stopping")
    failed = {**_failed(endpoints), **llms.unready()}
    if not started or runtime is None:
        return Readiness("starting: models are loading", failed)
    snap = runtime.snapshot()
    if isinstance(snap, ClusterSnapshot) and snap.view.replicas_alive == 0:
        return Readiness("no replica of the cluster is alive", failed)
    rt = snap.runtime if isinstance(snap, ClusterSnapshot) else snap
    workers = None if rt is None else rt.workers
    if workers is not None and workers.ready == 0:  # every worker is dead or still starting
        last = workers.last_failure
        why = f"; the last to fail: {last.cause}" if last else ""
        return Readiness(f"no worker can serve: {workers.size} are starting{why}", failed)
    resident = {} if rt is None else rt.resident
    for ep in endpoints:
        if ep.pinned and not ep.optional and ep.name not in failed \
                and not (ep.state is ModelState.READY and ep.name in resident):
            failed[ep.name] = "pinned, not resident yet"
    if not failed:
        return Readiness()
    return Readiness("models cannot serve: " + "; ".join(f"{n} ({c})" for n, c in failed.items()), failed)


def _failed(endpoints: list[Endpoint]) -> dict[str, str]:
    """The models, not optional, whose last load failed, with the failure."""
    return {ep.name: ep.failure.describe() for ep in endpoints if ep.failure is not None and not ep.optional}


def fatal_failures(endpoints: Iterable[Endpoint], llms: LanguageModels, start_error: str | None) -> str | None:
    """What ``server.exit_on_error`` exits on, named: the models and language models, not
    optional, that failed for good, with their causes, and a failed start-up; None: nothing."""
    failed = {ep.name: ep.failure.cause for ep in endpoints
              if ep.failure is not None and ep.failure.permanent and not ep.optional}
    failed |= llms.permanent_failures()
    if start_error:
        failed["start-up"] = start_error
    return "; ".join(f"{name}: {cause}" for name, cause in failed.items()) or None
