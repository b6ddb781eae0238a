"""``timeshare bench chaos``: faults never cost a wrong answer. A real ``timeshare serve``
(a child process) with worker processes, a training job and a memory budget that forces
loads; concurrent clients whose every reply is checked against its own request's
reference; and, every few seconds, a fault: a worker killed while it computes or loads,
while it trains, while idle, while it is still starting, or stopped (SIGSTOP) and
resumed later. Runs in the caller's process.

It reports the requests, the wrong answers (must be 0), the failures by status and
whether each happened while a fault was under way, how long the pool took to heal after
each fault, and the processes and shared-memory segments left after shutdown.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Container
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from timeshare.bench.environment import describe
from timeshare.bench.serve import SMALL_MODELS, ServeBenchConfig, compare_outputs, references, server_config
from timeshare.device import resolve_device
from timeshare.errors import ConfigError
from timeshare.harness.client import Client

FAULTS = ("kill-busy", "kill-training", "kill-idle", "kill-starting", "stop")
SHM = Path("/dev/shm")


@dataclass
class ChaosBenchConfig:
    models: list[str] = field(default_factory=lambda: list(SMALL_MODELS))
    clients: int = 8
    duration_s: float = 300.0
    workers: int = 2
    fault_every_s: float = 5.0
    # The run goes on past duration_s (by at most as long again) until this many faults have
    # happened: on a loaded machine a fault's wait for its target can eat the duration.
    min_faults: int = 0
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    training: str | None = "tiny_cnn:8"  # MODEL:BATCH, restarted whenever a fault ends it
    stop_max_s: float = 8.0  # a SIGSTOP lasts up to this; past the call's deadline the pool kills the worker
    deadline_min_s: float = 2.0  # runtime.task_deadline_min_s of the server
    attribution_s: float = 2.0  # a failure this soon after a fault ended is that fault's
    heal_timeout_s: float = 60.0
    distinct_inputs: int = 4
    device: str = "cpu"
    memory: str | None = None  # default: room for about half of the models (loads happen)
    seed: int = 0

    def __post_init__(self):
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown or not self.faults:
            raise ConfigError(f"unknown faults {unknown}; known: {list(FAULTS)}" if unknown else "no faults given")
        if self.workers < 2:
            raise ConfigError("bench chaos needs at least 2 workers (a standby to serve while one is replaced)")
        if self.clients < 1 or self.duration_s <= 0 or self.fault_every_s <= 0:
            raise ConfigError("clients must be at least 1; duration_s and fault_every_s positive")
        if self.training is not None:
            _training_job(self.training)


def _training_job(spec: str) -> dict:
    model, _, batch = spec.partition(":")
    try:
        # Bounded, as the admin plane asks of a job it (re)starts; longer than any run.
        return {"name": "chaos-train", "model": model, "batch": int(batch or 8), "iterations": 100_000, "start": True}
    except ValueError:
        raise ConfigError(f"training must be MODEL:BATCH, got {spec!r}") from None


def chaos_server_config(cfg: ChaosBenchConfig) -> dict:
    serve = ServeBenchConfig(models=cfg.models, device=cfg.device, memory=cfg.memory, workers=cfg.workers,
                             distinct_inputs=cfg.distinct_inputs, seed=cfg.seed)
    out = server_config(serve)
    out["runtime"]["task_deadline_min_s"] = cfg.deadline_min_s
    out["server"]["request_timeout_s"] = 60
    if cfg.training is not None:
        out["training"] = [_training_job(cfg.training)]
    return out


class _Recorder:
    """What the clients, the faults and the status poller saw, with times on one clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.faults: list[dict] = []
        self.status: list[tuple[float, dict]] = []  # (t, the pool's health)
        self.resubmits = 0
        self.refused_restarts: list[str] = []
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


