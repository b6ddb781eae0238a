"""``timeshare bench lanes``: N small inference models served together in Salus's lanes
(``scheduling="pack"``) against time-slicing them one at a time on the same runtime
(``scheduling="fifo"``). Runs in the CLI's process.

Each model has one closed-loop client thread (a request as soon as the previous one
answered) for ``duration_s`` per mode. Reported per N: aggregate requests per second
in each mode, each client's share of them against the mean, the added latency per
request over each model alone (the mean latency in the mode minus the model's own
latency measured alone, idle runtime), and whether
every output is bitwise equal to the model's output alone. Beside them: plain PyTorch
(the same N modules and threads, no runtime: what concurrency gives without lanes or
bounds) and the hardware bound (the model alone at one core, times min(N, cores)).
Then two training jobs (``train``) packed against FIFO time-slicing: the makespan of
both, and whether each ends with the weights of the same job run alone. The job is run
alone twice first: whether the two alone runs end with the same weights says whether
the training itself repeats bit for bit on this device, without which "packed equals
alone" cannot tell packing from the kernels (``compare_training``). With
``deterministic`` (the default) the training runs with deterministic kernels (NOTE
[Deterministic kernels] in ``device.py``), under which it must.
The timeline (``--plot``) shows each model's forwards in time under PACK.

"Alone" for exactness is the model alone on the same runtime (a lane computes on
``lane_threads`` cores whatever the load, so its bits do not change with the load;
whether they equal plain PyTorch's at the default thread count is reported too).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from timeshare.bench.common import native_call, native_module, outputs_equal
from timeshare.bench.environment import describe
from timeshare.device import cublas_workspace_deterministic, deterministic_kernels, kernel_settings, resolve_device
from timeshare.errors import ConfigError
from timeshare.memory.ephemeral import cores, cpu_share
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime


@dataclass
class LanesBenchConfig:
    model: str = "small_resnet"
    counts: tuple[int, ...] = field(default=(4, 8, 16, 42))
    batch: int = 1
    device: str = "auto"
    duration_s: float = 5.0  # of requests, per mode and count
    memory: str = "auto"
    lane_memory: str = "auto"
    workers: int = 0  # 0: lanes are threads of this process; else worker processes, one lane each at a time
    train: str | None = "small_resnet:8"  # two jobs of this workload, packed vs FIFO (None: skip)
    train_iterations: int = 20
    time_slice_s: float = 0.1  # FIFO time-slicing between the two jobs
    # The training runs with deterministic kernels (NOTE [Deterministic kernels]), so that
    # "packed equals alone" tests packing, not the device's kernels; False: the default ones.
    deterministic: bool = True


def run(config: LanesBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    if not config.counts or min(config.counts) < 1 or config.duration_s <= 0 or config.batch < 1:
        raise ConfigError("counts must be at least 1, duration_s positive, batch at least 1")
    workload = TrainingWorkload.parse(config.train) if config.train else None  # refused before any work
    if config.train_iterations < 1:
        raise ConfigError("train_iterations must be at least 1")
    with cublas_workspace_deterministic() if config.deterministic and workload is not None else nullcontext():
        # Before this process first computes: NOTE [Deterministic kernels].
        return _run(config, workload, progress)


def _run(config: LanesBenchConfig, workload: TrainingWorkload | None, progress: Callable[[str], None]) -> dict:
    device = resolve_device(config.device)
    zoo = zoo_get(config.model)
    inputs = zoo.example_inputs(config.batch)
    progress(f"{config.model} alone")
    native = native_module(config.model, None, device)
    for _ in range(3):  # kernels chosen and caches warm before anything is timed
        reference = native_call(native, inputs, device)
    alone_s = _alone_latency(native, inputs, device, threads=None)
    one_core_s = _alone_latency(native, inputs, device, threads=1)
    rows = []
    timeline: list[dict] = []
    for n in config.counts:
        row: dict = {"models": n}
        for mode in ("fifo", "pack"):
            progress(f"{n} models, {mode}")
            row[mode] = _served(config, device, zoo, inputs, reference, n, mode,
                                timeline if mode == "pack" and n == min(config.counts) else None)
        progress(f"{n} models, plain PyTorch threads")
        row["plain_pytorch_req_per_s"] = _native_threads(native, inputs, device, n, config.duration_s)
        row["bound_req_per_s"] = min(n, cores()) / one_core_s if device.type == "cpu" else None
        row["pack_over_fifo"] = row["pack"]["req_per_s"] / row["fifo"]["req_per_s"]
        rows.append(row)
    training = _training(config, workload, device, progress) if workload is not None else None
    return {
        "benchmark": "lanes",
        "config": {**vars(config), "counts": list(config.counts)},
        "environment": {**describe(device), "cores": cores()},
        "alone_ms": alone_s * 1e3,
        "alone_one_core_ms": one_core_s * 1e3,
        "rows": rows,
        "timeline": timeline,
        "training": training,
        "outputs_exact": all(r[m]["outputs_exact"] for r in rows for m in ("fifo", "pack")),
    }


def _training(config: LanesBenchConfig, workload: TrainingWorkload, device, progress) -> dict:
    """Two jobs of the same workload, ``train_iterations`` each, started together: the
    makespan and aggregate iterations per second under FIFO time-slicing and under PACK,
    and how each job's final weights compare with the same job run alone in that mode,
    itself run twice (``compare_training``). With workers, each job in a worker of its own
    (at least 3: two homes and a standby). With ``deterministic``, every process that
    trains does so with deterministic kernels: this one, and the workers, which take its
    flags when the runtime starts them (``BackendFlags``)."""
    workers = max(3, config.workers) if config.workers else 0
    with deterministic_kernels() if config.deterministic else nullcontext():
        settings = kernel_settings()
        out: dict = {"workload": str(workload), "iterations": config.train_iterations, "workers": workers,
                     "deterministic": config.deterministic, "kernels": settings}
        for mode in ("fifo", "pack"):
            out[mode] = _train_mode(config, workload, device, mode, workers, progress)
    out["alone_repeatable"] = out["fifo"]["alone_repeatable"] and out["pack"]["alone_repeatable"]
    out["packed_equals_alone"] = out["pack"]["equals_alone"]
    out["time_sliced_equals_alone"] = out["fifo"]["equals_alone"]
    out["comparison"] = ("final weights of each job against the same job alone on that runtime, run alone twice "
                         f"first; {_kernels_text(config.deterministic, settings)}")
    out["pack_over_fifo"] = out["pack"]["it_per_s"] / out["fifo"]["it_per_s"]
    return out


def _train_mode(config: LanesBenchConfig, workload: TrainingWorkload, device, mode: str, workers: int,
                progress) -> dict:
    slice_s = config.time_slice_s if mode == "fifo" else None
    args = dict(**workload.train_args(), iterations=config.train_iterations, seed=0)
    with Runtime(device, config.memory, scheduling=mode, lane_memory=config.lane_memory,
                 time_slice_s=slice_s, workers=workers) as rt:
        alone: list[dict[str, torch.Tensor]] = []
        alone_s = []
        for i in range(2):  # twice: does the training itself repeat on this device?
            progress(f"training alone ({i + 1} of 2), {mode}")
            job = rt.train(f"alone{i}", **args)
            t0 = time.perf_counter()
            _finish(job)
            alone_s.append(time.perf_counter() - t0)
            alone.append(job.state_dict())
            rt.forget_job(job.name)  # with workers, its home holds no state of it beside the next jobs
        progress(f"two jobs, {mode}")
        t0 = time.perf_counter()
        jobs = [rt.train(f"job{i}", **args) for i in range(2)]
        for job in jobs:
            _finish(job)
        makespan = time.perf_counter() - t0
        together = [job.state_dict() for job in jobs]
    return {"alone_s": min(alone_s), "makespan_s": makespan, "it_per_s": 2 * config.train_iterations / makespan,
            **compare_training(alone[0], alone[1], together)}


def weights_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    """The largest absolute difference between two state dicts' tensors of one name: 0.0
    exactly when every tensor is equal by ``torch.equal`` (as in ``outputs_equal``), inf
    where they differ by a NaN; None when their names, shapes or dtypes differ."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        return None
    worst = 0.0
    for k in a:
        if not torch.equal(a[k], b[k]):
            diff = (a[k].double() - b[k].double()).abs().max().item()
            worst = max(worst, diff if diff > 0 else float("inf"))  # a NaN on either side
    return worst


