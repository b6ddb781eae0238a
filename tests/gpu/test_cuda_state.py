"""CUDA: a training job's offload and the arena's IPC handles. Marked ``cuda``;
skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import models
from timeshare.worker.trainer import TrainingTask

pytestmark = pytest.mark.cuda


def _task(device) -> TrainingTask:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    # capturable: Adam keeps its 0-dim ``step`` on the device, which offload must carry both ways
    adam = torch.optim.Adam(net.parameters(), lr=1e-2, capturable=True)
    return TrainingTask(net, adam, models.offload_batches(), models.mse_step, None, device=device, offload=True,
                        seed=3)


def _optimizer_tensors(task):
    return [v for state in task.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def test_offload_takes_every_optimizer_tensor_off_the_device_and_brings_each_back():
    device = torch.device("cuda")
    task, plain = _task(device), _task(device)
    for _ in range(2):
        task.step_once()
        plain.step_once()
    zero_dim = [v for v in _optimizer_tensors(task) if v.dim() == 0]
    assert zero_dim and all(v.is_cuda for v in zero_dim)
    task.preempted()
    tensors = _optimizer_tensors(task) + [p for p in task.model.parameters()] + list(task.model.buffers())
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    task.restore()
    assert all(t.is_cuda for t in _optimizer_tensors(task) + list(task.model.parameters()))
    for _ in range(3):
        task.step_once()
        plain.step_once()
    for a, b in zip(_optimizer_tensors(task), _optimizer_tensors(plain), strict=True):
        assert a.device == b.device and torch.equal(a, b)
    for a, b in zip(task.model.state_dict().values(), plain.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
