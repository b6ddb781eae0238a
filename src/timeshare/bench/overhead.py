"""``timeshare bench overhead``: what the runtime costs around a forward when nothing is
switched, against plain PyTorch driven the same way. Runs in the CLI's process (and its
workers).

Four parts, each measured in one run beside its own baseline:
- ``single``: one caller, a tiny model resident: plain PyTorch's call, the runtime's
  in-process call and its call through worker processes, in rounds that alternate the
  three so that drift in the machine hits all of them alike (medians of rounds).
- ``threads``: 1, 4 and 16 caller threads over 8 and 42 resident tiny models: requests
  per second and CPU time per request (the process's), against plain PyTorch behind one
  lock (the device is time-shared: one forward at a time) driven by the same threads,
  and behind a fair lock handed over in arrival order (``FairLock``), as the runtime
  hands the device over: ``threading.Lock`` lets the releasing thread take it again and
  starve the others (each client's count is in the JSON).
- ``transfer``: the round trip of a large input (4.8 MB: a batch of 8 at 224x224; 8.6 MB:
  at 299x299) through a head that reads it all and answers a small output, and through
  one that echoes it back: plain PyTorch, in-process, through workers; the floor is one
  copy of the bytes in this process (``memcpy``), measured in the same run.
- ``pack``: one closed-loop client per model over 8 tiny models under ``fifo`` and under
  ``pack`` (Salus's lanes): requests per second and each client's share (none starved).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from timeshare.bench.common import native_call, native_module, outputs_equal
from timeshare.bench.environment import describe
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.facade import Runtime

PARTS = ("single", "threads", "transfer", "pack")
# The two input sizes of the issue: a batch of 8 ResNet-size and Inception-size images.
INPUT_SHAPES = {"4.8MB": (8, 3, 224, 224), "8.6MB": (8, 3, 299, 299)}


@dataclass
class OverheadBenchConfig:
    device: str = "auto"
    model: str = "tiny_mlp"
    workers: int = 2
    rounds: int = 15  # single: alternating rounds, each of ``calls`` calls per way
    calls: int = 200
    threads: tuple[int, ...] = field(default=(1, 4, 16))
    model_counts: tuple[int, ...] = field(default=(8, 42))
    duration_s: float = 1.5  # threads and pack: per measurement
    transfer_repeats: int = 20
    memory: str = "auto"
    lane_memory: str = "auto"
    parts: tuple[str, ...] = PARTS


class InputHead(nn.Module):
    """Reads every byte of its input and answers 10 numbers per image."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 10)

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