def compare_training(alone: dict[str, torch.Tensor], alone_again: dict[str, torch.Tensor],
                     together: list[dict[str, torch.Tensor]]) -> dict:
    """How jobs trained together (packed or time-sliced) compare with the same job alone.

    ``alone_repeatable``: the job alone twice ended with bitwise equal weights, so the
    training repeats on this device; ``equals_alone``: every job trained together ended
    bitwise equal to the first alone run. Only when the first holds does the second test
    the sharing; ``verdict`` says which case it is, and the largest differences are
    beside them (the kernels' rounding is of the order of the last bits; a lost or
    mixed-up update is not)."""
    again = weights_difference(alone, alone_again)
    diffs = [weights_difference(alone, t) for t in together]
    repeatable = again == 0.0
    equal = bool(together) and all(d == 0.0 for d in diffs)
    if not repeatable:
        verdict = "inconclusive: alone twice differs (the kernels do not repeat), so together vs alone says nothing"
    elif equal:
        verdict = "exact: together equals alone, and alone repeats"
    else:
        verdict = "SHARING CHANGES THE WEIGHTS: alone repeats, together differs"
    known = [d for d in diffs if d is not None]
    return {"alone_repeatable": repeatable, "alone_max_abs_diff": again, "equals_alone": equal,
            "max_abs_diff": max(known) if known and len(known) == len(diffs) else None, "verdict": verdict}


