"""The runtime's facade: the public API and lifecycle. Runs in the caller's process.

A model's life: ``register`` builds it on the CPU and packs its weights into a host
store (``registration``), then points its slots at meta tensors (it holds no weights
of its own). Residency decides where in the arena a model lives and which models leave
to make room, in integers (``residency``); an executor does the rest: binding,
pipelined loads, tracing and profiling, in this process or in worker processes
(``executor``). The facade never asks which executor it has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from timeshare.decode.step import Step
from timeshare.device import resolve_device, synchronize
from timeshare.errors import ConfigError, TimeshareError
from timeshare.executor.interface import Executor
from timeshare.executor.packing import build_and_pack
from timeshare.memory.arena import Region
from timeshare.models.binding import unbind
from timeshare.models.spec import Builder
from timeshare.options import RuntimeOptions
from timeshare.runtime import assembly, host_tier, observe, sharing
from timeshare.runtime.calls import Call
from timeshare.runtime.dispatch import Grant, Ticket
from timeshare.runtime.events import Listener, Outbox, RuntimeLock
from timeshare.runtime.jobs import JobTable, training_spec
from timeshare.runtime.lanes import lane_ask, lanes_call, turn_call, wait_idle
from timeshare.runtime.observe import Diagnostics
from timeshare.runtime.registration import model_spec, parse_dtype
from timeshare.runtime.residency import ModelEntry
from timeshare.runtime.table import ModelTable
from timeshare.runtime.training import TrainingJob, new_job
from timeshare.runtime.turns import ModelTurn
from timeshare.scheduler.eviction import make_eviction_policy
from timeshare.scheduler.task import Kind, Priority
from timeshare.scheduler.thrashing import ThrashingDetector
from timeshare.transfer.planner import STRATEGIES
from timeshare.transfer.profiler import ModelProfile
from timeshare.tree import shape_key
from timeshare.units import format_bytes
from timeshare.worker.profiling import release_host_cache

__all__ = ["Call", "ModelTurn", "Runtime", "parse_dtype"]

log = logging.getLogger(__name__)


class Runtime:
    """Time-shares one device among registered models.

    Its options (``timeshare.options.RuntimeOptions``, where each is documented: device,
    arena size, workers, scheduling and lanes, eviction, the host tier, deadlines,
    diagnostics) are given as keyword arguments, as one record (``options``; a server's
    ``runtime`` section is one), or both, the keywords overriding the record: ``Runtime("cpu",
    "1GiB", workers=2)``. A refused option raises ConfigError before any memory is taken.

    Outputs are returned on the CPU, so the same call works when the model runs in
    another process.
    """

    def __init__(self, device: str | torch.device | None = None, memory: int | str | None = None, *,
                 options: RuntimeOptions | None = None, **changes: Any):
        given = {k: v for k, v in (("device", device), ("memory", memory)) if v is not None}
        self.options = opts = RuntimeOptions.of(options, **given, **changes)
        self.task_timeout_s = opts.task_deadline_s  # a worker silent this long on a task is killed and replaced
        self.device = resolve_device(opts.device)
        self._arena = arena = assembly.open_arena(self.device, opts.memory)
        try:
            self._dispatcher = assembly.make_dispatcher(opts, self.device, arena)
            self._exec: Executor = assembly.make_executor(opts, self.device, arena)
        except BaseException:
            arena.close()
            raise
        self._jobs = JobTable()
        self._submitter: ThreadPoolExecutor | None = None
        outbox = Outbox()
        self._lock = RuntimeLock(outbox)  # NOTE [Records outside the lock]
        # A model's last unlocked call ended. (typeshed knows only its own locks; RuntimeLock has
        # what Condition calls.)
        self._idle = threading.Condition(self._lock)  # type: ignore[arg-type]
        shared_sets = sharing.SharedTensors() if opts.dedup else None
        try:
            host = host_tier.make_host_tier(opts.host_memory, opts.eviction, self._exec, workers=opts.workers,
                                            spill_dir=opts.spill_dir, direct_io=opts.direct_io,
                                            outside=shared_sets.nbytes if shared_sets is not None else lambda: 0)
        except BaseException:
            self._exec.close()
            arena.close()
            raise
        self._table = ModelTable(arena, make_eviction_policy(opts.eviction), self._exec, opts.strategy, host=host,
                                 sharing=shared_sets, outbox=outbox, wait_idle=self._wait_idle,
                                 poison=opts.poison_evicted, detector=ThrashingDetector() if opts.thrashing else None)
        self._residency = self._table.residency
        self._closed = False

    @property
    def strategy(self) -> str:
        """How loads are grouped when a call names no strategy; may be changed at any time."""
        return self._table.strategy

    @strategy.setter
    def strategy(self, value: str) -> None:
        self._table.strategy = RuntimeOptions.of(self.options, strategy=value).strategy

    @property
    def poison_evicted(self) -> bool:
        """The exactness diagnostic (NOTE [Poisoned reloads]): evicted blocks get NaN bytes."""
        return self._residency.poison

    # ------------------------------------------------------------------ models
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
        spec, priority = model_spec(name, build, weights, example_inputs, example_kwargs, dtype, priority, slo_s)
        with self._scheduled():
            self._table.check_free(name)
        self._exec.check_registrable(spec)
        stored = None
        entry = ModelEntry(spec, 0, pinned=pin, priority=priority, slo_s=slo_s)
        if self._table.sharing is not None:
            member, digests = sharing.prepare(spec)
            unbind(member.layout)
            with self._scheduled():  # a model laid out again waits for its running call (NOTE [Shared tensors])
                self._table.add_deduped(entry, member, digests)
            log.info("registered %s: %d tensors, %s of its own", name, len(member.layout.entries),
                     format_bytes(entry.nbytes))
            return
        if self._table.host is not None:
            packed, stored = host_tier.pack(spec, self._exec, self._table.host)
        else:
            module, layout, store = build_and_pack(spec)
            packed = self._exec.pack(spec, module, layout, store)
            del store
        unbind(packed.layout)  # the module now holds no weights of its own
        with self._scheduled():
            entry.nbytes = packed.nbytes
            self._table.add(entry, packed, stored)
        log.info("registered %s: %d tensors, %s", name, len(packed.layout.entries), format_bytes(packed.nbytes))

    def unregister(self, name: str) -> None:
        with self._scheduled():
            m = self._get(name)
            self._wait_idle(m)
            self._table.remove(m)
            release_host_cache(self.device)

    def models(self) -> list[str]:
        with self._scheduled():
            return list(self._table.entries)

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned model is never evicted to make room for another."""
        with self._scheduled():
            self._get(name).pinned = pinned

    def evict(self, name: str, *, host: bool = False) -> bool:
        """Remove ``name`` from device memory; True if it was resident. ``host``: under a
        host budget, give its host memory back too (NOTE [Host tier])."""
        with self._scheduled():
            m = self._get(name)
            self._wait_idle(m)
            evicted = self._table.evict(m, keep_host_copy=not host)
            if host and self._table.host is not None:
                self._table.host.drop(name)
            return evicted

    def reserve(self, owner: str, nbytes: int, what: str | None = None) -> Region:
        """``nbytes`` of the arena for ``owner``, at a fixed offset and device address until
        ``unreserve(owner)`` or ``close()`` (NOTE [Regions of the arena]):
        unpinned idle models are evicted to make room, as for a load, and no model's
        placement takes or evicts it. ``MemoryBudgetError`` (``ModelTooLargeError`` when
        larger than the arena) if it does not fit, ``what`` naming it."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"a region of the arena needs a positive whole number of bytes, got {nbytes!r}")
        with self._scheduled():
            block = self._table.reserve_region(owner, nbytes, what or f"region {owner!r}")
            return Region(owner, block.offset, nbytes, self._arena.region(block)[:nbytes])

    def unreserve(self, owner: str) -> None:
        """Give ``owner``'s region back (nothing if it holds none); nothing may read or
        write its tensor after."""
        with self._scheduled():
            self._table.release_region(owner)

    def resident(self) -> list[str]:
        """Names of the models in device memory, the first to evict first under the policy."""
        with self._scheduled():
            return self._residency.order(self._table.entries)

    def profile(self, name: str, *args, **kwargs) -> ModelProfile:
        """Profile ``name`` for these inputs (default: its example inputs) and plan its
        groupings. Loads the model if needed; plans are cached per input shape."""
        with self._scheduled():
            m = self._get(name)
            if not args and not kwargs:
                args, kwargs = m.spec.example_inputs, m.spec.example_kwargs
            if not args and not kwargs:
                raise ConfigError(f"model {name!r} has no example inputs; pass inputs to profile()")
            return self._table.profile(m, args, kwargs)

    # ------------------------------------------------------------------ inference
    def infer(self, name: str, *args, **kwargs):
        """Run model ``name`` on the inputs, loading it first (pipelined) if needed.

        Tensors in the inputs may live anywhere; outputs come back on the CPU with the
        structure the module returned (tensor, tuple, dict, dataclass...).
        """
        return self._call(name, args, kwargs).output

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None, *, strategy: str | None = None,
             arrived_at: float | None = None) -> Call:
        """``infer`` that also returns the call's own record (timings, whether it loaded
        the model, what it switched from). ``strategy`` overrides the runtime's grouping
        for this call's load, if it loads; ``arrived_at`` (``time.monotonic()``) is when a
        request that queued elsewhere (a server's queue) arrived: its SLO deadline counts from then."""
        if strategy is not None and strategy not in STRATEGIES:
            raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
        return self._call(name, args, kwargs, strategy=strategy, arrived_at=arrived_at)

    def _call(self, name: str, args: tuple, kwargs: dict | None, *, strategy: str | None = None,
              arrived_at: float | None = None, step: Step | None = None) -> Call:
        """``call``; ``step``: a language model's step instead of a forward (``ModelTurn.step``,
        NOTE [One step, two places]): its args and kwargs are empty."""
        args = args if type(args) is tuple else tuple(args)
        kwargs = {} if not kwargs else dict(kwargs)
        m = self._get(name)
        lanes = self._dispatcher.lane_capacity
        ask, unmeasured, key = 0, False, None
        if lanes is not None:  # the shape's measured peak, or what is free: NOTE [Asks that shrink]
            key = shape_key(args, kwargs)
            ask = lane_ask(m, key, self._dispatcher.free_lane_bytes)
            unmeasured = key not in m.ephemeral
        with self._lock.records_after(), \
                self._dispatcher.hold(name, Kind.INFERENCE, priority=m.priority, deadline_s=m.slo_s,
                                      arrived_at=arrived_at, ephemeral=ask, at_most=unmeasured) as grant, self._lock:
            m = self._get(name)  # unregistered while this call waited
            prev = grant.previous
            switched = None if prev is None or prev == (Kind.INFERENCE, name) else prev[1]
            if lanes is None:
                call = self._table.call(m, args, kwargs, strategy, waited_s=grant.waited_s, switched_from=switched,
                                        step=step)
            else:
                call = lanes_call(self._table, m, args, kwargs, strategy, grant, switched, self._lock, self._idle,
                                  self._dispatcher.lane_threads, key)
            if grant.switch is not None:
                self._dispatcher.served(grant.switch, call.record.timings)
            return call

    @contextmanager
    def turn(self, name: str, *, urgent_since: float | None = None,
             ticket: Ticket | None = None, ephemeral: int | None = None) -> Iterator[ModelTurn]:
        """Hold the device for a series of calls to model ``name``: a language model's
        decode steps (NOTE [Decode bursts] in ``llm/engine.py``). The scheduler gives the
        turn as it gives one call's; inside it, ``ModelTurn.call`` runs at once, and
        ``ModelTurn.contended`` says at each step whether to give the device back.
        ``urgent_since`` (``time.monotonic()``): the turn is due since then (a request
        waiting for its first token), and comes before turns of its class that are not;
        ``ticket`` lets another thread make it so while it waits (``Ticket.expedite``).
        With lanes: ``ephemeral``, the bytes the turn's lane must hold (None: what is
        free now); every call of the turn runs bounded by it (NOTE [Turns in lanes])."""
        if ephemeral is not None and (isinstance(ephemeral, bool) or not isinstance(ephemeral, int) or ephemeral < 0):
            raise ConfigError(f"ephemeral must be a whole number of bytes, at least 0, or None; got {ephemeral!r}")
        m = self._get(name)
        lanes = self._dispatcher.lane_capacity
        ask = 0 if lanes is None else min(lanes, self._dispatcher.free_lane_bytes() if ephemeral is None else ephemeral)
        deadline = None if urgent_since is None else 0.0
        with self._lock.records_after(), \
                self._dispatcher.hold(name, Kind.INFERENCE, priority=m.priority, deadline_s=deadline,
                                      arrived_at=urgent_since, ticket=ticket, ephemeral=ask, at_most=True) as held:
            if lanes is None:
                yield ModelTurn(name, m.priority, self._dispatcher, partial(self._call, name), switch=held.switch)
            else:
                yield ModelTurn(name, m.priority, self._dispatcher, partial(self._call_in_lane, name, held),
                                held.lane_bytes, held.switch)

    def _call_in_lane(self, name: str, held: Grant, args: tuple, kwargs: dict | None, *, step: Step | None) -> Call:
        """A call of a turn that holds a lane (NOTE [Turns in lanes])."""
        with self._lock:
            m = self._get(name)
            return turn_call(self._table, m, tuple(args), dict(kwargs or {}), held, self._lock, self._idle,
                             self._dispatcher.lane_threads, step)

    def submit(self, name: str, *args, **kwargs) -> Future:
        """Queue an inference; the future resolves to what ``infer`` would return. Queued
        requests run in order, one at a time, and survive a worker failure (only the
        request in flight fails)."""
        with self._scheduled():
            self._check_open()
            self._get(name)
            if self._submitter is None:
                self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="timeshare-submit")
            return self._submitter.submit(self.infer, name, *args, **kwargs)

    def infer_in_new_process(self, name: str, args: tuple, kwargs: dict | None = None):
        """Benchmarks only (``bench switch``'s "two processes" baseline, PipeSwitch's): run
        ``name`` in a worker process started for this call, loading it from the host store."""
        with self._scheduled():
            return self._table.run_in_new_process(self._get(name), tuple(args), kwargs or {})

    # ------------------------------------------------------------------ training
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
        resume: dict | None = None,
    ) -> TrainingJob:
        """Start a training job that time-shares the device with inference.

        ``model``: an ``nn.Module``, a callable returning one or a "module:function"
        string; ``optimizer``: a callable
        taking the parameters; ``data``: an iterable of batches (tensors anywhere) or a
        callable returning one; ``step(model, optimizer, batch)``: one iteration,
        returning the loss; ``iterations``: stop after this many (None: when ``data``
        ends). Inference preempts the job between iterations (NOTE [Preemption points]);
        ``offload`` moves its state to host memory while preempted; ``seed`` seeds the
        job's own random state and, when ``model`` is a builder, its initial weights
        (default: ``torch.initial_seed()``). ``resume``: a checkpoint of this job
        (``TrainingJob.checkpoint``) taken here or on another runtime, to go on from
        where it was (NOTE [Checkpoints]).

        With workers the job runs in a worker process that keeps its state between
        segments (NOTE [Switch protocol]); then every argument must be picklable, and
        the model is built there. Returns the job's handle.
        """
        spec = training_spec(name, model, optimizer, data, step, iterations, offload, seed, resume)
        self._exec.check_trainable(spec)
        with self._scheduled():
            self._check_open()
            self._jobs.check_free(name)
            job = self._jobs.add(new_job(spec, self._exec.start_job(spec), lock=self._lock,
                                         dispatcher=self._dispatcher))
        return job.start()

    def jobs(self) -> dict[str, TrainingJob]:
        with self._scheduled():
            return self._jobs.all()

    def job_handles(self) -> dict[str, TrainingJob]:
        """``jobs()`` read without waiting for the device (a status query, a pause, must
        not queue behind a long inference): a consistent-enough view, as ``snapshot``."""
        return self._jobs.all()

    def forget_job(self, name: str) -> None:
        """Drop a finished training job: its handle, and with workers the parameters and
        optimizer state its home worker still holds (kept until now for the handle's
        ``state_dict()``). A running job must be cancelled first."""
        with self._scheduled():
            self._jobs.forget(name)
            self._exec.drop_job(name)

    def switches(self) -> list[dict]:
        """The latest switches from a training job to an inference: stop, clean, start,
        load and total seconds of each (NOTE [Switch records]; in-process the stop
        and the total)."""
        return self._dispatcher.switches()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Evict everything and give the arena back. Idempotent; every step runs even if
        an earlier one fails, so no segment, thread or device memory is left behind."""
        with self._scheduled():
            if self._closed:
                return
            self._closed = True
            submitter, self._submitter = self._submitter, None
        self._jobs.stop_all()  # outside the lock: a job needs it to reach its preemption point
        if submitter is not None:
            submitter.shutdown(wait=True, cancel_futures=True)
        with self._scheduled():
            try:
                for m in self._table.entries.values():
                    self._wait_idle(m)
                self._table.evict_all()
            finally:
                try:
                    self._exec.close()
                    synchronize(self.device)
                finally:
                    self._residency.clear()
                    if self._table.host is not None:
                        self._table.host.close()
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

    # ------------------------------------------------------------------ what it shows
    def worker_pids(self) -> list[int]:
        """The operating-system ids of the worker processes now in the pool (empty
        without workers): for operators and fault-injection tests."""
        return self._exec.pids()

    def stats(self) -> dict:
        with self._scheduled():
            return observe.stats(self.device, self._arena, self._residency, self._table.entries)

    def snapshot(self) -> observe.RuntimeSnapshot:
        """Counters and memory for metrics, read without waiting for the device (a
        scrape must not queue behind a long inference): a consistent-enough view, not
        an atomic one."""
        table = self._table
        return observe.snapshot(self.device, self._arena, self._residency, table.entries.values(),
                                self._jobs.all().values(), self._exec, self._dispatcher, table.failures, table.host,
                                table.sharing, table.regions)

    def diagnostics(self) -> Diagnostics:
        """For operators and white-box tests, without waiting for the device: where
        everything is (``observe.Diagnostics``)."""
        with self._lock:
            return observe.diagnostics(self._arena, self._residency, self._table.entries, self._exec, self._dispatcher,
                                       self._table.host, self._table.sharing, self._table.regions)

    @property
    def executor(self) -> Executor:
        """Where the models execute (``executor/``), for tests and benchmarks: the test
        hooks are ``timeshare.executor.testing``'s; production code asks the runtime."""
        return self._exec

    def is_resident(self, name: str) -> bool:
        """Whether ``name`` is in device memory now, read without waiting for the device
        (for a server's queueing decisions; ``resident()`` waits its turn)."""
        m = self._table.entries.get(name)
        return m is not None and m.block is not None

    def thrashing_factor(self) -> float:
        """How much longer callers should let requests gather into batches: 1.0 unless
        thrashing control is on and loads dominate the device's recent time (up to 5.0)."""
        detector = self._residency.detector
        return 1.0 if detector is None else detector.batch_factor(time.monotonic())

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` with a :class:`~timeshare.runtime.events.CallRecord` after
        every inference and an :class:`~timeshare.runtime.events.EvictionRecord` after
        every eviction. It runs after the runtime's lock is let go, in the thread that
        let it go, before that thread's call returns (NOTE [Records outside the lock]);
        listeners get the records one at a time, in order; what it raises is logged,
        never passed to the caller."""
        self._table.outbox.subscribe(listener)

    # ------------------------------------------------------------------ internals
    def _get(self, name: str) -> ModelEntry:
        self._check_open()
        return self._table.get(name)

    def _check_open(self) -> None:
        if self._closed:
            raise TimeshareError("this runtime is closed")

    def _wait_idle(self, m: ModelEntry) -> None:
        wait_idle(self._idle, m, self.task_timeout_s)

    @contextmanager
    def _scheduled(self, model: str = "", kind: Kind = Kind.CONTROL):
        """The runtime's lock, once the scheduler gives this call its turn (NOTE [Preemption points])."""
        with self._lock.records_after(), self._dispatcher.hold(model, kind), self._lock:
            yield
