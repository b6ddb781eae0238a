"""The runtime's options, defined once (``RuntimeOptions``): ``timeshare.Runtime`` takes
them as keyword arguments or as one record, and ``timeshare.yaml``'s ``runtime`` section
is the same record read from YAML (``config/runtime.py`` adds only what the server needs).
Each option is validated here, once, with an error that names it; its default and its
documentation are written here only. Also the base of every section of the YAML file
(``Strict``) and the way a validation error is told (``describe``).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from timeshare.errors import ConfigError
from timeshare.scheduler.eviction import EVICTION_POLICIES
from timeshare.scheduler.policies import POLICIES
from timeshare.transfer.planner import STRATEGIES
from timeshare.units import parse_bytes

DEFAULT_TASK_TIMEOUT_S = 300.0
"""A worker's deadline for a call or a training iteration when none is given (a server
gives its request timeout instead)."""
# A language model's LoRA adapters on the device at once (``max_loras``; vLLM's
# --max-loras is 1 by default, S-LoRA holds many): here because the config checks
# ``max_cpu_loras`` against it and the controller sizes slots by it.
DEFAULT_MAX_LORAS = 8


def serves_adapters(adapters: int, max_loras: int | None, lora_dir: object | None, max_cpu_loras: int | None) -> bool:
    """Whether a language model serves LoRA adapters (and gets adapter slots): it has
    ``adapters`` (a count), or any of the options of serving them is given."""
    return adapters > 0 or max_loras is not None or lora_dir is not None or max_cpu_loras is not None


class Strict(BaseModel):
    """A record of options: unknown fields are errors (a typo never falls back to a
    default), values are frozen, defaults are validated too, and each field's docstring
    is its description."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True)