def _kernels_text(deterministic: bool, settings: dict) -> str:
    if not deterministic:
        return f"default kernels (deterministic algorithms {'on' if settings['deterministic_algorithms'] else 'off'})"
    return (f"deterministic kernels in every process that trains (torch.use_deterministic_algorithms(True), "
            f"cuDNN deterministic, benchmark off, CUBLAS_WORKSPACE_CONFIG={settings['cublas_workspace_config']})")


def _finish(job, timeout_s: float = 600.0) -> None:
    if not job.wait(timeout_s) or job.error is not None:
        raise ConfigError(f"training job {job.name} did not finish: {job.error or 'timed out'}")


def _alone_latency(module, inputs, device, *, threads: int | None, repeats: int = 50) -> float:
    """The median latency of the module alone, in a thread of its own (on ``threads``
    cores; None: the default), so no thread count set here stays behind."""
    samples: list[float] = []

    def measure() -> None:
        with cpu_share(device, threads):
            for _ in range(repeats):
                t0 = time.perf_counter()
                native_call(module, inputs, device)
                samples.append(time.perf_counter() - t0)

    _run_threads([threading.Thread(target=measure)])
    return statistics.median(samples)


def _served(config, device, zoo, inputs, reference, n: int, mode: str, timeline: list | None) -> dict:
    names = [f"{config.model}_{i}" for i in range(n)]
    with Runtime(device, config.memory, scheduling=mode, lane_memory=config.lane_memory,
                 workers=config.workers) as rt:
        own = {}
        for name in names:
            rt.register(name, zoo.builder, weights_path(config.model), inputs)
            rt.infer(name, *inputs)  # resident, profiled, its lane measured
            # The model alone on this runtime: what every call must give, computed in a thread
            # of its own as the clients' are (a new thread takes the process's thread count
            # for its kernels, which a lane may have set: NOTE [Lane threads in new threads]).
            own[name] = _in_thread(partial(rt.infer, name, *inputs))
        alone = {}
        for name in names:  # each model's own latency on this runtime, idle
            samples = []
            for _ in range(10):
                t0 = time.perf_counter()
                rt.infer(name, *inputs)
                samples.append(time.perf_counter() - t0)
            alone[name] = statistics.median(samples)
        records: list[CallRecord] = []
        rt.subscribe(lambda r: records.append(r) if isinstance(r, CallRecord) else None)
        latencies: dict[str, list[float]] = {name: [] for name in names}
        exact = [True]
        # The clock starts when every client is ready, and each makes at least one request:
        # on a loaded machine, starting the threads may take longer than ``duration_s``.
        stop = [0.0]
        start_line = threading.Barrier(n, action=lambda: stop.__setitem__(0, time.perf_counter() + config.duration_s))

        def client(name: str) -> None:
            start_line.wait(60)
            while not latencies[name] or time.perf_counter() < stop[0]:
                t0 = time.perf_counter()
                out = rt.infer(name, *inputs)
                latencies[name].append(time.perf_counter() - t0)
                if not outputs_equal(out, own[name]):
                    exact[0] = False

        t0 = time.perf_counter()
        _run_threads([threading.Thread(target=client, args=(name,)) for name in names])
        elapsed = time.perf_counter() - t0
        done = sum(len(v) for v in latencies.values())
        added = [statistics.fmean(v) - alone[name] for name, v in latencies.items() if v]
        if timeline is not None and records:
            base = records[0].started
            timeline.extend({"model": r.model, "start_s": r.started - base, "seconds": r.seconds}
                            for r in records[: 2000])
        per_client = [len(latencies[name]) for name in names]
        mean = statistics.fmean(per_client)
        return {
            "requests": done,
            "req_per_s": done / elapsed,
            # Fairness: each client's requests against the mean (NOTE [Requests wait in arrival order]).
            "per_client": per_client,
            "min_share_of_mean": min(per_client) / mean,
            "max_share_of_mean": max(per_client) / mean,
            "mean_latency_ms": statistics.fmean(x for v in latencies.values() for x in v) * 1e3,
            "alone_ms": statistics.fmean(alone.values()) * 1e3,
            "added_latency_ms": statistics.fmean(added) * 1e3 if added else None,
            "outputs_exact": exact[0],
            # Whether the model alone on this runtime gives plain PyTorch's bits (lanes use
            # ``lane_threads`` cores; kernels may block by thread count).
            "alone_equals_plain_pytorch": all(outputs_equal(o, reference) for o in own.values()),
            "lanes_seen": rt.snapshot().lanes is not None,
        }


