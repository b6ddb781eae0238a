"""A timeshare cluster on Ray: replicas (one runtime per device, each in a Ray actor) and
the router in front of them. Runs in the front end's process.

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

import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from timeshare.cluster.llm import LLMDef
from timeshare.cluster.replica import ModelDef, Replica, Reply
from timeshare.errors import (
    ConfigError,
    Conflict,
    ModelTooLargeError,
    Overloaded,
    Timeout,
    Unavailable,
    UnknownModelError,
)
from timeshare.models.workloads import TrainingWorkload
from timeshare.scheduler.routing import Fleet, Router, compile_steps, cpu_sooner, policy_code
from timeshare.units import parse_bytes

log = logging.getLogger(__name__)


OBSERVE = "observe"  # the actors' concurrency group for calls that must not wait for the device
GENERATE = "generate"  # the group of generations (NOTE [Language models on a cluster])
REPLICA_CALLS = 16  # calls a replica's actor takes at once (NOTE [Cluster deployment])
# The CPUs a replica's actor holds. Ray gives an actor as many intra-op threads as it holds
# CPUs (OMP_NUM_THREADS, unless the environment sets it), and a CPU kernel's bits depend on
# its thread count: a reference for a replica's outputs is computed on as many threads.
REPLICA_CPUS = 1


class ReplicaLostError(Unavailable):
    """A request whose replica died, and whose retry failed too (or had nowhere to go):
    the cluster's state, not the request, is at fault (503)."""


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
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    except Exception as exc:
        raise ConfigError(f"cannot start a local Ray cluster: {type(exc).__name__}: {exc}") from None
    return ray


@dataclass
class ReplicaSlot:
    name: str
    actor: Any = None  # a Ray actor handle
    alive: bool = False
    outstanding: int = 0
    error: str | None = None
    segments: list[str] = field(default_factory=list)  # its shared memory, when on this host
    reserved: bool = False  # being started by add_replica
    cpu_outstanding: int = 0  # of ``outstanding``, those on its CPU fallback
    cpu_free_at: float = 0.0  # when its CPU fallback's queue is expected to drain


@dataclass
class ClusterStats:
    requests: int = 0
    loads: int = 0
    retried: int = 0
    failed: int = 0
    migrations: int = 0
    replicas_lost: int = 0
    cpu_fallbacks: int = 0  # requests run on a replica's CPU (NOTE [CPU fallback])
    per_replica: dict[str, dict] = field(default_factory=dict)


