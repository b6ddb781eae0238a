"""The controller's end of one worker process (``WorkerHandle``, runs in the controller):
it spawns the process (whose loop is ``worker_main`` in :mod:`timeshare.worker.proc`),
owns its pipe (NOTE [One owner per pipe]) and ends it.

Every wait has a deadline: the handle waits on the pipe and the process sentinel
together, kills a worker that misses its deadline, and escalates shutdown from a
request to terminate to kill.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import select
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any

import torch

from timeshare import protocol as P
from timeshare.errors import MemoryBudgetError, TimeshareError, WorkerCrashedError, WorkerError, WorkerTimeoutError
from timeshare.memory.allocator import align_up
from timeshare.worker import channel as C
from timeshare.worker.proc import worker_main

SPIN_S = 0.002  # NOTE [Spin before sleeping]: calls that answer within this are awaited spinning

log = logging.getLogger(__name__)

# multiprocessing's fork-server processes report their exit status through a pipe that
# ``poll`` reads once, with no lock: two threads polling one dead worker at once (one of
# them, say, ``Process.start``'s own sweep of ended children while a replacement starts)
# leave one of them with EOF, and "exit code 255" for a worker killed by a signal. Every
# start and every poll of a worker process here holds this lock (NOTE [Fork server]).
_POLL = threading.Lock()


@dataclass(frozen=True)
class Inputs:
    """A call's args and kwargs as written into a worker's tensor channel (NOTE [Tensor
    channel]): TensorRefs in place of the tensors written, ``refs`` of them; ``channel``:
    the channel the worker must map first (None: the one it has); ``left``: tensors that
    travel pickled."""

    args: tuple
    kwargs: dict
    refs: int = 0
    channel: P.ChannelSpec | None = None
    left: tuple[torch.Tensor, ...] = ()


class WorkerHandle:
    """The controller's end of one worker process. ``channel_bytes``: its tensor channel's
    first size (0: none, every tensor pickled); ``channel_max_bytes``: the size it may grow
    to (NOTE [Tensor channel]); None: ``channel.DEFAULT_BYTES`` and ``channel.MAX_BYTES``."""

    def __init__(self, ctx, start: P.Start, channel_bytes: int | None = None, channel_max_bytes: int | None = None):
        self.id = start.worker
        channel_bytes = C.DEFAULT_BYTES if channel_bytes is None else channel_bytes
        channel_max_bytes = C.MAX_BYTES if channel_max_bytes is None else channel_max_bytes
        # NOTE [Tensor channel]: the controller owns it; the worker maps it by name at start.
        self.channel: C.Channel | None = None
        if channel_bytes > 0:
            try:
                self.channel = C.Channel.create(channel_bytes)
            except MemoryBudgetError as exc:  # a small /dev/shm (Docker's 64 MB): slower, still right
                log.warning("worker %d has no tensor channel, its calls' tensors are pickled: %s", self.id, exc)
        self._channel_max = max(channel_max_bytes, channel_bytes)
        self._channel_sent = False  # the worker confirmed mapping ``channel`` (a Result came back)
        self._out_hint = 0  # the most bytes the worker's outputs needed in the channel so far
        if self.channel is not None:
            start = replace(start, channel=self.channel.spec)
        self.start = start
        try:
            self.conn, child = ctx.Pipe(duplex=True)
            self.proc = ctx.Process(target=worker_main, args=(start, child), name=f"timeshare-worker-{self.id}",
                                    daemon=True)
            with _POLL:
                self.proc.start()
        except BaseException:
            if self.channel is not None:
                self.channel.release()
            raise
        child.close()
        self._readable = select.poll()  # NOTE [Spin before sleeping]
        self._readable.register(self.conn.fileno(), select.POLLIN)
        self.booted = False  # sent Hello
        self.ready = False  # booted and taught every model (set by the pool)
        self.pid: int | None = None
        self.os_pid: int = self.proc.pid  # kept after the process object is released
        self._released = False
        self.profiles: set[tuple[str, str]] = set()  # (model, shape key) this worker has measured or been sent
        self.taught: set[str] = set()  # models this worker has learned (AddModel answered)
        self.taught_sets: set[str] = set()  # shared sets it has learned (NOTE [Shared tensors])
        # NOTE [One owner per pipe]
        # Only the thread that holds a worker's lease reads its pipe or sends it a request:
        # a task for the whole request, a training segment from Train to Stopped. Anyone
        # may post a one-way message (Preempt, Shutdown) under the send lock. Every reply
        # carries the seq of the request it answers, and the owner discards (and logs) any
        # other message, so a reply left over from a failed or abandoned request can never
        # be taken for the answer to a later one.
        self._lease = threading.RLock()
        self._owner: int | None = None
        self._depth = 0
        self._send_lock = threading.Lock()
        self._life = threading.Lock()  # kill and stop, one at a time

    # ------------------------------------------------------------------ ownership
    def try_lease(self, timeout_s: float = 0.0) -> bool:
        """Take the pipe for this thread (re-entrant); False if another thread holds it."""
        got = self._lease.acquire(timeout=timeout_s) if timeout_s > 0 else self._lease.acquire(blocking=False)
        if not got:
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    @property
    def leased_now(self) -> bool:
        """Whether some thread holds the pipe (a task, a segment, a control request)."""
        return self._owner is not None

    def unlease(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lease.release()

    @contextmanager
    def leased(self, timeout_s: float, what: str):
        """Hold the pipe for a request; a worker busy for longer than ``timeout_s`` is an error."""
        if not self.try_lease(timeout_s):
            raise WorkerTimeoutError(f"worker {self.id} stayed busy for {timeout_s:g} s",
                                     where=f"worker {self.id}, {what}")
        try:
            yield self
        finally:
            self.unlease()

    def _check_owner(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError(f"worker {self.id}'s pipe used by a thread that does not hold its lease")

    def post(self, msg) -> bool:
        """Send a one-way message (no reply expected); False if the pipe is gone."""
        return self.post_bytes(P.dumps(msg))

    def post_bytes(self, data: bytes) -> bool:
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            return False

    # ------------------------------------------------------------------ calls
    def encode_inputs(self, args: tuple, kwargs: dict) -> Inputs:
        """Write a call's tensors into the worker's channel, grown first if they (and the
        outputs the worker last needed room for) do not fit (NOTE [Tensor channel]). The
        caller holds the lease, and sends the message made of them next."""
        self._check_owner()
        channel = self.channel
        if channel is None:
            return Inputs(args, kwargs)
        enc = C.encode((args, kwargs), channel.buffer, say=False)
        want = align_up(enc.need, C.ALIGNMENT) + self._out_hint
        if want > channel.nbytes and channel.nbytes < self._channel_max:
            grown = self._grow(want)
            if grown is not None:
                channel = grown
                enc = C.encode((args, kwargs), channel.buffer, say=False)
        C.report(enc)
        (a, k) = enc.value
        return Inputs(a, k, enc.refs, None if self._channel_sent else channel.spec, tuple(enc.left))

    def _grow(self, want: int) -> C.Channel | None:
        """A larger channel in place of the current one (between calls: nothing reads the
        old one any more); None, logged, where /dev/shm has no room for it."""
        assert self.channel is not None
        size = min(self._channel_max, max(align_up(want + want // 4, C.PAGE), 2 * self.channel.nbytes))
        try:
            grown = C.Channel.create(size)
        except MemoryBudgetError as exc:
            log.warning("worker %d: the tensor channel stays at %d bytes: %s", self.id, self.channel.nbytes, exc)
            self._channel_max = self.channel.nbytes  # not tried again
            return None
        log.debug("worker %d: tensor channel grown from %d to %d bytes", self.id, self.channel.nbytes, size)
        self.channel.release()  # the worker keeps its mapping until it maps the new one
        self.channel = grown
        self._channel_sent = False
        return grown

    def call(self, msg, inputs: Inputs, timeout_s: float, what: str, spin_s: float = 0.0,
             then: Callable[[], tuple[bytes, ...]] | None = None,
             writes: Callable[[Callable[[int], None]], None] | None = None) -> tuple[Any, Any]:
        """Send a call's message (made with ``inputs``) and wait for its reply (as
        ``request``); returns the reply and its value, whose tensors are copied out of the
        channel, the caller's own: the next call may overwrite the channel (NOTE [Tensor
        channel]). ``spin_s``: poll for the reply this long before sleeping (NOTE [Spin
        before sleeping]). ``then``: a step's late masks, computed once the step is sent,
        while the worker runs its forward, and sent after it (NOTE [Masks while the device
        runs]); before them ``writes``: its cold adapter slot written meanwhile, each
        layer told (NOTE [Adapters streamed in])."""
        self._check_owner()
        if not self.post_bytes(C.dumps(msg, inputs.left)):
            raise self._crashed(what)
        if then is not None or writes is not None:
            self._follow(msg.seq, writes, then, timeout_s, what)
        reply = self.receive(timeout_s, what, msg.seq, spin_s)
        if not isinstance(reply, P.Result):
            return reply, getattr(reply, "value", None)
        channel = self.channel
        if channel is not None and not self._channel_sent:
            self._channel_sent = True  # it maps the channel before it answers: the name can go
            channel.unlink()
        if reply.out_nbytes > self._out_hint:
            self._out_hint = reply.out_nbytes
        if not reply.refs:
            return reply, reply.value
        if channel is None:
            raise WorkerCrashedError(f"worker {self.id} answered with tensors in a channel it was not given",
                                     where=f"worker {self.id}, {what}")
        return reply, C.copies(reply.value, channel.buffer)

    def _follow(self, seq: int, writes: Callable[[Callable[[int], None]], None] | None,
                then: Callable[[], tuple[bytes, ...]] | None, timeout_s: float, what: str) -> None:
        """What follows step ``seq``: its adapter slot's layers as they are written, then its
        late masks; if writing or computing them raised, the step is told (it fails), its
        answer read, and the error raised here."""
        wrote = False

        def tell(written: int) -> None:
            if not self.post(P.SlotReady(seq, written)):
                raise self._crashed(what)

        try:
            if writes is not None:
                writes(tell)
                wrote = True
            masks = then() if then is not None else None
        except WorkerError:
            raise  # the worker is gone: the pool replaces it
        except BaseException as exc:
            if writes is not None and not wrote and not self.post(P.SlotReady(seq, -1)):
                raise self._crashed(what) from exc
            if then is not None and not self.post(P.StepMasks(seq, ())):
                raise self._crashed(what) from exc
            try:
                self.receive(timeout_s, what, seq)  # the step's failure, answering the empty masks
            except WorkerError as lost:  # the worker died or hung meanwhile: that is what the pool must see
                raise lost from exc
            except TimeshareError:
                pass
            raise
        if masks is not None and not self.post(P.StepMasks(seq, masks)):
            raise self._crashed(what)

    # ------------------------------------------------------------------ requests
    def wait_ready(self, timeout_s: float) -> None:
        if not self.booted:
            self._check_owner()
            hello = self._recv(timeout_s, "starting")
            if not isinstance(hello, P.Hello):
                raise WorkerCrashedError(f"worker {self.id} sent {type(hello).__name__} instead of Hello")
            self.pid, self.booted = hello.pid, True
            if self.channel is not None:  # mapped before its Hello (NOTE [Tensor channel])
                self._channel_sent = True
                self.channel.unlink()

    def request(self, msg, timeout_s: float, what: str):
        """Send ``msg`` and wait for the reply that carries its seq; a Failure is re-raised
        as an error. The caller holds the lease (NOTE [One owner per pipe])."""
        self._check_owner()
        if not self.post(msg):
            raise self._crashed(what)
        return self.receive(timeout_s, what, msg.seq)

    def receive(self, timeout_s: float, what: str, seq: int, spin_s: float = 0.0):
        """The next message from the worker that answers request ``seq`` (a reply, a
        training segment's Progress or Stopped); a Failure is re-raised as an error.
        Messages for other requests are discarded and logged."""
        self._check_owner()
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._recv(max(0.0, deadline - time.monotonic()), what, timeout_s, spin_s)
            got = getattr(reply, "seq", None)
            if got == seq:
                break
            log.warning("worker %d: discarding %s for request %s while %s (request %d)",
                        self.id, type(reply).__name__, got, what, seq)
        if isinstance(reply, P.Failure):
            raise reply.error.to_exception()
        return reply

    def _recv(self, timeout_s: float, what: str, deadline_s: float | None = None, spin_s: float = 0.0):
        if self._released:  # killed and replaced by another thread meanwhile
            raise WorkerCrashedError(f"worker {self.id} was stopped", where=f"worker {self.id}, {what}")
        if spin_s > 0 and self._spin(spin_s):
            try:
                return P.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                pass  # the process died: the wait below says how
        try:
            ready = wait([self.conn, self.proc.sentinel], timeout_s)
        except (ValueError, OSError):  # released by another thread between the check and the wait
            raise WorkerCrashedError(f"worker {self.id} was stopped", where=f"worker {self.id}, {what}") from None
        if self.conn in ready:
            try:
                return P.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                pass  # the process died: report it below
        if self.proc.sentinel in ready or self.conn in ready:
            raise self._crashed(what)
        self.kill()
        raise WorkerTimeoutError(
            f"worker {self.id} did not answer within {deadline_s or timeout_s:g} s; it was killed",
            where=f"worker {self.id}, {what}"
        )

    # NOTE [Spin before sleeping]
    # A short call's reply comes within a millisecond (a small resident model's forward).
    # Sleeping in the kernel until it comes costs the controller a wake-up from an idle
    # core, which on a virtual machine is hundreds of microseconds (a tiny model's round
    # trip went from 1.2 ms to 0.6 ms on the 2-core VM with this). So for a call whose
    # kind answered within SPIN_S last time (the pool knows: ``Deadlines.last``), the
    # lease holder first polls the pipe without blocking for up to SPIN_S, then sleeps as
    # before (with the worker's sentinel and the call's deadline). Longer calls sleep at
    # once: spinning through them took a core from the worker (an 8.6 MB input's call
    # doubled on 2 cores). Only the controller spins: a worker that spun while waiting
    # for its next request took the core its controller needed, and was slower. One poll
    # object per pipe, made once: the multiprocessing ``poll`` builds a selector per call.
    def _spin(self, seconds: float) -> bool:
        """Whether the pipe became readable within ``seconds``, polled without sleeping."""
        poll = self._readable.poll
        end = time.perf_counter() + seconds
        while not poll(0):
            if time.perf_counter() >= end:
                return False
        return True

    def exit_description(self) -> str:
        """How the process ended ("was killed by signal 9 (SIGKILL)", "exited with code 1"),
        waiting a moment for it to be reaped; for a worker that never said Hello, a hint
        at why."""
        try:
            code = self._exit_code(5)
            deadline = time.monotonic() + 5
            while code is None and time.monotonic() < deadline:
                time.sleep(0.01)  # another thread (the pool's watcher) is reaping it right now
                code = self._exit_code(0)
        except ValueError:  # its process object was closed by another thread: how it ended is unknown
            return "was stopped"
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                name = ""
            how = f"was killed by signal {-code}{name}"
        else:
            how = f"exited with code {code}"
        if not self.booted:
            how += " before it was ready"
            if code is not None and code > 0:  # it failed by itself (a signal is someone else's doing)
                how += ("; its stderr says why. A script that starts workers must create the Runtime under"
                        " `if __name__ == '__main__':` (workers are spawned)")
        return how

    def _crashed(self, what: str) -> WorkerCrashedError:
        """The error for a worker whose process ended, with how it ended."""
        return WorkerCrashedError(f"worker {self.id} {self.exit_description()}", where=f"worker {self.id}, {what}")

    def _exit_code(self, timeout_s: float) -> int | None:
        """The process's exit code once it has ended within ``timeout_s``, else None; the
        wait is outside the lock, the one read of the status under it."""
        wait([self.proc.sentinel], timeout_s)
        with _POLL:
            return self.proc.exitcode

    def alive(self) -> bool:
        if self._released:
            return False
        try:
            # Every task asks, so without a lock or a selector object (NOTE [Fork server]):
            # an exit status read already (by any thread, or by ``Process.start``'s sweep of
            # ended children) is kept on the process object; one not read yet makes the
            # sentinel readable. The status pipe is empty once read, and its end may still
            # be open: the sentinel alone would then say alive.
            popen = getattr(self.proc, "_popen", None)
            if popen is None or popen.returncode is not None:
                return False
            ended, _, _ = select.select([self.proc.sentinel], [], [], 0)
            return not ended and not self._released
        except (ValueError, OSError):  # released by another thread between the two checks
            return False

    def kill(self) -> None:
        """Kill the process (if alive) and release its pipe and sentinel."""
        with self._life:
            self._kill()

    def _kill(self) -> None:
        if self._released:
            return
        if self._exit_code(0) is None:
            self.proc.kill()
        self._exit_code(5)
        try:
            self._readable.unregister(self.conn.fileno())
        except (KeyError, ValueError, OSError):
            pass
        self.conn.close()
        if self.channel is not None:
            self.channel.release()  # NOTE [Tensor channel]: its name, and this side's mapping and descriptor
        if self._exit_code(0) is not None:
            self.proc.close()  # frees the sentinel's file descriptor
            self._released = True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit; terminate, then kill, if it does not."""
        with self._life:  # one thread at a time ends a process (the pool's watcher may race a close)
            if self._released:
                return
            if self._exit_code(0) is None:
                self.post(P.Shutdown())
                self._exit_code(timeout_s)
            if self._exit_code(0) is None:
                self.proc.terminate()
                self._exit_code(timeout_s)
            self._kill()


# NOTE [Fork server]
# Workers start from multiprocessing's fork server, which imports torch and the worker's
# modules once (``set_forkserver_preload``) and forks a fresh worker from that clean state:
# starting one costs a fork (tens of milliseconds) instead of a fresh interpreter importing
# torch (about 3 s of CPU on our 2-core machines), which is what a crashed worker's
# replacement, and every test that starts workers, used to wait for. It is still never a fork
# of the controller: the server has imported modules but run no kernel and touched no CUDA
# (CUDA is never touched at import), so a child may start CUDA itself. What a fork inherits
# from the server rather than from the controller is mended in ``worker_main``: the
# environment comes in ``Start.environ``, and a worker's parent is the server, which exits
# when its controller does, so a worker leaves when its parent changes or its controller
# is gone. Where the fork server is unavailable (not on Linux or macOS), workers are spawned.
WORKER_PRELOAD = ["timeshare.worker.proc"]


def spawn_context():
    """The start method of worker processes (NOTE [Fork server])."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts, with the first worker
    return ctx