def bytes_field(value: Any, what: str) -> int:
    """A byte size given as a number or with a unit ("64MiB"), as pydantic's error on failure."""
    try:
        return parse_bytes(value, what=what)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _integer(value: Any, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be a {'positive' if low == 1 else 'non-negative'} integer, got {value!r}")
    return value


def _known(value: Any, known: Any, what: str) -> str:
    name = value.lower() if isinstance(value, str) else value
    if name not in known:
        raise ValueError(f"unknown {what} {value!r}; known: {sorted(known)}")
    return name


class RuntimeOptions(Strict):
    """How one device is shared: ``timeshare.Runtime``'s options, and ``timeshare.yaml``'s
    ``runtime`` section."""

    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    memory: int | str = "auto"
    """The arena, the device memory for model weights: bytes or "4GiB"; "auto" takes half
    the free device memory on CUDA and an eighth of RAM (at most 2 GiB) on the CPU."""
    workers: int = 0
    """Worker processes (0: models run in the caller's process). Training jobs with workers
    need at least 2. A worker that does not answer a call within its deadline is killed and
    replaced (NOTE [Call deadlines])."""
    scheduling: str = "priority"
    """Who gets the device next: "priority" (calls preempt training at its next iteration
    boundary), "fifo", "fair", "srtf", "edf", or "pack", which runs the calls and training
    iterations of different memory lanes side by side (Salus's PACK; NOTE [Lanes in the
    runtime])."""
    time_slice_s: float | None = None
    """With "fifo" or "fair": how long a training job keeps the device before waiting
    calls run (FAIR's default: 1 s)."""
    lane_memory: int | str = "auto"
    """With "pack": the bytes for lanes of ephemeral memory (activations) and training jobs'
    state, beside the arena; "auto": as much as the arena (on CUDA at most nine tenths of
    what is free beside it)."""
    lane_threads: int | None = None
    """With "pack" on the CPU: the cores each lane's forward uses (default: half of them)."""
    lane_slots: int | None = None
    """With "pack": how many lanes run at once (default: one per worker with workers; on
    the CPU in the caller's process, the cores over ``lane_threads``, since more threads
    than cores only take turns; on CUDA, as many as memory allows)."""
    eviction: str = "lru"
    """Which resident model leaves when a new one needs room ("lru", "clock",
    "second_chance", "working_set", "cost"), fed with each model's measured load time
    (NOTE [Measured reload times]); on the device, and in host memory under
    ``host_memory``."""
    thrashing: bool = False
    """Thrashing control: while loads take most of the device's time, the models used
    recently are kept resident and each model's requests wait longer to form batches
    (``Runtime.thrashing_factor()``)."""
    strategy: str = "optimal"
    """How loads are grouped: "optimal", "per_layer", "whole" or "fixed" (groups of
    ``fixed_group_bytes``); may be changed later (``Runtime.strategy``)."""
    fixed_group_bytes: int | str = "2MiB"
    """The size of a group under the "fixed" strategy."""
    profile_repeats: int = 3
    """How many times each layer is timed when a model is profiled."""
    host_memory: int | str | None = None
    """A budget for the models' host copies: bytes, "8GiB" or "auto" (half the RAM); None
    (the default): every host copy stays in memory. Under it host memory is a cache over
    disk with the device's eviction policy (NOTE [Host tier]): a model whose weights are a
    safetensors file is read only when a load needs it, others are written once to
    ``spill_dir`` when first dropped. Every model then needs example inputs (its layer
    order is traced at registration)."""
    direct_io: bool = False
    """Under ``host_memory``: read weights and spill files with O_DIRECT where the file
    system allows, bypassing the page cache (NOTE [Direct reads]; buffered reads dropped
    from the cache were the faster on the machines measured)."""
    spill_dir: str | None = None
    """Under ``host_memory``: where host copies with no weights file behind them go when
    dropped (default: a temporary folder, removed at shutdown)."""
    dedup: bool = False
    """Tensors of identical content across models (fine-tuned variants of one base) are
    held once in host memory and once in the arena, and a load copies only those not
    resident (NOTE [Shared tensors]); needs example inputs at registration."""
    direct_host_access: bool | None = None
    """Leading embedding layers may be computed from the host copy instead of copied first,
    when the profile says it is cheaper (NOTE [Direct host access]). None: on the CPU, where
    host memory is the device's; not available on CUDA yet."""
    load_timeout_s: float = 60.0
    """The longest a load's copies may take before the load fails."""
    task_timeout_s: float | None = None
    """With workers: a worker that does not answer a call (or a training iteration) within
    this many seconds is killed and replaced; also the deadline of a kind of call not seen
    yet. Must exceed the slowest training iteration. None: 300 s, and in a server its
    ``request_timeout_s``, so that a hung worker costs at most one request deadline."""
    task_deadline_factor: float = 10.0
    """Once a kind of call has been answered, its deadline is this many times the slowest
    recent call of that kind (load or resident, and training iterations alike), at least
    ``task_deadline_min_s`` and at most ``task_timeout_s``: a hung worker is found in
    seconds, not a request timeout."""
    task_deadline_min_s: float = 5.0
    """The shortest deadline a call gets, whatever its history."""
    startup_timeout_s: float = 120.0
    """The longest a worker process may take to start."""
    poison_evicted: bool = False
    """A diagnostic for checks of exactness, never for serving (NOTE [Poisoned reloads]):
    an evicted model's block is overwritten with NaN bytes, so that a load that skipped a
    group's wait reads poison instead of the old bytes left there."""
    copy_delay_s: float = 0.0
    """A diagnostic: every group's copy starts this much later."""

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return str(value) if isinstance(value, torch.device) else value

    @field_validator("memory", "lane_memory", "host_memory", "fixed_group_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any, info) -> Any:
        if value == "auto" and info.field_name != "fixed_group_bytes" or value is None and info.field_name == \
                "host_memory":
            return value
        if bytes_field(value, info.field_name) <= 0 and info.field_name != "fixed_group_bytes":
            raise ValueError(f"{info.field_name} must be positive, got {value!r}")
        return value

    @field_validator("workers", "lane_threads", "lane_slots", "profile_repeats", mode="before")
    @classmethod
    def _integers(cls, value: Any, info) -> Any:
        if value is None and info.field_name in ("lane_threads", "lane_slots"):
            return value
        _integer(value, info.field_name, 0 if info.field_name == "workers" else 1)
        if info.field_name == "workers" and value > 64:
            raise ValueError(f"workers must be at most 64, got {value}")
        return value

    @field_validator("time_slice_s", "load_timeout_s", "task_timeout_s", "task_deadline_min_s", "startup_timeout_s")
    @classmethod
    def _positive(cls, value: float | None, info) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(f"{info.field_name} must be positive, got {value}")
        return value

    @field_validator("copy_delay_s", "task_deadline_factor")
    @classmethod
    def _at_least(cls, value: float, info) -> float:
        low, words = (0, "must not be negative") if info.field_name == "copy_delay_s" else (1, "must be at least 1")
        if value < low:
            raise ValueError(f"{info.field_name} {words}, got {value}")
        return value

    @field_validator("scheduling", mode="before")
    @classmethod
    def _scheduling(cls, value: Any) -> str:
        return _known(value, POLICIES, "scheduling policy")

    @field_validator("eviction", mode="before")
    @classmethod
    def _eviction(cls, value: Any) -> str:
        return _known(value, EVICTION_POLICIES, "eviction policy")

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> str:
        if value not in STRATEGIES:
            raise ValueError(f"unknown grouping strategy {value!r}; known: {list(STRATEGIES)}")
        return value

    @model_validator(mode="after")
    def _together(self) -> RuntimeOptions:
        if self.direct_io and self.host_memory is None:
            raise ValueError("direct_io applies to reads from disk under a host budget: set host_memory too")
        return self

    @property
    def task_deadline_s(self) -> float:
        """``task_timeout_s``, or its default when none was given."""
        return DEFAULT_TASK_TIMEOUT_S if self.task_timeout_s is None else self.task_timeout_s

    @classmethod
    def of(cls, base: RuntimeOptions | None = None, **changes: Any) -> RuntimeOptions:
        """``base`` (the defaults when None; only this record's fields of a larger one)
        with ``changes``, validated; a ConfigError names each refused option."""
        values = {} if base is None else {name: getattr(base, name) for name in cls.model_fields}
        try:
            return cls.model_validate(values | changes)
        except ValidationError as exc:
            raise ConfigError("; ".join(describe(e) for e in exc.errors())) from None


def describe(error: ErrorDetails, union_tag: Any = None) -> str:
    """One of pydantic's errors as a line: the option's path (``union_tag``: a pattern of
    pydantic's labels of a union's branches, left out of it), then what is wrong and the
    value given. A message of our own that starts with the option's name stands alone."""
    path = ""
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif union_tag is not None and union_tag.match(str(part)):
            continue  # pydantic's label of a union's branch, not one of the user's fields
        else:
            path += f".{part}" if path else str(part)
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown {'field' if union_tag is not None else 'option'}"
    if error["type"] == "missing":
        return f"{path}: required field missing"
    if path and msg.startswith(path.rsplit(".", 1)[-1] + " "):  # names the option, and the value if it must
        return f"{path}: {msg}" if "." in path else msg
    got = error.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None or repr(got) in msg else f" (got {got!r})"
    return f"{path or 'config'}: {msg}{shown}"
