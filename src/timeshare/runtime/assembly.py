"""Putting a runtime together from its options (validated already, ``timeshare.options``):
the arena reserved, the dispatcher and the executor started. Everything here runs once,
in ``Runtime.__init__``.
"""

from __future__ import annotations

import os

import torch

from timeshare.errors import ConfigError, MemoryBudgetError
from timeshare.executor.inprocess import InProcessExecutor
from timeshare.executor.interface import Executor
from timeshare.executor.pool import ProcessPool
from timeshare.executor.pool_executor import PoolExecutor
from timeshare.memory import Arena
from timeshare.memory.ephemeral import cores
from timeshare.options import RuntimeOptions
from timeshare.runtime.dispatch import Dispatcher
from timeshare.transfer.copy import make_copy_engine
from timeshare.units import format_bytes, parse_bytes


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


def make_dispatcher(opts: RuntimeOptions, device: torch.device, arena: Arena) -> Dispatcher:
    """The dispatcher; with "pack", over lanes of ``lane_memory`` bytes (NOTE [Lanes in the
    runtime]), ``lane_threads`` cores each, at most ``lane_slots`` at a time (NOTE [Lanes
    at once])."""
    lanes = lane_budget(device, arena, opts.lane_memory) if opts.scheduling == "pack" else None
    threads = opts.lane_threads or max(1, cores() // 2)
    # NOTE [Lanes at once]: with workers, one lane per worker (a worker runs one call at
    # a time). In-process on the CPU, the lanes are threads of one interpreter: more of
    # them than the cores hold only take turns for cores and the interpreter's lock, and
    # were slower than FIFO (bench lanes, 8 small models on 2 cores: 0.93x FIFO with 8
    # lanes at once, 1.20x with 2). On CUDA the kernels of each lane's stream overlap:
    # as many as memory allows.
    slots = opts.lane_slots
    if slots is None:
        slots = opts.workers or (max(1, cores() // threads) if device.type == "cpu" else None)
    return Dispatcher(opts.scheduling, time_slice_s=opts.time_slice_s, lane_memory=lanes, slots=slots,
                      lane_threads=threads)


def make_executor(opts: RuntimeOptions, device: torch.device, arena: Arena) -> Executor:
    """Models run in this process (no workers) or in ``opts.workers`` worker processes."""
    if opts.direct_host_access and device.type == "cuda":
        raise ConfigError("direct_host_access is not available on CUDA yet (it needs a device-visible mapping of "
                          "the pinned host copies, NOTE [Direct host access])")
    group_bytes = parse_bytes(opts.fixed_group_bytes, what="fixed_group_bytes")
    if not opts.workers:
        engine = make_copy_engine(device, opts.load_timeout_s, opts.copy_delay_s)
        return InProcessExecutor(device, arena, engine, profile_repeats=opts.profile_repeats,
                                 fixed_group_bytes=group_bytes, direct_host_access=opts.direct_host_access)
    pool = ProcessPool(opts, device=str(device), share_arena=arena.share, arena_capacity=arena.capacity)
    return PoolExecutor(device, pool)
