"""The exception tree of timeshare. Runs in every process.

Every error timeshare raises derives from :class:`TimeshareError`::

    TimeshareError
     ├── ConfigError              a value given by the user is invalid (also a ValueError)
     ├── DeviceError              the requested device is not usable here
     ├── ModelError               something is wrong with a registered model
     │    ├── UnknownModelError   no model of that name is registered (also a KeyError)
     │    ├── DuplicateModelError the name is taken
     │    └── WeightsError        weights missing, corrupt, or not matching the module
     ├── MemoryBudgetError        a model cannot be placed in the device arena
     │    ├── ModelTooLargeError  the model alone is larger than the whole budget
     │    └── LaneExceededError   a task's ephemeral memory outgrew its lane
     ├── PipelineError            a pipelined load failed or did not finish in time
     ├── GenerationError          a language model's step could not give its tokens
     ├── WorkerError              a worker process failed a task (recoverable: a new
     │    │                       worker takes its place)
     │    ├── WorkerCrashedError  the worker process died
     │    ├── WorkerTimeoutError  the worker did not answer before the deadline
     │    └── RemoteError         the task's own code raised in the worker
     └── ServingError             the HTTP server refuses or cannot answer a request
          ├── BadRequest          the request is malformed (400)
          ├── Unavailable         the model cannot take requests now (503, Retry-After)
          │    └── LoadFailed     it failed to load for good (503, no Retry-After)
          ├── Overloaded          its queue is full or the server is stopping (503)
          ├── Timeout             no answer within the request timeout (504)
          └── Conflict            the operation conflicts with the current state (409)

Errors carry ``where``: a short human description of the place they happened
("loading resnet152, group 14"), so that an error re-raised in another process
still says where it came from.
"""

from __future__ import annotations


class TimeshareError(Exception):
    """Root of every error raised by timeshare."""

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        if self.where:
            return f"{self.message} (at {self.where})"
        return self.message


class ConfigError(TimeshareError, ValueError):
    """An argument or configuration value is invalid; the message names the value."""


class DeviceError(TimeshareError):
    """The requested device does not exist or cannot be used on this machine."""


class ModelError(TimeshareError):
    """A registered model is unusable."""


class UnknownModelError(ModelError, KeyError):
    """No model of that name is registered."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return TimeshareError.__str__(self)


class DuplicateModelError(ModelError):
    """A model of that name is already registered."""


class WeightsError(ModelError):
    """Weights are missing, unreadable, or do not match the module's tensors."""


class MemoryBudgetError(TimeshareError):
    """A model cannot be placed in the device arena."""


class ModelTooLargeError(MemoryBudgetError):
    """A model needs more bytes than the whole arena holds."""

    def __init__(self, model: str, needed: int, capacity: int, what: str | None = None):
        super().__init__(
            f"{what or f'model {model!r}'} needs {needed:,} bytes of device memory but the whole "
            f"arena holds only {capacity:,} bytes; raise Runtime(memory=...)"
        )
        self.model = model
        self.needed = needed
        self.capacity = capacity


class LaneExceededError(MemoryBudgetError):
    """A task's ephemeral memory outgrew its lane (NOTE [Salus lanes]): it fails alone,
    and the tasks in other lanes go on."""

    def __init__(self, task: str, lane: int | None, lane_bytes: int, asked: int):
        where = f"lane {lane}" if lane is not None else "its lane"
        super().__init__(
            f"task {task!r} asked for {asked:,} bytes of ephemeral memory but {where} holds {lane_bytes:,}; "
            "its profile is smaller than this request (a larger input?): profile it for these inputs"
        )
        self.task = task
        self.lane = lane
        self.lane_bytes = lane_bytes
        self.asked = asked
        self.init_args = (task, lane, lane_bytes, asked)  # crosses processes as data (protocol.ErrorInfo)

    def __reduce__(self):
        return (type(self), self.init_args)


class PipelineError(TimeshareError):
    """A pipelined weight load failed, or a group did not arrive before its deadline."""


class GenerationError(TimeshareError):
    """A language model's step could not give its tokens: NaN logits, a step that wrote
    no keys and values for a layer, a step its pages or limits do not allow."""



class WorkerError(TimeshareError):
    """A worker process failed a task. The runtime replaces the worker; the error says
    which worker, which task and what it was doing."""


class WorkerCrashedError(WorkerError):
    """The worker process died (killed, or crashed in native code)."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer before the deadline; it was killed and replaced."""


class RemoteError(WorkerError):
    """An exception raised inside the worker. ``remote_type`` and ``remote_traceback``
    describe it as it was raised there; ``in_task`` is true when the task's own code
    raised it (the model's forward, a training step), false when the worker's handling of
    the message did (a fault of timeshare's)."""

    def __init__(self, message: str, *, where: str | None = None, remote_type: str = "",
                 remote_traceback: str = "", in_task: bool = False):
        super().__init__(message, where=where)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.in_task = in_task


class ServingError(TimeshareError):
    """The HTTP server refuses or cannot answer a request; the subclass says how
    (``server/status.py`` maps each to its status code)."""


class BadRequest(ServingError):
    """The request is malformed (HTTP 400); the message says what and where."""


class Unavailable(ServingError):
    """The model exists but cannot take requests now: the server is starting, or the model
    is unloaded or failed to load (HTTP 503 with Retry-After: the server's state, not the
    request, is at fault)."""

    retry_after = 1


class LoadFailed(Unavailable):
    """The model failed to load for a cause that waiting does not cure: its builder cannot
    be imported or raises, its weights are missing, corrupt or do not match the module, it
    is larger than the whole budget. Answered with 503 but no Retry-After (as Triton and
    KServe answer a model that is not ready), and the cause; it serves again only once
    the cause is fixed and the model is loaded again."""


class Overloaded(ServingError):
    """The queue is full or the server is stopping (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Timeout(ServingError):
    """No answer within ``server.request_timeout_s`` (HTTP 504)."""


class Conflict(ServingError):
    """The operation conflicts with the current state (HTTP 409)."""
