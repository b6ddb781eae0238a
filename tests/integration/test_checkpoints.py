"""NOTE [Checkpoints]: a training job paused, checkpointed and resumed on another runtime
ends bitwise equal to the same job never interrupted."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

import timeshare
from timeshare.errors import ConfigError
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get

ITERATIONS = 8


def varying_batches():
    """A different batch every iteration (seeded by its index): the data's position matters."""
    i = 0
    while True:
        yield zoo_get("tiny_cnn").example_inputs(4, seed=i)
        i += 1


def held(data, gate: str):
    """``data``'s batches, the fifth held back until the file ``gate`` exists (at most a
    minute): the job is surely still running meanwhile (a file: it works across processes)."""
    for i, batch in enumerate(data()):
        if i == 4:
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        yield batch


def dropout_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))


def varying_vectors():
    i = 0
    while True:
        yield (torch.randn(4, 8, generator=torch.Generator().manual_seed(i)),)
        i += 1


CNN = {**TrainingWorkload.parse("tiny_cnn:4").train_args(), "data": varying_batches}
# Dropout draws from the job's random state: resuming must carry it.
DROPOUT = {**CNN, "model": dropout_net, "data": varying_vectors}


def _paused(job, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while job.status != "paused":
        assert time.monotonic() < deadline, job.status
        time.sleep(0.005)


def _whole_then_checkpointed(rt, work) -> tuple[dict, list, dict, int]:
    """The job run whole on ``rt`` (its weights and losses), then the same job paused
    after a few iterations: its checkpoint and the iterations it holds."""
    whole = rt.train("whole", **work, iterations=ITERATIONS, seed=3)
    assert whole.wait(120) and whole.error is None
    want, want_losses = whole.state_dict(), list(whole.stats.losses)
    gate = Path(tempfile.mkdtemp(prefix="timeshare-gate-")) / "open"
    part = rt.train("part", **(work | {"data": functools.partial(held, work["data"], str(gate))}),
                    iterations=ITERATIONS, seed=3)
    while part.stats.iterations < 3:
        time.sleep(0.001)
    with pytest.raises(ConfigError, match="pause it"):
        part.checkpoint()  # running (held before its fifth batch): no consistent state to take
    part.pause()
    gate.touch()
    _paused(part)
    shutil.rmtree(gate.parent)
    done = part.stats.iterations
    assert 3 <= done < ITERATIONS
    cp = part.checkpoint()
    assert cp["iterations"] == done
    part.cancel()
    return want, want_losses, cp, done


def _resumed(rt, work, cp: dict, want: dict):
    """The job resumed on ``rt`` from ``cp``, ended with ``want``'s weights; its handle."""
    moved = rt.train("part", **work, iterations=ITERATIONS, seed=3, resume=cp)
    assert moved.wait(120) and moved.error is None
    got = moved.state_dict()
    assert moved.stats.iterations == ITERATIONS
    assert all(torch.equal(got[k], want[k]) for k in want)
    return moved


@pytest.mark.parametrize("WORK", [CNN, DROPOUT], ids=["cnn", "dropout"])
def test_a_job_resumed_on_another_runtime_ends_as_if_never_interrupted(WORK):
    with timeshare.Runtime(device="cpu", memory="16MiB") as rt:
        want, want_losses, cp, _ = _whole_then_checkpointed(rt, WORK)
    with timeshare.Runtime(device="cpu", memory="16MiB") as other:
        moved = _resumed(other, WORK, cp, want)
        assert list(moved.stats.losses) == want_losses
        # A checkpoint of another job's shape, or not a checkpoint, is refused clearly.
        with pytest.raises(ConfigError, match="does not fit this job's model"):
            other.train("bad", **WORK, iterations=ITERATIONS, seed=3,
                        resume=dict(cp, model={"nope": torch.zeros(1)}))
        with pytest.raises(ConfigError, match="not a training checkpoint"):
            other.train("bad2", **WORK, iterations=ITERATIONS, seed=3, resume={"model": {}})
        assert "bad" not in other.jobs() and "bad2" not in other.jobs()


def test_a_job_in_a_worker_process_is_checkpointed_and_resumed_in_another_pool():
    """The checkpoint comes from the worker that holds the job's state (``GetJobState``
    with ``full``); resumed in another runtime's workers, the job ends as if never
    interrupted (compared with the same job run whole in worker processes)."""
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2) as rt:
        want, want_losses, cp, done = _whole_then_checkpointed(rt, DROPOUT)
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2) as other:
        moved = _resumed(other, DROPOUT, cp, want)
        assert list(moved.stats.losses)[-(ITERATIONS - done):] == want_losses[-(ITERATIONS - done):]
