"""The serving layer: between the HTTP routes and the runtime; the routes call only
:class:`Service`. Runs in the server's process, on the event loop: it owns the runtime,
the models' endpoints and their queues (run by ``server/runner.py``, NOTE [Request
batching]), the model repository's operations (load, unload, pin), the training jobs
(``server/jobs.py``) and the parser processes (``server/parser_pool.py``). Calls into
:class:`~timeshare.Runtime` block: they run in the service's thread pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter_ns
from typing import TYPE_CHECKING

import torch

from timeshare.config import Config, LLMConfig, ModelConfig, TrainingConfig
from timeshare.errors import (
    BadRequest,
    Conflict,
    Overloaded,
    Timeout,
    TimeshareError,
    Unavailable,
    UnknownModelError,
)
from timeshare.llm import model as lm
from timeshare.llm.kv_budget import KVBudget
from timeshare.llm.model import LLMDef
from timeshare.llm.pages import PagePool
from timeshare.runtime.events import CallRecord, EvictionRecord
from timeshare.runtime.facade import Runtime
from timeshare.server.backend import Backend
from timeshare.server.endpoint import Endpoint, ModelState, Pending, describe_outputs, flatten_outputs, model_source
from timeshare.server.hops import HopTotals, RequestTimes
from timeshare.server.jobs import TrainingJobs
from timeshare.server.llms import LanguageModels, ServedLLM, llm_def, open_local
from timeshare.server.metrics import Metrics
from timeshare.server.parser_pool import ParserPool
from timeshare.server.readiness import Readiness, assess, fatal_failures
from timeshare.server.runner import QueueRunner, Reply
from timeshare.server.snapshot import ServiceSnapshot
from timeshare.server.status import FailureKind, ModelFailure, failure_of
from timeshare.units import parse_bytes

if TYPE_CHECKING:
    from timeshare.cluster.backend import ClusterRuntime

log = logging.getLogger(__name__)


class Service:
    """Owns the runtime; the routes call only this."""

    def __init__(self, config: Config, *, runtime: Backend | None = None):
        self.config = config
        self.endpoints = {m.name: Endpoint(m) for m in config.models}
        self.hops = HopTotals()  # where answered requests' time went (NOTE [Request hops])
        self.metrics = Metrics(self)
        self.llms = LanguageModels(config.llms, self.metrics.llm_event, warmup=config.server.warmup)
        kv_memory = config.runtime.kv_memory
        # NOTE [Key/value caches under pressure]: one budget for the language models here.
        self.kv_budget = None if kv_memory is None or config.cluster is not None else \
            KVBudget(parse_bytes(kv_memory, what="kv_memory"))
        self.runtime: Backend | None = runtime
        self.kv_pages: PagePool | None = None  # NOTE [Paged key/value caches]: shared, sized by kv_memory
        self.parsers = ParserPool.from_config(config.server)  # large request bodies (NOTE in parser_pool.py)
        # A model's batches run one at a time on one runtime; in front of a cluster, as many
        # at once as it has replicas (NOTE [Request batching]).
        c = config.cluster
        batches = 1 if c is None else c.replicas
        most = 1 if c is None else (c.max_replicas or c.replicas + 2)  # with the replicas added at run time
        self._executor = ThreadPoolExecutor(max_workers=len(self.endpoints) * most + len(config.llms) + 4,
                                            thread_name_prefix="timeshare-serve")
        self.training = TrainingJobs(config.admin, runtime=lambda: self._rt, call=self._call)
        self.runner = QueueRunner(runtime=lambda: self._rt, executor=self._executor, metrics=self.metrics,
                                  request_timeout_s=config.server.request_timeout_s, batches=batches)
        self._started = asyncio.Event()
        self._opened = False
        self.start_error: str | None = None
        self.fatal: str | None = None  # with server.exit_on_error: the models that failed for good
        self.on_fatal: Callable[[], None] | None = None  # then called (``serve`` stops the server)
        self._stopping = False
        self._busy_s = 0.0  # device seconds of inference calls
        self.last_used: dict[str, float] = {}  # model -> when its latest call ended (wall clock; ``timeshare ps``)
        self.started_at = time.time()

    # ------------------------------------------------------------------ life
    def open(self) -> None:
        """Create the runtime (blocking: worker processes start here). Errors in the
        runtime section surface now, before the server listens."""
        if self._opened:
            return
        if self.runtime is None:
            options = self.config.runtime.options(self.config.server.request_timeout_s)
            if self.config.cluster is not None:  # replicas on Ray (NOTE [Cluster deployment])
                from timeshare.cluster.backend import ClusterRuntime

                self.runtime = ClusterRuntime.from_config(self.config.cluster, options, self._model_defs(),
                                                          self._llm_defs())
            else:
                self.runtime = Runtime(options=options)
        self.runtime.subscribe(self._on_record)
        self._opened = True

    def _open_llm(self, cfg: LLMConfig) -> ServedLLM:
        """A language model of the config: generating on the cluster's replicas, or here."""
        if self.config.cluster is not None:
            return self.cluster().language_model(cfg.name)
        assert isinstance(self._rt, Runtime), "without a cluster the runtime is in this process"
        return open_local(self._rt, cfg, self.kv_budget, self._kv_pages(self._rt))

    def _kv_pages(self, rt: Runtime) -> PagePool | None:
        """With ``kv_memory`` and the models generating in this server's runtime: one pool for
        every language model's key/value pages (NOTE [Paged key/value caches]), made with
        the first model: ``kv_memory`` bytes, or what the largest model's ``max_sequences``
        rows take at ``max_context`` if more (a turn may always fill its batch: the others'
        caches make room), in pages of 32 positions of the largest model, in a region of
        the runtime's arena (NOTE [Regions of the arena])."""
        if self.kv_budget is None:
            return None
        if self.kv_pages is None:
            needs = [lm.pool_need(c.path, c.dtype, c.max_sequences, c.max_context) for c in self.config.llms]
            page_bytes = max(page for page, _ in needs)
            self.kv_pages = lm.arena_pool(rt, "kv-pages", max(self.kv_budget.capacity, *(n for _, n in needs)),
                                          page_bytes)
        return self.kv_pages

    def _llm_defs(self) -> list[LLMDef]:
        """The config's language models as every replica of a cluster loads them."""
        kv = self.config.runtime.kv_memory
        kv_memory = None if kv is None else parse_bytes(kv, what="kv_memory")
        return [llm_def(c, kv_memory) for c in self.config.llms]

    def _model_defs(self) -> list:
        """The config's models as every replica of a cluster builds them."""
        from timeshare.cluster.replica import ModelDef

        defs = []
        for ep in self.endpoints.values():
            cfg = ep.cfg
            build, weights = model_source(cfg)
            defs.append(ModelDef(cfg.name, build=build, weights=None if weights is None else str(weights),
                                 example=ep.example_inputs(), dtype=cfg.dtype, priority=cfg.priority,
                                 slo_s=None if cfg.slo_ms is None else cfg.slo_ms / 1000))
        return defs

    @property
    def _rt(self) -> Backend:
        """The runtime, for the code that runs once :meth:`open` has made it (the queues'
        runners, the routes behind the lifespan, the admin operations)."""
        assert self.runtime is not None, "the service is not open"
        return self.runtime

    async def start(self) -> None:
        """Register and warm up every model, then start the training jobs; the server
        answers (live, not ready) meanwhile. A model that fails is UNAVAILABLE with
        the reason; the others serve."""
        self.open()
        try:
            for ep in self.endpoints.values():
                ep.runner = asyncio.create_task(self.runner.run(ep), name=f"timeshare-queue-{ep.name}")
                ep.runner.add_done_callback(functools.partial(self._runner_ended, ep))
            # Pinned models last: they are resident when start-up ends, whatever the budget.
            for i, ep in enumerate(sorted(self.endpoints.values(), key=lambda e: e.pinned), 1):
                log.info("loading model %d of %d: %s", i, len(self.endpoints), ep.name)  # start-up's progress
                async with ep.lock:
                    await self._load(ep)
            if self.config.llms:
                await self.llms.start(self._open_llm, self._call)
            for cfg in self.config.training:
                if cfg.start:
                    try:
                        await self.submit_training(cfg, from_config=True)
                    except TimeshareError as exc:
                        log.error("training job %s did not start: %s", cfg.name, exc)
        except Exception as exc:  # the server stays up to say why it is not ready
            self.start_error = f"{type(exc).__name__}: {exc}"
            log.exception("start-up failed")
        finally:
            self._started.set()
        if self.config.server.exit_on_error:  # models that failed for good stop the server (``serve``)
            self.fatal = fatal_failures(self.endpoints.values(), self.llms, self.start_error)
            if self.fatal is not None:
                log.error("exiting (server.exit_on_error); failed for good: %s", self.fatal)
                if self.on_fatal is not None:
                    self.on_fatal()

    def _runner_ended(self, ep: Endpoint, task: asyncio.Task) -> None:
        """A runner ends only when the service stops; any other end is a bug, made visible."""
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        log.error("the queue of model %s stopped: %r", ep.name, exc)
        ep.state, ep.reason = ModelState.UNAVAILABLE, f"its queue stopped: {exc!r}"
        ep.failure = ModelFailure(FailureKind.PERMANENT, ep.reason)  # nothing restarts a queue
        while ep.queue:
            p = ep.queue.popleft()
            if not p.future.done():
                p.future.set_exception(Unavailable(f"model {ep.name!r} is unavailable: {ep.reason}"))

    @property
    def ready(self) -> bool:
        """:meth:`readiness` says ready."""
        return self.readiness().ready

    def readiness(self) -> Readiness:
        """Started, not stopping, a worker ready to serve (with workers), and every model
        and language model that is not optional able to serve, a pinned one resident;
        else why not, naming each model that cannot serve (``server/readiness.py``)."""
        return assess(start_error=self.start_error, stopping=self._stopping, started=self._started.is_set(),
                      runtime=self.runtime, endpoints=self.endpoints.values(), llms=self.llms)

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready (None: it is), for ``/admin/status``."""
        return self.readiness().reason

    async def stop(self) -> None:
        """Refuse new requests, let queued ones finish (up to ``drain_timeout_s``), then
        close the runtime: training jobs stop, worker processes exit, memory is freed."""
        self._stopping = True
        # uvicorn has already waited drain_timeout_s for the requests it holds; what is
        # still queued belongs to requests it gave up on, so only the batch on the device
        # gets a little longer.
        deadline = time.monotonic() + min(10.0, self.config.server.drain_timeout_s)
        while any(ep.queue or ep.busy for ep in self.endpoints.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for ep in self.endpoints.values():
            for p in [*ep.in_flight, *ep.queue]:
                if not p.future.done():
                    p.future.set_exception(Overloaded("the server is shutting down", 1))
            ep.queue.clear()
            for task in (ep.runner, ep.retry):
                if task is not None:
                    task.cancel()
        await self._call(self.parsers.close)  # a body still being parsed gets 503
        await self._call(self.llms.close)  # generations still running end with an error
        if self.runtime is not None:
            close = asyncio.get_running_loop().run_in_executor(self._executor, self.runtime.close)
            try:  # training jobs stop at their next iteration; workers get their own deadlines
                await asyncio.wait_for(close, 120)
            except TimeoutError:
                log.error("the runtime did not close within 120 s; exiting anyway")
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ data plane
    def endpoint(self, name: str) -> Endpoint:
        try:
            return self.endpoints[name]
        except KeyError:
            raise UnknownModelError(f"no model named {name!r}; known: {sorted(self.endpoints)}") from None

    async def infer(self, name: str, given: dict[str, torch.Tensor], times: RequestTimes | None = None) -> Reply:
        """Queue one request and wait for its outputs (all of them, by name); ``times``
        takes its stamps on the way (NOTE [Request hops])."""
        return await self.infer_at(self.endpoint(name), given, times)

    async def infer_at(self, ep: Endpoint, given: dict[str, torch.Tensor], times: RequestTimes | None = None) -> Reply:
        """:meth:`infer` for the endpoint the route has already looked up."""
        name = ep.name
        tensors, rows = ep.check(given)
        if self._stopping:
            raise Overloaded("the server is shutting down", 1)
        if ep.state is not ModelState.READY and ep.state is not ModelState.LOADING:
            raise ep.unavailable()  # without Retry-After when it failed for good
        if len(ep.queue) >= ep.cfg.max_queue:
            resident = self._rt.is_resident(name)
            self.metrics.rejected(name)
            raise Overloaded(f"model {name!r} has {len(ep.queue)} requests waiting (max_queue)",
                             ep.retry_after(resident))
        future = asyncio.get_running_loop().create_future()
        p = Pending(tensors, rows, future, times=times)
        ep.queue.append(p)
        if times is not None:
            times.queued = perf_counter_ns()
        ep.wake.set()
        # The request's own future, awaited under a deadline: a timed-out or abandoned
        # request's future is cancelled with its task, and the runner skips it if still
        # queued (no second future, no task for the deadline).
        try:
            async with asyncio.timeout(self.config.server.request_timeout_s):
                return await future
        except TimeoutError:
            raise Timeout(f"model {name!r} did not answer within {self.config.server.request_timeout_s} s") from None
        finally:
            future.cancel()  # no-op once answered

    def queue_depths(self) -> dict[str, int]:
        return {n: len(ep.queue) for n, ep in self.endpoints.items()}

    def _on_record(self, record: CallRecord | EvictionRecord) -> None:
        """Runtime listener (NOTE [Records outside the lock]: after the runtime is let go)."""
        if isinstance(record, CallRecord):
            self._busy_s += record.seconds
            self.last_used[record.model] = time.time()
        self.metrics.record(record)

    # ------------------------------------------------------------------ repository (admin)
    def index(self, ready_only: bool = False) -> list[dict]:
        out = []
        for ep in self.endpoints.values():
            if ready_only and ep.state is not ModelState.READY:
                continue
            entry = {"name": ep.name, "version": "1", "state": ep.state.value, "reason": ep.reason}
            out.append(entry)
        return out

    async def load(self, name: str) -> None:
        """Register the model if it is not, and bring it onto the device now."""
        if name in self.llms.configs:  # a language model: opened again as at start-up
            return await self.llms.load(name, self._open_llm, self._call)
        ep = self.endpoint(name)
        async with ep.lock:
            if ep.state is ModelState.UNAVAILABLE or ep.state is ModelState.LOADING:
                await self._load(ep)
            else:
                await self._call(self._rt.infer, name, *ep.example_inputs())
            if ep.state is not ModelState.READY:
                raise Conflict(f"model {name!r} did not load: {ep.reason}")

    async def unload(self, name: str) -> None:
        """Refuse new requests, finish the queued ones, then unregister the model: its
        device memory and its host copy are freed."""
        if name in self.llms.configs:
            return await self._call(self.llms.unload, name)
        ep = self.endpoint(name)
        async with ep.lock:
            if ep.retry is not None:  # unloaded on purpose: no load after a back-off, no failure to report
                ep.retry.cancel()
            if ep.state is ModelState.UNAVAILABLE:
                ep.reason, ep.failure = "unloaded", None
                return
            ep.state, ep.reason = ModelState.UNLOADING, "unloading"
            ep.wake.set()
            deadline = time.monotonic() + self.config.server.request_timeout_s
            while (ep.queue or ep.busy) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            while ep.queue:  # not served in time: their own deadline has passed too
                p = ep.queue.popleft()
                if not p.future.done():
                    p.future.set_exception(Unavailable(f"model {name!r} was unloaded"))
            try:
                if ep.pinned:
                    await self._call(self._rt.pin, name, False)
                await self._call(self._rt.unregister, name)
            except UnknownModelError:
                pass
            ep.pinned = False  # the config's pin applies again only through pin
            ep.state, ep.reason = ModelState.UNAVAILABLE, "unloaded"
            ep.wake.set()

    async def add_llm(self, source: str, name: str | None = None) -> LLMConfig:
        """Serve a language model from now on, from a directory or a cached repository id."""
        return await self.llms.add(source, name, self._open_llm, self._call)

    async def add_adapter(self, name: str, path: str, base: str | None = None, replace: bool = False) -> None:
        """Serve LoRA adapter ``name`` of ``base`` (or of the one model serving adapters)
        from directory ``path`` from now on (NOTE [Adapter residency]); ``replace``: an
        adapter of that name is replaced (vLLM's ``load_inplace``)."""
        await self._call(self.llms.add_adapter, name, path, base, replace)

    async def remove_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name``: its new requests are 404s."""
        await self._call(self.llms.remove_adapter, name)

    async def pin(self, name: str, pinned: bool) -> None:
        """A pinned model is loaded now and never evicted; readiness waits for it."""
        if name in self.llms.configs:
            return await self._call(self.llms.pin, name, pinned, self.runtime)
        ep = self.endpoint(name)
        if not pinned:
            ep.pinned = False
            if name in await self._call(self._rt.models):
                await self._call(self._rt.pin, name, False)
            return
        if ep.state is not ModelState.READY:
            await self.load(name)
        async with ep.lock:
            if ep.state is not ModelState.READY:
                raise Conflict(f"model {name!r} is {ep.state.value}; load it first")
            await self._call(self._rt.pin, name, True)
            try:  # resident now, or not pinned at all: readiness waits for pinned models
                await self._call(self._rt.infer, name, *ep.example_inputs())
            except BaseException:
                await self._call(self._rt.pin, name, False)
                raise
            ep.pinned = True

    async def _load(self, ep: Endpoint) -> None:
        """Register (if needed) and warm up ``ep``; on failure it is UNAVAILABLE with the reason."""
        ep.state, ep.reason = ModelState.LOADING, "loading"
        cfg = ep.cfg
        t0 = time.monotonic()
        try:
            if ep.name not in await self._call(self._rt.models):
                await self._call(self._register, cfg, ep.pinned, ep.example_inputs())
            if self.config.server.warmup or ep.pinned:
                out = await self._call(self._rt.infer, ep.name, *ep.example_inputs())
                ep.outputs = describe_outputs(flatten_outputs(out), cfg.example_batch)
        except Exception as exc:
            ep.failure = failure_of(exc)  # NOTE [Permanent and transient failures]
            ep.state, ep.reason = ModelState.UNAVAILABLE, ep.failure.cause
            log.error("model %s is unavailable (%s): %s", ep.name, ep.failure.kind.value, ep.reason)
            if not ep.failure.permanent and not self._stopping:
                ep.load_later(self._load)
            try:  # a half-registered model must not keep memory
                if ep.name in await self._call(self._rt.models):
                    await self._call(self._rt.unregister, ep.name)
            except Exception:
                log.exception("cleaning up model %s failed", ep.name)
        else:
            ep.state, ep.reason, ep.failure, ep.retries = ModelState.READY, "", None, 0
            log.info("model %s ready in %.1f s", ep.name, time.monotonic() - t0)
        ep.wake.set()

    def _register(self, cfg: ModelConfig, pinned: bool, example: tuple) -> None:
        build, weights = model_source(cfg)
        self._rt.register(cfg.name, build, weights, example, dtype=cfg.dtype, pin=pinned,
                          priority=cfg.priority, slo_s=None if cfg.slo_ms is None else cfg.slo_ms / 1000)

    # ------------------------------------------------------------------ training (admin)
    async def submit_training(self, cfg: TrainingConfig, *, from_config: bool = False) -> dict:
        """Start a training job (:meth:`TrainingJobs.submit`); its status."""
        return await self.training.submit(cfg, from_config=from_config)

    def job_names(self) -> list[str]:
        return self.training.names()

    def job_status(self, name: str) -> dict:
        return self.training.status(name)

    def control_job(self, name: str, action: str) -> dict:
        """pause, resume or cancel a training job, or on a cluster migrate it to another
        replica; its status."""
        if action == "migrate":
            self.training.status(name)  # a job of this server's, or 404
            moved = self.cluster().migrate(name)
            return {**self.training.status(name), "migrated": moved}
        return self.training.control(name, action)

    # ------------------------------------------------------------------ cluster (admin)
    def cluster(self) -> ClusterRuntime:
        """The cluster this server fronts (NOTE [A cluster behind the server]); 400 when none."""
        if self.config.cluster is None:
            raise BadRequest("this server runs no cluster (its config has no 'cluster' section)")
        from timeshare.cluster.backend import ClusterRuntime

        rt = self._rt
        assert isinstance(rt, ClusterRuntime), "a config with a cluster section opens a ClusterRuntime"
        return rt

    def replicas(self) -> dict:
        return self.cluster().snapshot().view.to_json()

    async def add_replica(self) -> dict:
        """Start one more replica; it takes requests once it has warmed every model up."""
        cluster = self.cluster()
        name = await self._call(cluster.add_replica)
        self.runner.batches = max(self.runner.batches, cluster.replicas_alive())  # one more batch at once
        return {"replica": name}

    def kill_replica(self, name: str) -> dict:
        """A drill: kill a replica as a crash would; its requests are retried elsewhere."""
        self.cluster().kill_replica(name)
        return {"replica": name, "killed": True}

    # ------------------------------------------------------------------ metrics
    def snapshot(self) -> ServiceSnapshot:
        return ServiceSnapshot.of(None if self.runtime is None else self.runtime.snapshot(),
                                  queue_depth=self.queue_depths(), inference_seconds=self._busy_s,
                                  jobs=self.training.iterations(), llms=self.llms.snapshot(),
                                  kv_memory=None if self.kv_budget is None else self.kv_budget.snapshot())

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

