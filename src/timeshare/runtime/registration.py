"""Registration: a model built on the CPU, its weights checked against the module and
packed into one host buffer (a :class:`~timeshare.transfer.host_store.HostStore`), the
floating tensors converted to the requested dtype. Runs in the controller, outside the
runtime's lock (building and reading weights take seconds for large models).
"""

from __future__ import annotations

import torch
from torch import nn

from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, ModelError
from timeshare.models.binding import TensorLayout, collect
from timeshare.models.spec import Builder, ModelSpec, build_module
from timeshare.models.weights import apply_weights, read_weights
from timeshare.scheduler.task import Priority
from timeshare.transfer.host_store import HostStore, TensorEntry


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
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"model name must be a non-empty string without '/', got {name!r}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    spec = ModelSpec(name, build, weights, example_inputs, dict(example_kwargs or {}), parse_dtype(dtype))
    return spec, priority


def build_and_pack(spec: ModelSpec) -> tuple[nn.Module, TensorLayout, HostStore]:
    """The module in eval mode, its layout, and its weights packed into a host store
    (not pinned: the executor decides where the store lives)."""
    module = build_module(spec.name, spec.build)
    module.eval()
    layout = collect(module)
    if not layout.entries:
        raise ModelError(f"model {spec.name!r} has no parameters or buffers to manage")
    current = layout.tensors()
    tensors = current if spec.weights is None else apply_weights(layout, current, read_weights(spec.weights))
    if spec.dtype is not None:
        layout.entries = [_with_dtype(e, spec.dtype) for e in layout.entries]
        tensors = {e.key: tensors[e.key].to(e.dtype) for e in layout.entries}
    store = HostStore.pack(layout.entries, tensors, pin=False)
    return module, layout, store


def _with_dtype(e: TensorEntry, dtype: torch.dtype) -> TensorEntry:
    if not e.dtype.is_floating_point:
        return e
    return TensorEntry(e.key, e.names, e.kind, e.shape, dtype, e.requires_grad, e.offset)
