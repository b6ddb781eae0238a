"""Modules whose inputs and outputs exercise a worker's tensor channel (NOTE [Tensor
channel]): nested outputs of every common dtype and layout, echoes, large inputs.
Importable, so that worker processes can rebuild them."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch import nn

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Heads:
    logits: torch.Tensor
    extra: tuple
    label: str = "heads"


class Nested(nn.Module):
    """Answers a dict of tensors of many dtypes and layouts, in tuples, named tuples and a
    dataclass; takes keyword tensors too (a mask, ids, a transposed matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, *, mask=None, ids=None, side=None):
        y = self.fc(x)
        out = {
            "y": y,
            "t": y.t(),  # a transposed view: its strides travel
            "pos": y > 0,
            "half": y.half(),
            "bf16": y.bfloat16(),
            "long": (y * 100).long(),
            "total": y.sum(),  # 0-dim
            "none": y[:0],  # empty
            "pair": Pair(y[:, :2], (y.double(), 3)),
            "heads": Heads(y.relu(), (y.exp(), "tag")),
        }
        if mask is not None:
            out["masked"] = y * mask.to(y.dtype).unsqueeze(-1)
        if ids is not None:
            out["picked"] = y[ids]
        if side is not None:
            out["side"] = side @ self.fc.weight.t()  # a transposed input: its layout kept
        return out


def nested() -> Nested:
    torch.manual_seed(0)
    return Nested()


class Echo(nn.Module):
    """Answers an output as large as its input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((), 1.5))

    def forward(self, x, *, delay_s: float = 0.0):
        if delay_s:
            import time

            time.sleep(delay_s)
        return x * self.scale


def echo() -> Echo:
    return Echo()


class Reader(nn.Module):
    """Reads every byte of a large input and answers a few numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 10)

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


def reader() -> Reader:
    torch.manual_seed(0)
    return Reader()
