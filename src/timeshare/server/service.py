"""The serving layer: between the HTTP routes and the runtime. Runs in the server's
process, on two sides:

- the event loop: per model a bounded queue of waiting requests and a runner task
  that takes the next batch (concurrent requests with the same shapes, up to
  ``max_batch`` rows, NOTE [Request batching]) and awaits its result;
- a thread pool: the calls into :class:`~timeshare.Runtime`, which block. The runtime's
  dispatcher orders them (priority, SLO) and loads a model that is not resident.

# NOTE [Request batching]
Requests for one model that wait together run as one forward: their inputs are
concatenated along dimension 0 and every output is split back along it. A model whose
outputs are not all batched along dimension 0 (a scalar, say) is found out on the
first batch: that batch is re-run one request at a time and the model is not batched
again. Batched outputs equal the per-request ones up to floating-point reassociation
(kernels may pick other paths for other batch sizes); the load test checks them
against references computed alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from timeshare.config import Config, ModelConfig, TrainingConfig
from timeshare.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    DuplicateModelError,
    MemoryBudgetError,
    Overloaded,
    PipelineError,
    RemoteError,
    Timeout,
    TimeshareError,
    Unavailable,
    UnknownModelError,
    WorkerError,
)
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.events import CallRecord, EvictionRecord
from timeshare.runtime.facade import Runtime
from timeshare.server.admission import check_training
from timeshare.server.endpoint import Endpoint, ModelState, Pending, describe_outputs, flatten_outputs, split_outputs
from timeshare.server.metrics import Metrics
from timeshare.server.parsing import ParserPool

log = logging.getLogger(__name__)


@dataclass
class Reply:
    outputs: dict[str, torch.Tensor]
    queue_s: float = 0.0  # from arrival until the device ran it
    compute_s: float = 0.0  # the device call (with its load, when it loaded)
    batch_rows: int = 0
    loaded: bool = False
    switched_from: str | None = None


@dataclass
class _Job:
    cfg: TrainingConfig
    handle: object  # TrainingJob
    submitted: float = field(default_factory=time.time)


class Service:
    """Owns the runtime; the routes call only this."""

    def __init__(self, config: Config, *, runtime: Runtime | None = None):
        self.config = config
        self.endpoints = {m.name: Endpoint(m) for m in config.models}
        self.metrics = Metrics(self)
        self.runtime = runtime
        self._jobs: dict[str, _Job] = {}  # in submission order; finished ones pruned (_prune_jobs)
        self._submitting = asyncio.Lock()  # one submission at a time: the running-jobs count holds
        self.parsers = ParserPool.from_config(config.server)  # large request bodies (NOTE in parsing.py)
        self._executor = ThreadPoolExecutor(max_workers=len(self.endpoints) + 4, thread_name_prefix="timeshare-serve")
        self._started = asyncio.Event()
        self._opened = False
        self.start_error: str | None = None
        self._stopping = False
        self._busy_s = 0.0  # device seconds of inference calls
        self.started_at = time.time()

    # ------------------------------------------------------------------ life
    def open(self) -> None:
        """Create the runtime (blocking: worker processes start here). Errors in the
        runtime section surface now, before the server listens."""
        if self._opened:
            return
        if self.runtime is None:
            r = self.config.runtime
            self.runtime = Runtime(r.device, r.memory, eviction=r.eviction, strategy=r.strategy, workers=r.workers,
                                   thrashing=r.thrashing,
                                   scheduling=r.scheduling, time_slice_s=r.time_slice_s,
                                   task_timeout_s=r.task_timeout_s or self.config.server.request_timeout_s,
                                   task_deadline_factor=r.task_deadline_factor,
                                   task_deadline_min_s=r.task_deadline_min_s)
        self.runtime.subscribe(self._on_record)
        self._opened = True

    async def start(self) -> None:
        """Register and warm up every model, then start the training jobs; the server
        answers (live, not ready) meanwhile. A model that fails is UNAVAILABLE with
        the reason; the others serve."""
        self.open()
        try:
            for ep in self.endpoints.values():
                ep.runner = asyncio.create_task(self._run_queue(ep), name=f"timeshare-queue-{ep.name}")
                ep.runner.add_done_callback(functools.partial(self._runner_ended, ep))
            # Pinned models last: they are resident when start-up ends, whatever the budget.
            for ep in sorted(self.endpoints.values(), key=lambda e: e.pinned):
                async with ep.lock:
                    await self._load(ep)
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

    def _runner_ended(self, ep: Endpoint, task: asyncio.Task) -> None:
        """A runner ends only when the service stops; any other end is a bug, made visible."""
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        log.error("the queue of model %s stopped: %r", ep.name, exc)
        ep.state, ep.reason = ModelState.UNAVAILABLE, f"its queue stopped: {exc!r}"
        while ep.queue:
            p = ep.queue.popleft()
            if not p.future.done():
                p.future.set_exception(Unavailable(f"model {ep.name!r} is unavailable: {ep.reason}"))

    @property
    def ready(self) -> bool:
        """Started, not stopping, a worker ready to serve (with workers), and every pinned
        model resident."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready (None: it is), for ``/admin/status``."""
        if self.start_error:
            return f"start-up failed: {self.start_error}"
        if self._stopping:
            return "stopping"
        if not self._started.is_set() or self.runtime is None:
            return "starting: models are loading"
        snap = self.runtime.snapshot()
        workers = snap["workers"]
        if workers is not None and workers["ready"] == 0:  # every worker is dead or still starting
            last = workers["last_failure"]
            why = f"; the last to fail: {last['cause']}" if last else ""
            return f"no worker can serve: {workers['size']} are starting{why}"
        resident = snap["resident"]
        missing = [ep.name for ep in self.endpoints.values()
                   if ep.pinned and not (ep.state is ModelState.READY and ep.name in resident)]
        return f"pinned models not resident yet: {missing}" if missing else None

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
            if ep.runner is not None:
                ep.runner.cancel()
        await self._call(self.parsers.close)  # a body still being parsed gets 503
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

    async def infer(self, name: str, given: dict[str, torch.Tensor]) -> Reply:
        """Queue one request and wait for its outputs (all of them, by name)."""
        ep = self.endpoint(name)
        tensors, rows = ep.check(given)
        if self._stopping:
            raise Overloaded("the server is shutting down", 1)
        if ep.state not in (ModelState.LOADING, ModelState.READY):
            raise Unavailable(f"model {name!r} is not loaded ({ep.state.value}: {ep.reason}); "
                              f"POST /v2/repository/models/{name}/load")
        if len(ep.queue) >= ep.cfg.max_queue:
            resident = name in self.runtime.snapshot()["resident"]
            self.metrics.rejected(name)
            raise Overloaded(f"model {name!r} has {len(ep.queue)} requests waiting (max_queue)",
                             ep.retry_after(resident))
        p = Pending(tensors, rows, asyncio.get_running_loop().create_future())
        ep.queue.append(p)
        ep.wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(p.future), self.config.server.request_timeout_s)
        except TimeoutError:
            raise Timeout(f"model {name!r} did not answer within {self.config.server.request_timeout_s} s") from None
        finally:
            p.future.cancel()  # no-op once answered; a timed-out or abandoned request is skipped if still queued

    def queue_depths(self) -> dict[str, int]:
        return {n: len(ep.queue) for n, ep in self.endpoints.items()}

    def _linger_s(self, ep: Endpoint) -> float:
        """How long a non-resident model's queue waits before its batch is taken: while
        the runtime thrashes (loads take most of its time), ``factor - 1`` batch durations,
        so that one load serves more requests; at most a tenth of the request timeout."""
        factor = self.runtime.thrashing_factor()
        if factor <= 1.0 or ep.name in self.runtime.snapshot()["resident"]:
            return 0.0
        return min((factor - 1.0) * ep.batch_s, self.config.server.request_timeout_s / 10)

    async def _run_queue(self, ep: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await ep.wake.wait()
            ep.wake.clear()
            while ep.queue and ep.state in (ModelState.READY, ModelState.UNLOADING):
                linger = self._linger_s(ep)
                if linger:  # thrashing: let more requests share the coming load
                    await asyncio.sleep(linger)
                batch = ep.take_batch()
                if not batch:
                    break
                ep.in_flight = batch
                try:
                    replies = await loop.run_in_executor(self._executor, self._execute, ep, batch)
                except Exception as exc:  # a bug in the batching itself: every request learns of it
                    replies = [exc] * len(batch)
                finally:
                    ep.in_flight = []
                for p, r in zip(batch, replies):
                    if not p.future.done():
                        if isinstance(r, BaseException):
                            p.future.set_exception(r)
                        else:
                            p.future.set_result(r)
            if ep.state is ModelState.UNAVAILABLE:
                while ep.queue:
                    p = ep.queue.popleft()
                    if not p.future.done():
                        p.future.set_exception(Unavailable(f"model {ep.name!r} was unloaded"))

    def _execute(self, ep: Endpoint, batch: list[Pending]) -> list[Reply | BaseException]:
        """In a pool thread: one forward for the batch (NOTE [Request batching]); each
        request's reply or error."""
        if len(batch) == 1:
            args = batch[0].tensors
        else:
            args = [torch.cat([p.tensors[i] for p in batch]) for i in range(len(batch[0].tensors))]
        try:
            # The SLO counts from the oldest request's arrival, not from the dispatcher.
            call = self.runtime.call(ep.name, tuple(args), arrived_at=min(p.enqueued for p in batch))
        except Exception as exc:
            err = served_error(ep.name, exc)
            if len(batch) > 1 and isinstance(err, (BadRequest, Overloaded)):
                # The model's own code raised, or the batch did not fit: one request's values
                # (or size) may be at fault, not its batch-mates'. Each is answered on its own.
                return [r for p in batch for r in self._execute(ep, [p])]
            return [err] * len(batch)
        out, rec = call.output, call.record
        rows = [p.rows for p in batch]
        named = flatten_outputs(out)
        if not ep.outputs:
            ep.outputs = describe_outputs(named, sum(rows))
        parts = [dict(named)] if len(batch) == 1 else split_outputs(named, rows)
        if parts is None:
            log.info("model %s: an output has no batch dimension; requests now run one at a time", ep.name)
            ep.batchable = False
            return [self._execute(ep, [p])[0] for p in batch]
        if rec.loaded:
            ep.load_s = rec.seconds
        else:
            ep.batch_s = 0.8 * ep.batch_s + 0.2 * rec.seconds
        replies = []
        for p, part in zip(batch, parts):
            r = Reply(part, batch_rows=sum(rows))
            r.queue_s = max(0.0, rec.started - p.enqueued)
            r.compute_s, r.loaded, r.switched_from = rec.seconds, rec.loaded, rec.switched_from
            self.metrics.queued(ep.name, r.queue_s)
            replies.append(r)
        self.metrics.batched(ep.name, sum(rows))
        return replies

    def _on_record(self, record: CallRecord | EvictionRecord) -> None:
        """Runtime listener (in the calling thread, NOTE in ``runtime/events.py``)."""
        if isinstance(record, CallRecord):
            self._busy_s += record.seconds
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
        ep = self.endpoint(name)
        async with ep.lock:
            if ep.state is ModelState.UNAVAILABLE or ep.state is ModelState.LOADING:
                await self._load(ep)
            else:
                await self._call(self.runtime.infer, name, *ep.example_inputs())
            if ep.state is not ModelState.READY:
                raise Conflict(f"model {name!r} did not load: {ep.reason}")

    async def unload(self, name: str) -> None:
        """Refuse new requests, finish the queued ones, then unregister the model: its
        device memory and its host copy are freed."""
        ep = self.endpoint(name)
        async with ep.lock:
            if ep.state is ModelState.UNAVAILABLE:
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
                    await self._call(self.runtime.pin, name, False)
                await self._call(self.runtime.unregister, name)
            except UnknownModelError:
                pass
            ep.pinned = False  # the config's pin applies again only through pin
            ep.state, ep.reason = ModelState.UNAVAILABLE, "unloaded"
            ep.wake.set()

    async def pin(self, name: str, pinned: bool) -> None:
        """A pinned model is loaded now and never evicted; readiness waits for it."""
        ep = self.endpoint(name)
        if not pinned:
            ep.pinned = False
            if name in await self._call(self.runtime.models):
                await self._call(self.runtime.pin, name, False)
            return
        if ep.state is not ModelState.READY:
            await self.load(name)
        async with ep.lock:
            if ep.state is not ModelState.READY:
                raise Conflict(f"model {name!r} is {ep.state.value}; load it first")
            await self._call(self.runtime.pin, name, True)
            try:  # resident now, or not pinned at all: readiness waits for pinned models
                await self._call(self.runtime.infer, name, *ep.example_inputs())
            except BaseException:
                await self._call(self.runtime.pin, name, False)
                raise
            ep.pinned = True

    async def _load(self, ep: Endpoint) -> None:
        """Register (if needed) and warm up ``ep``; on failure it is UNAVAILABLE with the reason."""
        ep.state, ep.reason = ModelState.LOADING, "loading"
        cfg = ep.cfg
        t0 = time.monotonic()
        try:
            if ep.name not in await self._call(self.runtime.models):
                await self._call(self._register, cfg, ep.pinned, ep.example_inputs())
            if self.config.server.warmup or ep.pinned:
                out = await self._call(self.runtime.infer, ep.name, *ep.example_inputs())
                ep.outputs = describe_outputs(flatten_outputs(out), cfg.example_batch)
        except Exception as exc:
            ep.state, ep.reason = ModelState.UNAVAILABLE, f"{type(exc).__name__}: {exc}"
            log.error("model %s is unavailable: %s", ep.name, ep.reason)
            try:  # a half-registered model must not keep memory
                if ep.name in await self._call(self.runtime.models):
                    await self._call(self.runtime.unregister, ep.name)
            except Exception:
                log.exception("cleaning up model %s failed", ep.name)
        else:
            ep.state, ep.reason = ModelState.READY, ""
            log.info("model %s ready in %.1f s", ep.name, time.monotonic() - t0)
        ep.wake.set()

    def _register(self, cfg: ModelConfig, pinned: bool, example: tuple) -> None:
        if cfg.zoo is not None:
            build = zoo_get(cfg.zoo).builder
            weights = cfg.weights or weights_path(cfg.zoo)
        else:
            build, weights = cfg.build, cfg.weights
        self.runtime.register(cfg.name, build, weights, example, dtype=cfg.dtype, pin=pinned,
                              priority=cfg.priority, slo_s=None if cfg.slo_ms is None else cfg.slo_ms / 1000)

    # ------------------------------------------------------------------ training (admin)
    async def submit_training(self, cfg: TrainingConfig, *, from_config: bool = False) -> dict:
        """Start a training job. One submitted through the admin plane is held to the
        admin section's bounds (``server/admission.py``): batch, iterations, memory
        (400), and the number of jobs running (409); one ``from_config`` is not."""
        from timeshare.models.workloads import TrainingWorkload, sgd

        admin = self.config.admin
        async with self._submitting:
            job = self._jobs.get(cfg.name)
            if job is not None and not job.handle.wait(0):
                raise Conflict(f"a training job named {cfg.name!r} is running")
            if not from_config:
                check_training(cfg, admin, budget_bytes=self.runtime.snapshot()["capacity_bytes"])
                running = [n for n, j in self._jobs.items() if not j.handle.wait(0)]
                if len(running) >= admin.max_training_jobs:
                    raise Conflict(f"{len(running)} training jobs are running ({', '.join(running)}), the limit "
                                   f"(admin.max_training_jobs); cancel one or wait for one to finish")
            args = TrainingWorkload(cfg.model, cfg.batch).train_args()
            args["optimizer"] = functools.partial(sgd, lr=cfg.lr)
            try:
                handle = await self._call(self.runtime.train, cfg.name, iterations=cfg.iterations,
                                          offload=cfg.offload, seed=cfg.seed, **args)
            except DuplicateModelError as exc:
                raise Conflict(str(exc)) from None
            self._jobs.pop(cfg.name, None)  # a resubmitted name is the newest
            await self._prune_jobs()
            self._jobs[cfg.name] = _Job(cfg, handle)
        return self.job_status(cfg.name)

    async def _prune_jobs(self) -> None:
        """Forget the oldest finished jobs beyond ``admin.max_finished_jobs``, here and in
        the runtime (whose workers hold their state). Only submissions add jobs, so pruning
        before each keeps the count bounded (by the limit plus the jobs that were running then)."""
        finished = [n for n, j in self._jobs.items() if j.handle.wait(0)]
        for name in finished[:max(0, len(finished) - self.config.admin.max_finished_jobs)]:
            del self._jobs[name]
            try:
                await self._call(self.runtime.forget_job, name)
            except (UnknownModelError, DuplicateModelError):
                pass  # resubmitted under that name meanwhile: the runtime's job is the new one

    def job_names(self) -> list[str]:
        return list(self._jobs)

    def job_status(self, name: str) -> dict:
        job = self._job(name)
        h = job.handle
        s = h.stats
        return {
            "name": name, "model": job.cfg.model, "batch": job.cfg.batch, "status": h.status,
            "iterations": s.iterations, "target_iterations": job.cfg.iterations, "preemptions": s.preemptions,
            "step_seconds": round(s.step_seconds, 6), "preempted_seconds": round(s.preempted_seconds, 6),
            "loss": s.losses[-1] if s.losses else None,
            "error": None if h.error is None else f"{type(h.error).__name__}: {h.error}",
        }

    def control_job(self, name: str, action: str) -> dict:
        h = self._job(name).handle
        if action == "pause":
            h.pause()
        elif action == "resume":
            h.resume()
        elif action == "cancel":
            h.cancel()
        else:
            raise BadRequest(f"unknown action {action!r}; known: pause, resume, cancel")
        return self.job_status(name)

    def _job(self, name: str) -> _Job:
        try:
            return self._jobs[name]
        except KeyError:
            raise UnknownModelError(f"no training job named {name!r}; known: {sorted(self._jobs)}") from None

    # ------------------------------------------------------------------ metrics
    def snapshot(self) -> dict:
        snap = self.runtime.snapshot() if self.runtime is not None else {}
        snap["queue_depth"] = self.queue_depths()
        snap["inference_seconds"] = self._busy_s
        snap["jobs"] = {n: j.handle.stats.iterations for n, j in list(self._jobs.items())}  # other threads scrape
        return snap

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))


