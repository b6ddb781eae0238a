"""The parser processes for large inference request bodies (NOTE [Parsing off the event
loop]). :class:`ParserPool` runs in the server's process, on the event loop; each large
body goes to a parser process (spawned; its loop is ``server/parser_process.py``), which
runs :func:`~timeshare.server.parsing.parse_infer` and sends back the request and its
tensors' bytes.

# NOTE [Parsing off the event loop]
``json.loads`` of a 63 MB body of numbers takes about a second, and converting the
values another; both hold the GIL, so a thread would stall the event loop as much as
parsing on it does: every other client would wait. Bodies whose JSON is larger than
``server.parse_in_process_bytes`` are therefore parsed in a parser process (spawned),
which sends back only what the server needs: the request without its ``data`` lists,
and each input's tensor as raw bytes. A process starts when a body first needs one and
stays; it parses one body at a time, with a deadline (``server.request_timeout_s``)
after which it is killed; one that dies (killed, out of memory) fails only the request
it was parsing (503) and is replaced at once. At most ``parse_processes`` bodies are
parsed and ``parse_queue`` wait; more get 503, before their body is read when its
Content-Length shows it. A parse peaks at about 6 times the body's size in the parser
process: ``json.loads`` makes a Python float of every value (about 4 times the text),
then numpy one array; the body's bytes, its text and each list of values are let go
as soon as the next form exists.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess

import torch

from timeshare.config import ServerConfig
from timeshare.dtypes import TORCH_DTYPES
from timeshare.errors import BadRequest, TimeshareError, WorkerCrashedError, WorkerError, WorkerTimeoutError
from timeshare.server.parser_process import parser_main
from timeshare.server.parsing import json_size, parse_infer
from timeshare.server.schemas import InferenceRequest

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # a parser process imports torch: seconds on a busy machine
STOP_TIMEOUT_S = 10.0  # how long a parser process may take to exit when the server stops


class ParserPool:
    """Parser processes for large request bodies (NOTE [Parsing off the event loop]).

    A process starts when a body first needs it (the first large body waits for its
    start-up, about two seconds: it imports torch), and stays. :meth:`parse` and
    :meth:`admit` run on the event loop; each exchange with a process runs in a thread of
    the pool's own; :meth:`close` blocks (call it in a thread from async code);
    :meth:`stats` and :meth:`pids` from anywhere."""

    def __init__(self, *, in_process_bytes: int, processes: int, queue: int, timeout_s: float):
        self.in_process_bytes = in_process_bytes
        self.timeout_s = timeout_s
        self.capacity = processes + queue
        self._parsers = [_Parser(i) for i in range(processes)]
        # Last in, first out: the warm parser goes again; another starts only when bodies overlap.
        self._idle: asyncio.LifoQueue[_Parser] = asyncio.LifoQueue()
        for p in reversed(self._parsers):
            self._idle.put_nowait(p)
        self._threads = ThreadPoolExecutor(max_workers=max(1, processes), thread_name_prefix="timeshare-parse")
        self._admitted = 0  # parsing or waiting for a parser
        self._closed = False

    @classmethod
    def from_config(cls, server: ServerConfig) -> ParserPool:
        return cls(in_process_bytes=int(server.parse_in_process_bytes), processes=server.parse_processes,
                   queue=server.parse_queue, timeout_s=server.request_timeout_s)

    def offloads(self, json_bytes: int) -> bool:
        """Whether JSON of this size is parsed in a parser process."""
        return bool(self._parsers) and json_bytes > self.in_process_bytes

    def admit(self, declared_bytes: int | None) -> None:
        """Before a body is read: a body declared (Content-Length) too large to parse on
        the event loop gets 503 now, rather than after it was read, when no parser can
        take it."""
        if declared_bytes is not None and self.offloads(declared_bytes):
            self._check_room()

    async def parse(self, body: bytes, header_length: str | None) -> tuple[InferenceRequest, dict[str, torch.Tensor]]:
        """:func:`parse_infer` of this body: on the event loop when its JSON is small,
        in a parser process otherwise."""
        if not self.offloads(json_size(body, header_length)):
            return parse_infer(body, header_length)
        self._check_room()
        self._admitted += 1
        try:
            parser = await self._idle.get()
            job = self._threads.submit(parser.parse, body, header_length, self.timeout_s)
            # The parser goes back when its exchange ends, even if this request was
            # cancelled meanwhile: never two exchanges on one pipe.
            job.add_done_callback(functools.partial(self._release, asyncio.get_running_loop(), parser))
            return await asyncio.wrap_future(job)
        finally:
            self._admitted -= 1

    def _check_room(self) -> None:
        if self._closed:
            raise _overloaded("the server is shutting down")
        if self._admitted >= self.capacity:
            raise _overloaded(f"every request parser is busy ({len(self._parsers)} parsing, "
                              f"{self.capacity - len(self._parsers)} waiting: server.parse_processes, "
                              "server.parse_queue)")

    def _release(self, loop: asyncio.AbstractEventLoop, parser: _Parser, _job: Future) -> None:
        try:
            loop.call_soon_threadsafe(self._idle.put_nowait, parser)
        except RuntimeError:  # the loop is closed: the server has stopped
            pass

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the parser processes: asked to exit, then terminated, then killed, each
        step with a deadline. A body being parsed fails with 503. Idempotent; blocks."""
        self._closed = True
        for p in self._parsers:
            p.stop(timeout_s)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def pids(self) -> list[int]:
        """The parser processes' ids (for operators and fault-injection tests)."""
        return [pid for p in self._parsers if (pid := p.pid) is not None]

    def stats(self) -> dict:
        """Counters: processes, busy (parsing now), waiting, parsed, replaced, and the
        parser processes' peak resident memory (bytes; ``ready_rss_bytes``: after start-up)."""
        parsers = list(self._parsers)
        busy = sum(p.busy for p in parsers)
        return {"processes": len(parsers), "busy": busy, "waiting": max(0, self._admitted - busy),
                "parsed": sum(p.parsed for p in parsers), "replaced": sum(p.replaced for p in parsers),
                "ready_rss_bytes": max((p.ready_rss for p in parsers), default=0),
                "peak_rss_bytes": max((p.peak_rss for p in parsers), default=0)}


