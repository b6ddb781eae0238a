"""What a user registers: how to build the module, its weights, example inputs.
Pure data plus builder resolution; runs in every process that builds modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from timeshare.errors import ConfigError, ModelError

Builder = Callable[[], nn.Module] | str


def resolve_builder(build: Builder) -> Callable[[], nn.Module]:
    """Turn a callable or a "package.module:function" string into a callable."""
    if callable(build):
        return build
    if not isinstance(build, str) or build.count(":") != 1:
        raise ConfigError(f"build must be a callable or a 'module:function' string, got {build!r}")
    mod_name, fn_name = build.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {mod_name!r} for build {build!r}: {exc}") from exc
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"build {build!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def build_module(name: str, build: Builder) -> nn.Module:
    fn = resolve_builder(build)
    try:
        module = fn()
    except Exception as exc:
        raise ModelError(f"building model {name!r} failed: {exc!r}", where=f"build of {name}") from exc
    if not isinstance(module, nn.Module):
        raise ModelError(f"build for model {name!r} returned {type(module).__name__}, not a torch.nn.Module")
    return module


@dataclass
class ModelSpec:
    """A registered model, as given by the user."""

    name: str
    build: Builder
    weights: object = None
    example_inputs: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype | None = None
