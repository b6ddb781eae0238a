"""Background training workloads, for the benchmarks and the server's admin plane: any
zoo model trained on a synthetic objective (the mean square of its outputs) with SGD, on
one fixed random batch. Every piece is a top-level function, so a worker process can
rebuild it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from timeshare.errors import ConfigError, ModelError
from timeshare.models.zoo import get as zoo_get
from timeshare.tree import tensors_in


@dataclass(frozen=True)
class TrainingWorkload:
    model: str
    batch: int

    @classmethod
    def parse(cls, text: str) -> TrainingWorkload:
        """"resnet152:64" -> ResNet-152 at batch 64."""
        name, _, batch = text.partition(":")
        zoo_get(name)  # an unknown model fails here, with the list of known ones
        try:
            b = int(batch or 8)
        except ValueError:
            raise ConfigError(f"training workload {text!r}: the batch after ':' must be an integer") from None
        if b < 1:
            raise ConfigError(f"training workload {text!r}: batch must be at least 1")
        return cls(name, b)

    def __str__(self) -> str:
        return f"{self.model}:{self.batch}"

    def train_args(self) -> dict:
        """Keyword arguments for ``Runtime.train`` (model, optimizer, data, step)."""
        return dict(model=zoo_get(self.model).builder, optimizer=sgd,
                    data=functools.partial(synthetic_batches, self.model, self.batch), step=synthetic_step)


def sgd(params, lr: float = 1e-4) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def synthetic_batches(model: str, batch: int) -> Iterator[tuple]:
    inputs = zoo_get(model).example_inputs(batch, seed=1)
    while True:
        yield inputs


def synthetic_step(model, optimizer, batch) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    out = model(*batch)
    terms = [t.float().pow(2).mean() for t in tensors_in(out) if t.is_floating_point()]
    if not terms:  # sum() of nothing is the int 0, which has no backward()
        raise ModelError(f"{type(model).__name__} has no floating-point output to train on")
    loss = sum(terms[1:], terms[0])  # sum(terms) less its exact ``0 +``: the same additions, in order
    loss.backward()
    optimizer.step()
    return loss.detach()
