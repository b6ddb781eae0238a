"""What the admin plane accepts of a training job submitted through it: bounds on its
batch, its iterations and its memory. Pure functions; run in the server's process.

Jobs of the config file are the operator's own and are not held to these bounds; the
number of jobs running at once (``admin.max_training_jobs``) counts them all
(``TrainingJobs.submit``, ``server/jobs.py``).
"""

from __future__ import annotations

from timeshare.config import AdminConfig, TrainingConfig
from timeshare.errors import BadRequest
from timeshare.models.zoo import get as zoo_get
from timeshare.units import format_bytes

# Parameters, their gradients and SGD's momentum, in fp32 (models/workloads.py's sgd).
TRAINING_BYTES_PER_PARAMETER = 3 * 4


def training_state_bytes(model: str) -> int:
    """A lower bound of what a training job of zoo ``model`` holds on the device: its
    parameters, gradients and optimizer state; activations come on top."""
    return TRAINING_BYTES_PER_PARAMETER * zoo_get(model).parameters


def check_training(cfg: TrainingConfig, admin: AdminConfig, *, budget_bytes: int) -> None:
    """Raise :class:`BadRequest` (400) naming the bound a submitted job exceeds:
    ``admin.max_training_batch``, ``admin.max_training_iterations``, or the device
    memory budget (``budget_bytes``, the runtime's) for its state alone."""
    job = f"training job {cfg.name!r}"
    if cfg.batch > admin.max_training_batch:
        raise BadRequest(f"{job}: batch {cfg.batch} is over the limit of {admin.max_training_batch} "
                         "(admin.max_training_batch)")
    limit = admin.max_training_iterations
    if limit is not None and cfg.iterations is None:
        raise BadRequest(f"{job}: give 'iterations' (at most {limit}, admin.max_training_iterations); jobs that run "
                         "until cancelled come from the config file")
    if limit is not None and cfg.iterations is not None and cfg.iterations > limit:
        raise BadRequest(f"{job}: {cfg.iterations} iterations are over the limit of {limit} "
                         "(admin.max_training_iterations)")
    need = training_state_bytes(cfg.model)
    if need > budget_bytes:
        raise BadRequest(f"{job}: model {cfg.model!r} needs at least {format_bytes(need)} for its parameters, "
                         f"gradients and optimizer state, more than the device memory budget of "
                         f"{format_bytes(budget_bytes)} (runtime.memory)")
