"""A cluster's requests: routed by the router's view of the replicas (NOTE [Fleet
routing]), run on the chosen replica or its CPU fallback (NOTE [CPU fallback]), and
retried once elsewhere when that replica dies (the faults of NOTE [Cluster deployment] in
``cluster/cluster.py``). Runs in the front end's process."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from timeshare.cluster.actors import cause
from timeshare.cluster.replica import ModelDef, Reply
from timeshare.cluster.replicas import ClusterStats, ReplicaLostError, ReplicaSet
from timeshare.errors import ConfigError, ModelTooLargeError, UnknownModelError
from timeshare.scheduler.routing import Fleet, Router, cpu_sooner, policy_code


class _ReplicaDied(Exception):
    pass


class Requests:
    """Inference on ``replicas``: the router of ``policy`` over a fleet of the models'
    ``costs`` (as ``ReplicaSet.profile`` measured them), and the calls it routes."""

    def __init__(self, replicas: ReplicaSet, models: Sequence[ModelDef], costs: dict, *, policy: str, seed: int):
        self.replicas = replicas
        self.models = list(models)
        self.index = {m.name: i for i, m in enumerate(self.models)}
        self.memory = replicas.memory
        self.costs = costs
        self.seed = seed
        self.policy = policy
        self.router = self._router(policy)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="timeshare-cluster")

    def _router(self, policy: str) -> Router:
        """A fresh view of the live replicas, all empty (NOTE [Fleet routing]). Only Ray's
        rule limits models by count, as in the simulator."""
        c = self.costs
        max_models = max(1, int(self.memory // float(np.mean(c["bytes"])))) if policy == "ray" else 0
        self.fleet = Fleet.create(c["bytes"], c["ready_s"], c["cold_s"], c["load_s"],
                                  [self.memory if s.alive else 0 for s in self.replicas.slots], max_models=max_models)
        return Router(self.fleet, policy, seed=self.seed)

    def use_policy(self, policy: str) -> None:
        """Route by ``policy`` from now on, every live replica emptied and the router's view
        started afresh: runs of several policies over the same replicas start alike. Not
        while requests are in flight."""
        policy_code(policy)
        replicas = self.replicas
        with replicas.lock:
            if any(s.outstanding for s in replicas.slots):
                raise ConfigError("use_policy while requests are in flight")
            live = replicas.live()
        replicas.evict_all(live)  # outside the lock: a replica found dead here is lost, not an error
        with replicas.lock:
            self.router = self._router(policy)
            self.policy = policy
            replicas.stats = ClusterStats()

    def admit(self, i: int) -> None:
        """Replica ``i`` (started at run time) is chosen from now on; under the lock."""
        self.router.admit(i, self.memory, self.replicas.now())

    def is_resident(self, model: str) -> bool:
        """Whether the router holds ``model`` resident on some live replica (its view,
        kept without asking them)."""
        m = self.index.get(model)
        return m is not None and int(self.fleet.nholders[m]) > 0

    # ------------------------------------------------------------------ requests
    def infer(self, model: str, *args, age_s: float = 0.0) -> Reply:
        """Route one request, run it on the chosen replica, retry it once elsewhere if that
        replica dies (NOTE [Cluster deployment]). ``age_s``: how long it has waited already
        (its replica's scheduler counts its SLO from then)."""
        t0 = time.monotonic()
        if model not in self.index:
            raise UnknownModelError(f"unknown model {model!r}; known: {sorted(self.index)}")
        replicas = self.replicas
        first_error: _ReplicaDied | None = None
        for _attempt in range(2):
            try:
                i, wait_s, on_cpu = self._route(model)
            except ReplicaLostError as exc:
                if first_error is None:
                    raise
                with replicas.lock:
                    replicas.stats.failed += 1
                raise ReplicaLostError(f"request for {model!r}: {first_error}; not retried: {exc}") from None
            try:
                reply = self._call(i, model, args, wait_s, on_cpu, age_s + time.monotonic() - t0)
            except _ReplicaDied as exc:
                replicas.mark_lost(i, str(exc))
                if first_error is None:
                    first_error = exc
                    with replicas.lock:
                        replicas.stats.retried += 1
                    continue
                with replicas.lock:
                    replicas.stats.failed += 1
                raise ReplicaLostError(f"request for {model!r}: {first_error}; retried: {exc}") from None
            with replicas.lock:
                replicas.stats.requests += 1
                replicas.stats.loads += int(reply.loaded and not on_cpu)  # the devices' loads
            return reply
        raise AssertionError("unreachable")

    def submit(self, model: str, *args) -> Future:
        return self._pool.submit(self.infer, model, *args)

    def _route(self, model: str) -> tuple[int, float, bool]:
        """The replica for a request, the seconds it is expected to wait there, and whether
        it runs on that replica's CPU fallback (NOTE [CPU fallback])."""
        m = self.index[model]
        replicas = self.replicas
        with replicas.lock:
            if not any(s.alive for s in replicas.slots):
                raise ReplicaLostError(f"request for {model!r}: no replica is alive")
            if self.fleet.size[m] > self.memory:
                raise ModelTooLargeError(model, int(self.fleet.size[m]), self.memory)
            now = replicas.now()
            i = self.router.choose(m, now)
            slot = replicas.slots[i]
            cpu_s = self.costs["cpu_s"][m]
            if cpu_s is not None and cpu_sooner(now, float(self.fleet.free_at[i]), self.router.cost_s(m, i),
                                                slot.cpu_free_at, cpu_s):
                start = max(now, slot.cpu_free_at)
                slot.cpu_free_at = start + cpu_s
                slot.outstanding += 1
                slot.cpu_outstanding += 1
                replicas.stats.cpu_fallbacks += 1
                return i, start - now, True
            placed = self.router.place(m, i, now)
            # The replica's runtime evicts by its own rule: the router's imagined evictions
            # (placed.owed_s) are not added to its queue.
            start = max(now, float(self.fleet.free_at[i]))
            cost = self.fleet.cold_s[m] if placed.loads else self.fleet.compute_s[m]
            self.router.queued(i, m, start + cost)
            replicas.slots[i].outstanding += 1
            return i, start - now, False

    def _call(self, i: int, model: str, args: tuple, wait_s: float, on_cpu: bool = False,
              age_s: float = 0.0) -> Reply:
        """The call on replica ``i``; its deadline is ``call_timeout_s`` beyond the wait the
        router expected there (a replica busy with a queue is not a dead one)."""
        replicas = self.replicas
        ray = replicas.ray
        slot = replicas.slots[i]
        deadline = replicas.call_timeout_s + wait_s
        ok = False
        try:
            reply = ray.get(slot.actor.infer.remote(model, args, on_cpu, age_s), timeout=deadline)
            ok = True
            return reply
        except ray.exceptions.RayTaskError as exc:  # the replica's own error (bad inputs, no memory): as raised there
            ok = True
            inner = exc.cause if isinstance(exc.cause, BaseException) else None
            if inner is None:
                raise
            raise inner from None
        except ray.exceptions.GetTimeoutError:
            raise _ReplicaDied(f"{slot.name} did not answer within {deadline:.3g} s; it was killed") from None
        except ray.exceptions.RayActorError as exc:
            raise _ReplicaDied(f"{slot.name} died: {cause(exc)}") from None
        finally:
            with replicas.lock:
                slot.outstanding -= 1
                if on_cpu:
                    slot.cpu_outstanding -= 1
                    if slot.cpu_outstanding == 0:
                        slot.cpu_free_at = replicas.now()
                if ok and slot.outstanding == slot.cpu_outstanding and slot.alive:  # the device's queue drained
                    self.router.drained(i, replicas.now())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