def served_error(model: str, exc: BaseException) -> BaseException:
    """What a failed device call becomes for the client. What the model's own code raised
    on these inputs, here or in a worker, is the request's fault (400) and says so;
    running out of memory is the server's state (503, retry). Every other error of
    timeshare keeps its type, and the routes map it to a status: a worker that crashed
    or hung is 503, a bug is 500, never 400."""
    if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, RemoteError) and exc.in_task:  # the model's code, in a worker: its type by name
        kind, message = exc.remote_type.rsplit(".", 1)[-1], str(exc)
    elif isinstance(exc, TimeshareError):
        return exc
    else:
        kind, message = type(exc).__name__, f"{type(exc).__name__}: {exc}"
    if kind in OUT_OF_MEMORY:
        return Overloaded(f"model {model!r} ran out of memory on this batch: {message}", 1)
    return BadRequest(f"model {model!r} failed on these inputs: {message}")


# Exceptions that mean the device or the host ran out of memory, not that the inputs are wrong.
OUT_OF_MEMORY = {"OutOfMemoryError", "MemoryError"}

# Status codes per error type, most specific first (used by the routes). A fault of the
# server's own (a crashed or hung worker, no room, not started) is 5xx; only what the
# request did wrong is 4xx.
STATUS = [
    (BadRequest, 400), (ConfigError, 400), (Unavailable, 503), (Conflict, 409), (Overloaded, 503), (Timeout, 504),
    (UnknownModelError, 404), (DuplicateModelError, 409), (MemoryBudgetError, 503), (RemoteError, 500),
    (WorkerError, 503), (PipelineError, 503), (TimeshareError, 500),
]
