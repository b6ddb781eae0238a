"""The worker process's loop: ``worker_main`` runs a :class:`~timeshare.worker.worker.Worker`
in a process of its own, through a :class:`WorkerProcess` (runs in the worker). The
controller's end of it is :class:`~timeshare.executor.handle.WorkerHandle`.

A worker is fully initialized before it is needed: torch imported, device resolved,
arena mapped, copy engine started, and every registered model's structure built on
the meta device and bound to its host store. Every wait has a deadline: the worker
polls its pipe and exits when its parent is gone. Each message type has its method on
``WorkerProcess``; a call's tensors go through ``worker/call_tensors.py``, a training
segment's iterations through ``worker/trainer.py``.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import torch

import timeshare.device as devices
from timeshare import protocol as P
from timeshare.decode.step import LoadFollows, MasksFollow
from timeshare.errors import GenerationError, ModelError
from timeshare.memory.arena import Arena, map_shared_memory
from timeshare.memory.ephemeral import in_lane
from timeshare.models.binding import collect
from timeshare.models.spec import resolve_builder
from timeshare.transfer.copy import make_copy_engine
from timeshare.transfer.host_store import HostStore
from timeshare.worker import channel as C
from timeshare.worker.call_tensors import CallTensors
from timeshare.worker.trainer import SegmentShutdown, TrainingTask, run_segment
from timeshare.worker.worker import Worker

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often an idle worker checks that its parent is alive
POLL_MS = int(POLL_S * 1000)
STEP_MASKS_S = 60.0  # the most a step waits for its late grammar masks (they take milliseconds)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its pid taken by another user's process
        return False
    return True


def worker_main(start: P.Start, conn: Connection) -> None:
    """Entry point of a worker process (spawned)."""
    WorkerProcess(start, conn).serve()


class SlotReader:
    """A prefill's cold adapter slot as its worker sees it (NOTE [Adapters streamed in]):
    the controller writes it after sending the step, and says after each layer how many
    targets are in place (``SlotReady``, the next message, waited for up to its own
    deadline; ``arrived``: whether one is there already); ``wait`` reads those messages
    as far as a correction needs, ``drain`` the rest once the step failed."""

    def __init__(self, next_message: Callable[[], P.SlotReady], arrived: Callable[[], bool], count: int):
        self._next, self._arrived = next_message, arrived
        self.count, self.written = count, 0
        self.failed = False

    def start(self) -> None:
        return None

    def wait(self, written: int) -> bool:
        waited = False
        while self.written < written:
            if self.failed:
                raise GenerationError("the controller could not write this step's adapter slot")
            waited = waited or not self._arrived()
            got = self._next().written
            if got < 0:
                self.failed = True
                continue
            self.written = max(self.written, got)  # a write taken up again says first where it stood
        return waited

    def drain(self) -> None:
        if not self.failed:
            self.wait(self.count)


class WorkerProcess:
    """One worker process: its device, arena, copy engine and ``Worker``, the training jobs
    it is home to, and a method per message the controller sends."""

    def __init__(self, start: P.Start, conn: Connection):
        self.start = start
        self.conn = conn
        self.where = f"worker {start.worker}"
        if start.environ:  # NOTE [Fork server]: the controller's environment, not the server's
            os.environ.clear()
            os.environ.update(start.environ)
        self.parent = os.getppid()  # the fork server's pid, or the controller's where workers are spawned
        if start.backend_flags is not None:  # before the first kernel: the creator's numerics, bit for bit
            start.backend_flags.apply()
        device = self.device = devices.resolve_device(start.device)
        if start.leave_a_core:  # the controller serves: NOTE [A core for the front end]
            devices.leave_a_core(one_team=True)
        devices.make_current(device)  # creates the device context, before any other CUDA call: NOTE [Current device]
        self.arena = Arena.attach(start.arena, start.arena_capacity, device)  # on CUDA, an IPC mapping on that device
        self.engine = make_copy_engine(device, start.load_timeout_s, start.copy_delay_s)
        self.registrar = devices.host_registrar(device)  # None on the CPU
        # NOTE [Direct host access]: each Result says whether the model computes from its host
        # store, so that the controller's host tier keeps that store while the model is resident.
        self.worker = Worker(device, self.arena, self.engine, profile_repeats=start.profile_repeats,
                             fixed_group_bytes=start.fixed_group_bytes, registrar=self.registrar,
                             direct_host_access=start.direct_host_access)
        self.tensors = CallTensors(start, device, self.registrar, self.arena.allocator.alignment, self.where)
        self.cuda = device.type == "cuda"
        self.unpickled = 0.0  # seconds the last message took to unpickle
        self.in_task = False  # inside the task's own code (a forward, a training step): its errors are the task's
        self.masks_due: int | None = None  # a step whose late grammar masks are still on the pipe
        self.load_due: SlotReader | None = None  # a step whose adapter slot's news are still on the pipe
        self.tasks: dict[str, TrainingTask] = {}  # training jobs whose state this worker holds
        self.handlers: dict[type, Callable[[Any], Any]] = {
            P.AddModel: self.add_model, P.AddShared: self.add_shared, P.RemoveShared: self.remove_shared,
            P.RemoveModel: self.remove_model, P.UnpinStore: self.unpin_store, P.RunModel: self.run_model,
            P.Profile: self.profile, P.Train: self.train, P.GetJobState: self.job_state, P.DropJob: self.drop_job,
            P.PreemptSegment: self.preempt_segment,
        }

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """Say Hello, then answer messages until Shutdown, a closed pipe or a parent gone."""
        conn = self.conn
        # One poll object for the pipe, made once: ``Connection.poll`` builds a selector per call.
        readable = select.poll()
        readable.register(conn.fileno(), select.POLLIN)
        conn.send_bytes(P.dumps(P.Hello(self.start.worker, os.getpid())))
        try:
            while True:
                if not readable.poll(POLL_MS):
                    if os.getppid() != self.parent or not _alive(self.start.parent_pid):
                        log.warning("%s: controller is gone; exiting", self.where)
                        return
                    continue
                t_recv = time.perf_counter()
                msg = P.loads(conn.recv_bytes())
                self.unpickled = time.perf_counter() - t_recv
                if isinstance(msg, P.Shutdown):
                    return
                try:
                    reply = self.answer(msg)
                except SegmentShutdown:
                    return
                if isinstance(reply, tuple):  # a call's Result, and the tensors it left to pickling
                    reply, left = reply
                    conn.send_bytes(C.dumps(reply, left))
                elif reply is not None:
                    conn.send_bytes(P.dumps(reply))
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the controller closed the pipe
        finally:
            self.close()

    def answer(self, msg: Any) -> Any:
        """The reply to ``msg``: its handler's, or a Failure that says where it happened."""
        seq = getattr(msg, "seq", -1)
        self.in_task = False
        try:
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise TypeError(f"unexpected message {type(msg).__name__}")
            return handler(msg)
        except SegmentShutdown:
            raise
        except Exception as exc:
            return P.Failure(seq, P.ErrorInfo.capture(exc, self.failed_at(msg), in_task=self.in_task))

    def failed_at(self, msg: Any) -> str:
        """Where ``msg``'s handling failed ("worker 2, run m (decode step of 3 rows)"); a job
        that failed in an iteration is dropped: its state is undefined now."""
        subject = getattr(msg, "model", None) or getattr(msg, "job", "")
        what = f"{self.where}, {_VERBS.get(type(msg), type(msg).__name__.lower())} {subject}".rstrip()
        if isinstance(msg, P.RunModel) and msg.step is not None:  # NOTE [One step, two places]
            what += f" ({msg.step.kind.value} step of {msg.step.rows} rows)"
        if isinstance(msg, P.Train) and msg.job in self.tasks:
            what += f" (iteration {self.tasks.pop(msg.job).stats.iterations + 1})"  # its state is undefined now
        elif isinstance(msg, P.Train):
            what += " (building the job)" if msg.spec is not None else ""
        return what

    def close(self) -> None:
        """Everything this process holds goes, in the order it was taken."""
        self.engine.close()
        for model in list(self.worker.models):
            self.worker.remove(model)
        self.tensors.release()
        self.arena.close()

    # ------------------------------------------------------------------ models and shared sets
    def add_model(self, msg: P.AddModel) -> P.Ack:
        with torch.device("meta"):
            module = resolve_builder(msg.builder)()
        module.eval()
        layout = collect(module)
        shared = {key: (sid, entry) for key, sid, entry in msg.shared}  # NOTE [Shared tensors]
        manifest = {e.key: e for e in msg.entries} | {k: replace(e, key=k) for k, (_, e) in shared.items()}
        for e in layout.entries:
            m = manifest.get(e.key)
            if m is None or m.shape != e.shape:
                raise ModelError(
                    f"model {msg.model!r} built in the worker does not match its registration at tensor "
                    f"{e.key!r} (is the builder deterministic?)"
                )
        if len(layout.entries) != len(manifest):
            raise ModelError(f"model {msg.model!r} built in the worker has a different set of tensors")
        layout.entries = [manifest[e.key] for e in layout.entries]
        # Mapped on its own: the mapping goes with the store's last view (NOTE [Mappings outlive close]).
        buffer = map_shared_memory(msg.store_name, msg.store_nbytes)
        store = HostStore(list(msg.entries), buffer, alignment=self.arena.allocator.alignment)
        del buffer
        if self.registrar is not None and not msg.droppable:
            store.pin(self.registrar)  # page-locked in this process, so copies are asynchronous DMA
        # A droppable store is locked by its loads instead (NOTE [Locked host tier]).
        self.worker.add(msg.model, module, layout, store, order=msg.order, shared=shared, droppable=msg.droppable)
        return P.Ack(msg.seq)

    def add_shared(self, msg: P.AddShared) -> P.Ack:
        buffer = map_shared_memory(msg.store_name, msg.store_nbytes)  # NOTE [Mappings outlive close]
        self.worker.add_shared(msg.sid, HostStore(list(msg.entries), buffer,
                                                  alignment=self.arena.allocator.alignment))
        return P.Ack(msg.seq)

    def remove_shared(self, msg: P.RemoveShared) -> P.Ack:
        self.worker.remove_shared(msg.sid)
        return P.Ack(msg.seq)

    def remove_model(self, msg: P.RemoveModel) -> P.Ack:
        self.worker.remove(msg.model)  # unpins its store and drops every view: the segment is unmapped
        return P.Ack(msg.seq)

    def unpin_store(self, msg: P.UnpinStore) -> P.Ack:
        self.worker.unpin_store(msg.model)  # NOTE [Locked host tier]: before the controller drops its pages
        return P.Ack(msg.seq)

    # ------------------------------------------------------------------ calls
    def _follower(self, seq: int, kind: type[P.StepMasks] | type[P.SlotReady], what: str) -> Any:
        """The next message on the pipe, step ``seq``'s ``kind`` (what follows a step: NOTE
        [Adapters streamed in], NOTE [Masks while the device runs]), waited for up to
        ``STEP_MASKS_S``."""
        if not self.conn.poll(STEP_MASKS_S):
            raise GenerationError(f"step {seq}'s {what} did not come within {STEP_MASKS_S:g} s")
        msg = P.loads(self.conn.recv_bytes())
        if isinstance(msg, P.Shutdown):
            raise SegmentShutdown
        if not isinstance(msg, kind) or msg.seq != seq:
            raise GenerationError(f"step {seq} expected its {what}, got {type(msg).__name__}")
        return msg

    def _step_masks(self, seq: int) -> tuple[bytes, ...]:
        """Step ``seq``'s late masks (NOTE [Masks while the device runs])."""
        self.masks_due = None
        return self._follower(seq, P.StepMasks, "grammar masks").masks

    def run_model(self, msg: P.RunModel) -> tuple[P.Result, list]:
        t0 = time.perf_counter()
        was_locked = self.worker.store_pinned(msg.model)
        if msg.step is not None and isinstance(msg.step.load, LoadFollows):  # NOTE [Adapters streamed in]
            self.load_due = SlotReader(partial(self._follower, msg.seq, P.SlotReady, "adapter slot"),
                                       partial(self.conn.poll, 0), msg.step.load.count)
        if msg.step is not None and isinstance(msg.step.masks, MasksFollow):
            self.masks_due = msg.seq  # read by the step, or below if it failed before
        try:
            return self._call(msg, t0)
        except BaseException:
            if self.load_due is not None:  # what the step did not read of its slot's news: off the pipe
                with suppress(GenerationError):
                    self.load_due.drain()
            if self.masks_due is not None:  # the step failed before it read its masks: off the pipe
                with suppress(GenerationError):  # a Shutdown instead still ends the worker
                    self._step_masks(self.masks_due)
            self.tensors.settle()
            # Only a Result reports a lock (NOTE [Locked host tier]): a load that locked the
            # store unlocks it whatever failed after it (a key/value step's bookkeeping, the
            # copy of its output to the host), or no record would name this worker.
            if not was_locked and self.worker.store_pinned(msg.model):
                self.worker.unlock_failed_load(msg.model)
            raise
        finally:
            self.load_due = None

    def _call(self, msg: P.RunModel, t0: float) -> tuple[P.Result, list]:
        worker, device = self.worker, self.device
        for profile in msg.profiles:
            worker.adopt_profile(msg.model, profile)
        wm = worker.models[msg.model]
        known = len(wm.profiles)
        args, kwargs, in_end = self.tensors.inputs_of(msg)
        t_up = time.perf_counter()
        self.in_task = True
        step = msg.step
        if step is not None and isinstance(step.masks, MasksFollow):  # NOTE [Masks while the device runs]
            step = replace(step, masks=partial(self._step_masks, msg.seq))
        if step is not None and self.load_due is not None:
            step = replace(step, load=self.load_due)
        with in_lane(msg.lane, device) as meter:  # NOTE [Lanes in the runtime]
            out = worker.run(msg.model, msg.offset, msg.resident, args, kwargs, msg.strategy, msg.fill,
                             msg.shared, msg.host_keys, step=step)
        self.in_task = False
        t_run = time.perf_counter()
        worker.finish_pending(msg.model)  # no copy outlives its task: eviction needs no round trip
        out, refs, out_nbytes, left = self.tensors.outputs(out, in_end, worker.to_host)
        t_host = time.perf_counter()
        if self.cuda:
            # Nothing of this task is still queued when we answer: no copy from the host
            # store, the channel or the input staging buffer (NOTE [Input staging]) is in
            # flight, every output is in the channel, and a step's keys and values are in
            # their pages, which the controller may read next (NOTE [Key/value caches off
            # the device]).
            torch.cuda.synchronize(device)
        t_sync = time.perf_counter()
        learned = tuple(wm.profiles.values())[known:] if len(wm.profiles) > known else ()
        staging, channel = self.tensors.staging, self.tensors.channel
        # Where the worker's time went (the bench's breakdown of a call through a worker), and
        # NOTE [Locked host tier]: whether this worker holds the store page-locked now, as
        # measured here (tests check the record); NOTE [Tensor channel]: what the tensors took
        # there and through the staging buffer, on every call (the GPU tier checks each call's
        # inputs came through the channel).
        timings = P.CallTimings(
            t0, self.unpickled, t_up - t0, t_run - t_up, t_host - t_run, t_sync - t_host, self.start.worker,
            wm.store.pinned, worker.lock_s,
            None if msg.resident else worker.load_seconds(),
            worker.last_fill.read_s if msg.fill is not None and worker.last_fill else None,
            None if msg.resident else worker.moved_bytes, wm.host_bound,
            None if meter is None else meter.peak,
            in_end, out_nbytes, refs, len(left), staging.staged_nbytes, staging.pinned_nbytes,
            channel.nbytes if channel is not None and channel.pinned else 0,
            channel is not None and channel.page_locked)
        if not msg.resident:
            # What a load leaves behind, measured where it happened (tests): counted over every
            # store, and the allocator's statistics on CUDA, so not on a resident call's path.
            timings.host_pinned_bytes = worker.pinned_host_bytes()
            if self.cuda:  # device allocations made by this process so far
                timings.cuda_segments = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
        return P.Result(msg.seq, out, time.perf_counter() - t0, timings, learned, refs, out_nbytes), left

    def profile(self, msg: P.Profile) -> P.Result:
        try:
            args, kwargs, _ = self.tensors.inputs_of(msg)
            profile = self.worker.profile(msg.model, msg.offset, args, kwargs, msg.shared, msg.host_keys)
        finally:
            self.tensors.settle()
        return P.Result(msg.seq, profile, profiles=(profile,))

    # ------------------------------------------------------------------ training jobs
    def train(self, msg: P.Train) -> P.SegmentStopped:
        """A training segment of a job this worker is home to (``worker/trainer.py``);
        ``spec`` builds the job first, replacing any state kept for it."""
        if msg.spec is not None:
            self.tasks.pop(msg.job, None)
            self.tasks[msg.job] = TrainingTask.build(msg.spec, self.device)
        return run_segment(self.conn, msg, self.tasks[msg.job], self.device, self)

    def job_state(self, msg: P.GetJobState) -> P.Result:
        task = self.tasks[msg.job]
        return P.Result(msg.seq, task.checkpoint() if msg.full else task.state_dict())

    def drop_job(self, msg: P.DropJob) -> P.Ack:
        self.tasks.pop(msg.job, None)
        return P.Ack(msg.seq)

    def preempt_segment(self, msg: P.PreemptSegment) -> None:
        return None  # its segment already ended


_VERBS = {P.RunModel: "run", P.GetJobState: "job state", P.AddModel: "adding", P.RemoveModel: "removing",
          P.AddShared: "adding a shared set", P.RemoveShared: "removing a shared set"}
