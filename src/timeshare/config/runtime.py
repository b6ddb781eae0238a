"""The ``runtime`` section of ``timeshare.yaml``: how the device is shared (device, memory
budget, workers, scheduling, lanes, eviction, the host tier, deadlines), as
``timeshare.Runtime``'s arguments. Runs in the server's process.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from timeshare.config.fields import Strict, bytes_field


class RuntimeConfig(Strict):
    """How the device is shared (``timeshare.Runtime``'s arguments)."""

    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    memory: int | str = "auto"
    """The device memory budget for model weights: bytes or "4GiB"; "auto" takes half the
    free device memory on CUDA and an eighth of RAM (at most 2 GiB) on the CPU."""
    workers: Annotated[int, Field(ge=0, le=64)] = 0
    """Worker processes (0: models run in the server's process). Training jobs with
    workers need at least 2."""
    scheduling: Literal["priority", "fifo", "fair", "srtf", "edf", "pack"] = "priority"
    """Who gets the device next; "priority" lets inference preempt training; "pack" runs
    the calls and training iterations of different memory lanes side by side (Salus's
    PACK)."""
    lane_memory: int | str = "auto"
    """With "pack": the bytes for lanes of ephemeral memory (activations) and training
    jobs' state, beside the arena; "auto": as much as the arena."""
    lane_threads: Annotated[int, Field(ge=1)] | None = None
    """With "pack" on the CPU: the cores each lane's forward uses (default: half of them)."""
    lane_slots: Annotated[int, Field(ge=1)] | None = None
    """With "pack": how many lanes run at once (default: one per worker with workers; on
    the CPU in the server's process, the cores over ``lane_threads``; on CUDA, as many as
    memory allows)."""
    time_slice_s: Annotated[float, Field(gt=0)] | None = None
    """With "fifo" or "fair": how long a training job keeps the device before waiting calls run."""
    eviction: Literal["lru", "clock", "second_chance", "working_set", "cost"] = "lru"
    """Which resident model leaves when a new one needs room (on the device, and in host
    memory under ``host_memory``)."""
    host_memory: int | str | None = None
    """A budget for the models' host copies: bytes, "8GiB" or "auto" (half the RAM). Under
    it host memory is a cache over disk: a model whose weights are a safetensors file is
    read from it only when a load needs it, and dropped again under pressure; others are
    written once to ``spill_dir``. Null (the default): every host copy stays in memory.
    With a budget every model needs example inputs (its layer order is traced at
    registration)."""
    direct_io: bool = False
    """Under ``host_memory``: read weights files with O_DIRECT where the file system
    allows, bypassing the page cache (buffered reads, dropped from the cache after each
    read, were the faster on the machines measured)."""
    spill_dir: str | None = None
    """Under ``host_memory``: where host copies with no weights file behind them go when
    dropped (default: a temporary folder, removed at shutdown)."""
    kv_memory: int | str | None = None
    """With ``llms``: how many bytes of the device the key/value caches of language models
    may keep there between their turns; beyond it, the caches of the models that ran least
    recently move to host memory until their next turn. Null: they all stay."""
    dedup: bool = False
    """Tensors of identical content across models (fine-tuned variants of one base model)
    are held once in host memory and once on the device, and a load copies only those not
    resident. Needs no host_memory for now."""
    thrashing: bool = False
    """Thrashing control: while loads take most of the device's time, the models used
    recently are kept resident and each model's requests wait longer to form batches."""
    strategy: Literal["optimal", "per_layer", "whole", "fixed"] = "optimal"
    """How loads are grouped."""
    task_timeout_s: Annotated[float, Field(gt=0)] | None = None
    """A worker that does not answer a task (or a training iteration) within this many
    seconds is killed and replaced. Default: the server's ``request_timeout_s``, so a hung
    worker costs at most one request deadline. Must exceed the slowest training iteration."""
    task_deadline_factor: Annotated[float, Field(ge=1)] = 10.0
    """Once a kind of call has been answered, its deadline is this many times its slowest
    recent call of the same kind (load or resident), at least ``task_deadline_min_s`` and
    at most ``task_timeout_s``: a hung worker is found in seconds, not a request timeout.
    Training iterations get the same rule."""
    task_deadline_min_s: Annotated[float, Field(gt=0)] = 5.0
    """The shortest deadline a call gets, whatever its history."""

    def runtime_kwargs(self, default_task_timeout_s: float) -> dict[str, Any]:
        """``timeshare.Runtime``'s keyword arguments for this section; a task's deadline
        defaults to ``default_task_timeout_s`` (the server's request timeout)."""
        return dict(device=self.device, memory=self.memory, eviction=self.eviction, strategy=self.strategy,
                    workers=self.workers, thrashing=self.thrashing, dedup=self.dedup, scheduling=self.scheduling,
                    time_slice_s=self.time_slice_s, lane_memory=self.lane_memory, lane_threads=self.lane_threads,
                    lane_slots=self.lane_slots, host_memory=self.host_memory, spill_dir=self.spill_dir,
                    direct_io=self.direct_io,
                    task_timeout_s=self.task_timeout_s or default_task_timeout_s,
                    task_deadline_factor=self.task_deadline_factor, task_deadline_min_s=self.task_deadline_min_s)

    @field_validator("memory", "lane_memory", "host_memory", "kv_memory", mode="before")
    @classmethod
    def _memory(cls, v, info):
        if (v == "auto" and info.field_name != "kv_memory") or (v is None and info.field_name in ("host_memory",
                                                                                                   "kv_memory")):
            return v
        bytes_field(v, info.field_name)
        return v