def run(cfg: ChaosBenchConfig, progress=None) -> dict:
    from timeshare.harness.process import ServerProcess

    serve_cfg = ServeBenchConfig(models=cfg.models, distinct_inputs=cfg.distinct_inputs, seed=cfg.seed)
    cases = references(serve_cfg)
    server_cfg = chaos_server_config(cfg)
    rec = _Recorder()
    with ServerProcess(server_cfg) as server:
        if progress:
            progress(f"server ready; {cfg.duration_s:g} s of requests with a fault every {cfg.fault_every_s:g} s")
        stop = threading.Event()
        threads = [threading.Thread(target=_client, args=(server.url, cfg, cases, rec, stop, i), daemon=True)
                   for i in range(cfg.clients)]
        threads.append(threading.Thread(target=_poll, args=(server.url, cfg, rec, stop), daemon=True))
        for t in threads:
            t.start()
        segments = _segments_of_tree(server.pid)
        _fault_loop(cfg, rec)
        _wait_healed(rec, cfg.heal_timeout_s)
        time.sleep(1.0)  # requests after the heal, with every worker back
        stop.set()
        for t in threads:
            t.join(90)
        final = _final_check(server.url, cfg, cases)
        segments |= _segments_of_tree(server.pid)
        code = server.stop()
        leftovers = [server.describe(pid) for pid in server.leftovers()]
    shm_left = sorted(name for name in segments if (SHM / name).exists())
    result = summarize(rec, cfg)
    result.update(final_check=final, server_exit_code=code, server_leftover_processes=len(leftovers),
                  server_leftovers=leftovers, shm_segments_seen=len(segments), shm_segments_left=shm_left)
    return {"benchmark": "chaos", "config": asdict(cfg), "server_config": server_cfg,
            "environment": describe(resolve_device(cfg.device)), "result": result}


# ---------------------------------------------------------------------- the actors
def _client(url: str, cfg: ChaosBenchConfig, cases, rec: _Recorder, stop: threading.Event, index: int) -> None:
    rng = random.Random(cfg.seed * 1000 + index)
    with Client(url, timeout_s=90) as client:
        n = 0
        while not stop.is_set():
            model = rng.choice(cfg.models)
            case = cases[model][rng.randrange(cfg.distinct_inputs)]
            rid = f"c{index}-{n}"
            n += 1
            start = rec.now()
            try:
                answer = client.infer(model, case.inputs, request_id=rid)
                status: int | str = answer.status
            except Exception as exc:  # the connection failed: counted apart from HTTP statuses
                answer, status = None, f"transport: {type(exc).__name__}"
            wrong = None
            if answer is not None and answer.status == 200:
                wrong = f"answer id {answer.id!r} for {rid!r}" if answer.id != rid else \
                    compare_outputs(answer.outputs, case.reference)
            with rec.lock:
                rec.requests.append({"model": model, "start_s": start, "end_s": rec.now(), "status": status,
                                     "wrong": wrong, "error": None if answer is None else answer.error})


def _poll(url: str, cfg: ChaosBenchConfig, rec: _Recorder, stop: threading.Event) -> None:
    """The pool's health every 0.1 s; a training job that a fault ended is started again,
    so training keeps contending for the device."""
    job = _training_job(cfg.training) if cfg.training is not None else None
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            try:
                status = http.get("/admin/status").json()
                with rec.lock:
                    rec.status.append((rec.now(), status["workers"]))
                if job is not None and http.get(f"/admin/training/{job['name']}").json()["status"] == "failed":
                    answer = http.post("/admin/training", json=job)
                    with rec.lock:
                        if answer.status_code == 201:
                            rec.resubmits += 1
                        else:  # shows in the report: a restart the server refused is a finding
                            rec.refused_restarts.append(f"{answer.status_code}: {answer.text[:200]}")
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # a status that did not come back is a gap in the timeline, nothing more
            stop.wait(0.1)


def _latest(rec: _Recorder) -> dict | None:
    with rec.lock:
        return rec.status[-1][1] if rec.status else None