class EchoHead(nn.Module):
    """Answers an output as large as its input (scaled by a weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.scale


def input_head() -> nn.Module:
    return InputHead()


def echo_head() -> nn.Module:
    return EchoHead()


_HEADS = {"input": "timeshare.bench.overhead:input_head", "echo": "timeshare.bench.overhead:echo_head"}


def run(config: OverheadBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    unknown = sorted(set(config.parts) - set(PARTS))
    if unknown:
        raise ConfigError(f"unknown parts {unknown}; known: {list(PARTS)}")
    if config.rounds < 1 or config.calls < 1 or config.duration_s <= 0 or config.workers < 1:
        raise ConfigError("rounds, calls and workers must be at least 1, duration_s positive")
    device = resolve_device(config.device)
    result: dict = {"benchmark": "overhead",
                    "config": {**vars(config), "threads": list(config.threads),
                               "model_counts": list(config.model_counts), "parts": list(config.parts)},
                    "environment": {**describe(device), "torch_threads": torch.get_num_threads()}}
    if "single" in config.parts:
        progress("single caller")
        result["single"] = _single(config, device)
    if "threads" in config.parts:
        result["threads"] = [_threads(config, device, n, progress) for n in config.model_counts]
    if "transfer" in config.parts:
        progress("large inputs")
        result["transfer"] = _transfer(config, device)
    if "pack" in config.parts:
        progress("pack against fifo")
        result["pack"] = _pack(config, device)
    return result


# ---------------------------------------------------------------------- single caller
def _single(config: OverheadBenchConfig, device) -> dict:
    zoo = zoo_get(config.model)
    inputs = zoo.example_inputs(1)
    native = native_module(config.model, None, device)
    reference = native_call(native, inputs, device)
    with Runtime(device, config.memory) as local, Runtime(device, config.memory, workers=config.workers) as pooled:
        for rt in (local, pooled):
            rt.register(config.model, zoo.builder, weights_path(config.model), inputs)
            rt.infer(config.model, *inputs)  # resident and profiled
        exact = all(outputs_equal(rt.infer(config.model, *inputs), reference) for rt in (local, pooled))
        ways: dict[str, Callable[[], object]] = {
            "plain_pytorch": lambda: native_call(native, inputs, device),
            "in_process": lambda: local.infer(config.model, *inputs),
            "workers": lambda: pooled.infer(config.model, *inputs),
        }
        samples: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(config.rounds):
            for way, fn in ways.items():
                t0 = time.perf_counter()
                for _ in range(config.calls):
                    fn()
                samples[way].append((time.perf_counter() - t0) / config.calls)
    us = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    return {
        "model": config.model,
        "us_per_call": us,
        "spread_us": {k: (max(v) - min(v)) * 1e6 for k, v in samples.items()},
        "in_process_over_plain_us": us["in_process"] - us["plain_pytorch"],
        "workers_over_in_process_us": us["workers"] - us["in_process"],
        "outputs_exact": exact,
    }


# ---------------------------------------------------------------------- threads
def _threads(config: OverheadBenchConfig, device, n_models: int, progress) -> dict:
    zoo = zoo_get(config.model)
    inputs = zoo.example_inputs(1)
    names = [f"{config.model}_{i}" for i in range(n_models)]
    natives = [native_module(config.model, None, device) for _ in names]
    rows = []
    with Runtime(device, config.memory) as rt:
        for name in names:
            rt.register(name, zoo.builder, weights_path(config.model), inputs)
            rt.infer(name, *inputs)
        lock = threading.Lock()

        fair = FairLock()

        def plain(i: int) -> None:
            with lock:
                native_call(natives[i], inputs, device)

        def plain_fair(i: int) -> None:
            with fair:
                native_call(natives[i], inputs, device)

        for n in config.threads:
            progress(f"{n_models} models, {n} threads")
            ours = _drive(n, n_models, config.duration_s, lambda i: rt.infer(names[i], *inputs))
            base = _drive(n, n_models, config.duration_s, plain)
            handed = _drive(n, n_models, config.duration_s, plain_fair)
            rows.append({"threads": n, "timeshare": ours, "plain_pytorch": base, "plain_pytorch_fair": handed,
                         "req_per_s_vs_plain": ours["req_per_s"] / base["req_per_s"],
                         "req_per_s_vs_plain_fair": ours["req_per_s"] / handed["req_per_s"]})
    one = rows[0]["timeshare"]["cpu_us_per_request"] if rows and rows[0]["threads"] == 1 else None
    for row in rows:
        row["cpu_per_request_vs_one_thread"] = None if one is None else row["timeshare"]["cpu_us_per_request"] / one
    return {"models": n_models, "rows": rows}


class FairLock:
    """One forward at a time in arrival order: the lock is handed to the longest waiter
    (a thread that releases and asks again queues behind the others), as the runtime
    hands the device over. Plain PyTorch behind ``threading.Lock`` is unfair: the thread
    that releases usually takes it again, running many forwards in a row with no switch
    between threads, while others starve."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[threading.Lock] = deque()
        self._busy = False

    def __enter__(self) -> None:
        with self._lock:
            if not self._busy:
                self._busy = True
                return
            waiter = threading.Lock()
            waiter.acquire()
            self._queue.append(waiter)
        waiter.acquire()  # released by the holder, which hands the lock over

    @property
    def waiting(self) -> int:
        """Threads queued for the lock."""
        with self._lock:
            return len(self._queue)

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._queue:
                self._queue.popleft().release()
            else:
                self._busy = False


def _caller(rt: Runtime, names: list[str], inputs: tuple) -> Callable[[int], object]:
    return lambda i: rt.infer(names[i], *inputs)


