"""Mapping a function over the tensors inside nested outputs: tuples, lists, dicts,
named tuples and dataclasses. Pure; runs anywhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# NOTE [Walks on the fast path]
# Every call walks its inputs and outputs a few times (to the host, into the tensor
# channel, back out of it). The plain containers are told by their exact type first, and
# rebuilt with comprehensions; scalars and strings end the walk at once; named tuples,
# subclasses and dataclasses then take the general path. Same results, fewer steps.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    kind = type(obj)
    if kind is torch.Tensor:
        return fn(obj)
    if kind is tuple:
        return tuple([map_tensors(x, fn) for x in obj])
    if kind is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()} if obj else {}
    if kind is list:
        return [map_tensors(x, fn) for x in obj]
    if kind in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return kind(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return kind(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return kind((k, map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def map_instances(obj: Any, cls: type, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every instance of ``cls`` inside it replaced by ``fn(instance)``, over
    the same structures as ``map_tensors`` (an instance that is itself a dataclass is a
    leaf, not opened)."""
    kind = type(obj)
    if kind is cls:
        return fn(obj)
    if kind is tuple:
        return tuple([map_instances(x, cls, fn) for x in obj])
    if kind is dict:
        return {k: map_instances(v, cls, fn) for k, v in obj.items()} if obj else {}
    if kind is list:
        return [map_instances(x, cls, fn) for x in obj]
    if kind in _LEAVES and not issubclass(kind, cls):
        return obj
    if isinstance(obj, cls):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return kind(*(map_instances(x, cls, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return kind(map_instances(x, cls, fn) for x in obj)
    if isinstance(obj, dict):
        return kind((k, map_instances(v, cls, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_instances(getattr(obj, f.name), cls, fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(obj, visit)
    return found


def shape_key(args: tuple, kwargs: dict) -> str:
    """A stable description of the inputs' tensor shapes and dtypes, for plan caching."""
    parts = []
    for i, a in enumerate(args):
        parts += [f"{i}:{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in tensors_in(a)]
    for k in sorted(kwargs):
        parts += [f"{k}:{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in tensors_in(kwargs[k])]
    return ",".join(parts) or "()"