def _overloaded(message: str) -> Exception:
    """503 with Retry-After: the service's Overloaded (the service imports this module)."""
    from timeshare.errors import Overloaded

    return Overloaded(message, 1)


class _Watchdog:
    """Kills ``proc`` unless the block ends within ``seconds``: every send or receive on
    its pipe then ends with an error, so no wait outlasts the deadline."""

    def __init__(self, proc, seconds: float):
        self.expired = False
        self._proc = proc
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        self.expired = True
        self._proc.kill()

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


class _OutOfStep(Exception):
    """A reply that answers another request than the one sent: the pipe cannot be trusted."""


class _Parser:
    """One parser process and the server's end of its pipe: one exchange at a time
    (``_lock``), every one under a watchdog that kills the process at its deadline, so
    no wait on the pipe outlasts it."""

    def __init__(self, index: int):
        self.index = index
        self._lock = threading.Lock()
        self._proc: SpawnProcess | None = None
        self._conn: Connection | None = None  # our end of its pipe (set and cleared with _proc)
        self._ready = False  # its start-up message was read
        self._seq = 0
        self._stopping = False
        self.busy = False
        self.parsed = 0
        self.replaced = 0
        self.ready_rss = 0
        self.peak_rss = 0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.is_alive() else None

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=parser_main, args=(theirs,), name=f"timeshare-parser-{self.index}", daemon=True)
        proc.start()
        theirs.close()  # only the child holds its end: its death is our EOF, ours its EOF
        self._proc, self._conn, self._ready = proc, ours, False

    def parse(self, body: bytes, header_length: str | None, timeout_s: float):
        """In a pool thread: one exchange with the process (started if needed); its
        start-up has STARTUP_TIMEOUT_S, the parse itself ``timeout_s``."""
        where = f"request parser {self.index}"
        with self._lock:
            if self._stopping:
                raise _overloaded("the server is shutting down")
            if self._proc is None:
                self._spawn()
            proc, conn = self._proc, self._conn
            assert proc is not None and conn is not None
            startup, watchdog = _Watchdog(proc, STARTUP_TIMEOUT_S), _Watchdog(proc, timeout_s)
            self.busy = True
            try:
                if not self._ready:
                    with startup:
                        _, _pid, self.ready_rss = conn.recv()
                    self._ready = True
                with watchdog:
                    reply, tensors = self._exchange(conn, body, header_length)
            except (EOFError, OSError, _OutOfStep) as exc:
                code = self._replace()
                if isinstance(exc, _OutOfStep):
                    raise WorkerError(f"{exc}; it was replaced", where=where) from None
                if startup.expired or watchdog.expired:
                    took = f"start within {STARTUP_TIMEOUT_S}" if startup.expired else f"finish within {timeout_s}"
                    raise WorkerTimeoutError(f"the request parser did not {took} s; it was replaced",
                                             where=where) from None
                raise WorkerCrashedError(f"the request parser process died (exit code {code}) while parsing this "
                                         f"request's {len(body)} bytes; it was replaced", where=where) from None
            finally:
                self.busy = False
        if reply[1] == "bad":
            raise BadRequest(reply[2])
        if reply[1] == "oom":
            raise _overloaded(f"the request parser ran out of memory on a body of {len(body)} bytes")
        if reply[1] == "error":  # a bug of ours
            raise TimeshareError(f"the request parser failed: {reply[2]}", where=where)
        self.parsed += 1
        return reply[2], tensors

    def _exchange(self, conn, body: bytes, header_length: str | None):
        """Send the body; the reply, and the tensors that follow an "ok" one (the
        messages: ``server/parser_process.py``)."""
        self._seq += 1
        conn.send((self._seq, header_length, len(body)))
        conn.send_bytes(body)
        reply = conn.recv()
        if reply[0] != self._seq:
            raise _OutOfStep(f"the request parser answered request {reply[0]}, not {self._seq}")
        tensors: dict[str, torch.Tensor] = {}
        if reply[1] == "ok":
            _, _, _, specs, self.peak_rss = reply
            for name, datatype, shape, nbytes in specs:
                buf = bytearray(nbytes)
                conn.recv_bytes_into(buf)
                dtype = TORCH_DTYPES[datatype]
                tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes \
                    else torch.empty(shape, dtype=dtype)
        return reply, tensors

    def _replace(self) -> int | None:
        """Kill and reap the process (it is dead or out of step), then start a new one
        so the next body finds it starting. Returns the old one's exit code."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self.replaced += 1
        code = None
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
            code = proc.exitcode
        if not self._stopping:
            self._spawn()
        return code

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        if not self._lock.acquire(timeout=0):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the body it parses fails with 503; the exchange then lets go
            if not self._lock.acquire(timeout=timeout_s):
                log.error("request parser %d did not let go within %.0f s", self.index, timeout_s)
                return
        try:
            proc, conn = self._proc, self._conn
            self._proc = self._conn = None
            if proc is None:
                return
            assert conn is not None, "_conn is set and cleared with _proc"
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout_s)
            for end in (proc.terminate, proc.kill):
                if proc.is_alive():
                    end()
                    proc.join(timeout_s)
            conn.close()
        finally:
            self._lock.release()
