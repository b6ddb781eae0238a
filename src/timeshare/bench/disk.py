"""``timeshare bench disk``: the first inference of a model whose weights are only on disk
(NOTE [Disk to device]). Runs in the CLI's process.

For each model, with the file's pages dropped from the page cache before every cold run
(``posix_fadvise(DONTNEED)``; no root needed):
- the disk itself: a plain sequential read of the weights file (buffered, one thread),
  the same with the reader's threads, and timeshare's reader alone (``read_ranges``),
  buffered and with O_DIRECT (NOTE [Direct reads]): the bandwidth the disk stage is held
  to; ``direct_io`` makes the runtime read with O_DIRECT;
- plain PyTorch: ``safetensors.torch.load_file`` + ``load_state_dict`` + ``.to(device)``
  on a module built beforehand (building is not timed), then the first inference;
- timeshare: the model registered under a host budget, profiled once, then evicted from
  device and host memory (``Runtime.evict(host=True)``); the cold call streams the file
  group by group while earlier groups are copied and computed, into a store page-locked
  on CUDA before the reads (NOTE [Locked host tier]; ``store_pinned`` says so). Its disk
  stage is the reads' own time (first read to last);
- the floor: max(file bytes / sequential bandwidth, the resident model's inference).
Outputs are compared bitwise with plain PyTorch's.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from timeshare.bench.common import native_call, outputs_equal
from timeshare.bench.environment import describe
from timeshare.device import resolve_device, synchronize
from timeshare.errors import ConfigError
from timeshare.models.weights import load_strictly
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.facade import Runtime
from timeshare.transfer.disk import READ_CHUNK, READ_THREADS, FileReader

DEFAULT_MODELS = ("resnet152", "inception_v3", "bert_base")


@dataclass
class DiskBenchConfig:
    models: Sequence[str] = field(default=DEFAULT_MODELS)
    batch: int | None = None  # default: 8 on CUDA, 1 on the CPU
    device: str = "auto"
    repeats: int = 3
    memory: str = "auto"
    direct_io: bool = False  # NOTE [Direct reads]: the runtime's reads with O_DIRECT


def drop_cached(path: Path) -> None:
    """The file's pages out of the page cache (clean pages only: it is not being written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential_read(path: Path, threads: int = 1, chunk: int = READ_CHUNK) -> float:
    """Seconds to read the whole file cold into one buffer with plain ``preadv`` calls of
    ``chunk`` bytes spread over ``threads`` threads: the disk's own bandwidth."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(offset: int, view: memoryview) -> None:
            done = 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], offset + done)

        return _read_whole(path, threads, chunk, read)
    finally:
        os.close(fd)


def reader_read(path: Path, direct: bool) -> tuple[float, bool]:
    """Seconds for timeshare's reader (its chunks and threads; ``direct``: O_DIRECT where
    possible) to read the whole file cold, and whether its reads were direct."""
    reader = FileReader(path, direct=direct)
    try:
        return _read_whole(path, READ_THREADS, READ_CHUNK, reader.read), reader.direct
    finally:
        reader.close()


def _read_whole(path: Path, threads: int, chunk: int, read: Callable[[int, memoryview], None]) -> float:
    """Seconds for ``read(offset, view)`` over the whole file in ``chunk`` pieces on
    ``threads`` threads, into one buffer, the file's pages out of the page cache before
    and after."""
    from concurrent.futures import ThreadPoolExecutor

    view = torch.empty(path.stat().st_size, dtype=torch.uint8).numpy().data.cast("B")
    chunks = [(off, view[off:off + chunk]) for off in range(0, len(view), chunk)]
    drop_cached(path)
    try:
        t0 = time.perf_counter()
        if threads <= 1:
            for c in chunks:
                read(*c)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda c: read(*c), chunks))
        return time.perf_counter() - t0
    finally:
        drop_cached(path)


def run(config: DiskBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    if config.repeats < 1 or (config.batch is not None and config.batch < 1):
        raise ConfigError("repeats and batch must be at least 1")
    for name in config.models:
        zoo_get(name)  # unknown names fail before any work
    device = resolve_device(config.device)
    batch = config.batch or (8 if device.type == "cuda" else 1)
    rows = [_one(name, device, batch, config, progress) for name in config.models]
    return {"environment": describe(device), "config": {"models": list(config.models), "batch": batch,
                                                         "repeats": config.repeats, "memory": config.memory,
                                                         "read_threads": READ_THREADS,
                                                         "direct_io": config.direct_io,
                                                         "read_chunk_bytes": READ_CHUNK},
            "rows": rows}


def _one(name: str, device: torch.device, batch: int, config: DiskBenchConfig,
         progress: Callable[[str], None]) -> dict:
    zoo = zoo_get(name)
    path = weights_path(name)
    size = path.stat().st_size
    inputs = zoo.example_inputs(batch, torch.float32)

    progress(f"{name}: the disk's own bandwidth")
    seq_s = statistics.median(sequential_read(path) for _ in range(config.repeats))
    par_s = statistics.median(sequential_read(path, threads=READ_THREADS) for _ in range(config.repeats))
    reader_s = statistics.median(reader_read(path, False)[0] for _ in range(config.repeats))
    direct_runs = [reader_read(path, True) for _ in range(config.repeats)]
    direct_s = statistics.median(s for s, _ in direct_runs)

    progress(f"{name}: plain PyTorch (load_file + load_state_dict + to)")
    base_load, base_total, reference = [], [], None
    for _ in range(config.repeats):
        module = zoo.build().eval()
        drop_cached(path)
        synchronize(device)
        t0 = time.perf_counter()
        state = load_file(str(path))
        load_strictly(module, state, name)  # load_state_dict, tied weights named once in the file
        module = module.to(device)
        synchronize(device)
        t1 = time.perf_counter()
        out = native_call(module, inputs, device)
        synchronize(device)
        base_load.append(t1 - t0)
        base_total.append(time.perf_counter() - t0)
        reference = out
        del module, state

    progress(f"{name}: timeshare, cold from disk")
    cold, disk, exact = [], [], True
    with Runtime(device, config.memory, host_memory=int(size * 1.5), direct_io=config.direct_io) as rt:
        rt.register(name, zoo.builder, path, inputs)
        outputs_equal(rt.infer(name, *inputs), reference)  # the first load traces and profiles
        ready = []
        for _ in range(config.repeats):
            t0 = time.perf_counter()
            rt.infer(name, *inputs)
            ready.append(time.perf_counter() - t0)
        for _ in range(config.repeats):
            rt.evict(name, host=True)
            drop_cached(path)
            before = rt.snapshot().host_tier
            t0 = time.perf_counter()
            out = rt.infer(name, *inputs)
            cold.append(time.perf_counter() - t0)
            after = rt.snapshot().host_tier
            assert before is not None and after is not None, "the runtime was opened with host_memory"
            assert after.streamed_fills == before.streamed_fills + 1, "the cold call did not stream"
            disk.append(after.read_seconds - before.read_seconds)
            exact = exact and outputs_equal(out, reference)
        pinned = rt.snapshot().host_pinned_bytes > 0  # the store the cold calls copied from (the only one)
    seq_bw = size / seq_s
    ours, disk_s, ready_s = statistics.median(cold), statistics.median(disk), statistics.median(ready)
    floor = max(size / seq_bw, ready_s)
    return {
        "model": name, "bytes": size,
        "sequential_read_GBps": seq_bw / 1e9, "parallel_read_GBps": size / par_s / 1e9,
        "reader_GBps": size / reader_s / 1e9, "direct_reader_GBps": size / direct_s / 1e9,
        "direct_reader_was_direct": all(d for _, d in direct_runs), "store_pinned": pinned,
        "baseline_load_s": statistics.median(base_load), "baseline_first_inference_s": statistics.median(base_total),
        "ready_inference_s": ready_s,
        "cold_first_inference_s": ours, "cold_samples_s": cold,
        "disk_stage_s": disk_s, "disk_stage_GBps": size / disk_s / 1e9,
        "disk_stage_of_sequential": (size / disk_s) / seq_bw,
        "speedup_vs_baseline": statistics.median(base_total) / ours,
        "floor_s": floor, "over_floor": ours / floor,
        "bitwise_equal": exact,
    }


def plot(result: dict, path) -> None:
    """Per model: plain PyTorch's cold first inference, timeshare's, its disk stage, the
    floor and the resident model, in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = result["rows"]
    series = [("plain PyTorch (load_file + load_state_dict + to + infer)", "baseline_first_inference_s"),
              ("timeshare, cold from disk", "cold_first_inference_s"), ("its disk stage", "disk_stage_s"),
              ("floor: max(bytes / sequential read, ready)", "floor_s"), ("ready (resident)", "ready_inference_s")]
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(rows), 4))
    for i, (label, key) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [r[key] for r in rows], width, label=label)
    ax.set_xticks(x, [f"{r['model']}\n{r['bytes'] / 1e6:.0f} MB" for r in rows])
    ax.set_ylabel("seconds")
    env = result["environment"]
    ax.set_title(f"cold first inference from disk on {env['device']} ({env.get('gpu') or env.get('cpu') or ''})",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
