"""A registration's arguments checked and made into a ``ModelSpec`` (``Runtime.register``);
building and packing the model is the executors' side (``executor/packing.py``). Runs
in the controller.
"""

from __future__ import annotations

import torch

from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError
from timeshare.models.spec import Builder, ModelSpec
from timeshare.scheduler.task import Priority

__all__ = ["model_spec", "parse_dtype"]


def model_spec(name: str, build: Builder, weights, example_inputs, example_kwargs: dict | None,
               dtype: str | torch.dtype | None, priority: Priority | str,
               slo_s: float | None) -> tuple[ModelSpec, Priority]:
    """A registration's arguments checked (``Runtime.register`` says what each is)."""
    try:
        priority = Priority.parse(priority)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if slo_s is not None and not slo_s > 0:
        raise ConfigError(f"slo_s must be positive, got {slo_s!r}")
    if not isinstance(name, str) or not all(name.split("/")):
        raise ConfigError(f"model name must be a non-empty string, '/' only between parts (as 'org/model'), "
                          f"got {name!r}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    spec = ModelSpec(name, build, weights, example_inputs, dict(example_kwargs or {}), parse_dtype(dtype))
    return spec, priority
