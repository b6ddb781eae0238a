"""Builders for the tests of failures at load (issue 34): one that raises, a small model
to write mismatched weights for, and one whose forward runs out of memory while the test
says so (a transient failure the test ends)."""

from __future__ import annotations

import torch
from torch import nn


def raising() -> nn.Module:
    raise RuntimeError("this builder is broken on purpose")


def not_a_module():
    return "a string"


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


class Flaky(nn.Module):
    """A linear layer whose forward raises MemoryError while ``Flaky.failing`` is set."""

    failing = False

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if Flaky.failing:
            raise MemoryError("out of memory (on purpose, while the test says so)")
        return self.fc(x)


def flaky() -> nn.Module:
    torch.manual_seed(0)
    return Flaky()
