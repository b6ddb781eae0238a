"""The models' queues at work: per model, a runner task on the event loop takes the next
batch (concurrent requests with the same shapes, up to ``max_batch`` rows, NOTE [Request
batching]), runs it in a thread of the service's pool (``Runtime.call`` blocks; the
runtime's dispatcher orders the calls and loads a model that is not resident) and
answers each request. Runs in the server's process.

# NOTE [Request batching]
Requests for one model that wait together run as one forward: their inputs are
concatenated along dimension 0 and every output is split back along it. A model whose
outputs are not all batched along dimension 0 (a scalar, say) is found out on the
first batch: that batch is re-run one request at a time and the model is not batched
again. Batched outputs equal the per-request ones up to floating-point reassociation
(kernels may pick other paths for other batch sizes); the load test checks them
against references computed alone.
A model's batches run one at a time (the runtime would run them in turn anyway); in front
of a cluster, up to ``batches`` at once (its replicas), so that a hot model can be served
by several replicas together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from time import perf_counter_ns

import torch

from timeshare.errors import BadRequest, Overloaded, Unavailable
from timeshare.server.backend import Backend
from timeshare.server.endpoint import Endpoint, ModelState, Pending, describe_outputs, flatten_outputs, split_outputs
from timeshare.server.metrics import Metrics
from timeshare.server.status import served_error

log = logging.getLogger(__name__)


@dataclass
class Reply:
    outputs: dict[str, torch.Tensor]
    queue_s: float = 0.0  # from arrival until the device ran it
    compute_s: float = 0.0  # the device call (with its load, when it loaded)
    batch_rows: int = 0
    loaded: bool = False
    switched_from: str | None = None


class QueueRunner:
    """Runs the queues of the service's endpoints. ``runtime`` gives the open runtime;
    the device calls run in ``executor``; a non-resident model's queue lingers at most a
    tenth of ``request_timeout_s``."""

    def __init__(self, *, runtime: Callable[[], Backend], executor: Executor, metrics: Metrics,
                 request_timeout_s: float, batches: int = 1):
        self.batches = batches
        self._runtime = runtime
        self._executor = executor
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    def linger_s(self, ep: Endpoint) -> float:
        """How long a non-resident model's queue waits before its batch is taken: while
        the runtime thrashes (loads take most of its time), ``factor - 1`` batch durations,
        so that one load serves more requests; at most a tenth of the request timeout."""
        rt = self._runtime()
        factor = rt.thrashing_factor()
        if factor <= 1.0 or rt.is_resident(ep.name):
            return 0.0
        return min((factor - 1.0) * ep.batch_s, self.request_timeout_s / 10)

    async def run(self, ep: Endpoint) -> None:
        """``ep``'s runner task: ends only when cancelled."""
        running: set[asyncio.Task] = set()
        while True:
            await ep.wake.wait()
            ep.wake.clear()
            while ep.queue and ep.state in (ModelState.READY, ModelState.UNLOADING):
                if len(running) >= self.batches:  # as many batches out as allowed: wait for one
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                linger = self.linger_s(ep)
                if linger:  # thrashing: let more requests share the coming load
                    await asyncio.sleep(linger)
                batch = ep.take_batch()
                if not batch:
                    break
                now = perf_counter_ns()
                for p in batch:
                    if p.times is not None:
                        p.times.taken = now
                ep.in_flight.extend(batch)
                if self.batches == 1:  # served by this task: no task per batch, no wake-up to start it
                    await self._serve(ep, batch)
                    continue
                task = asyncio.create_task(self._serve(ep, batch), name=f"timeshare-batch-{ep.name}")
                running.add(task)
                task.add_done_callback(running.discard)
            if ep.state is ModelState.UNAVAILABLE:
                while ep.queue:
                    p = ep.queue.popleft()
                    if not p.future.done():
                        p.future.set_exception(Unavailable(f"model {ep.name!r} was unloaded"))

    async def _serve(self, ep: Endpoint, batch: list[Pending]) -> None:
        """One batch: its forward in a pool thread, which answers each request itself
        (one wake-up of the event loop for the requests, not one for this task and then
        one for them), then this task goes on."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work() -> None:  # in a pool thread
            try:
                replies = self.execute(ep, batch)
            except BaseException as exc:  # a bug in the batching itself: every request learns of it
                replies = [exc] * len(batch)
            loop.call_soon_threadsafe(_answer, batch, replies, done)

        try:
            self._executor.submit(work)
            await done
        finally:
            if len(ep.in_flight) == len(batch):  # the only batch out (always, but in front of a cluster)
                ep.in_flight = []
            else:
                ids = {id(p) for p in batch}
                ep.in_flight = [p for p in ep.in_flight if id(p) not in ids]

    def execute(self, ep: Endpoint, batch: list[Pending]) -> list[Reply | BaseException]:
        """In a pool thread: one forward for the batch (NOTE [Request batching]); each
        request's reply or error."""
        in_thread = perf_counter_ns()
        if len(batch) == 1:
            args = batch[0].tensors
        else:
            args = [torch.cat([p.tensors[i] for p in batch]) for i in range(len(batch[0].tensors))]
        try:
            # The SLO counts from the oldest request's arrival, not from the dispatcher.
            called = perf_counter_ns()
            call = self._runtime().call(ep.name, tuple(args), arrived_at=min(p.enqueued for p in batch))
            returned = perf_counter_ns()
        except Exception as exc:
            err = served_error(ep.name, exc)
            if len(batch) > 1 and isinstance(err, (BadRequest, Overloaded)):
                # The model's own code raised, or the batch did not fit: one request's values
                # (or size) may be at fault, not its batch-mates'. Each is answered on its own.
                return [r for p in batch for r in self.execute(ep, [p])]
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
            return [self.execute(ep, [p])[0] for p in batch]
        if rec.loaded:
            ep.load_s = rec.seconds
        else:
            ep.batch_s = 0.8 * ep.batch_s + 0.2 * rec.seconds
        replies: list[Reply | BaseException] = []
        for p, part in zip(batch, parts):
            r = Reply(part, batch_rows=sum(rows))
            r.queue_s = max(0.0, rec.started - p.enqueued)
            r.compute_s, r.loaded, r.switched_from = rec.seconds, rec.loaded, rec.switched_from
            self.metrics.queued(ep.name, r.queue_s)
            replies.append(r)
        self.metrics.batched(ep.name, sum(rows))
        replied = perf_counter_ns()
        for p in batch:  # NOTE [Request hops]: the batch's stamps are each request's
            t = p.times
            if t is not None:
                t.in_thread, t.called, t.returned, t.replied = in_thread, called, returned, replied
        return replies


def _answer(batch: list[Pending], replies: list[Reply | BaseException], done: asyncio.Future) -> None:
    """On the event loop: each request's reply or error, then the runner's turn."""
    for p, r in zip(batch, replies):
        if not p.future.done():
            if isinstance(r, BaseException):
                p.future.set_exception(r)
            else:
                p.future.set_result(r)
    if not done.done():
        done.set_result(None)