def _native_threads(module, inputs, device, n: int, duration_s: float) -> float:
    count = [0] * n
    stop = time.perf_counter() + duration_s

    def client(i: int) -> None:
        with cpu_share(device, max(1, cores() // n)):
            while time.perf_counter() < stop:
                native_call(module, inputs, device)
                count[i] += 1

    t0 = time.perf_counter()
    _run_threads([threading.Thread(target=client, args=(i,)) for i in range(n)])
    return sum(count) / (time.perf_counter() - t0)


# NOTE [Lane threads in new threads]
# ``cpu_share`` sets the thread count of a lane's kernels with ``torch.set_num_threads``,
# and the setting stays (memory/ephemeral.py). A thread started after that computes with
# the count set last, while a thread that ran kernels before keeps its own: the same
# forward in the main thread and in a client thread can then differ in its last bits (a
# convolution's sums are split by thread). So the references a bench compares clients
# with are computed in a new thread too.
def _in_thread(fn: Callable[[], object]) -> object:
    """``fn()`` in a new thread; its result, or its exception raised here."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # re-raised in the caller
            out.append((False, exc))

    _run_threads([threading.Thread(target=run)])
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _run_threads(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
        if t.is_alive():
            raise ConfigError("a benchmark client did not finish within 600 s")


def plot(result: dict, path) -> None:
    """The PACK timeline: one row per model, a bar for each forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = result["timeline"]
    models = sorted({s["model"] for s in spans}, key=lambda m: int(m.rsplit("_", 1)[1]))
    end = min((s["start_s"] + s["seconds"] for s in spans), default=0.0) + 0.2  # the first 200 ms
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.4 * len(models)))
    for row, model in enumerate(models):
        bars = [(s["start_s"] * 1e3, s["seconds"] * 1e3) for s in spans if s["model"] == model and s["start_s"] < end]
        ax.broken_barh(bars, (row - 0.4, 0.8))
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel("ms since the first request")
    first = result["rows"][0]
    ax.set_title(f"PACK: {first['models']} x {result['config']['model']}, calls overlapping in time "
                 f"({first['pack_over_fifo']:.2f}x time-slicing's throughput)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
