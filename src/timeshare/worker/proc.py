"""The worker process's loop: ``worker_main`` runs a :class:`~timeshare.worker.worker.Worker`
in a process of its own (runs in the worker). The controller's end of it is
:class:`~timeshare.worker.handle.WorkerHandle`.

A worker is fully initialized before it is needed: torch imported, device resolved,
arena mapped, copy engine started, and every registered model's structure built on
the meta device and bound to its host store. Every wait has a deadline: the worker
polls its pipe and exits when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import select
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from timeshare import protocol as P
from timeshare.errors import ModelError
from timeshare.memory.ephemeral import in_lane

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often an idle worker checks that its parent is alive
POLL_MS = int(POLL_S * 1000)


class _Exit(Exception):
    """Shutdown arrived in the middle of a training segment."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its pid taken by another user's process
        return False
    return True


def worker_main(start: P.Start, conn: Connection) -> None:
    """Entry point of a worker process (spawned)."""
    import torch

    from timeshare.device import host_registrar, make_current, resolve_device
    from timeshare.memory.arena import Arena, map_shared_memory
    from timeshare.models.binding import collect
    from timeshare.models.spec import resolve_builder
    from timeshare.transfer.copy import make_copy_engine
    from timeshare.transfer.host_store import HostStore, InputStaging
    from timeshare.tree import map_tensors, tensors_in
    from timeshare.worker import channel as C
    from timeshare.worker.generation import Batches
    from timeshare.worker.trainer import TrainingTask
    from timeshare.worker.worker import Worker

    where = f"worker {start.worker}"
    if start.environ:  # NOTE [Fork server]: the controller's environment, not the server's
        os.environ.clear()
        os.environ.update(start.environ)
    parent = os.getppid()  # the fork server's pid, or the controller's where workers are spawned
    if start.backend_flags is not None:  # before the first kernel: the creator's numerics, bit for bit
        start.backend_flags.apply()
    device = resolve_device(start.device)
    make_current(device)  # creates the device context, before any other CUDA call: NOTE [Current device]
    arena = Arena.attach(start.arena, start.arena_capacity, device)  # on CUDA, an IPC mapping on that device
    engine = make_copy_engine(device, start.load_timeout_s, start.copy_delay_s)
    registrar = host_registrar(device)  # None on the CPU
    # NOTE [Direct host access]: each Result says whether the model computes from its host
    # store, so that the controller's host tier keeps that store while the model is resident.
    worker = Worker(device, arena, engine, profile_repeats=start.profile_repeats,
                    fixed_group_bytes=start.fixed_group_bytes, registrar=registrar,
                    direct_host_access=start.direct_host_access)
    staging = InputStaging(registrar, alignment=arena.allocator.alignment)  # inputs that came pickled
    # NOTE [Tensor channel]: mapped (and on CUDA page-locked) before the Hello.
    channel = C.Channel.attach(start.channel, registrar) if start.channel is not None else None
    cuda = device.type == "cuda"

    unpickled = [0.0]  # seconds the last message took to unpickle
    in_task = [False]  # inside the task's own code (a forward, a training step): its errors are the task's

    def inputs_of(msg: P.RunModel | P.Profile) -> tuple[tuple, dict, int]:
        """The call's args and kwargs where the model runs, and the first channel byte after
        them (NOTE [Tensor channel]): views of the channel where the controller wrote them,
        mapping first a channel it has grown."""
        nonlocal channel
        if msg.channel is not None and (channel is None or msg.channel.name != channel.spec.name):
            old, channel = channel, None
            if old is not None:
                old.release()
            channel = C.Channel.attach(msg.channel, registrar)
        args, kwargs, end = msg.args, msg.kwargs, 0
        if msg.refs:
            if channel is None:
                raise ModelError(f"{msg.refs} inputs are in a tensor channel this worker was not given")
            (args, kwargs), end = C.views((args, kwargs), channel.buffer)
        if not cuda:
            return args, kwargs, end  # already where the model runs
        return (*to_device(args, kwargs), end)

    def to_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """On CUDA each input is uploaded once, with a non-blocking copy: from the page-locked
        channel where it lies there (NOTE [Tensor channel]), else (it came pickled) from the
        pinned staging buffer, in one call for args and kwargs (NOTE [Input staging])."""
        tensors = tensors_in((args, kwargs))
        if not tensors:
            return args, kwargs
        in_channel = [channel is not None and channel.holds(t) for t in tensors]
        staged = iter(staging.upload([t for t, c in zip(tensors, in_channel) if not c], device)
                      if not all(in_channel) else [])
        moved = []
        for t, c in zip(tensors, in_channel):
            if c:
                up = t.detach().to(device, non_blocking=True)
                moved.append(up.requires_grad_() if t.requires_grad else up)
            else:
                moved.append(next(staged))
        if channel is not None and any(in_channel):
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            channel.mark_in_flight(done)  # the uploads read the channel until then
        it = iter(moved)
        return map_tensors((args, kwargs), lambda _t: next(it))

    def settle() -> None:
        """Nothing of this worker reads the channel once this returns: before any answer to
        a call, a Failure too, since the controller then writes the next call's inputs."""
        if channel is None:
            return
        try:
            channel.settle()
        except Exception:
            log.exception("%s: waiting for the uploads from the tensor channel", where)

    tasks: dict[str, TrainingTask] = {}  # training jobs whose state this worker holds
    batches = Batches(device)  # language models' decode batches this worker is home to

    def add_model(msg: P.AddModel) -> None:
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
        store = HostStore(list(msg.entries), buffer, alignment=arena.allocator.alignment)
        del buffer
        if registrar is not None and not msg.droppable:
            store.pin(registrar)  # page-locked in this process, so copies are asynchronous DMA
        # A droppable store is locked by its loads instead (NOTE [Locked host tier]).
        worker.add(msg.model, module, layout, store, order=msg.order, shared=shared, droppable=msg.droppable)

    def add_shared(msg: P.AddShared) -> None:
        buffer = map_shared_memory(msg.store_name, msg.store_nbytes)  # NOTE [Mappings outlive close]
        worker.add_shared(msg.sid, HostStore(list(msg.entries), buffer, alignment=arena.allocator.alignment))

    def run_model(msg: P.RunModel, t0: float) -> tuple[P.Result, list]:
        for profile in msg.profiles:
            worker.adopt_profile(msg.model, profile)
        wm = worker.models[msg.model]
        known = len(wm.profiles)
        args, kwargs, in_end = inputs_of(msg)
        t_up = time.perf_counter()
        in_task[0] = True
        kv_bytes = None
        with in_lane(msg.lane, device) as meter:  # NOTE [Lanes in the runtime]
            if msg.kv is None:
                out = worker.run(msg.model, msg.offset, msg.resident, args, kwargs, msg.strategy, msg.fill,
                                 msg.shared, msg.host_keys)
            else:  # NOTE [Generation in worker processes]: a step on the caches kept here
                out, kv_bytes = batches.step(
                    msg.kv, wm.module,
                    lambda a, k: worker.run(msg.model, msg.offset, msg.resident, a, k, msg.strategy, msg.fill,
                                            msg.shared, msg.host_keys))
        in_task[0] = False
        t_run = time.perf_counter()
        try:
            worker.finish_pending(msg.model)  # no copy outlives its task: eviction needs no round trip
            # Each output is copied once, into the channel after the inputs (from the device,
            # queued, on CUDA); one that does not fit comes down to the host and is pickled.
            if channel is not None:
                enc = C.encode(out, channel.buffer, in_end, non_blocking=cuda, keep=worker.to_host)
                out, refs, out_nbytes, left = enc.value, enc.refs, enc.need - in_end, enc.left
            else:
                out, refs, out_nbytes, left = worker.to_host(out), 0, 0, []
            t_host = time.perf_counter()
            if cuda:
                # Nothing of this task is still queued when we answer: no copy from the host
                # store, the channel or the input staging buffer (NOTE [Input staging]) is in
                # flight, and every output is in the channel.
                torch.cuda.synchronize(device)
        except BaseException:
            if msg.kv is not None and msg.kv.kind == "decode":
                batches.drop(msg.kv.batch)  # the controller fails the batch's rows: nothing here keeps them
            raise
        t_sync = time.perf_counter()
        learned = tuple(wm.profiles.values())[known:] if len(wm.profiles) > known else ()
        # Where the worker's time went (the bench's breakdown of a call through a worker), and
        # NOTE [Locked host tier]: whether this worker holds the store page-locked now, as
        # measured here (tests check the record); NOTE [Tensor channel]: what the tensors took
        # there and through the staging buffer, on every call (the GPU tier checks each call's
        # inputs came through the channel).
        timings = P.CallTimings(
            t0, unpickled[0], t_up - t0, t_run - t_up, t_host - t_run, t_sync - t_host, start.worker,
            wm.store.pinned, worker.lock_s,
            None if msg.resident else worker.load_seconds(),
            worker.last_fill.read_s if msg.fill is not None and worker.last_fill else None,
            None if msg.resident else worker.moved_bytes, wm.host_bound,
            None if meter is None else meter.peak, kv_bytes,
            in_end, out_nbytes, refs, len(left), staging.staged_nbytes, staging.pinned_nbytes,
            channel.nbytes if channel is not None and channel.pinned else 0,
            channel is not None and channel.page_locked)
        if not msg.resident:
            # What a load leaves behind, measured where it happened (tests): counted over every
            # store, and the allocator's statistics on CUDA, so not on a resident call's path.
            timings.host_pinned_bytes = worker.pinned_host_bytes()
            if cuda:  # device allocations made by this process so far
                timings.cuda_segments = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
        return P.Result(msg.seq, out, time.perf_counter() - t0, timings, learned, refs, out_nbytes), left

    def handle(msg):
        if isinstance(msg, P.AddModel):
            add_model(msg)
            return P.Ack(msg.seq)
        if isinstance(msg, P.AddShared):
            add_shared(msg)
            return P.Ack(msg.seq)
        if isinstance(msg, P.RemoveShared):
            worker.remove_shared(msg.sid)
            return P.Ack(msg.seq)
        if isinstance(msg, P.RemoveModel):
            worker.remove(msg.model)  # unpins its store and drops every view: the segment is unmapped
            return P.Ack(msg.seq)
        if isinstance(msg, P.UnpinStore):
            worker.unpin_store(msg.model)  # NOTE [Locked host tier]: before the controller drops its pages
            return P.Ack(msg.seq)
        if isinstance(msg, P.RunModel):
            t0 = time.perf_counter()
            was_locked = worker.store_pinned(msg.model)
            try:
                return run_model(msg, t0)
            except BaseException:
                settle()
                # Only a Result reports a lock (NOTE [Locked host tier]): a load that locked the
                # store unlocks it whatever failed after it (a key/value step's bookkeeping, the
                # copy of its output to the host), or no record would name this worker.
                if not was_locked and worker.store_pinned(msg.model):
                    worker.unlock_failed_load(msg.model)
                raise
        if isinstance(msg, P.Profile):
            try:
                args, kwargs, _ = inputs_of(msg)
                profile = worker.profile(msg.model, msg.offset, args, kwargs, msg.shared, msg.host_keys)
            finally:
                settle()
            return P.Result(msg.seq, profile, profiles=(profile,))
        if isinstance(msg, P.Train):
            return train(msg)
        if isinstance(msg, P.GetJobState):
            task = tasks[msg.job]
            return P.Result(msg.seq, task.checkpoint() if msg.full else task.state_dict())
        if isinstance(msg, P.DropJob):
            tasks.pop(msg.job, None)
            return P.Ack(msg.seq)
        if isinstance(msg, P.DropCaches):
            batches.drop(msg.batch)
            return P.Ack(msg.seq)
        if isinstance(msg, P.OffloadCaches):
            return P.Result(msg.seq, batches.offload(msg.batch))
        if isinstance(msg, P.PreemptSegment):
            return None  # its segment already ended
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def train(msg: P.Train):
        """Run a training segment: iterations until the job ends or a Preempt for this
        segment arrives (NOTE [Preemption points]). Progress after every iteration is
        also the controller's heartbeat."""
        if msg.spec is not None:
            tasks.pop(msg.job, None)
            tasks[msg.job] = TrainingTask.build(msg.spec, device)
        task = tasks[msg.job]
        reason = "finished"
        try:
            while not task.finished:
                if conn.poll(0):  # a preemption point: what the controller said meanwhile
                    ctl = P.loads(conn.recv_bytes())
                    if isinstance(ctl, P.Shutdown):
                        raise _Exit
                    if isinstance(ctl, P.PreemptSegment) and ctl.seq == msg.seq:
                        reason = "preempted"
                        break
                    if not isinstance(ctl, P.PreemptSegment):
                        raise TypeError(f"{type(ctl).__name__} arrived while training {msg.job}")
                t0 = time.perf_counter()
                in_task[0] = True
                try:
                    with in_lane(msg.lane, device):  # NOTE [Lanes in the runtime]: no lane, no meter
                        loss = task.step_once()
                except StopIteration:
                    break
                in_task[0] = False
                seconds = time.perf_counter() - t0
                task.stats.step_seconds += seconds
                conn.send_bytes(P.dumps(P.Progress(msg.seq, task.stats.iterations, loss, seconds,
                                                   task.stats.ephemeral_bytes, task.stats.persistent_bytes)))
        except _Exit:
            raise
        stopped = time.perf_counter()
        if reason == "preempted":
            task.preempted()  # cleaning: offload if the job asked for it
        return P.SegmentStopped(msg.seq, reason, task.stats, stopped, time.perf_counter())

    # One poll object for the pipe, made once: ``Connection.poll`` builds a selector per call.
    readable = select.poll()
    readable.register(conn.fileno(), select.POLLIN)
    conn.send_bytes(P.dumps(P.Hello(start.worker, os.getpid())))
    try:
        while True:
            if not readable.poll(POLL_MS):
                if os.getppid() != parent or not _alive(start.parent_pid):
                    log.warning("%s: controller is gone; exiting", where)
                    return
                continue
            t_recv = time.perf_counter()
            msg = P.loads(conn.recv_bytes())
            unpickled[0] = time.perf_counter() - t_recv
            if isinstance(msg, P.Shutdown):
                return
            seq = getattr(msg, "seq", -1)
            in_task[0] = False
            try:
                reply = handle(msg)
            except _Exit:
                return
            except Exception as exc:
                subject = getattr(msg, "model", None) or getattr(msg, "job", "") or getattr(msg, "batch", "")
                what = f"{where}, {_VERBS.get(type(msg), type(msg).__name__.lower())} {subject}".rstrip()
                if isinstance(msg, P.RunModel) and msg.kv is not None:  # NOTE [Generation in worker processes]
                    what += f" ({msg.kv.kind} of batch {msg.kv.batch})"
                if isinstance(msg, P.Train) and msg.job in tasks:
                    what += f" (iteration {tasks.pop(msg.job).stats.iterations + 1})"  # its state is undefined now
                elif isinstance(msg, P.Train):
                    what += " (building the job)" if msg.spec is not None else ""
                reply = P.Failure(seq, P.ErrorInfo.capture(exc, what, in_task=in_task[0]))
            if isinstance(reply, tuple):  # a call's Result, and the tensors it left to pickling
                reply, left = reply
                conn.send_bytes(C.dumps(reply, left))
            elif reply is not None:
                conn.send_bytes(P.dumps(reply))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the controller closed the pipe
    finally:
        engine.close()
        for model in list(worker.models):
            worker.remove(model)
        staging.release()
        if channel is not None:
            channel.release()
        arena.close()


_VERBS = {P.RunModel: "run", P.GetJobState: "job state", P.AddModel: "adding", P.RemoveModel: "removing",
          P.AddShared: "adding a shared set", P.RemoveShared: "removing a shared set"}
