"""What ``timeshare serve --check`` checks before anything is served: for every model of
a config, its builder imported and its module built (on the meta device, or on the CPU
when the builder needs real tensors, as registration builds it), its weights file's
header read and every tensor's name, shape and dtype matched against the module, and its
bytes against an explicit ``runtime.memory``; for every language model, its directory's
config and tokenizer read, its module built from the config on the meta device and its
shards' headers matched against it. No weight is read and nothing touches a device.
Each model's result is a :class:`ModelCheck`, its failure as data (the error's type and
message). Runs in the CLI's process.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from timeshare.config import Config, LLMConfig, ModelConfig
from timeshare.dtypes import parse_dtype
from timeshare.errors import ModelError, ModelTooLargeError, WeightsError
from timeshare.llm import hfdir
from timeshare.llm.model import open_directory
from timeshare.memory.allocator import DEFAULT_ALIGNMENT
from timeshare.models.binding import TensorLayout, collect
from timeshare.models.spec import Builder, build_module, resolve_builder
from timeshare.models.weights import match_file
from timeshare.server.endpoint import model_source
from timeshare.transfer.host_store import aligned_offsets
from timeshare.transfer.safetensors_index import SafetensorsIndex
from timeshare.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """One model's check: ``problem`` is None when it passed (``detail`` says what was
    checked), else the cause, as the error said it."""

    name: str
    kind: str  # "model" or "language model"
    optional: bool
    problem: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True, slots=True)
class CheckReport:
    """Every model's check, in the config's order (models, then language models)."""

    checks: tuple[ModelCheck, ...]

    @property
    def failed(self) -> list[ModelCheck]:
        """The checks that failed for models that are not optional: a server would not be ready."""
        return [c for c in self.checks if not c.ok and not c.optional]

    @property
    def ok(self) -> bool:
        return not self.failed


def check_config(config: Config) -> CheckReport:
    """Check every model and language model of ``config``."""
    budget = _budget(config)
    checks = [check_model(m, budget) for m in config.models] + [check_llm(m, budget) for m in config.llms]
    return CheckReport(tuple(checks))


def check_model(cfg: ModelConfig, budget: int | None = None) -> ModelCheck:
    """``cfg``'s builder, module and weights header; ``budget``: the arena's bytes, if known."""
    try:
        detail = _check_model(cfg, budget)
    except Exception as exc:  # the builder's own errors included: each is the check's answer
        return ModelCheck(cfg.name, "model", cfg.optional, problem=f"{type(exc).__name__}: {exc}")
    return ModelCheck(cfg.name, "model", cfg.optional, detail=detail)


def check_llm(cfg: LLMConfig, budget: int | None = None) -> ModelCheck:
    """``cfg``'s directory: config, tokenizer, the module built from the config, the shards' headers."""
    try:
        detail = _check_llm(cfg, budget)
    except Exception as exc:
        return ModelCheck(cfg.name, "language model", cfg.optional, problem=f"{type(exc).__name__}: {exc}")
    return ModelCheck(cfg.name, "language model", cfg.optional, detail=detail)


def _check_model(cfg: ModelConfig, budget: int | None) -> str:
    build, weights = model_source(cfg)
    layout = _layout(cfg.name, _built(cfg.name, build))
    nbytes = _fits(cfg.name, layout, cfg.dtype, budget)
    what = f"{len(layout.entries)} tensors, {format_bytes(nbytes)}"
    if weights is None:
        return f"{what}, the module's own values (no weights file)"
    files = weights if isinstance(weights, list) else [weights]  # a directory's shards, or one file
    _match(layout, files)
    return f"{what}, matching {', '.join(str(f) for f in files)}"


def _check_llm(cfg: LLMConfig, budget: int | None) -> str:
    directory = open_directory(cfg.name, cfg.path, cfg.max_context)  # config.json and the tokenizer
    shards = hfdir.shard_files(directory.path)
    with torch.device("meta"):
        module = hfdir.build_causal_lm(str(directory.path))
    layout = _layout(cfg.name, module)
    nbytes = _fits(cfg.name, layout, cfg.dtype, budget)
    _match(layout, shards)
    return f"{len(layout.entries)} tensors, {format_bytes(nbytes)}, matching {len(shards)} shard(s) in {directory.path}"


def _built(name: str, build: Builder) -> nn.Module:
    """The module, built on the meta device (no memory, whatever its size); a builder that
    needs real tensors is built on the CPU, as registration builds it, with its error."""
    fn = resolve_builder(build)  # a ConfigError naming the module that cannot be imported
    try:
        with torch.device("meta"):
            module = fn()
        if isinstance(module, nn.Module):
            return module
    except Exception as exc:
        log.debug("building %s on the meta device failed (%r); building it on the CPU", name, exc)
    return build_module(name, fn)


def _layout(name: str, module: nn.Module) -> TensorLayout:
    layout = collect(module)
    if not layout.entries:
        raise ModelError(f"model {name!r} has no parameters or buffers to manage")
    return layout


def _match(layout: TensorLayout, files: Sequence[str | os.PathLike]) -> None:
    """Every file's header read, and its tensors matched against the module's (the
    errors of registration, each naming the tensor)."""
    for f in files:
        if Path(f).suffix != ".safetensors":
            raise WeightsError(f"weights file {str(f)!r} is not a .safetensors file")
    match_file(layout, SafetensorsIndex.read_many(files), layout.tensors())


def _fits(name: str, layout: TensorLayout, dtype: str | None, budget: int | None) -> int:
    """The model's bytes in the arena (floating tensors in ``dtype``, each aligned);
    ``ModelTooLargeError`` when they exceed ``budget``."""
    target = parse_dtype(dtype)
    sizes = []
    for e in layout.entries:
        element = target if target is not None and e.dtype.is_floating_point else e.dtype
        sizes.append(math.prod(e.shape) * element.itemsize)
    nbytes = aligned_offsets(sizes, DEFAULT_ALIGNMENT)[1]
    if budget is not None and nbytes > budget:
        raise ModelTooLargeError(name, nbytes, budget)
    return nbytes


def _budget(config: Config) -> int | None:
    """``runtime.memory`` in bytes (each replica's, on a cluster); None for "auto"."""
    memory = config.runtime.memory
    if memory == "auto":
        return None
    return parse_bytes(memory, what="runtime.memory")
