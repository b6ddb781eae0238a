"""A training job's offload moves every piece of its state off the device and back,
0-dim optimizer state included, and training then goes on exactly as if it had not."""

from __future__ import annotations

import torch
from torch import nn

from tests import models
from timeshare.worker.trainer import TrainingTask


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _task() -> TrainingTask:
    net = _net()
    adam = torch.optim.Adam(net.parameters(), lr=1e-2)
    return TrainingTask(net, adam, models.offload_batches(), models.mse_step, None, device=torch.device("cpu"),
                        offload=True, seed=3)


def _state(task: TrainingTask) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in task.model.state_dict().items()}
    for i, state in enumerate(task.optimizer.state.values()):
        out.update({f"opt.{i}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    for name, p in task.model.named_parameters():
        if p.grad is not None:
            out[f"grad.{name}"] = p.grad
    return out


def test_offload_copies_every_tensor_and_restore_brings_each_back_unchanged():
    task = _task()
    for _ in range(3):
        task.step_once()
    before = {k: v.clone() for k, v in _state(task).items()}
    originals = _state(task)
    assert any(v.dim() == 0 for v in originals.values())  # Adam's step: 0-dim state is part of the check
    task.preempted()
    assert task.offloaded and task.stats.offloads == 1
    moved = _state(task)
    assert moved.keys() == before.keys()
    for key, value in moved.items():
        assert value is not originals[key] and value.data_ptr() != originals[key].data_ptr(), key  # a copy
        assert torch.equal(value, before[key]), key
    task.restore()
    assert not task.offloaded
    for key, value in _state(task).items():
        assert value.device == before[key].device and value.dtype == before[key].dtype, key
        assert torch.equal(value, before[key]), key
    # The optimizer still updates the model's own parameters (its references were kept).
    assert all(p in task.optimizer.state for p in task.model.parameters())


def test_training_preempted_with_offload_ends_exactly_like_an_uninterrupted_run():
    plain, offloaded = _task(), _task()
    for i in range(6):
        plain.step_once()
        offloaded.step_once()
        if i % 2 == 0:
            offloaded.preempted()  # the next step brings it back
    assert offloaded.stats.offloads == 3
    for (k, a), (_, b) in zip(sorted(_state(plain).items()), sorted(_state(offloaded).items()), strict=True):
        assert torch.equal(a, b), k
