"""One replica: a timeshare runtime on one device, the body of a Ray actor. Plain Python
(no Ray here), so it is tested and used without a cluster too."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

from timeshare.cluster.snapshots import ReplicaSnapshot
from timeshare.errors import ConfigError, ModelTooLargeError
from timeshare.llm.kv_budget import KVBudget
from timeshare.models.spec import Builder
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.options import RuntimeOptions
from timeshare.runtime.events import CallRecord, EvictionRecord
from timeshare.runtime.facade import Runtime

CANCELLED_KEPT = 10_000  # ids of generations cancelled before they started, remembered


@dataclass(frozen=True)
class ModelDef:
    """A model every replica can build: a zoo architecture (``zoo``, with the batch of
    its example inputs) or a builder (``build``: "module:function" or a picklable
    callable, with ``example`` inputs), and a safetensors file every replica can read."""

    name: str
    zoo: str | None = None
    weights: str | None = None
    batch: int = 1
    build: Builder | None = None
    example: tuple | None = field(default=None, compare=False)
    dtype: str | None = None
    priority: str = "latency_critical"
    slo_s: float | None = None

    def __post_init__(self):
        if (self.zoo is None) == (self.build is None):
            raise ConfigError(f"model {self.name!r}: give exactly one of zoo and build")
        if self.build is not None and self.example is None:
            raise ConfigError(f"model {self.name!r}: a model given by build needs example inputs")

    def builder(self) -> Builder:
        if self.build is not None:
            return self.build
        assert self.zoo is not None, "checked in __post_init__"
        return zoo_get(self.zoo).builder

    def example_inputs(self) -> tuple:
        if self.example is not None:
            return self.example
        assert self.zoo is not None, "checked in __post_init__"
        return zoo_get(self.zoo).example_inputs(self.batch)

    def register(self, rt: Runtime) -> None:
        rt.register(self.name, self.builder(), self.weights, self.example_inputs(), dtype=self.dtype,
                    priority=self.priority, slo_s=self.slo_s)


@dataclass(frozen=True)
class Reply:
    """A request's answer from a replica: the outputs, whether the model had to be loaded
    for it, the seconds the replica spent on it, and the runtime's record of the call
    (its ``started`` is on the replica's clock)."""

    outputs: object
    loaded: bool
    seconds: float
    replica: str
    record: CallRecord | None = None
    on_cpu: bool = False  # ran on the replica's CPU fallback (NOTE [CPU fallback])


class Replica:
    """A runtime on ``device`` with ``memory`` bytes of model memory, every model of
    ``models`` registered (none loaded until asked for). ``cpu_fallback``: the bytes of a
    second runtime on the CPU with the same models, which requests may run on instead
    (NOTE [CPU fallback]); None: none."""

    def __init__(self, name: str, models: list[ModelDef], *, device: str = "cpu", memory: int | str = "64MiB",
                 runtime: RuntimeOptions | None = None, cpu_fallback: int | str | None = None, llms: list | None = None,
                 fail_start: bool = False):
        if fail_start:  # for tests and drills: a replica that cannot start
            raise ConfigError(f"replica {name} was told not to start")
        self.name = name
        # ``runtime``: all of the runtime's options (a server's runtime section); else the
        # device and its budget.
        self.rt = Runtime(options=runtime) if runtime is not None else Runtime(device, memory)
        self.models = {m.name: m for m in models}
        self._resumed_at: dict[str, int] = {}  # training job -> the iterations it was resumed at here
        self._evicted: list[tuple[str, int]] = []  # evictions not yet reported (snapshot)
        self._events = threading.Lock()
        self._profiling = threading.Lock()
        self._warming = False
        self.rt.subscribe(self._on_record)
        self.cpu: Runtime | None = None
        self.llms: dict = {}  # language models (``llm/model.py``'s LLMDef) -> their LanguageModel here
        self._sequences: dict[str, object] = {}  # generations in progress, by the front end's id
        self._cancelled: dict[str, None] = {}  # ids cancelled before their generation got here (oldest first)
        self.llm_failures: dict[str, str] = {}  # language models that did not load here, and why
        budgets = {spec.kv_memory for spec in llms or () if spec.kv_memory is not None}
        self.kv_budget = KVBudget(budgets.pop()) if budgets else None  # NOTE [Key/value caches under pressure]
        try:
            for m in models:
                m.register(self.rt)
            for spec in llms or ():  # one that fails is unavailable; the rest serve
                try:
                    self.llms[spec.name] = spec.load(self.rt, self.kv_budget)
                except Exception as exc:
                    self.llm_failures[spec.name] = f"{type(exc).__name__}: {exc}"
            if cpu_fallback is not None:
                self.cpu = Runtime(device="cpu", memory=cpu_fallback)
                for m in models:
                    m.register(self.cpu)
        except BaseException:
            self.close()
            raise

    def _on_record(self, record) -> None:
        if isinstance(record, EvictionRecord) and not self._warming:  # a warm-up's evictions are its own
            with self._events:
                self._evicted.append((record.model, record.nbytes))

    def ping(self) -> dict:
        """Who answers, and where: the host and the shared-memory segments this replica
        owns (its arena), so that whoever sees it die on the same host can unlink them."""
        return {"replica": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "llm_failures": dict(self.llm_failures),
                "segments": [rt.diagnostics().arena.name for rt in (self.rt, self.cpu) if rt is not None]}

    def echo(self, args: tuple) -> tuple:
        """The arguments back: a round trip of tensors through the cluster's transport."""
        return args

    def infer(self, model: str, args: tuple, on_cpu: bool = False, age_s: float = 0.0) -> Reply:
        """Run ``model`` on its device, or with ``on_cpu`` on the CPU fallback; ``age_s``:
        how long the request has waited before it got here (its SLO counts from then)."""
        if on_cpu and self.cpu is None:
            raise ConfigError(f"replica {self.name} has no CPU fallback")
        rt = self.cpu if on_cpu and self.cpu is not None else self.rt
        t0 = time.perf_counter()
        call = rt.call(model, args, arrived_at=time.monotonic() - max(0.0, age_s))
        return Reply(call.output, call.record.loaded, time.perf_counter() - t0, self.name, call.record, on_cpu)

    def profile(self, model: str, repeats: int = 3) -> dict:
        """Warm the model up (its first load here profiles it), then measure its cold time
        (evicted, then one request), its ready time (the median of ``repeats`` more) and
        its bytes; it is left evicted."""
        with self._profiling:  # calls run in threads of the actor: one profile at a time
            self._warming = True
            try:
                return self._profile(model, repeats)
            finally:
                self._warming = False

    def _profile(self, model: str, repeats: int) -> dict:
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
        nbytes = self.rt.snapshot().resident[model]
        self.rt.evict(model)
        cpu_cold = None
        if self.cpu is not None:  # its cold time on the CPU fallback, after a warm-up there
            try:
                self.cpu.infer(model, *args)
                self.cpu.evict(model)
                t0 = time.perf_counter()
                self.cpu.infer(model, *args)
                cpu_cold = time.perf_counter() - t0
                self.cpu.evict(model)
            except ModelTooLargeError:
                pass  # never sent to this CPU fallback
        return {"too_large": False, "cold_s": cold, "ready_s": sorted(ready)[len(ready) // 2], "bytes": nbytes,
                "cpu_cold_s": cpu_cold}

    # Training jobs (NOTE [Checkpoints]): started here, paused, checkpointed, dropped.
    def train(self, name: str, workload: str, iterations: int, seed: int, resume: dict | None = None) -> None:
        self.start_job(name, {**TrainingWorkload.parse(workload).train_args(), "iterations": iterations,
                              "seed": seed, "resume": resume})

    def start_job(self, name: str, kwargs: dict) -> dict:
        """``Runtime.train(name, **kwargs)``: every argument picklable (a checkpoint in
        ``resume`` to go on from one); the job's view."""
        self.rt.train(name, **kwargs)
        resume = kwargs.get("resume")
        self._resumed_at[name] = 0 if resume is None else int(resume["iterations"])
        return self.job(name)

    def job(self, name: str) -> dict:
        j = self._job(name)
        s = j.stats
        return {"status": j.status, "iterations": s.iterations, "resumed_at": self._resumed_at.get(name, 0),
                "preemptions": s.preemptions, "step_seconds": s.step_seconds,
                "preempted_seconds": s.preempted_seconds, "loss": s.losses[-1] if s.losses else None,
                "ephemeral_bytes": s.ephemeral_bytes, "persistent_bytes": s.persistent_bytes,
                "error": None if j.error is None else f"{type(j.error).__name__}: {j.error}"}

    def control_job(self, name: str, action: str) -> dict:
        """pause, resume or cancel; the job's view."""
        j = self._job(name)
        if action not in ("pause", "resume", "cancel"):
            raise ConfigError(f"unknown action {action!r}; known: pause, resume, cancel")
        getattr(j, action)()
        return self.job(name)

    def forget_job(self, name: str) -> None:
        self.rt.forget_job(name)

    def pause_job(self, name: str, timeout_s: float = 60.0) -> dict:
        """Pause the job and wait (up to ``timeout_s``) until it stands at a preemption point."""
        j = self._job(name)
        j.pause()
        deadline = time.monotonic() + timeout_s
        while j.status not in ("paused", "finished", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise ConfigError(f"training job {name!r} did not pause within {timeout_s:g} s")
            time.sleep(0.002)
        return self.job(name)

    def checkpoint(self, name: str) -> dict:
        return self._job(name).checkpoint()

    def drop_job(self, name: str, timeout_s: float = 60.0) -> None:
        j = self._job(name)
        j.cancel()
        if not j.wait(timeout_s):
            raise ConfigError(f"training job {name!r} did not stop within {timeout_s:g} s on replica {self.name}")
        self.rt.forget_job(name)

    def job_weights(self, name: str, timeout_s: float = 600.0) -> dict:
        """The job's final parameters and buffers once it has ended; its error if it failed."""
        j = self._job(name)
        if not j.wait(timeout_s):
            raise ConfigError(f"training job {name!r} did not end within {timeout_s:g} s")
        if j.error is not None:
            raise j.error
        return j.state_dict()

    def _job(self, name: str):
        job = self.rt.job_handles().get(name)
        if job is None:
            raise ConfigError(f"no training job {name!r} on replica {self.name}")
        return job

    def generate(self, model: str, prompt: list[int], params, gen_id: str, timeout_s: float = 600.0,
                 adapter: str | None = None):
        """Generate from language model ``model`` (under its adapter ``adapter``, NOTE
        [Adapters on a cluster]): its events (deltas, then the finish) as they come (a Ray
        generator, NOTE [Language models on a cluster])."""
        seq = self.llms[model].generate(prompt, params, adapter=adapter)
        with self._events:
            self._sequences[gen_id] = seq
            if gen_id in self._cancelled:  # its cancel came first
                del self._cancelled[gen_id]
                seq.cancel()
        try:
            yield from seq.events(timeout_s)
        finally:
            seq.cancel()  # a no-op once finished; a reader gone stops it at the next step
            with self._events:
                self._sequences.pop(gen_id, None)

    def cancel_generation(self, gen_id: str) -> None:
        with self._events:
            seq = self._sequences.get(gen_id)
            if seq is None:  # not here yet (or over): cancelled on arrival
                self._cancelled[gen_id] = None
                while len(self._cancelled) > CANCELLED_KEPT:
                    del self._cancelled[next(iter(self._cancelled))]
        if seq is not None:
            seq.cancel()  # type: ignore[attr-defined]

    def add_adapter(self, model: str, name: str, path: str, replace: bool = False, pinned: bool = False) -> None:
        """Serve adapter ``name`` of ``model`` from ``path`` (NOTE [Adapters on a cluster])."""
        self._adapters(model).add(name, path, pinned=pinned, replace=replace)

    def remove_adapter(self, model: str, name: str) -> bool:
        """Stop serving adapter ``name`` of ``model``; whether this replica served it (one
        resolved on another replica's request is not known here)."""
        adapters = self._adapters(model)
        if not adapters.serves(name):
            return False
        adapters.remove(name)
        return True

    def _adapters(self, model: str):
        served = self.llms.get(model)
        if served is None or served.adapters is None:
            raise ConfigError(f"language model {model!r} serves no adapters on replica {self.name}")
        return served.adapters

    def evict(self, model: str) -> bool:
        return self.rt.evict(model)

    def snapshot(self) -> ReplicaSnapshot:
        """For a front end's metrics and status, without waiting for the device: the
        runtime's snapshot, the evictions since the last one, and every job's view."""
        with self._events:
            evicted, self._evicted = self._evicted, []
        return ReplicaSnapshot(replica=self.name, runtime=self.rt.snapshot(), evicted=evicted,
                               jobs={n: self.job(n) for n in self.rt.job_handles()},
                               cpu_fallback=None if self.cpu is None else self.cpu.snapshot(),
                               llms={n: m.engine.snapshot() for n, m in self.llms.items()},
                               adapters={n: tuple(m.adapters.infos()) for n, m in self.llms.items()
                                         if m.adapters is not None})

    def evict_all(self) -> None:
        """Nothing resident: a fresh start for the next run over the same replica."""
        for name in self.rt.resident():
            self.rt.evict(name)

    def stats(self) -> dict:
        s = self.rt.stats()
        return {"replica": self.name, "resident": s["resident"], "loads": sum(s["loads"].values()),
                "evictions": s["evictions"], "capacity_bytes": s["capacity_bytes"]}

    def close(self) -> None:
        for model in self.llms.values():
            model.engine.close()
        try:
            self.rt.close()
        finally:
            if self.cpu is not None:
                self.cpu.close()
