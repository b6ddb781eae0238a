"""Packing a registered model for the executors: built on the CPU, its weights checked
against the module and packed into one host buffer (a :class:`~timeshare.transfer.host_store.HostStore`), the
floating tensors converted to the requested dtype. With a host budget the store is
backed by disk (``build_tiered``, NOTE [Host tier]). Runs in the controller, outside
the runtime's lock (building and reading weights take seconds for large models).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from timeshare.errors import ConfigError, ModelError
from timeshare.memory.allocator import DEFAULT_ALIGNMENT
from timeshare.models.binding import TensorLayout, bind, collect
from timeshare.models.spec import ModelSpec, build_module
from timeshare.models.weights import apply_weights, is_file_source, match_file, read_weights
from timeshare.transfer.backing import Backing, FileBacking, HostPages, SpillBacking
from timeshare.transfer.disk import SafetensorsIndex
from timeshare.transfer.host_store import HostStore, TensorEntry, aligned_offsets
from timeshare.transfer.profiler import ExecutionOrder, trace_execution_order
from timeshare.tree import map_tensors
from timeshare.worker.profiling import owners_of


def build_and_pack(spec: ModelSpec) -> tuple[nn.Module, TensorLayout, HostStore]:
    """The module in eval mode, its layout, and its weights packed into a host store
    (not pinned: the executor decides where the store lives)."""
    module, layout = _build(spec)
    current = layout.tensors()
    tensors = current if spec.weights is None else apply_weights(layout, current, read_weights(spec.weights))
    tensors = _converted(spec, layout, tensors)
    store = HostStore.pack(layout.entries, tensors, pin=False)
    return module, layout, store


@dataclass
class Tiered:
    """A registration under a host budget (NOTE [Host tier]): the store laid out in
    execution order in pages of its own, filled or not, and what refills it."""

    module: nn.Module
    layout: TensorLayout
    store: HostStore
    pages: HostPages
    order: ExecutionOrder
    backing: Backing
    filled: bool


def build_tiered(spec: ModelSpec, spill_dir: Path) -> Tiered:
    """Register under a host budget. From a safetensors file only its header is read
    (names, shapes and dtypes checked against the module): the store stays empty until
    a load needs it, and the file is its backing. Otherwise the store is filled from the
    weights given, and written to ``spill_dir`` the first time it is dropped. The
    execution order is traced at registration, on the host, from the store as it is
    (zeros when empty: only the order in which tensors are used matters), so the store
    is laid out in that order once and never moves (the executor may move it to pages
    of its own before anything maps it: ``Executor.pack_tiered``)."""
    if not spec.example_inputs and not spec.example_kwargs:
        raise ConfigError(f"model {spec.name!r}: with a host budget, register() needs example_inputs (the "
                          "execution order is traced at registration, so that the store never moves)")
    module, layout = _build(spec)
    current = layout.tensors()
    lazy = is_file_source(spec.weights)
    backing: Backing
    if lazy:
        files = [spec.weights] if isinstance(spec.weights, (str, os.PathLike)) else spec.weights
        index = SafetensorsIndex.read_many(files)  # type: ignore[arg-type]
        sources, kept, tied = match_file(layout, index, current)
        if spec.dtype is not None:
            _cast(layout, spec.dtype)
        kept = {k: v.to(_entry(layout, k).dtype) for k, v in kept.items()}
        backing = FileBacking(index, sources, kept, tied)
        tensors = None
    else:
        tensors = current if spec.weights is None else apply_weights(layout, current, read_weights(spec.weights))
        tensors = _converted(spec, layout, tensors)
        backing = SpillBacking(spill_dir / f"{_file_name(spec.name)}-{uuid.uuid4().hex[:8]}.store")
    scratch = HostStore.laid_out(layout.entries, HostPages(_span(layout.entries)).tensor)
    if tensors is not None:
        for e in scratch.entries:
            scratch.tensor(e.key).copy_(tensors[e.key])
    del tensors
    order = trace_on_host(module, layout, scratch, spec)
    by_key = {e.key: e for e in layout.entries}
    pages = HostPages(_span(layout.entries))
    store = HostStore.laid_out([by_key[k] for k in order.key_order()], pages.tensor)
    if not lazy:
        for e in store.entries:
            store.tensor(e.key).copy_(scratch.tensor(e.key))
    return Tiered(module, layout, store, pages, order, backing, filled=not lazy)


def tiered_copy(name: str, module: nn.Module, layout: TensorLayout, store: HostStore, order: ExecutionOrder,
                spill_dir: Path) -> Tiered:
    """A copy of a store already laid out in execution order (a model's own tensors under
    deduplication, NOTE [Shared tensors under a host budget]) in droppable pages of its
    own, filled, with a spill file written the first time it is dropped."""
    pages = HostPages(store.nbytes)
    copy = HostStore(store.entries, pages.tensor, store.alignment)
    copy.buffer.copy_(store.buffer)
    backing = SpillBacking(spill_dir / f"{_file_name(name)}-{uuid.uuid4().hex[:8]}.store")
    return Tiered(module, layout, copy, pages, order, backing, filled=True)


def _build(spec: ModelSpec) -> tuple[nn.Module, TensorLayout]:
    module = build_module(spec.name, spec.build)
    module.eval()
    layout = collect(module)
    if not layout.entries:
        raise ModelError(f"model {spec.name!r} has no parameters or buffers to manage")
    return module, layout


def _converted(spec: ModelSpec, layout: TensorLayout, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if spec.dtype is None:
        return tensors
    _cast(layout, spec.dtype)
    return {e.key: tensors[e.key].to(e.dtype) for e in layout.entries}


def _entry(layout: TensorLayout, key: str) -> TensorEntry:
    return next(e for e in layout.entries if e.key == key)


def _span(entries: list[TensorEntry]) -> int:
    return aligned_offsets([e.nbytes for e in entries], DEFAULT_ALIGNMENT)[1]


def trace_on_host(module: nn.Module, layout: TensorLayout, store: HostStore, spec: ModelSpec) -> ExecutionOrder:
    """The execution order from one forward on the CPU, with the module bound to ``store``."""
    bind(layout, store.state())
    spans = store.spans(store.buffer.data_ptr())
    args = map_tensors(spec.example_inputs, lambda t: t.to("cpu"))
    kwargs = map_tensors(spec.example_kwargs, lambda t: t.to("cpu"))
    with torch.no_grad():
        order, _ = trace_execution_order(module, args, kwargs, spans, owners_of(layout))
    return order


def _cast(layout: TensorLayout, dtype: torch.dtype) -> None:
    """The layout's floating tensors in ``dtype``, but for buffers outside the state dict:
    constants a model computes for itself (a rotary table's inverse frequencies, kept in
    float32 by transformers, as its ``from_pretrained`` leaves them) keep their dtype, so
    that a model registered in bfloat16 computes what ``transformers`` computes."""
    layout.entries = [_with_dtype(e, dtype) if layout.persistent.get(e.key, True) else e for e in layout.entries]


def _with_dtype(e: TensorEntry, dtype: torch.dtype) -> TensorEntry:
    if not e.dtype.is_floating_point:
        return e
    return TensorEntry(e.key, e.names, e.kind, e.shape, dtype, e.requires_grad, e.offset)


def _file_name(model: str) -> str:
    """A model's name as part of a file name ("org/model" -> "org--model")."""
    return model.replace("/", "--")
