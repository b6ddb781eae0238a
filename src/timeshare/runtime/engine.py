"""The runtime's controller: registered models, the arena, placement and eviction.
Runs in the caller's process.

A model's life: ``register`` builds it on the CPU, checks and packs its weights into a
host store, then points its slots at meta tensors (it holds no weights of its own).
The controller decides where in the arena a model lives and which models leave to
make room (integers only); a :class:`~timeshare.worker.worker.Worker` does the rest:
binding, pipelined loads, tracing and profiling. The in-process runtime drives one
worker in this process.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch
from torch import nn

from timeshare import protocol as P
from timeshare.device import host_registrar, resolve_device, synchronize
from timeshare.errors import (
    ConfigError,
    DuplicateModelError,
    MemoryBudgetError,
    ModelError,
    ModelTooLargeError,
    TimeshareError,
    UnknownModelError,
)
from timeshare.memory import Arena, Block
from timeshare.memory.arena import reserve_shared_memory
from timeshare.models.binding import TensorLayout, bind, collect, unbind
from timeshare.models.spec import Builder, ModelSpec, build_module
from timeshare.models.weights import apply_weights, read_weights
from timeshare.runtime.dispatch import Dispatcher
from timeshare.runtime.events import CallRecord, EvictionRecord, Listener
from timeshare.runtime.pool import ProcessPool
from timeshare.runtime.training import (
    LocalTrainingJob,
    TrainingJob,
    WorkerTrainingJob,
    validate_training_args,
)
from timeshare.runtime.tree import map_tensors
from timeshare.scheduler.eviction import make_eviction_policy
from timeshare.scheduler.task import Kind, Priority
from timeshare.transfer.copy import LoadHandle, make_copy_engine
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.planner import STRATEGIES
from timeshare.transfer.profiler import ExecutionOrder, ModelProfile, trace_execution_order
from timeshare.units import format_bytes, parse_bytes
from timeshare.worker.trainer import TrainingTask, TrainSpec
from timeshare.worker.worker import Worker, owners_of, release_host_cache

log = logging.getLogger(__name__)

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; known: {sorted(_DTYPES)}") from None


@dataclass
class _Model:
    """What the controller knows of a model: its size and where it lives."""

    spec: ModelSpec
    nbytes: int
    block: Block | None = None
    last_offset: int | None = None
    pinned: bool = False
    loads: int = 0
    priority: Priority = Priority.LATENCY_CRITICAL
    slo_s: float | None = None
    host_pinned: bool = False  # with workers: they page-lock its store's segment (an AddModel fails if not)

    @property
    def name(self) -> str:
        return self.spec.name


class Runtime:
    """Time-shares one device among registered models.

    ``device``: "auto", "cpu", "cuda" or "cuda:N". ``memory``: the arena's size in bytes
    or a string like "4GiB"; "auto" takes half the free device memory on CUDA and an
    eighth of RAM (at most 2 GiB) on the CPU. ``eviction``: the policy that picks which
    resident model leaves when a new one needs room. ``strategy``: how loads are
    grouped: "optimal" (default), "per_layer", "whole" or "fixed".

    ``scheduling``: who gets the device next (``timeshare.runtime.dispatch``):
    "priority" (default; calls preempt training at its next iteration boundary),
    "fifo", "fair", "srtf" or "edf"; ``time_slice_s``: how long a training job keeps
    the device before waiting calls get it (FIFO time-slicing; FAIR's default 1 s).

    ``workers``: worker processes (0: models run in this process). With workers, a
    worker that does not answer a call within its deadline is killed and replaced
    (NOTE [Call deadlines]): ``task_deadline_factor`` times the slowest recent call of the
    same kind, at least ``task_deadline_min_s``, at most ``task_timeout_s`` (also the
    deadline of a kind of call not seen yet).

    Outputs are returned on the CPU, so the same call works when the model runs in
    another process.

    Diagnostics, for checks of exactness (NOTE [Poisoned reloads]), never for serving:
    ``poison_evicted`` overwrites an evicted model's block with NaN bytes, so that a load
    that skipped a group's wait reads poison instead of the old bytes sticky placement
    left there; ``copy_delay_s`` starts every group's copy that much later.
    """

    def __init__(
        self,
        device: str | torch.device = "auto",
        memory: int | str = "auto",
        *,
        eviction: str = "lru",
        strategy: str = "optimal",
        profile_repeats: int = 3,
        fixed_group_bytes: int | str = "2MiB",
        load_timeout_s: float = 60.0,
        workers: int = 0,
        task_timeout_s: float = 300.0,
        task_deadline_factor: float = 10.0,
        task_deadline_min_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        scheduling: str = "priority",
        time_slice_s: float | None = None,
        poison_evicted: bool = False,
        copy_delay_s: float = 0.0,
    ):
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
        if profile_repeats < 1:
            raise ConfigError(f"profile_repeats must be at least 1, got {profile_repeats}")
        for what, value in (("load_timeout_s", load_timeout_s), ("task_timeout_s", task_timeout_s),
                            ("startup_timeout_s", startup_timeout_s), ("task_deadline_min_s", task_deadline_min_s)):
            if value <= 0:
                raise ConfigError(f"{what} must be positive, got {value}")
        if copy_delay_s < 0:
            raise ConfigError(f"copy_delay_s must not be negative, got {copy_delay_s}")
        self.poison_evicted = poison_evicted  # NOTE [Poisoned reloads]
        if task_deadline_factor < 1:
            raise ConfigError(f"task_deadline_factor must be at least 1, got {task_deadline_factor}")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ConfigError(f"workers must be a non-negative integer, got {workers!r}")
        # Who gets the device next (NOTE [Preemption points]); a refused name fails here,
        # before any memory is taken.
        self._gate = Dispatcher(scheduling, time_slice_s=time_slice_s)
        self.task_timeout_s = task_timeout_s  # a worker silent this long on a task is killed and replaced
        self.device = resolve_device(device)
        self.strategy = strategy
        self.profile_repeats = profile_repeats
        self.fixed_group_bytes = parse_bytes(fixed_group_bytes, what="fixed_group_bytes")
        self._policy = make_eviction_policy(eviction)
        capacity = self._resolve_memory(memory)
        try:
            self._arena = Arena(self.device, capacity)
        except torch.OutOfMemoryError as exc:
            raise MemoryBudgetError(
                f"cannot reserve an arena of {format_bytes(capacity)} on {self.device}: {exc}"
            ) from exc
        self._engine = None
        self._worker: Worker | None = None
        self._pool: ProcessPool | None = None
        self._stores: dict[str, SharedMemory] = {}  # multi-process: host stores the workers map
        try:
            if workers:
                self._pool = ProcessPool(
                    workers, device=str(self.device), share_arena=self._arena.share,
                    arena_capacity=self._arena.capacity, profile_repeats=profile_repeats,
                    fixed_group_bytes=self.fixed_group_bytes, load_timeout_s=load_timeout_s,
                    task_timeout_s=task_timeout_s, startup_timeout_s=startup_timeout_s,
                    task_deadline_factor=task_deadline_factor, task_deadline_min_s=task_deadline_min_s,
                    copy_delay_s=copy_delay_s,
                )
            else:
                self._engine = make_copy_engine(self.device, load_timeout_s, copy_delay_s)
                self._worker = Worker(
                    self.device, self._arena, self._engine,
                    profile_repeats=profile_repeats, fixed_group_bytes=self.fixed_group_bytes,
                )
        except BaseException:
            self._arena.close()
            raise
        self._jobs: dict[str, TrainingJob] = {}
        self._submitter: ThreadPoolExecutor | None = None
        self._quarantine: list[tuple[Block, LoadHandle]] = []  # blocks a stuck copy may still write
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._evictions = 0
        self._failures = 0
        self._listeners: list[Listener] = []

    # ------------------------------------------------------------------ public API
    def register(
        self,
        name: str,
        build: Builder,
        weights=None,
        example_inputs: tuple = (),
        *,
        example_kwargs: dict | None = None,
        dtype: str | torch.dtype | None = None,
        pin: bool = False,
        priority: Priority | str = Priority.LATENCY_CRITICAL,
        slo_s: float | None = None,
    ) -> None:
        """Register a model: build it, check and pack its weights. Nothing is loaded yet.

        ``build`` is a callable or a "module:function" string returning an ``nn.Module``;
        ``weights`` a safetensors path or a state dict (None keeps the module's own
        initial values); ``example_inputs`` the positional inputs used to profile it;
        ``dtype`` converts floating tensors; ``pin`` keeps it resident once loaded;
        ``priority`` ("latency_critical" or "best_effort") and ``slo_s`` (a latency
        objective, the deadline of EDF within a priority class) order its calls.
        """
        self._check_open()
        try:
            priority = Priority.parse(priority)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if slo_s is not None and not slo_s > 0:
            raise ConfigError(f"slo_s must be positive, got {slo_s!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"model name must be a non-empty string without '/', got {name!r}")
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        with self._turn():
            if name in self._models:
                raise DuplicateModelError(f"a model named {name!r} is already registered")
        spec = ModelSpec(name, build, weights, example_inputs, dict(example_kwargs or {}), parse_dtype(dtype))
        if self._pool is not None:
            _check_shippable(spec)
        module = build_module(name, build)
        module.eval()
        layout = collect(module)
        if not layout.entries:
            raise ModelError(f"model {name!r} has no parameters or buffers to manage")
        current = layout.tensors()
        tensors = current if weights is None else apply_weights(layout, current, read_weights(weights))
        if spec.dtype is not None:
            layout.entries = [_with_dtype(e, spec.dtype) for e in layout.entries]
            tensors = {e.key: tensors[e.key].to(e.dtype) for e in layout.entries}
        # Page-locked on CUDA, at its exact size (NOTE [Exact host pinning]): here, or by
        # each worker over the shared segment.
        host_pinned = self.device.type == "cuda"
        store = HostStore.pack(layout.entries, tensors, pin=host_pinned and self._pool is None,
                               registrar=host_registrar(self.device))
        del tensors, current
        shm = order = None
        if self._pool is not None:
            # Workers map the store, so it is laid out in execution order once, here.
            order = _trace_on_host(module, layout, store, spec)
            by_key = {e.key: e for e in store.entries}
            shm = SharedMemory(create=True, size=store.nbytes)
            reserve_shared_memory(shm, f"the host copy of model {name!r}",
                                  "free space in /dev/shm (unregister models, or enlarge it: Docker's default "
                                  "is 64 MB, --shm-size raises it)")
            buffer = torch.frombuffer(shm.buf, dtype=torch.uint8, count=store.nbytes)
            store = HostStore.pack([by_key[k] for k in order.key_order()], store.state(), pin=False, buffer=buffer)
            del buffer
        unbind(layout)  # the module now holds no weights of its own
        with self._turn():
            try:
                if name in self._models:
                    raise DuplicateModelError(f"a model named {name!r} is already registered")
                if store.nbytes > self._arena.capacity:
                    log.warning("model %s (%s) is larger than the arena (%s)", name,
                                format_bytes(store.nbytes), format_bytes(self._arena.capacity))
                if self._pool is not None:
                    assert shm is not None and order is not None
                    msg = P.AddModel(0, name, build, tuple(store.entries), shm.name, store.nbytes, order)
                    nbytes = store.nbytes
                    del store  # the controller keeps no view of it, so the segment can close
                    self._pool.add(msg)
                    self._stores[name] = shm
                else:
                    nbytes = store.nbytes
                    self._worker.add(name, module, layout, store)
            except BaseException:
                if shm is not None and name not in self._stores:
                    _drop_segment(shm)
                raise
            self._models[name] = _Model(spec, nbytes, pinned=pin, priority=priority, slo_s=slo_s,
                                        host_pinned=host_pinned and self._pool is not None)
        log.info("registered %s: %d tensors, %s", name, len(layout.entries), format_bytes(nbytes))

    def infer(self, name: str, *args, **kwargs):
        """Run model ``name`` on the inputs, loading it first (pipelined) if needed.

        Tensors in the inputs may live anywhere; outputs come back on the CPU with the
        structure the module returned (tensor, tuple, dict, dataclass...).
        """
        return self._infer(name, args, kwargs, None)

    def infer_since(self, name: str, arrived_at: float, args: tuple = (), kwargs: dict | None = None):
        """``infer`` for a request that arrived at ``arrived_at`` (``time.monotonic()``)
        and has queued elsewhere since (a server's queue): the model's SLO deadline
        counts from then, not from when the call reaches the runtime."""
        return self._infer(name, tuple(args), kwargs or {}, None, arrived_at=arrived_at)

    def submit(self, name: str, *args, **kwargs) -> Future:
        """Queue an inference; the future resolves to what ``infer`` would return. Queued
        requests run in order, one at a time, and survive a worker failure (only the
        request in flight fails)."""
        with self._turn():
            self._check_open()
            self._get(name)
            if self._submitter is None:
                self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="timeshare-submit")
            return self._submitter.submit(self.infer, name, *args, **kwargs)

    def train(
        self,
        name: str,
        model,
        optimizer,
        data,
        step,
        iterations: int | None = None,
        *,
        offload: bool = False,
        seed: int | None = None,
    ) -> TrainingJob:
        """Start a training job that time-shares the device with inference.

        ``model``: an ``nn.Module``, a callable returning one or a "module:function"
        string; ``optimizer``: a callable
        taking the parameters; ``data``: an iterable of batches (tensors anywhere) or a
        callable returning one; ``step(model, optimizer, batch)``: one iteration,
        returning the loss; ``iterations``: stop after this many (None: when ``data``
        ends). Inference preempts the job between iterations (NOTE [Preemption points]);
        ``offload`` moves its state to host memory while preempted; ``seed`` seeds the
        job's own random state (default: ``torch.initial_seed()``).

        With workers the job runs in a worker process that keeps its state between
        segments (NOTE [Switch protocol]); then every argument must be picklable, and
        the model is built there. Returns the job's handle.
        """
        validate_training_args(name, model, optimizer, data, step, iterations)
        spec = TrainSpec(name, model, optimizer, data, step, iterations, offload,
                         torch.initial_seed() if seed is None else int(seed))
        if self._pool is not None:
            spec.check_shippable()
            if len(self._pool.workers) < 2:
                raise ConfigError("training with workers needs workers >= 2: one holds the job, another "
                                  "stays free so that inference never waits for a process to start")
        with self._turn():
            self._check_open()
            if name in self._jobs and not self._jobs[name].wait(0):
                raise DuplicateModelError(f"a training job named {name!r} is running")
            if self._pool is not None:
                self._pool.drop_job(name)  # a finished job of that name
                job: TrainingJob = WorkerTrainingJob(spec, pool=self._pool, lock=self._lock, gate=self._gate)
            else:
                task = TrainingTask.build(spec, self.device)
                job = LocalTrainingJob(task, name, lock=self._lock, gate=self._gate)
            self._jobs[name] = job
        return job.start()

    def switches(self) -> list[dict]:
        """The latest switches from a training job to an inference (workers only): stop,
        start, load, clean and total seconds of each (NOTE [Switch protocol])."""
        with self._turn():
            return [s.as_dict() for s in self._pool.switches] if self._pool is not None else []

    def jobs(self) -> dict[str, TrainingJob]:
        with self._turn():
            return dict(self._jobs)

    def forget_job(self, name: str) -> None:
        """Drop a finished training job: its handle, and with workers the parameters and
        optimizer state its home worker still holds (kept until now for the handle's ``state_dict()``).
        A running job must be cancelled first."""
        with self._turn():
            job = self._jobs.get(name)
            if job is None:
                raise UnknownModelError(f"no training job named {name!r}")
            if not job.wait(0):
                raise DuplicateModelError(f"training job {name!r} is still running; cancel it first")
            del self._jobs[name]
            if self._pool is not None:
                self._pool.drop_job(name)

    def profile(self, name: str, *args, **kwargs) -> ModelProfile:
        """Profile ``name`` for these inputs (default: its example inputs) and plan its
        groupings. Loads the model if needed; plans are cached per input shape."""
        with self._turn():
            m = self._get(name)
            if not args and not kwargs:
                args, kwargs = m.spec.example_inputs, m.spec.example_kwargs
            if not args and not kwargs:
                raise ConfigError(f"model {name!r} has no example inputs; pass inputs to profile()")
            args, kwargs = self._to_device(args), self._to_device(kwargs)
            if m.block is None:
                self._run(m, args, kwargs, None)
            assert m.block is not None
            return self._exec.profile(name, m.block.offset, args, kwargs)

    def evict(self, name: str) -> bool:
        """Remove ``name`` from device memory; True if it was resident."""
        with self._turn():
            m = self._get(name)
            if m.block is None:
                return False
            self._evict(m)
            return True

    def resident(self) -> list[str]:
        """Names of the models in device memory, the first to evict first under the policy."""
        with self._turn():
            return [n for n in self._policy.candidates(time.monotonic()) if self._models[n].block is not None]

    def models(self) -> list[str]:
        with self._turn():
            return list(self._models)

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned model is never evicted to make room for another."""
        with self._turn():
            self._get(name).pinned = pinned

    def unregister(self, name: str) -> None:
        with self._turn():
            m = self._get(name)
            self._evict(m)
            self._exec.remove(name)
            del self._models[name]
            if name in self._stores:
                _drop_segment(self._stores.pop(name))
            release_host_cache(self.device)

    def worker_pids(self) -> list[int]:
        """The operating-system ids of the worker processes now in the pool (empty
        without workers): for operators and fault-injection tests."""
        return list(self._pool.pids()) if self._pool is not None else []

    def stats(self) -> dict:
        with self._turn():
            alloc = self._arena.allocator
            return {
                "device": str(self.device),
                "capacity_bytes": alloc.capacity,
                "used_bytes": alloc.used,
                "free_bytes": alloc.free,
                "largest_free_bytes": alloc.largest_free,
                "blocks": len(alloc.blocks()),
                "resident": self.resident(),
                "loads": {n: m.loads for n, m in self._models.items()},
                "evictions": self._evictions,
            }

    def snapshot(self) -> dict:
        """Counters and memory for metrics, read without waiting for the device (a
        scrape must not queue behind a long inference): a consistent-enough view, not
        an atomic one."""
        alloc = self._arena.allocator
        models = list(self._models.values())
        jobs = list(self._jobs.values())
        return {
            "device": str(self.device),
            "capacity_bytes": alloc.capacity,
            "used_bytes": alloc.used,
            "resident": {m.name: m.nbytes for m in models if m.block is not None},
            "host_bytes": sum(m.nbytes for m in models),
            "host_pinned_bytes": self._host_pinned_bytes(models),
            "loads": {m.name: m.loads for m in models},
            "evictions": self._evictions,
            "failures": self._failures,
            "preemptions": self._gate.scheduler.preemptions,
            "training_seconds": sum(j.stats.step_seconds for j in jobs),
            "training_iterations": sum(j.stats.iterations for j in jobs),
            # With workers: the pool's size, the workers ready to serve, replacements so far.
            "workers": self._pool.health() if self._pool is not None else None,
        }

    def _host_pinned_bytes(self, models: list[_Model]) -> int:
        """Host memory page-locked for the stores (NOTE [Exact host pinning]): what the
        in-process worker registered; with workers, each store's segment, which every
        worker registers (the same pages, counted once)."""
        if self._worker is not None:
            return self._worker.pinned_host_bytes()
        return sum(m.nbytes for m in models if m.host_pinned)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` with a :class:`~timeshare.runtime.events.CallRecord` after
        every inference and an :class:`~timeshare.runtime.events.EvictionRecord` after
        every eviction. It runs while the runtime is held: keep it quick; what it
        raises is logged, never passed to the caller."""
        self._listeners.append(listener)

    def _emit(self, record: CallRecord | EvictionRecord) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:
                log.exception("runtime listener %r failed on %r", listener, record)

    def close(self) -> None:
        """Evict everything and give the arena back. Idempotent; every step runs even if
        an earlier one fails, so no segment, thread or device memory is left behind."""
        with self._turn():
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
            submitter, self._submitter = self._submitter, None
        for job in jobs:  # outside the lock: a job needs it to reach its preemption point
            job.cancel()
        for job in jobs:
            if not job.wait(60):
                log.warning("training job %s did not stop within 60 s", job.name)
        if submitter is not None:
            submitter.shutdown(wait=True, cancel_futures=True)
        with self._turn():
            try:
                for m in self._models.values():
                    self._evict(m)
                    if self._worker is not None:
                        self._worker.remove(m.name)
                self._models.clear()
            finally:
                try:
                    if self._pool is not None:
                        self._pool.close()
                    if self._engine is not None:
                        self._engine.close()
                    synchronize(self.device)
                finally:
                    self._quarantine.clear()
                    for shm in self._stores.values():
                        _drop_segment(shm)
                    self._stores.clear()
                    self._arena.close()
                    release_host_cache(self.device)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten close() must not leak the shared-memory segment
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # interpreter shutdown: modules may be half torn down
            pass

    def _infer_in_new_process(self, name: str, args: tuple, kwargs: dict | None = None):
        """Benchmarks only (``bench switch``'s "two processes" baseline): run ``name`` in a
        worker process started for this call, loading it from the host store."""
        if self._pool is None:
            raise ConfigError("a new-process inference needs workers")
        with self._turn():
            m = self._get(name)
            self._evict(m)
            block = self._place(m)
            try:
                return self._pool.run_in_new_worker(name, block.offset, self._to_device(args),
                                                    self._to_device(kwargs or {}), self.strategy)
            finally:
                self._evict(m)

    # ------------------------------------------------------------------ internals
    def _infer(self, name: str, args: tuple, kwargs: dict, strategy: str | None, *, arrived_at: float | None = None):
        m = self._get(name)
        with self._gate.priority(name, Kind.INFERENCE, priority=m.priority, deadline_s=m.slo_s,
                                 arrived_at=arrived_at) as turn, self._lock:
            m = self._get(name)  # unregistered while this call waited
            t0 = time.monotonic()
            loaded = m.block is None
            error = None
            try:
                args, kwargs = self._to_device(args), self._to_device(kwargs)
                return self._to_caller(self._run(m, args, kwargs, strategy))
            except BaseException as exc:
                error = type(exc).__name__
                self._failures += 1
                raise
            finally:
                prev = turn.previous
                switched = None if prev is None or prev == (Kind.INFERENCE, name) else prev[1]
                timings = dict(self._pool.last_timings) if self._pool is not None and error is None else None
                self._emit(CallRecord(name, t0, time.monotonic() - t0, turn.waited_s, loaded, switched, error,
                                      timings))

    def _run(self, m: _Model, args: tuple, kwargs: dict, strategy: str | None):
        """Forward ``m`` on device inputs, loading it first if it is not resident."""
        resident = m.block is not None
        block = m.block if resident else self._place(m)
        assert block is not None
        try:
            out = self._exec.run(m.name, block.offset, resident, args, kwargs, strategy or self.strategy)
        except BaseException:
            if not resident:
                self._evict(m)  # a failed load leaves nothing behind
            raise
        if not resident:
            m.loads += 1
        self._policy.touched(m.name, time.monotonic())
        return out

    def _place(self, m: _Model) -> Block:
        """A block for ``m``, evicting unpinned models in policy order until it fits."""
        need = m.nbytes
        if self._arena.allocator.rounded(need) > self._arena.capacity:
            raise ModelTooLargeError(m.name, need, self._arena.capacity)
        self._reclaim_quarantine()

        def allocate() -> Block | None:  # its old offset first: NOTE [Sticky placement]
            block = None
            if m.last_offset is not None:
                block = self._arena.allocator.allocate_at(m.last_offset, need, m.name)
            return block or self._arena.allocate(need, m.name)

        block = allocate()
        while block is None:
            protected = {n for n, x in self._models.items() if x.pinned or x is m}
            victims = [n for n in self._policy.candidates(time.monotonic(), protected)
                       if self._models[n].block is not None]
            if not victims:
                alloc = self._arena.allocator
                raise MemoryBudgetError(
                    f"cannot place model {m.name!r} ({format_bytes(need)}): {format_bytes(alloc.free)} free, "
                    f"largest free range {format_bytes(alloc.largest_free)}, and every resident model is pinned"
                )
            self._evict(self._models[victims[0]])
            block = allocate()
        m.block = block
        m.last_offset = block.offset
        self._policy.admitted(m.name, time.monotonic(), reload_s=0.0)
        return block

    def _evict(self, m: _Model) -> None:
        """Make ``m`` non-resident. Never raises: the worker waits for its copies, and a
        block a copy may still be writing (its deadline passed) is quarantined."""
        if m.block is None:
            return
        block, m.block = m.block, None
        self._policy.removed(m.name)
        self._evictions += 1
        self._emit(EvictionRecord(m.name, m.nbytes, time.monotonic()))
        still_copying = self._exec.release(m.name)
        if still_copying is not None:
            self._quarantine.append((block, still_copying))
        else:
            if self.poison_evicted:  # NOTE [Poisoned reloads]
                self._arena.poison(block)
            self._arena.release(block)  # the module keeps stale views: NOTE [Sticky placement]

    def _reclaim_quarantine(self) -> None:
        still = []
        for block, handle in self._quarantine:
            if handle.done():
                self._arena.release(block)
            else:
                still.append((block, handle))
        self._quarantine = still

    def _get(self, name: str) -> _Model:
        self._check_open()
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModelError(f"no model named {name!r} is registered; known: {sorted(self._models)}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TimeshareError("this runtime is closed")

    def _to_device(self, obj):
        # With workers, inputs stay on the host: they cross the pipe as host bytes and the
        # worker uploads them once, pinned (NOTE [Input staging]). Moving them here would send
        # device tensors through pickling, a device-to-host copy in the controller and another
        # upload in the worker.
        if self._pool is not None:
            return map_tensors(obj, lambda t: t.cpu())
        return map_tensors(obj, lambda t: t.to(self.device))

    def _to_caller(self, out):
        # Workers in other processes already answer with host tensors of their own.
        return self._worker.to_host(out) if self._worker is not None else out

    @contextmanager
    def _turn(self, model: str = "", kind: Kind = Kind.CONTROL):
        """The runtime's lock, once the scheduler gives this call its turn (NOTE [Preemption points])."""
        with self._gate.priority(model, kind), self._lock:
            yield

    @property
    def _exec(self):
        """Where models execute: the in-process worker or the pool of worker processes."""
        return self._pool if self._pool is not None else self._worker

    def _resolve_memory(self, memory: int | str) -> int:
        if memory != "auto":
            return parse_bytes(memory, what="memory")
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return free // 2
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(2 << 30, total // 8)


def _check_shippable(spec: ModelSpec) -> None:
    """Worker processes rebuild the module from ``build`` and trace it with the example
    inputs, so both must be sendable to another process."""
    if not spec.example_inputs and not spec.example_kwargs:
        raise ConfigError(
            f"model {spec.name!r}: with workers, register() needs example_inputs (the execution order is "
            "traced at registration)"
        )
    try:
        pickle.dumps(spec.build)
    except Exception as exc:
        raise ConfigError(
            f"model {spec.name!r}: with workers, build must be a 'module:function' string or a top-level "
            f"function that worker processes can import, not {spec.build!r} ({exc})"
        ) from None


def _trace_on_host(module: nn.Module, layout: TensorLayout, store: HostStore, spec: ModelSpec) -> ExecutionOrder:
    """The execution order from one forward on the CPU, with the module bound to the store."""
    bind(layout, store.state())
    spans = store.spans(store.buffer.data_ptr())
    cpu = lambda t: t.to("cpu")  # noqa: E731
    args, kwargs = map_tensors(spec.example_inputs, cpu), map_tensors(spec.example_kwargs, cpu)
    with torch.no_grad():
        order, _ = trace_execution_order(module, args, kwargs, spans, owners_of(layout))
    return order


def _drop_segment(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view is still alive somewhere; the mapping goes with it
        pass
    shm.unlink()


def _with_dtype(e: TensorEntry, dtype: torch.dtype) -> TensorEntry:
    if not e.dtype.is_floating_point:
        return e
    return TensorEntry(e.key, e.names, e.kind, e.shape, dtype, e.requires_grad, e.offset)
