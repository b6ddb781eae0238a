"""The whole of ``timeshare.yaml`` (``Config``): its sections, the checks across them
(distinct names, what a cluster allows), and reading and validating the file, with an
error that names each bad field as a path and the value it got. Runs in the server's
process (and the command line's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from timeshare.config.cluster import ClusterConfig
from timeshare.config.fields import Strict
from timeshare.config.runtime import RuntimeConfig
from timeshare.config.server import AdminConfig, ServerConfig
from timeshare.config.workloads import LLMConfig, ModelConfig, TrainingConfig
from timeshare.errors import ConfigError
from timeshare.options import describe

_UNION_TAG = re.compile(r"^(int|str|float|bool|none|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|literal\[.*\]"
                        r"|constrained-\w+)$")


class Config(Strict):
    """The whole of ``timeshare.yaml``."""

    runtime: RuntimeConfig = RuntimeConfig()
    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    models: list[ModelConfig] = []
    llms: list[LLMConfig] = []
    training: list[TrainingConfig] = []
    cluster: ClusterConfig | None = None
    """Null: one runtime in the server's process (the usual case)."""

    @model_validator(mode="after")
    def _consistent(self):
        names = [m.name for m in self.models] + [m.name for m in self.llms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be distinct; repeated: {dup}")
        if self.cluster is not None:
            if any(m.pinned for m in self.llms):
                raise ValueError("cluster: language models cannot be pinned on a cluster")
            pinned = [m.name for m in self.models if m.pinned]
            if pinned:
                raise ValueError(f"cluster: models cannot be pinned on a cluster (the router places them); "
                                 f"pinned: {pinned}")
            if self.runtime.device not in ("cpu", "cuda") or self.runtime.memory == "auto":
                raise ValueError("cluster: give runtime.device ('cpu', or 'cuda': each replica's own GPU) and "
                                 "runtime.memory (each replica's budget), not 'auto'")
        jobs = [t.name for t in self.training]
        dup = sorted({n for n in jobs if jobs.count(n) > 1})
        if dup:
            raise ValueError(f"training job names must be distinct; repeated: {dup}")
        if self.training and self.runtime.workers == 1:
            raise ValueError("runtime.workers: training with workers needs at least 2 (or 0 for in-process)")
        return self


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate a parsed YAML document; a :class:`ConfigError` names every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"(runtime, server, admin, models, llms, training, cluster), got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(describe(e, _UNION_TAG) for e in exc.errors())) from None


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate ``timeshare.yaml``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(p)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return parse_config(data, str(p))


DEFAULT_CONFIG = Path(__file__).parents[1] / "default.yaml"
"""The embedded default: the zoo models and a training job (``timeshare demo``)."""
