"""A cluster behind the interface a server uses of a runtime (``server/backend.py``'s
``Backend``), so that ``timeshare serve`` with a ``cluster`` section serves the same HTTP
APIs from replicas on Ray. Runs in the server's process.

NOTE [A cluster behind the server]
The server's service, queues and admin plane call the runtime's methods; this class
answers them from a :class:`Cluster`. Requests go through the router (NOTE [Fleet
routing]); each reply brings the replica's own record of the call, so the metrics of a
load or a switch are those of the replica that did it. What the server reads without
waiting (``snapshot``, ``is_resident``, a training job's status) comes from a poller
thread that asks every replica for its snapshot every ``poll_s`` beside whatever it is
running (the actors' "observe" concurrency group), adds them up, turns the evictions
they report into eviction records for the listeners, and decides which starved
training jobs move (NOTE [Migration of starved jobs]). The models are the config's,
registered on every replica when it starts; ``register`` and ``unregister`` mark a model
served or not (unregistering also evicts it everywhere); a model cannot be pinned.
A training job's handle (:class:`RemoteJob`) follows the job when it moves; a job whose
replica is lost fails with that reason.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from timeshare.cluster.cluster import Cluster, ReplicaLostError
from timeshare.cluster.llm import RemoteEngine, RemoteGeneration, RemoteLanguageModel, relay
from timeshare.cluster.remote_job import ENDED, RemoteJob
from timeshare.cluster.replica import ModelDef
from timeshare.cluster.snapshots import (
    ClusterSnapshot,
    ClusterView,
    ReplicaRow,
    ReplicaSnapshot,
    add_snapshots,
    keep_counters,
)
from timeshare.cluster.starvation import JobTrack, jobs_seen
from timeshare.config import ClusterConfig
from timeshare.errors import ConfigError, Conflict, TimeshareError, UnknownModelError
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.model import LLMDef
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import Delta, Finish
from timeshare.options import RuntimeOptions
from timeshare.runtime.calls import Call
from timeshare.runtime.events import CallRecord, EvictionRecord, Listener
from timeshare.scheduler.migration import RUNNABLE, ReplicaSeen, plan_migrations

log = logging.getLogger(__name__)


class ClusterRuntime:
    """``cluster`` behind the runtime interface of a server (NOTE [A cluster behind the
    server]). ``migrate_after_s``: None, or how long a job may starve before it moves."""

    def __init__(self, cluster: Cluster, *, migrate_after_s: float | None = None, poll_s: float = 0.5,
                 owns_cluster: bool = True):
        self.cluster = cluster
        self.migrate_after_s = migrate_after_s
        self.poll_s = poll_s
        self.owns_cluster = owns_cluster
        self._served = {m.name for m in cluster.models}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()  # the views below
        self._moves = threading.Lock()  # a job's control and its migration, one at a time
        self._latest: dict[str, ReplicaSnapshot] = {}  # replica -> its last snapshot
        self._retired: list[ReplicaSnapshot] = []  # the last snapshots of replicas lost: their counters still count
        self._views: dict[str, dict] = {}  # training job -> its last view, with its replica
        self._tracks: dict[str, JobTrack] = {}  # training job -> where it is since when, its device time
        self._changed_at: dict[str, float] = {}  # training job -> when it was last moved, forgotten or started
        self.migrations: deque[dict] = deque(maxlen=100)
        self.unmovable: dict[str, str] = {}  # jobs whose move failed, and why: not tried again
        self._stop = threading.Event()
        self.poll()  # the server's first snapshot has the replicas in it
        self._poller = threading.Thread(target=self._poll_loop, name="timeshare-cluster-poll", daemon=True)
        self._poller.start()

    @classmethod
    def from_config(cls, cfg: ClusterConfig, runtime: RuntimeOptions, models: list[ModelDef],
                    llms: Sequence[LLMDef] = ()) -> ClusterRuntime:
        cluster = Cluster(models, replicas=cfg.replicas, runtime=runtime, policy=cfg.policy, llms=llms,
                          address=cfg.address, num_cpus=cfg.num_cpus, max_replicas=cfg.max_replicas,
                          call_timeout_s=cfg.call_timeout_s, start_timeout_s=cfg.start_timeout_s, seed=cfg.seed,
                          cpu_fallback=cfg.cpu_fallback)
        return cls(cluster, migrate_after_s=cfg.migrate_after_s)

    # ------------------------------------------------------------------ models
    def register(self, name: str, build: Any = None, weights: Any = None, example_inputs: tuple = (), *,
                 example_kwargs: dict | None = None, dtype: Any = None, pin: bool = False, priority: Any = None,
                 slo_s: float | None = None) -> None:
        """Serve ``name`` again: the cluster's models are its config's, registered on every
        replica when it started; the other arguments are theirs already."""
        if name not in self.cluster.index:
            raise UnknownModelError(f"a cluster serves the models of its config; {name!r} is not one of "
                                    f"{sorted(self.cluster.index)}")
        if pin:
            raise Conflict(f"model {name!r}: models cannot be pinned on a cluster (the router places them)")
        with self._lock:
            self._served.add(name)

    def unregister(self, name: str) -> None:
        self._check_served(name)
        with self._lock:
            self._served.discard(name)
        self.cluster.evict(name)

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._served)

    def pin(self, name: str, pinned: bool = True) -> None:
        if pinned:
            raise Conflict(f"model {name!r}: models cannot be pinned on a cluster (the router places them)")

    def _check_served(self, name: str) -> None:
        with self._lock:
            if name not in self._served:
                raise UnknownModelError(f"no model named {name!r} is registered; registered: {sorted(self._served)}")

    # ------------------------------------------------------------------ inference
    def call(self, name: str, args: tuple = (), kwargs: dict | None = None, *, strategy: str | None = None,
             arrived_at: float | None = None) -> Call:
        """One request through the router (retried once elsewhere if its replica dies).
        The record is the replica's, its start moved onto this host's clock."""
        self._check_served(name)
        if kwargs:
            raise TimeshareError("a cluster's models take positional inputs only")
        t0 = time.monotonic()
        age_s = 0.0 if arrived_at is None else max(0.0, t0 - arrived_at)  # queued in the server already
        try:
            reply = self.cluster.infer(name, *args, age_s=age_s)
        except Exception as exc:
            self._emit(CallRecord(name, t0, time.monotonic() - t0, 0.0, False, None, error=type(exc).__name__))
            raise
        done = time.monotonic()
        rec = reply.record
        if rec is None:  # a replica of an older build
            record = CallRecord(name, t0, done - t0, 0.0, reply.loaded, None)
        elif reply.on_cpu:  # the CPU fallback's call: no load or switch of a device
            record = CallRecord(name, max(t0, done - rec.seconds), rec.seconds, rec.waited_s, False, None)
        else:
            record = CallRecord(name, max(t0, done - rec.seconds), rec.seconds, rec.waited_s, rec.loaded,
                                rec.switched_from, moved_bytes=rec.moved_bytes)
        self._emit(record)
        return Call(reply.outputs, record)

    def infer(self, name: str, *args, **kwargs):
        return self.call(name, args, kwargs).output

    def is_resident(self, name: str) -> bool:
        return self.cluster.is_resident(name)

    def thrashing_factor(self) -> float:
        return 1.0  # each replica's runtime batches nothing itself; the queues do not linger

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, record: CallRecord | EvictionRecord) -> None:
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                log.exception("a listener failed on %r", record)

    # ------------------------------------------------------------------ training
    def train(self, name: str, model: Any, optimizer: Any, data: Any, step: Any, iterations: int | None = None, *,
              offload: bool = False, seed: int | None = None, resume: dict | None = None) -> RemoteJob:
        """Start a training job on the replica running the fewest (every argument picklable)."""
        kwargs = dict(model=model, optimizer=optimizer, data=data, step=step, iterations=iterations,
                      offload=offload, seed=seed, resume=resume)
        view = self.cluster.start_job(name, kwargs)
        now = time.monotonic()
        with self._lock:
            self._views[name] = view
            self._tracks[name] = JobTrack(view["replica"], now)
            self._changed_at[name] = now
            self.unmovable.pop(name, None)
        return RemoteJob(self, name)

    def jobs(self) -> dict[str, RemoteJob]:
        return {n: RemoteJob(self, n) for n in self.cluster.job_names()}

    def forget_job(self, name: str) -> None:
        with self._moves:
            self.cluster.forget_job(name)
        with self._lock:
            self._views.pop(name, None)
            self._tracks.pop(name, None)
            self._changed_at[name] = time.monotonic()
            self.unmovable.pop(name, None)

    def job_view(self, name: str) -> dict:
        with self._lock:
            view = self._views.get(name)
        if view is None:
            raise UnknownModelError(f"no training job named {name!r}")
        return view

    def control_job(self, name: str, action: str) -> dict:
        with self._moves:
            view = self.cluster.control_job(name, action)
        with self._lock:
            self._views[name] = view
            self._changed_at[name] = time.monotonic()
        return view

    def migrate(self, name: str, to: str | None = None) -> dict:
        """Move a training job now (NOTE [Checkpoints]); what moved, from where to where."""
        with self._moves:
            moved = self.cluster.migrate(name, to)
            view = self.cluster.job(name)
        now = time.monotonic()
        with self._lock:
            self._views[name] = view
            self._tracks[name] = JobTrack(view["replica"], now, moved["from"])
            self._changed_at[name] = now
            self.migrations.append({**moved, "at": time.time()})
        log.info("training job %s moved from %s to %s at iteration %d", name, moved["from"], moved["to"],
                 moved["iterations"])
        return moved

    # ------------------------------------------------------------------ language models
    def language_model(self, name: str) -> RemoteLanguageModel:
        """The cluster's language model ``name`` (NOTE [Language models on a cluster])."""
        spec = self.cluster.llms.get(name)
        if spec is None:
            raise UnknownModelError(f"no language model named {name!r}; known: {sorted(self.cluster.llms)}")
        if name in self.cluster.llm_failures:
            why = self.cluster.llm_failures[name]
            raise ConfigError(f"language model {name!r} did not load on the replicas: {why}")
        return RemoteLanguageModel(self, spec)

    def generate(self, model: str, prompt: list[int], params: SamplingParams,
                 on_event: Callable[[Delta | Finish], None] | None, engine: RemoteEngine,
                 adapter: str | None = None) -> RemoteGeneration:
        """Start a generation on a replica (under adapter ``adapter``); a thread relays its events."""
        gen_id = uuid.uuid4().hex
        arrived = time.monotonic()
        i, stream, finished = self.cluster.generate(model, prompt, params, gen_id, adapter)
        generation = RemoteGeneration(lambda: self.cluster.cancel_generation(i, gen_id), on_event)
        replica = self.cluster.slots[i].name

        def failed(exc: BaseException) -> BaseException:
            if self.cluster.died(exc):  # the replica died: found by the next poll too
                return ReplicaLostError(f"generation for {model!r} on {replica}: {type(exc).__name__}: {exc}"[:500])
            return exc  # late (Timeout), or the replica's own error as raised there

        def run() -> None:
            try:
                relay(self.cluster.events(stream, self.cluster.call_timeout_s), generation, engine, model,
                      len(prompt), arrived, failed)
            finally:
                finished()

        try:
            threading.Thread(target=run, name=f"timeshare-generation-{model}", daemon=True).start()
        except BaseException:
            finished()
            generation.cancel()
            raise
        return generation

    def adapt(self, model: str, name: str, path: str | None, pinned: bool = False,
              restore: str | None = None) -> None:
        """NOTE [Adapters on a cluster]: adapter ``name`` of ``model`` served from ``path``
        by every replica, now and later (None: by none; ``restore``: the directory a
        refused replace puts back)."""
        self.cluster.adapt(model, name, path, pinned, restore)

    def adapter_slots(self, model: str) -> dict[str, int]:
        """``model``'s adapters on some replica's device, in the slot they have there (as of
        the last poll)."""
        with self._lock:
            snaps = list(self._latest.values())
        return {info.name: info.slot for snap in snaps for info in snap.adapters.get(model, ())
                if info.slot is not None}

    def llm_snapshots(self, name: str) -> list[EngineSnapshot]:
        """Language model ``name``'s engines on the replicas (as of the last poll)."""
        with self._lock:
            return [s.llms[name] for s in self._latest.values() if name in s.llms]

    # ------------------------------------------------------------------ replicas
    def add_replica(self) -> str:
        return self.cluster.add_replica()

    def replicas_alive(self) -> int:
        return sum(1 for r in self.cluster.replica_rows() if r.alive)

    def kill_replica(self, name: str) -> None:
        self.cluster.kill_replica(name)

    # ------------------------------------------------------------------ observing
    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:
                log.exception("polling the replicas failed")

    def poll(self) -> None:
        """Ask every replica for its snapshot; emit its evictions, refresh the jobs' views,
        and move the starved jobs (NOTE [Migration of starved jobs])."""
        asked = time.monotonic()
        snaps = self.cluster.snapshots(timeout_s=max(1.0, 4 * self.poll_s))
        now = time.monotonic()
        rows = self.cluster.replica_rows()
        dead = dict(self.cluster.lost)
        jobs = set(self.cluster.job_names())
        for snap in snaps.values():
            for model, nbytes in snap.evicted:
                self._emit(EvictionRecord(model, nbytes, now))
        with self._lock:
            self._retired += [v for k, v in self._latest.items() if k in dead]
            self._latest = {**{k: v for k, v in self._latest.items() if k not in dead}, **snaps}
            for replica, snap in snaps.items():
                for name, view in snap.jobs.items():
                    if name not in jobs or self._changed_at.get(name, -1.0) >= asked:
                        continue  # forgotten, a copy being dropped, or changed since this poll asked
                    self._views[name] = {"replica": replica, **view}
                    track = self._tracks.get(name)
                    if track is None or track.replica != replica:  # new here (started elsewhere, or moved)
                        track = self._tracks[name] = JobTrack(replica, now)
                    if view["status"] in RUNNABLE:
                        track.sample(now, view["step_seconds"])
                    else:  # paused or ended: judged afresh once it runs again
                        track.samples.clear()
            for name, view in self._views.items():
                if view["replica"] in dead and view["status"] not in ENDED:
                    self._views[name] = {**view, "status": "failed",
                                         "error": f"its replica {view['replica']} was lost: {dead[view['replica']]}"}
        if self.migrate_after_s is not None:
            self._move_starved(rows, now)

    def _move_starved(self, rows: list[ReplicaRow], now: float) -> None:
        after_s = self.migrate_after_s
        assert after_s is not None
        with self._lock:
            seen, running = jobs_seen(self._views, self._tracks, self.unmovable, now, after_s)
        replicas = [ReplicaSeen(r.replica, r.alive, r.outstanding, running.count(r.replica)) for r in rows]
        for job, target in plan_migrations(seen, replicas, now, after_s):
            try:
                self.migrate(job, target)
            except Exception as exc:  # it stays where it is, running; not tried again
                self.unmovable[job] = f"{type(exc).__name__}: {exc}"
                log.warning("training job %s did not move to %s and stays where it is: %s", job, target, exc)

    def snapshot(self) -> ClusterSnapshot:
        """The replicas' snapshots added up (as of the last poll), and the cluster's own
        counters and replicas (``ClusterSnapshot``)."""
        with self._lock:
            latest = dict(self._latest)
            retired = [s.runtime for s in self._retired]
            migrations = list(self.migrations)
        snaps = [s.runtime for s in latest.values()]
        device = f"{self.cluster.device} x {len(snaps)} replicas"
        merged = add_snapshots(snaps)
        if merged is not None:
            if retired:  # counters never go back: the lost replicas' last counts stay in
                merged = keep_counters(merged, add_snapshots(snaps + retired))
            merged = replace(merged, device=device)
        stats = self.cluster.stats
        rows = []
        for row in self.cluster.replica_rows():
            s = latest[row.replica].runtime if row.replica in latest else None
            rows.append(row if s is None else replace(row, resident=s.resident, used_bytes=s.used_bytes,
                                                      capacity_bytes=s.capacity_bytes, loads=sum(s.loads.values())))
        view = ClusterView(policy=self.cluster.policy, replicas=rows, replicas_alive=sum(1 for r in rows if r.alive),
                           requests=stats.requests, loads=stats.loads, retried=stats.retried, failed=stats.failed,
                           replicas_lost=stats.replicas_lost, migrations=stats.migrations,
                           cpu_fallbacks=stats.cpu_fallbacks, recent_migrations=migrations[-10:])
        # What one job may take is one replica's budget, not the sum.
        return ClusterSnapshot(device, merged, max((s.capacity_bytes for s in snaps), default=None), view)

    def close(self) -> None:
        self._stop.set()
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join(timeout=30)
        if self.owns_cluster:
            self.cluster.close()
