"""A cluster's replicas as the front end holds them: slots, each with its actor (started,
warmed up, added at run time, killed, lost), and what is asked of every live replica at
once (snapshots, evictions, closing). Runs in the front end's process (NOTE [Cluster
deployment] in ``cluster/cluster.py``)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from timeshare.cluster.actors import OBSERVE, cause, unlink_segments
from timeshare.cluster.replica import ModelDef
from timeshare.cluster.snapshots import ReplicaSnapshot
from timeshare.errors import ConfigError, Unavailable
from timeshare.llm.model import LLMDef
from timeshare.options import RuntimeOptions

log = logging.getLogger(__name__)

KILL_WAIT_S = 30.0  # how long ``ReplicaSet.kill`` waits for a killed actor to be gone


class ReplicaLostError(Unavailable):
    """A request whose replica died, and whose retry failed too (or had nowhere to go):
    the cluster's state, not the request, is at fault (503)."""


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


class ReplicaSet:
    """The replica slots of a cluster and their actors (of ``actor_class``), each a
    runtime of ``memory`` bytes on ``device`` with every model of ``models``.

    ``lock`` guards the slots, ``stats`` and the state of the parts that share it (the
    router's view, the jobs' table, the generations in flight). ``on_lost(i)`` runs under
    that lock when replica ``i`` is found lost, so that what ran there is forgotten with
    it."""

    def __init__(self, ray: Any, actor_class: Any, models: Sequence[ModelDef], *, memory: int, device: str,
                 runtime: RuntimeOptions | None, cpu_fallback: int | str | None, llms: Sequence[LLMDef],
                 call_timeout_s: float, start_timeout_s: float, on_lost: Callable[[int], None]):
        self.ray = ray
        self._actor_class = actor_class
        self.models = list(models)
        self.memory = memory
        self.device = device
        self.runtime = runtime
        self.cpu_fallback = cpu_fallback
        self.llms = list(llms)
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._on_lost = on_lost
        self.lock = threading.Lock()
        # NOTE [Adapters on a cluster]: an adapter's load or unload and a replica's start, one at a time.
        self._adapting = threading.Lock()
        self._t0 = time.monotonic()
        self.slots: list[ReplicaSlot] = []
        self.stats = ClusterStats()
        self._segments: dict[int, list[str]] = {}
        self._generations: dict[int, int] = {}
        self.lost: dict[str, str] = {}  # every replica lost so far -> why
        self.llm_failures: dict[str, str] = {}  # language models that did not load on a replica, and why
        self._observing: dict[str, Any] = {}  # replica -> its snapshot asked for and not yet read

    def now(self) -> float:
        """Seconds since the cluster started: the router's clock."""
        return time.monotonic() - self._t0

    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.alive]

    # ------------------------------------------------------------------ starting
    def start_all(self, slots: int, replicas: int, failing: Sequence[int] = ()) -> None:
        """``slots`` slots, the first ``replicas`` of them started (those in ``failing``
        told to fail their start, a drill); at least one must start."""
        self.slots = [ReplicaSlot(f"replica-{i}") for i in range(slots)]
        started = [self.start(i, fail=i in failing) for i in range(replicas)]
        for i, (actor, error) in enumerate(started):
            self.slots[i] = ReplicaSlot(f"replica-{i}", actor, actor is not None, error=error,
                                        segments=self._segments.pop(i, []))
        if not any(s.alive for s in self.slots):
            raise ConfigError(f"no replica started: {[e for _, e in started]}")

    def start(self, i: int, *, fail: bool = False, name: str | None = None) -> tuple[Any, str | None]:
        """A replica actor, started and answering, or the error that stopped it."""
        actor = self._actor_class.remote(name or f"replica-{i}", self.models, device=self.device,
                                         memory=self.memory, runtime=self.runtime, cpu_fallback=self.cpu_fallback,
                                         llms=self.llms, fail_start=fail)
        try:
            hello = self.ray.get(actor.ping.remote(), timeout=self.start_timeout_s)
            if hello["host"] == socket.gethostname():
                self._segments[i] = list(hello["segments"])
            for model, why in hello["llm_failures"].items():
                log.error("language model %s did not load on replica-%d: %s", model, i, why)
                self.llm_failures.setdefault(model, why)
            return actor, None
        except Exception as exc:
            self.ray.kill(actor)
            log.warning("replica-%d did not start: %s", i, cause(exc))
            return None, f"replica-{i}: {cause(exc)}"

    def profile(self) -> dict:
        """Every replica warms every model up (its first load profiles it there), so no
        request pays that; the costs are the first live replica's measurements (cold and
        ready times, bytes)."""
        live = [s for s in self.slots if s.alive]
        refs = {s.name: [s.actor.profile.remote(m.name) for m in self.models] for s in live}
        answers = {}
        for s in live:
            try:
                answers[s.name] = self.ray.get(refs[s.name], timeout=self.start_timeout_s)
            except Exception as exc:
                self.mark_lost(self.slots.index(s), f"{s.name} failed its warm-up: {cause(exc)}")
        if not answers:
            raise ConfigError("no replica finished its warm-up")
        # The first call carrying tensors sets up their transport (seconds, once): not on a request.
        args = self.models[0].example_inputs()
        self.ray.get([s.actor.echo.remote(args) for s in live if s.name in answers], timeout=self.start_timeout_s)
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
        self.ray.get([slot.actor.profile.remote(m.name) for m in self.models], timeout=self.start_timeout_s)

    def add(self, admit: Callable[[int], None]) -> str:
        """Start one more replica in a free slot; ``admit(i)`` (under the lock) makes it
        take requests from then on."""
        with self.lock:
            free = [i for i, s in enumerate(self.slots) if not s.alive and not s.reserved]
            if not free:
                raise ConfigError(f"no free replica slot (max_replicas={len(self.slots)})")
            i = free[0]
            name = f"replica-{i}" if self.slots[i].error is None else f"replica-{i}.{self._generation(i)}"
            self.slots[i] = ReplicaSlot(name, reserved=True)  # taken: no other add_replica gets it
        with self._adapting:  # NOTE [Adapters on a cluster]: it starts with the adapters served now
            actor, error = self.start(i, name=name)
            try:
                if actor is None:
                    raise ConfigError(f"the new replica did not start: {error}")
                with self.lock:
                    self.slots[i] = ReplicaSlot(name, actor, False, reserved=True,
                                                segments=self._segments.pop(i, []))
                self._warm(i)
            except BaseException as exc:
                with self.lock:
                    slot = self.slots[i]
                    self.slots[i] = ReplicaSlot(name, error=f"{name} did not start: {cause(exc)}")
                if slot.actor is not None:
                    self.ray.kill(slot.actor, no_restart=True)
                    unlink_segments(slot.segments)
                raise
            with self.lock:
                self.slots[i].alive, self.slots[i].reserved = True, False
                admit(i)
        return name

    def _generation(self, i: int) -> int:
        self._generations[i] = self._generations.get(i, 0) + 1
        return self._generations[i]

    # ------------------------------------------------------------------ losing
    def kill(self, name: str) -> None:
        """Kill a replica's actor (a drill: what a crashed replica looks like)."""
        slot = next((s for s in self.slots if s.name == name and s.alive), None)
        if slot is None:
            raise ConfigError(f"no live replica {name!r}")
        actor = slot.actor  # a request that finds it dead meanwhile clears the slot's (``mark_lost``)
        self.ray.kill(actor, no_restart=True)
        # Ray's kill only asks for it: a call made at once could still reach the actor
        # and be answered. A drill wants what a crash leaves, so wait until it is gone.
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            try:
                self.ray.get(actor.ping.options(concurrency_group=OBSERVE).remote(), timeout=1.0)
            except self.ray.exceptions.RayActorError:
                return
            except self.ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.02)
        log.warning("%s still answered %.3g s after it was killed", name, KILL_WAIT_S)

    def mark_lost(self, i: int, error: str) -> None:
        """Replica ``i`` is gone: killed for good (an actor Ray calls unavailable may still
        run), retired from the router, its shared memory unlinked, its slot free again."""
        with self.lock:
            slot = self.slots[i]
            if not slot.alive:
                return
            slot.alive, slot.error = False, error
            self.stats.replicas_lost += 1
            self.lost[slot.name] = error
            self._on_lost(i)  # its jobs died with it; the router retires it
        log.warning("%s lost: %s", slot.name, error)
        try:
            self.ray.kill(slot.actor, no_restart=True)
        except Exception:  # gone already
            pass
        unlink_segments(slot.segments)  # a killed process never unlinks its shared memory
        with self.lock:
            slot.actor, slot.segments = None, []

    # ------------------------------------------------------------------ every replica
    def evict(self, model: str) -> None:
        """Evict ``model`` on every live replica."""
        refs = [(i, s.actor.evict.remote(model)) for i, s in enumerate(self.slots) if s.alive]
        for i, ref in refs:  # a replica found dead here is lost, not an error
            try:
                self.ray.get(ref, timeout=self.call_timeout_s)
            except Exception as exc:
                self.mark_lost(i, f"{self.slots[i].name} died: {cause(exc)}")

    def adapt(self, model: str, name: str, path: str | None, pinned: bool = False,
              restore: str | None = None) -> None:
        """Serve adapter ``name`` of language model ``model`` from ``path`` (None: no longer)
        on every live replica, and on every replica started from now on (NOTE [Adapters on
        a cluster]). A replica found dead is lost, not an error. A replica's refusal is
        raised as it raised it once every answer is in, and the replicas that took the
        adapter are put back as they were: without it, or (``restore``: the directory it
        replaced) with the one before; the replicas started later are not told. A replica
        is started (``add``) either wholly before or wholly after this."""
        with self._adapting:
            with self.lock:
                live = [(i, s.actor) for i, s in enumerate(self.slots) if s.alive and s.actor is not None]
                # What is served under the name now (the LLMDef's, read under the turn; else the
                # front end's word, for an adapter the resolver found); a replace keeps its pin.
                before = next(((p, was) for spec in self.llms if spec.name == model
                               for n, p, was in spec.adapters if n == name), (restore, False))
                pinned = pinned or before[1]
            took, refused = self._each(live, model, name, path, pinned)
            if refused is not None:
                if path is not None:  # replicas disagree: those that took it go back
                    _, failed = self._each(took, model, name, before[0], before[1])
                    if failed is not None:
                        log.warning("adapter %s: a replica could not be put back as it was: %s", name, failed)
                raise refused
            with self.lock:
                self.llms = [spec.with_adapter(name, path, pinned) if spec.name == model else spec
                             for spec in self.llms]

    def _each(self, actors: list[tuple[int, Any]], model: str, name: str, path: str | None,
              pinned: bool) -> tuple[list[tuple[int, Any]], BaseException | None]:
        """Adapter ``name`` served from ``path`` (None: not served) by each of ``actors``
        (replicas take the front end's word for a name: a load replaces what they hold);
        those that did it, and the first refusal. A replica found dead is lost."""
        refs = [(i, actor, actor.add_adapter.remote(model, name, path, True, pinned) if path is not None
                 else actor.remove_adapter.remote(model, name)) for i, actor in actors]
        took, refused = [], None
        for i, actor, ref in refs:  # every answer read: a refusal leaves no death unseen
            try:
                self.ray.get(ref, timeout=self.call_timeout_s)
                took.append((i, actor))
            except self.ray.exceptions.RayTaskError as exc:
                refused = refused or (exc.cause if isinstance(exc.cause, BaseException) else exc)
            except Exception as exc:
                self.mark_lost(i, f"{self.slots[i].name} died: {cause(exc)}")
        return took, refused

    def evict_all(self, replicas: list[int]) -> None:
        """Empty each of ``replicas``; one found dead is lost, not an error."""
        for i in replicas:
            try:
                self.ray.get(self.slots[i].actor.evict_all.remote(), timeout=self.call_timeout_s)
            except Exception as exc:
                self.mark_lost(i, f"{self.slots[i].name} died: {cause(exc)}")

    def snapshots(self, timeout_s: float = 5.0) -> dict[str, ReplicaSnapshot]:
        """Each live replica's ``Replica.snapshot`` (its runtime's counters, the evictions
        since the last one, its jobs), asked beside whatever it is running; a replica that
        does not answer in ``timeout_s`` is left out this time."""
        ray = self.ray
        live = [(i, s) for i, s in enumerate(self.slots) if s.alive and s.actor is not None]
        for _, s in live:  # at most one asked per replica: one not read yet is read now
            if s.name not in self._observing:
                self._observing[s.name] = s.actor.snapshot.options(concurrency_group=OBSERVE).remote()
        refs = [self._observing[s.name] for _, s in live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        done = set(ready)
        out: dict[str, ReplicaSnapshot] = {}
        for i, s in live:
            ref = self._observing[s.name]
            if ref not in done:
                log.warning("%s did not report within %.3g s", s.name, timeout_s)
                continue
            del self._observing[s.name]
            try:
                out[s.name] = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError as exc:
                self.mark_lost(i, f"{s.name} died: {cause(exc)}")
            except Exception as exc:
                log.warning("%s did not report: %s", s.name, cause(exc))
        return out

    def close(self) -> None:
        """Close every live replica's runtime, then kill every actor and unlink what it
        left in shared memory."""
        live = [s for s in self.slots if s.alive]
        try:  # a replica that closes its runtime gives its memory back itself
            self.ray.get([s.actor.close.remote() for s in live], timeout=min(self.call_timeout_s, 30.0))
        except Exception as exc:
            log.warning("replicas did not all close: %s", cause(exc))
        for s in self.slots:
            if s.actor is not None:
                try:
                    self.ray.kill(s.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            unlink_segments(s.segments)
            s.alive = False
