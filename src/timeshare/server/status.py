"""What an error becomes for the HTTP client: :func:`served_error` turns a failed device
call into the request's fault or the server's, :func:`status_of` gives any error its
status code (``STATUS``) and :func:`retry_headers` its Retry-After, and
:func:`failure_of` says whether a model's failure to load is permanent or transient
(NOTE [Permanent and transient failures]). Runs in the server's process: the first in
the service's pool threads, the others on the event loop.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from timeshare.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    DeviceError,
    DuplicateModelError,
    LoadFailed,
    MemoryBudgetError,
    ModelError,
    ModelTooLargeError,
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


def retry_headers(exc: BaseException, status: int) -> dict[str, str] | None:
    """Every 503 says when to come back (a full queue knows; a worker being replaced or a
    model waiting for room takes about a second), except a model that failed for good:
    coming back does not help it (NOTE [Permanent and transient failures])."""
    if status != 503 or isinstance(exc, LoadFailed):
        return None
    return {"Retry-After": str(getattr(exc, "retry_after", 1))}


# NOTE [Permanent and transient failures]
# A model (or language model) that failed to load records why, as a ``ModelFailure`` of
# one of two kinds. Permanent: waiting cannot cure it (its builder cannot be imported or
# raises, its weights are missing, corrupt or do not match the module, it is larger than
# the whole budget, its own code raised on its example inputs); requests get 503 without
# Retry-After and the cause (``LoadFailed``), and with ``server.exit_on_error`` the server
# exits at start-up. Transient: the machinery failed under it (a worker crashed or hung,
# a load ran out of time, no room while others held the memory); requests get 503 with
# Retry-After and the service loads it again after a back-off. Either way the server is
# not ready while a model that is not ``optional`` cannot serve, and readiness names it.
class FailureKind(enum.Enum):
    PERMANENT = "permanent"
    TRANSIENT = "transient"


@dataclass(frozen=True, slots=True)
class ModelFailure:
    """Why a model cannot serve: its kind and the cause, as the error said it."""

    kind: FailureKind
    cause: str

    @property
    def permanent(self) -> bool:
        return self.kind is FailureKind.PERMANENT

    def describe(self) -> str:
        """The cause with its kind in front ("permanent: WeightsError: ...")."""
        return f"{self.kind.value}: {self.cause}"


def failure_of(exc: BaseException) -> ModelFailure:
    """The failure a model's load ended with, classified (NOTE [Permanent and transient
    failures])."""
    return ModelFailure(_kind_of(exc), f"{type(exc).__name__}: {exc}")


def _kind_of(exc: BaseException) -> FailureKind:
    if isinstance(exc, (UnknownModelError, DuplicateModelError)):  # a race with the repository's operations
        return FailureKind.TRANSIENT
    if isinstance(exc, (ConfigError, DeviceError, ModelError, ModelTooLargeError, LoadFailed)):
        return FailureKind.PERMANENT  # the builder, the weights, the size: fixed only by the user
    if isinstance(exc, RemoteError) and exc.in_task:  # the model's own code, in a worker
        name = exc.remote_type.rsplit(".", 1)[-1]
        return FailureKind.TRANSIENT if name in OUT_OF_MEMORY else FailureKind.PERMANENT
    if isinstance(exc, TimeshareError):  # a worker lost, a deadline, no room now, a full queue
        return FailureKind.TRANSIENT
    # Not ours: the model's own code raised in this process (its forward on the example
    # inputs, or an import its builder made), except when memory ran out.
    return FailureKind.TRANSIENT if type(exc).__name__ in OUT_OF_MEMORY else FailureKind.PERMANENT
