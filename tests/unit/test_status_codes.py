"""Whose fault: what the request did wrong is 4xx; a fault of the server (a crashed or
hung worker, no memory, not started, a bug) is 5xx, never 400."""

import pytest

from timeshare.errors import (
    BadRequest,
    Overloaded,
    PipelineError,
    RemoteError,
    TimeshareError,
    Unavailable,
    UnknownModelError,
    WorkerCrashedError,
    WorkerTimeoutError,
)
from timeshare.server.status import served_error, status_of


def _remote(type_name: str, in_task: bool = True) -> RemoteError:
    return RemoteError(f"{type_name}: boom", where="worker 1, run m", remote_type=type_name, in_task=in_task)


@pytest.mark.parametrize("raised, status, kind", [
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 400, BadRequest),  # the model, here
    (_remote("builtins.RuntimeError"), 400, BadRequest),  # the model, in a worker
    (_remote("torch.OutOfMemoryError"), 503, Overloaded),  # no room for this batch now
    (MemoryError(), 503, Overloaded),
    (WorkerCrashedError("worker 3 was killed by signal 9"), 503, WorkerCrashedError),
    (WorkerTimeoutError("worker 3 did not answer within 5 s"), 503, WorkerTimeoutError),
    (PipelineError("group 4 did not arrive"), 503, PipelineError),
    (UnknownModelError("no model named 'x'"), 404, UnknownModelError),
    (TimeshareError("a bug"), 500, TimeshareError),
])
def test_a_failed_call_becomes_the_status_of_whose_fault_it_is(raised, status, kind):
    err = served_error("m", raised)
    assert type(err) is kind
    assert status_of(err) == status
    if kind is BadRequest:
        assert "model 'm' failed on these inputs" in str(err)


def test_server_state_errors_are_503_and_a_remote_error_outside_the_model_is_500():
    assert status_of(Unavailable("model 'm' is not loaded")) == 503  # starting, unloaded or failed to load
    assert status_of(Overloaded("queue full", 3)) == 503
    handling = _remote("builtins.KeyError", in_task=False)  # the worker's handling of the message: a bug
    assert served_error("m", handling) is handling and status_of(handling) == 500