def _find(rec: _Recorder, states: tuple[str, ...], within_s: float,
          exclude: Container[int] = frozenset()) -> dict | None:
    """A worker in one of ``states`` (as the latest status says), waiting up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        status = _latest(rec)
        found = [w for w in (status or {}).get("workers", []) if w["state"] in states and w["pid"] not in exclude]
        if found:
            return random.choice(found)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _fault_loop(cfg: ChaosBenchConfig, rec: _Recorder) -> None:
    rng = random.Random(cfg.seed)
    order: list[str] = []
    end = rec.now() + cfg.duration_s
    hard_end = end + cfg.duration_s
    while rec.now() + cfg.fault_every_s <= end or (len(rec.faults) < cfg.min_faults and rec.now() < hard_end):
        time.sleep(cfg.fault_every_s * rng.uniform(0.7, 1.3) if rec.faults else cfg.fault_every_s)
        if not order:  # every kind in turn, in a shuffled order: each one happens
            order = list(cfg.faults)
            rng.shuffle(order)
        _fault(order.pop(), cfg, rec, rng)


def _fault(kind: str, cfg: ChaosBenchConfig, rec: _Recorder, rng: random.Random) -> None:
    start = rec.now()
    pids = []
    if kind == "kill-starting":  # kill one, then its replacement while it boots
        first = _find(rec, ("idle", "busy", "training"), 2.0)
        if first is None:
            return
        _signal(first["pid"], signal.SIGKILL)
        pids.append(first["pid"])
        target = _find(rec, ("starting",), 5.0, exclude={first["pid"]})
        if target is not None:
            time.sleep(rng.uniform(0.0, 0.5))
            _signal(target["pid"], signal.SIGKILL)
            pids.append(target["pid"])
    else:
        states = {"kill-busy": ("busy",), "kill-training": ("training",), "kill-idle": ("idle",),
                  "stop": ("busy", "idle", "training")}[kind]
        target = _find(rec, states, 3.0)
        if target is None:
            return  # nothing in that state now (no training job, say): no fault, none recorded
        if kind == "stop":
            _signal(target["pid"], signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, cfg.stop_max_s))  # past the call's deadline the pool kills it first
            _signal(target["pid"], signal.SIGCONT)
        else:
            _signal(target["pid"], signal.SIGKILL)
        pids.append(target["pid"])
    with rec.lock:
        rec.faults.append({"kind": kind, "pids": pids,
                           "state": target["state"] if target else None, "start_s": start, "end_s": rec.now()})


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_healed(rec: _Recorder, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) until the pool healed from the last fault."""
    deadline = time.monotonic() + timeout_s
    while rec.faults and time.monotonic() < deadline:
        with rec.lock:
            if _heal_time(rec.faults[-1], list(rec.status)) is not None:
                return
        time.sleep(0.05)


def _final_check(url: str, cfg: ChaosBenchConfig, cases) -> dict:
    """After the faults: every model answers every case correctly."""
    wrong, failed = [], []
    with Client(url, timeout_s=60) as client:
        for model in cfg.models:
            for case in cases[model]:
                answer = client.infer(model, case.inputs)
                if answer.status != 200:
                    failed.append(f"{model}: {answer.status} {answer.error}")
                elif (why := compare_outputs(answer.outputs, case.reference)) is not None:
                    wrong.append(f"{model}: {why}")
    return {"requests": len(cfg.models) * cfg.distinct_inputs, "wrong": wrong, "failed": failed}


def _segments_of_tree(pid: int) -> set[str]:
    """The segments the server and its descendants (worker and parser processes) map:
    host stores are mapped by the workers only."""
    names: set[str] = set()
    for p in _descendants(pid) | {pid}:
        names |= _segments_of(p)
    return names


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            todo.extend(c for c in children if c not in found)
            found.update(children)
    return found


