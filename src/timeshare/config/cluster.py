"""The ``cluster`` section of ``timeshare.yaml``: serving from replicas on Ray
(NOTE [Cluster deployment]), how requests are routed between them, and the CPU beside
each device. Runs in the server's process.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from timeshare.config.fields import Strict, bytes_field


class ClusterConfig(Strict):
    """Serve from a timeshare cluster on Ray (NOTE [Cluster deployment]): several
    replicas, each a runtime on its own device built from the ``runtime`` section, with
    every model registered on each and requests routed between them. The HTTP APIs are
    the same; ``/admin/status`` and ``/metrics`` add up the replicas."""

    address: str | None = None
    """A running Ray cluster ("host:port", "ray://host:port" or "auto"); null starts a
    local one on this host's loopback interface."""
    replicas: Annotated[int, Field(ge=1, le=1024)] = 2
    """Replicas started with the server."""
    max_replicas: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Replicas may be added at run time (``POST /admin/replicas``) up to this many
    (default: two more than ``replicas``)."""
    policy: Literal["timeshare", "ray", "least-loaded", "random"] = "timeshare"
    """How a request's replica is chosen (NOTE [Fleet routing])."""
    num_cpus: Annotated[int, Field(ge=1)] | None = None
    """A local cluster's CPUs (each replica takes one; default: one per replica slot, plus one)."""
    call_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """A replica that does not answer a call within this many seconds beyond the wait
    the router expected is taken for dead and replaced by the others."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long a replica may take to start and warm every model up."""
    migrate_after_s: Annotated[float, Field(gt=0)] | None = 2.0
    """A training job preempted for this long, while another replica has no job and no
    requests in flight, moves there (SwitchFlow's migration; null: never on its own)."""
    cpu_fallback: int | str | None = None
    """Bytes for a CPU runtime beside each replica's device, with every model registered
    there too: a request runs on the replica's CPU when that would end sooner than waiting
    for its busy device (NOTE [CPU fallback]). Null: none. Meant for GPU replicas; on CPU
    replicas both runtimes share the same cores."""
    seed: int = 0
    """The router's random numbers (the "random" policy, ties)."""

    @field_validator("cpu_fallback", mode="before")
    @classmethod
    def _fallback_bytes(cls, v):
        if v is not None:
            bytes_field(v, "cpu_fallback")
        return v

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be at least replicas ({self.replicas})")
        return self