class Cluster:
    """``replicas`` timeshare runtimes of ``memory`` bytes each, every model of ``models``
    registered on each, requests routed by ``policy`` (NOTE [Fleet routing]).

    ``address``: a running Ray cluster's address; None starts a local one on the loopback
    interface with ``num_cpus`` CPUs. ``max_replicas`` bounds ``add_replica``."""

    def __init__(self, models: Sequence[ModelDef], *, replicas: int = 3, memory: int | str = "64MiB",
                 policy: str = "timeshare", address: str | None = None, num_cpus: int | None = None,
                 max_replicas: int | None = None, call_timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 seed: int = 0, device: str = "cpu", runtime: dict | None = None,
                 cpu_fallback: int | str | None = None, llms: Sequence[LLMDef] = (), failing: Sequence[int] = ()):
        if not models:
            raise ConfigError("a cluster needs at least one model")
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
            device, memory = runtime["device"], runtime["memory"]
        self.memory = parse_bytes(memory, what="memory")
        self.device = device
        self.runtime = runtime
        self.policy = policy
        self.cpu_fallback = cpu_fallback  # NOTE [CPU fallback]
        self.llms = {spec.name: spec for spec in llms}  # NOTE [Language models on a cluster]
        self._llm_home: dict[str, int] = {}  # language model -> the replica that generated for it last
        self._generating: dict[tuple[int, str], int] = {}  # (replica, model) -> generations in flight
        self.llm_failures: dict[str, str] = {}  # language models that did not load on a replica, and why
        # A replica's generations, each holding a thread of its actor's "generate" group.
        self.generations_per_replica = max(1, sum(spec.max_sequences for spec in llms))
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        n = max_replicas or replicas + 2
        self._owns_ray = False
        if address is not None:
            _reachable(address)
        if "ray" in sys.modules and import_ray().is_initialized():
            self._ray = import_ray()
        elif address is None:
            self._ray = start_local_ray(num_cpus or n + 1)
            self._owns_ray = True
        else:
            self._ray = ray = import_ray()
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as exc:
                raise ConfigError(f"cannot reach the Ray cluster at {address}: {type(exc).__name__}: {exc}") from None
            self._owns_ray = True
        # Calls in the "observe" group (snapshots, a job's pause or resume) run beside the
        # inference in progress, in threads of their own: a scrape never waits for the device.
        # A replica on "cuda" takes one GPU, which Ray makes its "cuda" (CUDA_VISIBLE_DEVICES).
        gpus = 1 if str(device).startswith("cuda") else 0
        self._actor_class = self._ray.remote(num_cpus=REPLICA_CPUS, num_gpus=gpus, max_restarts=0,
                                             max_concurrency=REPLICA_CALLS,
                                             concurrency_groups={OBSERVE: 2,
                                                                 GENERATE: self.generations_per_replica})(Replica)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.slots: list[ReplicaSlot] = []
        self.stats = ClusterStats()
        self._segments: dict[int, list[str]] = {}
        self._generations: dict[int, int] = {}
        self._jobs: dict[str, int] = {}  # training job -> the slot it runs on
        self._job_specs: dict[str, dict] = {}  # training job -> Runtime.train's keyword arguments
        self.lost: dict[str, str] = {}  # every replica lost so far -> why
        self._observing: dict[str, Any] = {}  # replica -> its snapshot asked for and not yet read
        self.seed = seed
        try:  # whatever fails from here on, nothing started is left behind
            self.slots = [ReplicaSlot(f"replica-{i}") for i in range(n)]
            started = [self._start(i, fail=i in failing) for i in range(replicas)]
            for i, (actor, error) in enumerate(started):
                self.slots[i] = ReplicaSlot(f"replica-{i}", actor, actor is not None, error=error,
                                            segments=self._segments.pop(i, []))
            if not any(s.alive for s in self.slots):
                raise ConfigError(f"no replica started: {[e for _, e in started]}")
            compile_steps()  # the router's compiled steps, before any request waits on them
            self.costs = self._profile()
            self.router = self._router(policy)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="timeshare-cluster")

    def _router(self, policy: str) -> Router:
        """A fresh view of the live replicas, all empty (NOTE [Fleet routing]). Only Ray's
        rule limits models by count, as in the simulator."""
        c = self.costs
        max_models = max(1, int(self.memory // float(np.mean(c["bytes"])))) if policy == "ray" else 0
        self.fleet = Fleet.create(c["bytes"], c["ready_s"], c["cold_s"], c["load_s"],
                                  [self.memory if s.alive else 0 for s in self.slots], max_models=max_models)
        return Router(self.fleet, policy, seed=self.seed)

    def use_policy(self, policy: str) -> None:
        """Route by ``policy`` from now on, every live replica emptied and the router's view
        started afresh: runs of several policies over the same replicas start alike. Not
        while requests are in flight."""
        policy_code(policy)
        with self._lock:
            if any(s.outstanding for s in self.slots):
                raise ConfigError("use_policy while requests are in flight")
            live = [i for i, s in enumerate(self.slots) if s.alive]
        for i in live:  # outside the lock: a replica found dead here is lost, not an error
            try:
                self._ray.get(self.slots[i].actor.evict_all.remote(), timeout=self.call_timeout_s)
            except Exception as exc:
                self._lost(i, f"{self.slots[i].name} died: {_cause(exc)}")
        with self._lock:
            self.router = self._router(policy)
            self.policy = policy
            self.stats = ClusterStats()

    # ------------------------------------------------------------------ replicas
    def _start(self, i: int, *, fail: bool = False, name: str | None = None) -> tuple[Any, str | None]:
        """A replica actor, started and answering, or the error that stopped it."""
        actor = self._actor_class.remote(name or f"replica-{i}", self.models, device=self.device,
                                         memory=self.memory, runtime=self.runtime, cpu_fallback=self.cpu_fallback,
                                         llms=list(self.llms.values()), fail_start=fail)
        try:
            hello = self._ray.get(actor.ping.remote(), timeout=self.start_timeout_s)
            if hello["host"] == socket.gethostname():
                self._segments[i] = list(hello["segments"])
            for model, why in hello["llm_failures"].items():
                log.error("language model %s did not load on replica-%d: %s", model, i, why)
                self.llm_failures.setdefault(model, why)
            return actor, None
        except Exception as exc:
            self._ray.kill(actor)
            log.warning("replica-%d did not start: %s", i, _cause(exc))
            return None, f"replica-{i}: {_cause(exc)}"

    def add_replica(self) -> str:
        """Start one more replica in a free slot; it takes requests from then on."""
        with self._lock:
            free = [i for i, s in enumerate(self.slots) if not s.alive and not s.reserved]
            if not free:
                raise ConfigError(f"no free replica slot (max_replicas={len(self.slots)})")
            i = free[0]
            name = f"replica-{i}" if self.slots[i].error is None else f"replica-{i}.{self._generation(i)}"
            self.slots[i] = ReplicaSlot(name, reserved=True)  # taken: no other add_replica gets it
        actor, error = self._start(i, name=name)
        try:
            if actor is None:
                raise ConfigError(f"the new replica did not start: {error}")
            with self._lock:
                self.slots[i] = ReplicaSlot(name, actor, False, reserved=True, segments=self._segments.pop(i, []))
            self._warm(i)
        except BaseException as exc:
            with self._lock:
                slot = self.slots[i]
                self.slots[i] = ReplicaSlot(name, error=f"{name} did not start: {_cause(exc)}")
            if slot.actor is not None:
                self._ray.kill(slot.actor, no_restart=True)
                _unlink(slot.segments)
            raise
        with self._lock:
            self.slots[i].alive, self.slots[i].reserved = True, False
            self.router.admit(i, self.memory, self._now())
        return name

    def _generation(self, i: int) -> int:
        self._generations[i] = self._generations.get(i, 0) + 1
        return self._generations[i]

    def kill_replica(self, name: str) -> None:
        """Kill a replica's actor (a drill: what a crashed replica looks like)."""
        slot = next((s for s in self.slots if s.name == name and s.alive), None)
        if slot is None:
            raise ConfigError(f"no live replica {name!r}")
        self._ray.kill(slot.actor, no_restart=True)

    def _lost(self, i: int, error: str) -> None:
        """Replica ``i`` is gone: killed for good (an actor Ray calls unavailable may still
        run), retired from the router, its shared memory unlinked, its slot free again."""
        with self._lock:
            slot = self.slots[i]
            if not slot.alive:
                return
            slot.alive, slot.error = False, error
            self.stats.replicas_lost += 1
            self.lost[slot.name] = error
            for job in [n for n, j in self._jobs.items() if j == i]:  # they died with it
                del self._jobs[job]
                self._job_specs.pop(job, None)
            router = getattr(self, "router", None)  # none yet during the warm-up: nothing to retire
            if router is not None:
                router.retire(i)
        log.warning("%s lost: %s", slot.name, error)
        try:
            self._ray.kill(slot.actor, no_restart=True)
        except Exception:  # gone already
            pass
        _unlink(slot.segments)  # a killed process never unlinks its shared memory
        with self._lock:
            slot.actor, slot.segments = None, []

    def _profile(self) -> dict:
        """Every replica warms every model up (its first load profiles it there), so no
        request pays that; the costs are the first live replica's measurements (cold and
        ready times, bytes)."""
        live = [s for s in self.slots if s.alive]
        refs = {s.name: [s.actor.profile.remote(m.name) for m in self.models] for s in live}
        answers = {}
        for s in live:
            try:
                answers[s.name] = self._ray.get(refs[s.name], timeout=self.start_timeout_s)
            except Exception as exc:
                self._lost(self.slots.index(s), f"{s.name} failed its warm-up: {_cause(exc)}")
        if not answers:
            raise ConfigError("no replica finished its warm-up")
        # The first call carrying tensors sets up their transport (seconds, once): not on a request.
        args = self.models[0].example_inputs()
        self._ray.get([s.actor.echo.remote(args) for s in live if s.name in answers], timeout=self.start_timeout_s)
        first = answers[next(iter(answers))]
        for m, p in zip(self.models, first, strict=True):
            if p["too_large"]:
                log.warning("model %s (%d bytes) fits on no replica of %d bytes: its requests are refused",
                            m.name, p["bytes"], self.memory)
        return {"cold_s": [max(p["cold_s"], 1e-6) for p in first], "ready_s": [max(p["ready_s"], 1e-6) for p in first],
                "bytes": [p["bytes"] for p in first], "cpu_s": [p.get("cpu_cold_s") for p in first],
                "load_s": [max(p["cold_s"] - p["ready_s"], 1e-6) for p in first]}

    def _warm(self, i: int) -> None:
        """A replica started at run time warms every model up before it takes requests."""
        slot = self.slots[i]
        self._ray.get([slot.actor.profile.remote(m.name) for m in self.models], timeout=self.start_timeout_s)

    # ------------------------------------------------------------------ requests
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def infer(self, model: str, *args, age_s: float = 0.0) -> Reply:
        """Route one request, run it on the chosen replica, retry it once elsewhere if that
        replica dies (NOTE [Cluster deployment]). ``age_s``: how long it has waited already
        (its replica's scheduler counts its SLO from then)."""
        t0 = time.monotonic()
        if model not in self.index:
            raise UnknownModelError(f"unknown model {model!r}; known: {sorted(self.index)}")
        first_error: _ReplicaDied | None = None
        for _attempt in range(2):
            try:
                i, wait_s, on_cpu = self._route(model)
            except ReplicaLostError as exc:
                if first_error is None:
                    raise
                with self._lock:
                    self.stats.failed += 1
                raise ReplicaLostError(f"request for {model!r}: {first_error}; not retried: {exc}") from None
            try:
                reply = self._call(i, model, args, wait_s, on_cpu, age_s + time.monotonic() - t0)
            except _ReplicaDied as exc:
                self._lost(i, str(exc))
                if first_error is None:
                    first_error = exc
                    with self._lock:
                        self.stats.retried += 1
                    continue
                with self._lock:
                    self.stats.failed += 1
                raise ReplicaLostError(f"request for {model!r}: {first_error}; retried: {exc}") from None
            with self._lock:
                self.stats.requests += 1
                self.stats.loads += int(reply.loaded and not on_cpu)  # the devices' loads
            return reply
        raise AssertionError("unreachable")

    def submit(self, model: str, *args) -> Future:
        return self._pool.submit(self.infer, model, *args)

    def _route(self, model: str) -> tuple[int, float, bool]:
        """The replica for a request, the seconds it is expected to wait there, and whether
        it runs on that replica's CPU fallback (NOTE [CPU fallback])."""
        m = self.index[model]
        with self._lock:
            if not any(s.alive for s in self.slots):
                raise ReplicaLostError(f"request for {model!r}: no replica is alive")
            if self.fleet.size[m] > self.memory:
                raise ModelTooLargeError(model, int(self.fleet.size[m]), self.memory)
            now = self._now()
            i = self.router.choose(m, now)
            slot = self.slots[i]
            cpu_s = self.costs["cpu_s"][m]
            if cpu_s is not None and cpu_sooner(now, float(self.fleet.free_at[i]), self.router.cost_s(m, i),
                                                slot.cpu_free_at, cpu_s):
                start = max(now, slot.cpu_free_at)
                slot.cpu_free_at = start + cpu_s
                slot.outstanding += 1
                slot.cpu_outstanding += 1
                self.stats.cpu_fallbacks += 1
                return i, start - now, True
            placed = self.router.place(m, i, now)
            # The replica's runtime evicts by its own rule: the router's imagined evictions
            # (placed.owed_s) are not added to its queue.
            start = max(now, float(self.fleet.free_at[i]))
            cost = self.fleet.cold_s[m] if placed.loads else self.fleet.compute_s[m]
            self.router.queued(i, m, start + cost)
            self.slots[i].outstanding += 1
            return i, start - now, False

    def _call(self, i: int, model: str, args: tuple, wait_s: float, on_cpu: bool = False,
              age_s: float = 0.0) -> Reply:
        """The call on replica ``i``; its deadline is ``call_timeout_s`` beyond the wait the
        router expected there (a replica busy with a queue is not a dead one)."""
        ray = self._ray
        slot = self.slots[i]
        deadline = self.call_timeout_s + wait_s
        ok = False
        try:
            reply = ray.get(slot.actor.infer.remote(model, args, on_cpu, age_s), timeout=deadline)
            ok = True
            return reply
        except ray.exceptions.RayTaskError as exc:  # the replica's own error (bad inputs, no memory): as raised there
            ok = True
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if cause is None:
                raise
            raise cause from None
        except ray.exceptions.GetTimeoutError:
            raise _ReplicaDied(f"{slot.name} did not answer within {deadline:.3g} s; it was killed") from None
        except ray.exceptions.RayActorError as exc:
            raise _ReplicaDied(f"{slot.name} died: {_cause(exc)}") from None
        finally:
            with self._lock:
                slot.outstanding -= 1
                if on_cpu:
                    slot.cpu_outstanding -= 1
                    if slot.cpu_outstanding == 0:
                        slot.cpu_free_at = self._now()
                if ok and slot.outstanding == slot.cpu_outstanding and slot.alive:  # the device's queue drained
                    self.router.drained(i, self._now())

    # ------------------------------------------------------------------ language models
    def generate(self, model: str, prompt: list[int], params: Any, gen_id: str) -> tuple[int, Any, Callable]:
        """Start a generation of language model ``model`` (NOTE [Language models on a
        cluster]): the replica's slot, the stream of its events (each a Ray object
        reference), and what ends its count in flight."""
        spec = self.llms.get(model)
        if spec is None:
            raise UnknownModelError(f"no language model named {model!r}; known: {sorted(self.llms)}")
        with self._lock:
            live = [i for i, s in enumerate(self.slots) if s.alive and s.actor is not None]
            if not live:
                raise ReplicaLostError(f"generation for {model!r}: no replica is alive")

            def load(i: int) -> int:
                return sum(n for (j, _), n in self._generating.items() if j == i)

            home = self._llm_home.get(model)
            if home not in live or self._generating.get((home, model), 0) >= spec.max_sequences \
                    or load(home) >= self.generations_per_replica:
                home = min(live, key=load)
            if load(home) >= self.generations_per_replica:
                raise Overloaded(f"every replica generates {self.generations_per_replica} sequences already", 1)
            self._llm_home[model] = home
            key = (home, model)
            self._generating[key] = self._generating.get(key, 0) + 1
            actor = self.slots[home].actor
        done = threading.Event()

        def finished() -> None:
            if not done.is_set():
                done.set()
                with self._lock:
                    self._generating[key] -= 1

        try:
            stream = actor.generate.options(num_returns="streaming", concurrency_group=GENERATE).remote(
                model, prompt, params, gen_id, self.call_timeout_s)
        except BaseException:
            finished()
            raise
        return home, stream, finished

    def events(self, stream: Any, timeout_s: float):
        """The events of a generation's stream, each waited for at most ``timeout_s``
        (then ``Timeout``); the replica's own error as raised there."""
        ray = self._ray
        while True:
            ready, _ = ray.wait([stream], timeout=timeout_s)
            if not ready:
                raise Timeout(f"no token within {timeout_s:g} s (cluster.call_timeout_s)")
            try:
                ref = next(stream)
            except StopIteration:
                return
            try:
                yield ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else None
                if cause is None:
                    raise
                raise cause from None

    def died(self, exc: BaseException) -> bool:
        """Whether ``exc`` says a replica's actor died."""
        return isinstance(exc, self._ray.exceptions.RayActorError)

    def cancel_generation(self, i: int, gen_id: str) -> None:
        slot = self.slots[i]
        if slot.alive and slot.actor is not None:
            slot.actor.cancel_generation.options(concurrency_group=OBSERVE).remote(gen_id)  # not waited for

    # ------------------------------------------------------------------ training jobs
    def train(self, name: str, workload: str, iterations: int, *, seed: int = 0, replica: str | None = None) -> str:
        """Start a training job (a zoo workload, "model:batch") on ``replica`` (default: the
        live replica running the fewest jobs); returns the replica's name."""
        kwargs = {**TrainingWorkload.parse(workload).train_args(), "iterations": iterations, "seed": seed}
        return self.start_job(name, kwargs, replica=replica)["replica"]

    def start_job(self, name: str, kwargs: dict, *, replica: str | None = None) -> dict:
        """``Runtime.train(name, **kwargs)`` on ``replica`` (default: the live replica
        running the fewest jobs); every argument must be picklable. The job's view, with
        its replica's name."""
        with self._lock:
            old = self._jobs.get(name)
        if old is not None:  # a name may be used again once its job has ended
            view = self._ray.get(self.slots[old].actor.job.options(concurrency_group=OBSERVE).remote(name),
                                 timeout=self.call_timeout_s)
            if view["status"] not in ("finished", "failed", "cancelled"):
                raise Conflict(f"a training job named {name!r} is {view['status']} on {self.slots[old].name}")
            self.forget_job(name)
        with self._lock:
            if name in self._jobs:
                raise Conflict(f"a training job named {name!r} was started meanwhile")
            i = self._replica_for_job(replica)
            self._jobs[name] = i  # reserved: a second start of the name is refused meanwhile
        try:
            view = self._ray.get(self.slots[i].actor.start_job.remote(name, kwargs), timeout=self.call_timeout_s)
        except BaseException:
            with self._lock:
                del self._jobs[name]
            raise
        with self._lock:
            self._job_specs[name] = dict(kwargs)
        return {"replica": self.slots[i].name, **view}

    def job_names(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def job_replica(self, name: str) -> str:
        return self.slots[self._job_slot(name)].name

    def _job_slot(self, name: str) -> int:
        with self._lock:
            i = self._jobs.get(name)
        if i is None:
            raise UnknownModelError(f"no training job named {name!r}; known: {sorted(self._jobs)}")
        return i

    def control_job(self, name: str, action: str) -> dict:
        """pause, resume or cancel the job where it runs (beside any inference there)."""
        i = self._job_slot(name)
        view = self._ray.get(self.slots[i].actor.control_job.options(concurrency_group=OBSERVE).remote(name, action),
                             timeout=self.call_timeout_s)
        return {"replica": self.slots[i].name, **view}

    def forget_job(self, name: str) -> None:
        """Drop an ended job here and on its replica (which holds its final state until then)."""
        i = self._job_slot(name)
        if self.slots[i].alive:
            self._ray.get(self.slots[i].actor.forget_job.remote(name), timeout=self.call_timeout_s)
        with self._lock:
            if self._jobs.get(name) == i:
                del self._jobs[name]
                self._job_specs.pop(name, None)

    def migrate(self, name: str, to: str | None = None) -> dict:
        """Move a training job to another replica (SwitchFlow): paused where it is at its
        next iteration boundary, checkpointed, dropped there, and resumed on ``to``
        (default: the other live replica running the fewest jobs) from that checkpoint
        (NOTE [Checkpoints]); it ends as if never moved."""
        src = self._job_slot(name)
        with self._lock:
            dst = self._replica_for_job(to, avoid=src)
        source, target = self.slots[src], self.slots[dst]
        spec = self._ray.get(source.actor.job.remote(name), timeout=self.call_timeout_s)
        if spec["status"] not in ("queued", "running"):
            raise Conflict(f"training job {name!r} is {spec['status']}: only a job that runs can move "
                           "(resume a paused one first)")
        started = False
        try:  # the job runs on the target before it is dropped here: a move that fails leaves it where it was
            self._ray.get(source.actor.pause_job.remote(name), timeout=self.call_timeout_s)
            checkpoint = self._ray.get(source.actor.checkpoint.remote(name), timeout=self.call_timeout_s)
            ref = target.actor.start_job.remote(name, {**self._job_specs[name], "resume": checkpoint})
            started = True  # perhaps: a start that timed out may still happen there
            self._ray.get(ref, timeout=self.call_timeout_s)
        except BaseException:
            if started:  # whatever started there goes (best effort: the target may be the one failing)
                try:
                    self._ray.get(target.actor.drop_job.remote(name), timeout=self.call_timeout_s)
                except Exception as exc:
                    log.warning("training job %s: dropping its copy on %s failed: %s", name, target.name,
                                _cause(exc))
            self._ray.get(source.actor.control_job.options(concurrency_group=OBSERVE).remote(name, "resume"),
                          timeout=self.call_timeout_s)
            raise
        try:
            self._ray.get(source.actor.drop_job.remote(name), timeout=self.call_timeout_s)
        except Exception as exc:  # it was cancelled there at least; it runs on the target now
            log.warning("training job %s moved, but its old copy on %s did not go: %s", name, source.name,
                        _cause(exc))
        with self._lock:
            self._jobs[name] = dst
            self.stats.migrations += 1
        return {"job": name, "from": source.name, "to": target.name, "iterations": checkpoint["iterations"],
                "status_before": spec["status"]}

    def job(self, name: str) -> dict:
        i = self._job_slot(name)
        return {"replica": self.slots[i].name,
                **self._ray.get(self.slots[i].actor.job.remote(name), timeout=self.call_timeout_s)}

    def job_weights(self, name: str, timeout_s: float = 600.0) -> dict:
        """The job's final parameters and buffers, once it has ended where it runs now."""
        i = self._job_slot(name)
        return self._ray.get(self.slots[i].actor.job_weights.remote(name, timeout_s), timeout=timeout_s + 30)

    def _replica_for_job(self, name: str | None, avoid: int | None = None) -> int:
        live = [i for i, s in enumerate(self.slots) if s.alive and i != avoid]
        if name is not None:
            live = [i for i in live if self.slots[i].name == name]
        if not live:
            raise ConfigError(f"no live replica {name or 'to run the job'}" + (" other than its own" if avoid else ""))
        return min(live, key=lambda i: sum(1 for j in self._jobs.values() if j == i))

    # ------------------------------------------------------------------ observing
    def is_resident(self, model: str) -> bool:
        """Whether the router holds ``model`` resident on some live replica (its view,
        kept without asking them)."""
        m = self.index.get(model)
        return m is not None and int(self.fleet.nholders[m]) > 0

    def evict(self, model: str) -> None:
        """Evict ``model`` on every live replica."""
        refs = [(i, s.actor.evict.remote(model)) for i, s in enumerate(self.slots) if s.alive]
        for i, ref in refs:  # a replica found dead here is lost, not an error
            try:
                self._ray.get(ref, timeout=self.call_timeout_s)
            except Exception as exc:
                self._lost(i, f"{self.slots[i].name} died: {_cause(exc)}")

    def snapshots(self, timeout_s: float = 5.0) -> dict[str, dict]:
        """Each live replica's ``Replica.snapshot`` (its runtime's counters, the evictions
        since the last one, its jobs), asked beside whatever it is running; a replica that
        does not answer in ``timeout_s`` is left out this time."""
        ray = self._ray
        live = [(i, s) for i, s in enumerate(self.slots) if s.alive and s.actor is not None]
        for _, s in live:  # at most one asked per replica: one not read yet is read now
            if s.name not in self._observing:
                self._observing[s.name] = s.actor.snapshot.options(concurrency_group=OBSERVE).remote()
        refs = [self._observing[s.name] for _, s in live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        done = set(ready)
        out = {}
        for i, s in live:
            ref = self._observing[s.name]
            if ref not in done:
                log.warning("%s did not report within %.3g s", s.name, timeout_s)
                continue
            del self._observing[s.name]
            try:
                out[s.name] = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError as exc:
                self._lost(i, f"{s.name} died: {_cause(exc)}")
            except Exception as exc:
                log.warning("%s did not report: %s", s.name, _cause(exc))
        return out

    def replica_rows(self) -> list[dict]:
        """Each replica slot in use: name, alive, requests outstanding, error, and the
        router's view of what it holds."""
        with self._lock:
            rows = []
            for i, s in enumerate(self.slots):
                if not (s.alive or s.error or s.reserved):
                    continue
                held = [self.models[m].name for m in range(len(self.models)) if int(self.fleet.slot_of[m, i]) >= 0]
                rows.append({"replica": s.name, "alive": s.alive, "starting": s.reserved,
                             "outstanding": s.outstanding, "error": s.error, "routed_resident": held,
                             "jobs": sorted(n for n, j in self._jobs.items() if j == i)})
            return rows

    def status(self) -> dict:
        """``replica_rows`` with each live replica's own state, resident models and loads
        (asked of it), and the cluster's counters."""
        out = self.replica_rows()
        actors = {s.name: s.actor for s in self.slots}
        for row in out:
            if row["alive"]:
                try:
                    row.update(self._ray.get(actors[row["replica"]].stats.remote(), timeout=self.call_timeout_s))
                except Exception as exc:
                    row["error"] = _cause(exc)
        return {"replicas": out, "requests": self.stats.requests, "loads": self.stats.loads,
                "retried": self.stats.retried, "failed": self.stats.failed, "migrations": self.stats.migrations,
                "cpu_fallbacks": self.stats.cpu_fallbacks,
                "replicas_lost": self.stats.replicas_lost}

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        live = [s for s in self.slots if s.alive]
        try:  # a replica that closes its runtime gives its memory back itself
            self._ray.get([s.actor.close.remote() for s in live], timeout=min(self.call_timeout_s, 30.0))
        except Exception as exc:
            log.warning("replicas did not all close: %s", _cause(exc))
        for s in self.slots:
            if s.actor is not None:
                try:
                    self._ray.kill(s.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            _unlink(s.segments)
            s.alive = False
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ReplicaDied(Exception):
    pass


def _unlink(segments: list[str]) -> None:
    for name in segments:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:  # closed by its owner, or unlinked already
            pass
        except OSError as exc:
            log.warning("cannot unlink shared memory %s: %s", name, exc)


def _reachable(address: str, timeout_s: float = 5.0) -> None:
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


def _cause(exc: BaseException) -> str:
    """One line: the exception's type and, for Ray's wrapped errors, the innermost
    error line of its text (the replica's own error), else its first line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    inner = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    text = inner[-1] if inner else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:300]
