"""A timeshare cluster on Ray: the front end (``Cluster``) over replicas (one runtime per
device, each in a Ray actor), composed of the replicas' slots (``replicas.py``), the
router and the requests it routes (``requests.py``), the training jobs (``jobs.py``) and
the language models' generations (``generations.py``); Ray's side in ``actors.py``. Runs
in the front end's process.

NOTE [Cluster deployment]
Why Ray actors and not Ray Serve: a Serve deployment's replicas are interchangeable and
its router picks among them with its own rule (for multiplexed models, Ray's LRU by
model count); ours must route by the state of each replica's device memory, with the
policy the simulator measured (NOTE [Fleet routing]). So each replica is a plain Ray
actor (``Replica``: one runtime, one device), and the front end holds the router (the
same compiled ``choose``/``place`` as ``timeshare sim cluster``) over a ``Fleet`` whose
devices are the replicas. A replica's actor takes up to ``REPLICA_CALLS`` calls at
once, each in a thread of its own waiting in the runtime's dispatcher: the runtime, not
Ray's mailbox, orders the requests waiting there (priority, EDF), and a training job
there sees that inference waits (it is preempted between iterations, not given the
device between two requests).
Ray gives placement, process supervision and transport; the
decision is ours.

The router's view of each replica is an estimate kept without asking it: a request
routed there adds its profiled time (cold if the model is not resident there, ready if
it is) to when the replica's queue drains, and a replica with nothing outstanding has
drained now. Costs come from profiling each model once on the first replica (its cold
and ready times, its bytes).

Faults. A replica that dies (its actor is killed, or its process crashes) fails the
calls it held; an inference is safe to run again, so each such call is retried once on
another replica, chosen by the router after the dead one is retired (it holds nothing
and is never chosen again). Calls still queued in the dead actor fail the same way and
are retried the same way: nothing queued is lost. A retried call that fails again
fails with the error of both attempts. A replica added at run time (``add_replica``)
takes a free slot and is chosen from then on. Every wait has a deadline
(``call_timeout_s``); a replica that misses it is treated as dead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from timeshare.cluster.actors import (
    OBSERVE,
    REPLICA_CALLS,
    REPLICA_CPUS,
    actor_class,
    cause,
    connect,
    import_ray,
    start_local_ray,
)
from timeshare.cluster.generations import Generations, generations_per_replica
from timeshare.cluster.jobs import Jobs
from timeshare.cluster.replica import ModelDef, Reply
from timeshare.cluster.replicas import ClusterStats, ReplicaLostError, ReplicaSet, ReplicaSlot
from timeshare.cluster.requests import Requests
from timeshare.cluster.snapshots import ReplicaRow, ReplicaSnapshot
from timeshare.errors import ConfigError, UnknownModelError
from timeshare.llm.model import LLMDef
from timeshare.options import RuntimeOptions
from timeshare.scheduler.routing import Fleet, Router, compile_steps, policy_code
from timeshare.units import parse_bytes

# Imported from here by the rest of timeshare (and its tests): the cluster's public names.
__all__ = ["OBSERVE", "REPLICA_CALLS", "REPLICA_CPUS", "Cluster", "ClusterStats", "ReplicaLostError",
           "ReplicaSlot", "import_ray", "start_local_ray"]

class Cluster:
    """``replicas`` timeshare runtimes of ``memory`` bytes each, every model of ``models``
    registered on each, requests routed by ``policy`` (NOTE [Fleet routing]).

    ``address``: a running Ray cluster's address; None starts a local one on the loopback
    interface with ``num_cpus`` CPUs. ``max_replicas`` bounds ``add_replica``.

    The front end composes the parts: ``replicas`` (the actors, started, lost, asked),
    ``requests`` (the router and the calls it routes), ``jobs`` (training jobs and their
    moves) and ``generations`` (language models' sequences)."""

    def __init__(self, models: Sequence[ModelDef], *, replicas: int = 3, memory: int | str = "64MiB",
                 policy: str = "timeshare", address: str | None = None, num_cpus: int | None = None,
                 max_replicas: int | None = None, call_timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 seed: int = 0, device: str = "cpu", runtime: RuntimeOptions | None = None,
                 cpu_fallback: int | str | None = None, llms: Sequence[LLMDef] = (), failing: Sequence[int] = ()):
        if not models and not llms:
            raise ConfigError("a cluster needs at least one model or language model")
        if replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {replicas}")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must be unique, got {names}")
        policy_code(policy)  # an unknown policy is refused before anything starts
        if max_replicas is not None and max_replicas < replicas:
            raise ConfigError(f"max_replicas ({max_replicas}) must be at least replicas ({replicas})")
        self.models = list(models)
        self.index = {m.name: i for i, m in enumerate(self.models)}
        if runtime is not None:  # a server's runtime section: its device and budget are the replicas'
            device, memory = runtime.device, runtime.memory
        self.memory = parse_bytes(memory, what="memory")
        self.device = device
        self.runtime = runtime
        self.cpu_fallback = cpu_fallback  # NOTE [CPU fallback]
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.seed = seed
        n = max_replicas or replicas + 2
        self._ray, self._owns_ray = connect(address, num_cpus or n + 1)
        llm_specs = {spec.name: spec for spec in llms}  # NOTE [Language models on a cluster]
        self.replicas = ReplicaSet(self._ray, actor_class(self._ray, device, generations_per_replica(llms)),
                                   self.models, memory=self.memory, device=device, runtime=runtime,
                                   cpu_fallback=cpu_fallback, llms=list(llm_specs.values()),
                                   call_timeout_s=call_timeout_s, start_timeout_s=start_timeout_s,
                                   on_lost=self._on_lost)
        self.jobs = Jobs(self.replicas)
        self.generations = Generations(self.replicas, llms)
        self.requests: Requests | None = None  # None: no model to route (language models alone)
        self._policy = policy
        try:  # whatever fails from here on, nothing started is left behind
            self.replicas.start_all(n, replicas, failing)
            if self.models:  # language models alone route by generations (``Generations``): no router
                compile_steps()  # the router's compiled steps, before any request waits on them
                costs = self.replicas.profile()
                self.requests = Requests(self.replicas, self.models, costs, policy=policy, seed=seed)
        except BaseException:
            self.close()
            raise

    def _on_lost(self, i: int) -> None:
        """Replica ``i`` was lost (under the replicas' lock): its jobs died with it, and the
        router retires it (none yet during the warm-up: nothing to retire)."""
        self.jobs.drop_replica(i)
        if self.requests is not None:
            self.requests.router.retire(i)

    @property
    def _requests(self) -> Requests:
        if self.requests is None:
            raise UnknownModelError("this cluster serves language models only: it has no model to route requests to")
        return self.requests

    # ------------------------------------------------------------------ the parts' state
    @property
    def slots(self) -> list[ReplicaSlot]:
        return self.replicas.slots

    @property
    def stats(self) -> ClusterStats:
        return self.replicas.stats

    @property
    def lost(self) -> dict[str, str]:
        """Every replica lost so far -> why."""
        return self.replicas.lost

    @property
    def llms(self) -> dict[str, LLMDef]:
        """The language models as replicas start them now (with the adapters loaded since)."""
        with self.replicas.lock:
            return {spec.name: spec for spec in self.replicas.llms}

    @property
    def llm_failures(self) -> dict[str, str]:
        """Language models that did not load on a replica, and why."""
        return self.replicas.llm_failures

    @property
    def generations_per_replica(self) -> int:
        return self.generations.per_replica

    @property
    def policy(self) -> str:
        return self.requests.policy if self.requests is not None else self._policy

    @property
    def costs(self) -> dict:
        return self._requests.costs

    @property
    def router(self) -> Router:
        return self._requests.router

    @property
    def fleet(self) -> Fleet:
        return self._requests.fleet

    # ------------------------------------------------------------------ replicas
    def add_replica(self) -> str:
        """Start one more replica in a free slot; it takes requests from then on."""
        return self.replicas.add(self.requests.admit if self.requests is not None else lambda i: None)

    def kill_replica(self, name: str) -> None:
        """Kill a replica's actor (a drill: what a crashed replica looks like)."""
        self.replicas.kill(name)

    def use_policy(self, policy: str) -> None:
        """Route by ``policy`` from now on (``Requests.use_policy``). Not while requests are
        in flight."""
        self._requests.use_policy(policy)

    # ------------------------------------------------------------------ requests
    def infer(self, model: str, *args, age_s: float = 0.0) -> Reply:
        """One request, routed, and retried once elsewhere if its replica dies
        (``Requests.infer``)."""
        return self._requests.infer(model, *args, age_s=age_s)

    def submit(self, model: str, *args) -> Future:
        return self._requests.submit(model, *args)

    def is_resident(self, model: str) -> bool:
        return self._requests.is_resident(model)

    def evict(self, model: str) -> None:
        """Evict ``model`` on every live replica."""
        self.replicas.evict(model)

    # ------------------------------------------------------------------ language models
    def generate(self, model: str, prompt: list[int], params: Any, gen_id: str,
                 adapter: str | None = None) -> tuple[int, Any, Callable]:
        return self.generations.generate(model, prompt, params, gen_id, adapter)

    def adapt(self, model: str, name: str, path: str | None, pinned: bool = False,
              restore: str | None = None) -> None:
        """Adapter ``name`` of ``model`` served from ``path`` by every replica (None: by
        none; ``restore``: what a refused replace puts back)."""
        try:
            self.replicas.adapt(model, name, path, pinned, restore)
        finally:  # new contents, or none, or a refusal some replicas took back: no slot is known to hold it
            self.generations.forget(model, name)

    def events(self, stream: Any, timeout_s: float):
        return self.generations.events(stream, timeout_s)

    def died(self, exc: BaseException) -> bool:
        return self.generations.died(exc)

    def cancel_generation(self, i: int, gen_id: str) -> None:
        self.generations.cancel(i, gen_id)

    # ------------------------------------------------------------------ training jobs
    def train(self, name: str, workload: str, iterations: int, *, seed: int = 0, replica: str | None = None) -> str:
        return self.jobs.train(name, workload, iterations, seed=seed, replica=replica)

    def start_job(self, name: str, kwargs: dict, *, replica: str | None = None) -> dict:
        return self.jobs.start_job(name, kwargs, replica=replica)

    def job_names(self) -> list[str]:
        return self.jobs.job_names()

    def job_replica(self, name: str) -> str:
        return self.jobs.job_replica(name)

    def control_job(self, name: str, action: str) -> dict:
        return self.jobs.control_job(name, action)

    def forget_job(self, name: str) -> None:
        self.jobs.forget_job(name)

    def migrate(self, name: str, to: str | None = None) -> dict:
        return self.jobs.migrate(name, to)

    def job(self, name: str) -> dict:
        return self.jobs.job(name)

    def job_weights(self, name: str, timeout_s: float = 600.0) -> dict:
        return self.jobs.job_weights(name, timeout_s)

    # ------------------------------------------------------------------ observing
    def snapshots(self, timeout_s: float = 5.0) -> dict[str, ReplicaSnapshot]:
        """Each live replica's snapshot (``ReplicaSet.snapshots``)."""
        return self.replicas.snapshots(timeout_s)

    def replica_rows(self) -> list[ReplicaRow]:
        """Each replica slot in use: name, alive, requests outstanding, error, and the
        router's view of what it holds."""
        with self.replicas.lock:
            fleet = self.requests.fleet if self.requests is not None else None
            rows = []
            for i, s in enumerate(self.slots):
                if not (s.alive or s.error or s.reserved):
                    continue
                held = [] if fleet is None else \
                    [self.models[m].name for m in range(len(self.models)) if int(fleet.slot_of[m, i]) >= 0]
                rows.append(ReplicaRow(replica=s.name, alive=s.alive, starting=s.reserved, outstanding=s.outstanding,
                                       error=s.error, routed_resident=held, jobs=self.jobs.on(i)))
            return rows

    def status(self) -> dict:
        """``replica_rows`` with each live replica's own state, resident models and loads
        (asked of it), and the cluster's counters."""
        out = [r.to_json() for r in self.replica_rows()]
        actors = {s.name: s.actor for s in self.slots}
        for row in out:
            if row["alive"]:
                try:
                    row.update(self._ray.get(actors[row["replica"]].stats.remote(), timeout=self.call_timeout_s))
                except Exception as exc:
                    row["error"] = cause(exc)
        return {"replicas": out, "requests": self.stats.requests, "loads": self.stats.loads,
                "retried": self.stats.retried, "failed": self.stats.failed, "migrations": self.stats.migrations,
                "cpu_fallbacks": self.stats.cpu_fallbacks,
                "replicas_lost": self.stats.replicas_lost}

    def close(self) -> None:
        if self.requests is not None:
            self.requests.close()
        self.replicas.close()
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
