"""Putting a runtime together: its options checked, the arena reserved, the executor
started. Everything here runs once, in ``Runtime.__init__``; a refused option fails
before any memory is taken.
"""

from __future__ import annotations

import os

import torch

from timeshare.errors import ConfigError, MemoryBudgetError
from timeshare.memory import Arena
from timeshare.memory.ephemeral import cores
from timeshare.runtime.dispatch import Dispatcher
from timeshare.runtime.executor import Executor
from timeshare.runtime.inprocess import InProcessExecutor
from timeshare.runtime.pool import ProcessPool
from timeshare.runtime.pool_executor import PoolExecutor
from timeshare.transfer.copy import make_copy_engine
from timeshare.transfer.planner import STRATEGIES
from timeshare.units import format_bytes, parse_bytes


def check_options(*, strategy: str, profile_repeats: int, load_timeout_s: float, task_timeout_s: float,
                  startup_timeout_s: float, task_deadline_min_s: float, task_deadline_factor: float,
                  copy_delay_s: float, workers: object, lane_threads: object = None,
                  lane_slots: object = None) -> None:
    """Raise ConfigError naming the first option out of its range."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown grouping strategy {strategy!r}; known: {list(STRATEGIES)}")
    if profile_repeats < 1:
        raise ConfigError(f"profile_repeats must be at least 1, got {profile_repeats}")
    for what, value in (("load_timeout_s", load_timeout_s), ("task_timeout_s", task_timeout_s),
                        ("startup_timeout_s", startup_timeout_s), ("task_deadline_min_s", task_deadline_min_s)):
        if value <= 0:
            raise ConfigError(f"{what} must be positive, got {value}")
    if copy_delay_s < 0:
        raise ConfigError(f"copy_delay_s must not be negative, got {copy_delay_s}")
    if task_deadline_factor < 1:
        raise ConfigError(f"task_deadline_factor must be at least 1, got {task_deadline_factor}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigError(f"workers must be a non-negative integer, got {workers!r}")
    for name, given in (("lane_threads", lane_threads), ("lane_slots", lane_slots)):
        if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 1):
            raise ConfigError(f"{name} must be a positive integer, got {given!r}")


def lane_budget(device: torch.device, arena: Arena, lane_memory: int | str) -> int:
    """The bytes for lanes of ephemeral memory ("auto": as much as the arena holds, on
    CUDA at most nine tenths of what is free beside it)."""
    if lane_memory != "auto":
        return parse_bytes(lane_memory, what="lane_memory")
    if device.type == "cuda":
        return min(arena.capacity, int(torch.cuda.mem_get_info(device)[0] * 0.9))
    return arena.capacity


def open_arena(device: torch.device, memory: int | str) -> Arena:
    """The arena of ``memory`` bytes ("auto": half the free device memory on CUDA, an
    eighth of RAM and at most 2 GiB on the CPU)."""
    if memory != "auto":
        capacity = parse_bytes(memory, what="memory")
    elif device.type == "cuda":
        capacity = torch.cuda.mem_get_info(device)[0] // 2
    else:
        capacity = min(2 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)
    try:
        return Arena(device, capacity)
    except torch.OutOfMemoryError as exc:
        raise MemoryBudgetError(f"cannot reserve an arena of {format_bytes(capacity)} on {device}: {exc}") from exc


def make_dispatcher(scheduling: str, time_slice_s: float | None, device: torch.device, arena: Arena, *,
                    lane_memory: int | str, workers: int, lane_threads: int | None,
                    lane_slots: int | None = None) -> Dispatcher:
    """The dispatcher; with "pack", over lanes of ``lane_memory`` bytes (NOTE [Lanes in the
    runtime]), ``lane_threads`` cores each, at most ``lane_slots`` at a time (NOTE [Lanes
    at once])."""
    lanes = lane_budget(device, arena, lane_memory) if scheduling == "pack" else None
    threads = lane_threads or max(1, cores() // 2)
    # NOTE [Lanes at once]: with workers, one lane per worker (a worker runs one call at
    # a time). In-process on the CPU, the lanes are threads of one interpreter: more of
    # them than the cores hold only take turns for cores and the interpreter's lock, and
    # were slower than FIFO (bench lanes, 8 small models on 2 cores: 0.93x FIFO with 8
    # lanes at once, 1.20x with 2). On CUDA the kernels of each lane's stream overlap:
    # as many as memory allows.
    if lane_slots is None:
        lane_slots = workers or (max(1, cores() // threads) if device.type == "cpu" else None)
    return Dispatcher(scheduling, time_slice_s=time_slice_s, lane_memory=lanes, slots=lane_slots,
                      lane_threads=threads)


def make_executor(device: torch.device, arena: Arena, workers: int, *, profile_repeats: int,
                  fixed_group_bytes: int, load_timeout_s: float, copy_delay_s: float,
                  direct_host_access: bool | None = None, **pool_options) -> Executor:
    """Models run in this process (``workers == 0``) or in ``workers`` worker processes."""
    if direct_host_access and device.type == "cuda":
        raise ConfigError("direct_host_access is not available on CUDA yet (it needs a device-visible mapping of "
                          "the pinned host copies, NOTE [Direct host access])")
    if not workers:
        engine = make_copy_engine(device, load_timeout_s, copy_delay_s)
        return InProcessExecutor(device, arena, engine, profile_repeats=profile_repeats,
                                 fixed_group_bytes=fixed_group_bytes, direct_host_access=direct_host_access)
    pool = ProcessPool(
        workers, device=str(device), share_arena=arena.share, arena_capacity=arena.capacity,
        profile_repeats=profile_repeats, fixed_group_bytes=fixed_group_bytes,
        load_timeout_s=load_timeout_s, copy_delay_s=copy_delay_s, direct_host_access=direct_host_access,
        **pool_options,
    )
    return PoolExecutor(device, pool)
