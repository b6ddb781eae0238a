"""What an error becomes for the HTTP client: :func:`served_error` turns a failed device
call into the request's fault or the server's, and :func:`status_of` gives any error its
status code (``STATUS``). Runs in the server's process: the first in the service's pool
threads, the second in the routes.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

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


def status_of(exc: BaseException) -> int:
    if isinstance(exc, HTTPException):
        return exc.status_code
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return 500
