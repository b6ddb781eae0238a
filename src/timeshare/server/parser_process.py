"""A parser process's loop, :func:`parser_main`: request bodies in, the request and its
tensors' bytes out (NOTE [Parsing off the event loop], in ``server/parser_pool.py``,
whose pool spawns the process). Runs in the parser process.

Its pipe carries one exchange at a time. At start-up the process sends ``("ready", pid,
peak_rss)``. The server sends ``(seq, header_length, size)`` and then the body's bytes
(``None``: exit); the process answers ``(seq, "ok", request, specs, peak_rss)`` followed
by the bytes of each input, ``specs`` being ``(name, datatype, shape, nbytes)`` per
input, or ``(seq, "bad", message)`` (400), ``(seq, "oom", "")`` (503) or ``(seq,
"error", message)`` (a bug: 500).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys

import torch

from timeshare.errors import BadRequest
from timeshare.server.parsing import build_request, read_body
from timeshare.server.schemas import InferenceRequest

log = logging.getLogger(__name__)


def parser_main(conn) -> None:
    """The loop (spawned by ``server/parser_pool.py``): bodies in, the request and its
    tensors' bytes out, until the server says stop or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the server stops us
    try:
        conn.send(("ready", os.getpid(), _peak_rss()))
        while True:
            msg = conn.recv()
            if msg is None:
                return
            seq, header_length, size = msg
            body: bytearray | str  # declared apart: mypy keeps a declaration's type, but narrows an assignment
            body = bytearray(size)
            conn.recv_bytes_into(body)
            try:
                # Memory (NOTE [Parsing off the event loop]): the bytes go once decoded, the
                # text once parsed, each value list once converted (from_json).
                if header_length is None:
                    body = _decoded(body)
                obj, binary = read_body(body, header_length)
                del body
                req, tensors = build_request(obj, binary)
                del obj, binary
                raws = [_raw(t) for t in tensors.values()]
                specs = [(name, _datatype(req, name), list(t.shape), raw.nbytes)
                         for (name, t), raw in zip(tensors.items(), raws)]
            except BadRequest as exc:
                conn.send((seq, "bad", exc.message))
                continue
            except MemoryError:
                conn.send((seq, "oom", ""))
                continue
            except Exception as exc:  # a bug: reported to the server, which answers 500
                log.exception("parsing a request failed")
                conn.send((seq, "error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send((seq, "ok", req, specs, _peak_rss()))
            for raw in raws:
                conn.send_bytes(raw)
    except (EOFError, OSError):  # the server is gone
        return


def _decoded(body: bytearray) -> bytearray | str:
    """The text of a JSON body, decoded as ``json.loads`` decodes bytes; the bytes
    themselves when they do not decode (``json.loads`` then says why)."""
    try:
        return body.decode(json.detect_encoding(body), "surrogatepass")
    except UnicodeDecodeError:
        return body


def _raw(t: torch.Tensor):
    """A tensor's bytes, without a copy when it is contiguous."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _datatype(req: InferenceRequest, name: str) -> str:
    return next(i.datatype for i in req.inputs if i.name == name)


def _peak_rss() -> int:
    """This process's peak resident memory in bytes: Linux's VmHWM (getrusage's maximum
    would include the server's memory at the fork that preceded the spawn's exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