def _drive(n_threads: int, n_models: int, duration_s: float, call: Callable[[int], object]) -> dict:
    """``n_threads`` closed-loop callers, thread k calling models k, k+n, ... in turn, for
    ``duration_s`` once all are ready: requests per second and process CPU per request."""
    counts = [0] * n_threads
    stop = [0.0]
    cpu = [0.0]

    def begin() -> None:
        stop[0] = time.perf_counter() + duration_s
        cpu[0] = time.process_time()

    line = threading.Barrier(n_threads, action=begin)

    def client(k: int) -> None:
        line.wait(60)
        i, done = k % n_models, 0
        while time.perf_counter() < stop[0]:
            call(i)
            done += 1
            i = (i + n_threads) % n_models
        counts[k] = done

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 120)
        if t.is_alive():
            raise ConfigError("a benchmark client did not finish in time")
    elapsed = time.perf_counter() - (stop[0] - duration_s)
    cpu_s = time.process_time() - cpu[0]
    total = sum(counts)
    return {"requests": total, "req_per_s": total / elapsed, "cpu_us_per_request": cpu_s / max(1, total) * 1e6,
            "per_client": counts}


# ---------------------------------------------------------------------- large inputs
def _transfer(config: OverheadBenchConfig, device) -> dict:
    rows = []
    with Runtime(device, config.memory) as local, Runtime(device, config.memory, workers=config.workers) as pooled:
        for head, builder in _HEADS.items():
            for label, shape in INPUT_SHAPES.items():
                x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
                name = f"{head}_{label}"
                module = getattr(__import__(builder.split(":")[0], fromlist=["_"]), builder.split(":")[1])()
                torch.manual_seed(0)
                for rt in (local, pooled):
                    rt.register(name, builder, module.state_dict(), (x,))
                    rt.infer(name, x)
                native = module.to(device).eval()
                reference = native_call(native, (x,), device)
                exact = all(outputs_equal(rt.infer(name, x), reference) for rt in (local, pooled))
                ways = _transfer_ways(x, native, name, local, pooled, device)
                samples: dict[str, list[float]] = {k: [] for k in ways}
                for _ in range(config.transfer_repeats):
                    for way, fn in ways.items():
                        t0 = time.perf_counter()
                        fn()
                        samples[way].append(time.perf_counter() - t0)
                ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
                rows.append({"head": head, "input": label, "input_bytes": x.numel() * x.element_size(),
                             "ms": ms, "in_process_over_plain_ms": ms["in_process"] - ms["plain_pytorch"],
                             "workers_over_in_process_ms": ms["workers"] - ms["in_process"],
                             "outputs_exact": exact})
                for rt in (local, pooled):
                    rt.unregister(name)
    return {"rows": rows}


def _transfer_ways(x: torch.Tensor, native: nn.Module, name: str, local: Runtime, pooled: Runtime,
                   device) -> dict[str, Callable[[], object]]:
    into = torch.empty_like(x)
    return {
        "memcpy": lambda: into.copy_(x),
        "plain_pytorch": lambda: native_call(native, (x,), device),
        "in_process": lambda: local.infer(name, x),
        "workers": lambda: pooled.infer(name, x),
    }


# ---------------------------------------------------------------------- pack
def _pack(config: OverheadBenchConfig, device) -> dict:
    zoo = zoo_get(config.model)
    inputs = zoo.example_inputs(1)
    n = 8
    names = [f"{config.model}_{i}" for i in range(n)]
    out: dict = {"models": n}
    for mode in ("fifo", "pack"):
        with Runtime(device, config.memory, scheduling=mode, lane_memory=config.lane_memory) as rt:
            for name in names:
                rt.register(name, zoo.builder, weights_path(config.model), inputs)
                rt.infer(name, *inputs)
                rt.infer(name, *inputs)
            r = _drive(n, n, config.duration_s, _caller(rt, names, inputs))
        mean = statistics.fmean(r["per_client"])
        r["min_share_of_mean"] = min(r["per_client"]) / mean if mean else None
        r["max_share_of_mean"] = max(r["per_client"]) / mean if mean else None
        out[mode] = r
    natives = [native_module(config.model, None, device) for _ in names]
    out["plain_pytorch_threads"] = _drive(n, n, config.duration_s, lambda i: native_call(natives[i], inputs, device))
    out["pack_over_fifo"] = out["pack"]["req_per_s"] / out["fifo"]["req_per_s"]
    return out