def _segments_of(pid: int) -> set[str]:
    """The shared-memory segments a process maps (the server's arena and host stores):
    these, and only these, must be gone after it stopped, whatever else runs here."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    names = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
            names.add(fields[5][len(f"{SHM}/"):].split()[0])  # a deleted one ends in " (deleted)"
    return names


# ---------------------------------------------------------------------- the report
def summarize(rec: _Recorder, cfg: ChaosBenchConfig) -> dict:
    requests, faults, status = rec.requests, rec.faults, rec.status
    failed = [r for r in requests if r["status"] != 200]
    windows = [(f["start_s"], f["end_s"] + cfg.attribution_s) for f in faults]
    unexplained = [r for r in failed if not any(r["start_s"] <= end and r["end_s"] >= start for start, end in windows)]
    by_status: dict[str, int] = {}
    for r in failed:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    heal = [_heal_time(f, status) for f in faults]
    for f, h in zip(faults, heal):
        f["heal_s"] = h
    stops = [_during_stop(f, requests) for f in faults if f["kind"] == "stop"]
    known = [h for h in heal if h is not None]
    final = status[-1][1] if status else {}
    return {
        "requests": len(requests),
        "answered": sum(r["status"] == 200 for r in requests),
        "wrong": sum(r["wrong"] is not None for r in requests),
        "wrong_examples": [r["wrong"] for r in requests if r["wrong"]][:5],
        "failed": len(failed),
        "failed_by_status": by_status,
        "failed_4xx": sum(isinstance(r["status"], int) and 400 <= r["status"] < 500 for r in failed),
        "failed_outside_faults": len(unexplained),
        "failed_outside_examples": [f"{r['status']} at {r['start_s']:.2f}-{r['end_s']:.2f} s: {r['error']}"
                                    for r in unexplained[:5]],
        "faults": len(faults),
        "faults_by_kind": {k: sum(f["kind"] == k for f in faults) for k in cfg.faults},
        "fault_log": faults,
        "heal_s_max": max(known) if known else None,
        "heal_s_p50": float(np.median(known)) if known else None,
        "not_healed": sum(h is None for h in heal),
        "heal_after_last_fault_s": heal[-1] if heal else None,
        # A stopped worker must cost the other requests at most about one call deadline:
        # the slowest request under way while a worker was stopped, beside that deadline.
        "stop_faults": stops,
        "stop_slowest_request_s": max((x["slowest_request_s"] for x in stops), default=None),
        "call_deadline_min_s": cfg.deadline_min_s,
        "pool_at_end": {k: final.get(k) for k in ("size", "ready", "replacements", "failures", "last_failure")},
        "training_restarts": rec.resubmits,
        "training_restarts_refused": len(rec.refused_restarts),
        "training_restart_refusals": sorted(set(rec.refused_restarts))[:3],
        "wall_s": rec.now(),
    }


def _during_stop(fault: dict, requests: list[dict]) -> dict:
    """The requests under way while a worker was stopped: how many, how many failed, and
    the slowest answered one's latency."""
    under = [r for r in requests if r["start_s"] <= fault["end_s"] and r["end_s"] >= fault["start_s"]]
    answered = [r["end_s"] - r["start_s"] for r in under if r["status"] == 200]
    return {"stopped_s": fault["end_s"] - fault["start_s"], "requests": len(under),
            "failed": len(under) - len(answered), "slowest_request_s": max(answered, default=0.0)}


def _heal_time(fault: dict, status: list[tuple[float, dict]]) -> float | None:
    """Seconds from a fault's end until the pool was at full size, every worker ready,
    and every process the fault killed no longer one of them (a status read before the
    kill was seen does not count). A stopped worker that resumed in time may stay."""
    gone = set(fault["pids"]) if fault["kind"] != "stop" else set()
    for t, w in status:
        if t >= fault["end_s"] and w["ready"] == w["size"] and not gone & {x["pid"] for x in w.get("workers", [])}:
            return t - fault["end_s"]
    return None
