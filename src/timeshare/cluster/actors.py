"""The Ray side of a cluster, in the front end's process: Ray imported, reached, or
started as a local cluster on the loopback interface; the replica's actor class and its
concurrency groups; Ray's wrapped errors as one line; a lost replica's shared memory
unlinked. Ray is imported only when a cluster starts."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from typing import Any

from timeshare.cluster.replica import Replica
from timeshare.errors import ConfigError

log = logging.getLogger(__name__)


OBSERVE = "observe"  # the actors' concurrency group for calls that must not wait for the device
GENERATE = "generate"  # the group of generations (NOTE [Language models on a cluster])
REPLICA_CALLS = 16  # calls a replica's actor takes at once (NOTE [Cluster deployment])
# The CPUs a replica's actor holds. Ray gives an actor as many intra-op threads as it holds
# CPUs (OMP_NUM_THREADS, unless the environment sets it), and a CPU kernel's bits depend on
# its thread count: a reference for a replica's outputs is computed on as many threads.
REPLICA_CPUS = 1


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("a timeshare cluster needs Ray: pip install 'timeshare[cluster]' (or ray)") from None
    return ray


# Ray binds a node's services to the host's network address even for a one-node cluster;
# with this set before Ray is imported, every process of a local cluster uses the loopback
# interface only (nothing of it is reachable from elsewhere, nothing leaves the host).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_local_ray(num_cpus: int):
    """A one-node Ray cluster on this host's loopback interface; returns the ``ray``
    module. Set up before anything in this process imports Ray, or Ray's own processes
    and this one disagree about the node's address (a warning says so)."""
    if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in LOOPBACK_ENV.items()):
        log.warning("Ray was imported before timeshare could keep a local cluster on the loopback interface")
    os.environ.update(LOOPBACK_ENV)
    ray = import_ray()
    try:
        # Ray starts its workers at nice 15, below every other process of the host: a
        # replica is the serving process itself, and it lost the CPU to anything else
        # running (3 to 9 times slower under the test suite's load). Ours run at 0.
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 _system_config={"worker_niceness": 0})
    except Exception as exc:
        raise ConfigError(f"cannot start a local Ray cluster: {type(exc).__name__}: {exc}") from None
    return ray


def connect(address: str | None, num_cpus: int) -> tuple[Any, bool]:
    """The ``ray`` module, connected: to Ray already running in this process, to the
    cluster at ``address``, or to a local one started with ``num_cpus`` CPUs (``address``
    None); and whether this process started the connection (and shuts it down)."""
    if address is not None:
        reachable(address)
    if "ray" in sys.modules and import_ray().is_initialized():
        return import_ray(), False
    if address is None:
        return start_local_ray(num_cpus), True
    ray = import_ray()
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {type(exc).__name__}: {exc}") from None
    return ray, True


def actor_class(ray: Any, device: str, generations: int) -> Any:
    """``Replica`` as a Ray actor class (NOTE [Cluster deployment]), with ``generations``
    threads for generations (NOTE [Language models on a cluster])."""
    # Calls in the "observe" group (snapshots, a job's pause or resume) run beside the
    # inference in progress, in threads of their own: a scrape never waits for the device.
    # A replica on "cuda" takes one GPU, which Ray makes its "cuda" (CUDA_VISIBLE_DEVICES).
    gpus = 1 if str(device).startswith("cuda") else 0
    return ray.remote(num_cpus=REPLICA_CPUS, num_gpus=gpus, max_restarts=0, max_concurrency=REPLICA_CALLS,
                      concurrency_groups={OBSERVE: 2, GENERATE: generations})(Replica)


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """A Ray address ``host:port`` (or ``ray://host:port``) answers a TCP connection within
    ``timeout_s``; otherwise a clear error now, not Ray's long retries."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the Ray cluster at {address!r} cannot be reached: {exc}") from None


def cause(exc: BaseException) -> str:
    """One line: the exception's type and, for Ray's wrapped errors, the innermost
    error line of its text (the replica's own error), else its first line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    inner = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    text = inner[-1] if inner else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:300]


def unlink_segments(segments: list[str]) -> None:
    """Unlink a replica's shared memory (a killed process never unlinks its own)."""
    for name in segments:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:  # closed by its owner, or unlinked already
            pass
        except OSError as exc:
            log.warning("cannot unlink shared memory %s: %s", name, exc)
