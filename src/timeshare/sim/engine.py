"""The discrete-event simulator: a trace, a cost model and the real scheduler objects,
on a virtual clock. Runs in the simulator's process (the CLI).

The simulator is the scheduler's executor: it submits arrivals, carries out Run and
Preempt decisions on a model of the device, and reports Finished and Stopped back,
calling ``schedule`` after every event and at ``next_wakeup``. Deterministic: no
wall clock, no randomness of its own (traces carry their seed).

# NOTE [Device sharing model]
Each running task (a training job's segment, or a batch of requests) needs some
seconds of device work if it ran alone. Tasks that run at once share the device: each
has a utilization u (1 unless the cost model says less), and when their total U
exceeds 1 each progresses at 1/U of its solo speed, so co-located tasks help exactly
as much as the device was idle. A Run pays set-up first: a training job's start-up on
its first start (``resume_s`` on later ones), a request batch's model load on a cache
miss (the pipelined load's extra latency; stop-and-start: the whole restart). A
preempted training task runs on to its next iteration boundary, overlapping the task
that replaces it (NOTE [Scheduler slots]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from timeshare.errors import ConfigError, TimeshareError
from timeshare.scheduler.core import Scheduler
from timeshare.scheduler.task import Finished, Kind, Preempt, Run, State, Stopped, Task
from timeshare.sim.cache import ModelCache
from timeshare.sim.costs import WorkloadCosts
from timeshare.sim.trace import Arrival

_STUCK_DECISIONS = 100_000  # decisions at one instant before the replay is called stuck


class _Job:
    """One running task (with its batch) on the simulated device."""

    __slots__ = ("task", "left", "setup", "unit_s", "done0", "u", "rate", "epoch", "stop_at", "compute")

    def __init__(self, task: Task, setup: float, unit_s: float, work_s: float, u: float):
        self.task = task
        self.setup = setup  # seconds of set-up at the start of ``left``
        self.unit_s = unit_s
        self.done0 = task.done
        self.left = setup + work_s  # solo seconds to the end (or to the stop boundary)
        self.compute = work_s
        self.u = u
        self.rate = 1.0
        self.epoch = 0
        self.stop_at: float | None = None  # units at which a preempted task stops


@dataclass
class SimResult:
    """Per-task records and counters of one simulation."""

    policy: str
    kinds: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    finishes: list = field(default_factory=list)
    deadlines: list = field(default_factory=list)
    busy_s: float = 0.0
    useful_s: float = 0.0
    load_s: float = 0.0
    preemptions: int = 0
    loads: int = 0
    evictions: int = 0
    unfinished: int = 0
    events: int = 0
    devices: int = 1

    @classmethod
    def merge(cls, results: list[SimResult]) -> SimResult:
        """One record of several devices' replays of one trace (sim/cluster.py): the
        per-task lists joined, the counters and busy seconds summed."""
        if not results:
            raise ConfigError("nothing to merge: no device results")
        out = cls(results[0].policy, devices=sum(r.devices for r in results))
        for r in results:
            for name in ("kinds", "arrivals", "starts", "finishes", "deadlines"):
                getattr(out, name).extend(getattr(r, name))
            for name in ("busy_s", "useful_s", "load_s", "preemptions", "loads", "evictions", "unfinished", "events"):
                setattr(out, name, getattr(out, name) + getattr(r, name))
        return out

    def report(self) -> dict:
        """Makespan, queuing and completion times of training jobs; latency
        percentiles and SLO attainment of requests; utilization (busy device-seconds
        over makespan x devices), switches, evictions."""
        kinds = np.array(self.kinds)
        arr, start, fin = np.array(self.arrivals), np.array(self.starts), np.array(self.finishes)
        out: dict = {"policy": self.policy, "tasks": int(len(fin)), "unfinished": self.unfinished}
        if len(fin):
            span = float(fin.max() - arr.min())
            out["makespan_s"] = span
            capacity = span * self.devices
            out["utilization"] = self.busy_s / capacity if span > 0 else 0.0
            out["useful_utilization"] = self.useful_s / capacity if span > 0 else 0.0
        train = kinds == "t"
        if train.any():
            jct = fin[train] - arr[train]
            out["training"] = {
                "jobs": int(train.sum()),
                "avg_queuing_s": float((start[train] - arr[train]).mean()),
                "avg_jct_s": float(jct.mean()),
                "p95_jct_s": float(np.percentile(jct, 95)),
            }
        inf = kinds == "i"
        if inf.any():
            lat = fin[inf] - arr[inf]
            dl = np.array(self.deadlines)[inf]
            has = ~np.isnan(dl)
            out["inference"] = {
                "requests": int(inf.sum()),
                "p50_ms": float(np.percentile(lat, 50) * 1e3),
                "p95_ms": float(np.percentile(lat, 95) * 1e3),
                "p99_ms": float(np.percentile(lat, 99) * 1e3),
                "mean_ms": float(lat.mean() * 1e3),
                "slo_attainment": float((fin[inf][has] <= dl[has]).mean()) if has.any() else None,
            }
        out.update(devices=self.devices, switches=self.preemptions + self.loads, preemptions=self.preemptions,
                   loads=self.loads, evictions=self.evictions, load_s=self.load_s, events=self.events)
        return out


class Simulator:
    """Replays ``trace`` against ``scheduler`` with ``costs``. ``cache``: resident
    models for inference (None: every model stays resident). ``restart``: a cache miss
    costs the model's whole stop-and-start time (Ollama-style process swap).
    ``resume_s``: set-up of a training job resumed after preemption."""

    def __init__(self, scheduler: Scheduler, costs: WorkloadCosts, *, cache: ModelCache | None = None,
                 restart: bool = False, resume_s: float = 0.0):
        self.scheduler = scheduler
        self.costs = costs
        self.cache = cache
        self.restart = restart
        self.resume_s = resume_s
        self._jobs: dict[int, _Job] = {}
        self._events: list = []
        self._seq = 0
        self._last = 0.0
        self._wake_at = math.inf
        self._res = SimResult(scheduler.policy.name)
        self._busy_at, self._busy_n = -math.inf, 0  # decisions at one instant (a livelock guard)

    def run(self, trace: list[Arrival], *, horizon_s: float = math.inf) -> SimResult:
        self.begin()
        for i, a in enumerate(trace):
            if a.time > horizon_s:
                break
            self.step_until(a.time, horizon_s=horizon_s)
            self.arrive(i, a)
        return self.finish(horizon_s=horizon_s)

    # NOTE [Stepping a device]: ``run`` is begin, then for each arrival step_until(its
    # time) and arrive, then finish. A cluster (sim/cluster.py) drives several
    # simulators the same way, choosing the device between the step and the arrival.
    # At one instant the order is arrivals, then completions, then time-slice ends.
    def begin(self) -> None:
        """Start a replay: empty device, clock at 0."""
        self._res = SimResult(self.scheduler.policy.name)
        self._jobs.clear()
        self._events.clear()
        self._last = 0.0
        self._wake_at = math.inf
        self._busy_at, self._busy_n = -math.inf, 0

    def step_until(self, t: float, *, horizon_s: float = math.inf) -> None:
        """Carry out completions and time-slice ends before ``t`` (and not after ``horizon_s``)."""
        events = self._events
        res = self._res
        while True:
            t_ev = events[0][0] if events else math.inf
            nxt = min(t_ev, self._wake_at)
            if nxt >= t or nxt > horizon_s:
                return
            res.events += 1
            if t_ev <= self._wake_at:
                _, _, job, epoch = heappop(events)
                if job.epoch != epoch or job.task.id not in self._jobs:
                    continue
                self._advance(t_ev)
                self._complete(job, t_ev)
                self._decide(t_ev)
            else:
                self._advance(nxt)
                self._decide(nxt)

    def arrive(self, task_id: int, a: Arrival) -> None:
        """Submit ``a`` as task ``task_id`` at its time (call ``step_until(a.time)`` first)."""
        now = a.time
        self._res.events += 1
        self._advance(now)
        c = self.costs[a.model]
        self.scheduler.submit(Task(task_id, a.kind, a.model, now, a.work, c.unit_s, a.priority,
                                   None if a.slo_s is None else now + a.slo_s, c.persistent, c.ephemeral,
                                   c.startup_s), now)
        self._decide(now)

    def finish(self, *, horizon_s: float = math.inf) -> SimResult:
        """Run to the end (or ``horizon_s``) and return the records."""
        self.step_until(math.inf, horizon_s=horizon_s)
        res = self._res
        sched = self.scheduler
        res.unfinished = len(sched.tasks)
        res.evictions = self.cache.evictions if self.cache is not None else 0
        res.loads = self.cache.loads if self.cache is not None else res.loads
        res.preemptions = sched.preemptions
        return res

    def backlog_s(self, now: float) -> float:
        """Device seconds still needed by the tasks on this device, alone: for running
        ones what the device model has left (the progress a real executor reports),
        for waiting ones the scheduler's estimate (start-up included if never started).
        What a dispatcher in front of several devices can know (sim/cluster.py); call
        after ``step_until(now)``."""
        self._advance(now)
        total = 0.0
        for job in self._jobs.values():
            total += max(0.0, job.left)
            if job.stop_at is not None:  # stops at the boundary, then waits with the rest
                total += (job.task.work - job.stop_at) * job.unit_s + self.resume_s
        for t in self.scheduler.tasks.values():
            if t.state is State.WAITING:
                total += t.remaining_s()
        return total

    def _decide(self, now: float) -> None:
        """Ask the scheduler after an event, carry out its decisions, note its next wake-up."""
        sched = self.scheduler
        self._wake_at = math.inf
        decisions = sched.schedule(now)
        if decisions:
            if now == self._busy_at:
                self._busy_n += 1
                if self._busy_n > _STUCK_DECISIONS:
                    raise TimeshareError(
                        f"simulation stuck at t={now:.6f} s: {self._busy_n} decisions without the clock moving, "
                        f"the last {decisions!r} (a scheduler that preempts and restarts the same task?)")
            else:
                self._busy_at, self._busy_n = now, 1
            self._execute(decisions, now)
        if sched.quantum_s:
            w = sched.next_wakeup(now)
            if w is not None:
                self._wake_at = max(w, now)

    # ------------------------------------------------------------------ device model
    def _advance(self, now: float) -> None:
        dt = now - self._last
        self._last = now
        if dt <= 0 or not self._jobs:
            return
        self._res.busy_s += dt
        for job in self._jobs.values():
            job.left -= job.rate * dt

    def _rates(self, now: float) -> None:
        """Re-derive every running job's speed and completion event (NOTE [Device sharing model])."""
        jobs = self._jobs.values()
        total = sum(j.u for j in jobs)
        slow = 1.0 / total if total > 1.0 else 1.0
        for j in jobs:
            j.rate = slow
            j.epoch += 1
            self._seq += 1
            heappush(self._events, (now + max(0.0, j.left) / slow, self._seq, j, j.epoch))

    def _execute(self, decisions, now: float) -> None:
        for d in decisions:
            if isinstance(d, Run):
                self._start(d, now)
            elif isinstance(d, Preempt):
                job = self._jobs[d.task.id]
                # Solo seconds done so far -> units; stop at the next whole unit.
                elapsed = job.setup + job.compute - job.left
                units = job.done0 + max(0.0, elapsed - job.setup) / job.unit_s if job.unit_s > 0 else job.done0
                boundary = min(math.ceil(units - 1e-9), d.task.work)
                job.stop_at = boundary
                job.left = job.setup + (boundary - job.done0) * job.unit_s - elapsed
            else:
                raise ConfigError(f"unknown decision {d!r}")
        self._rates(now)

    def _start(self, d: Run, now: float) -> None:
        t = d.task
        c = self.costs[t.model]
        if t.kind is Kind.INFERENCE:
            setup = 0.0
            if self.cache is not None:
                in_use = [j.task.model for j in self._jobs.values()]
                if self.cache.acquire(t.model, c.nbytes, c.load_s, now, in_use):
                    setup = c.restart_s - c.unit_s if self.restart and c.restart_s else c.load_s
                    self._res.load_s += setup
                    if self.cache.detector is not None:
                        self.cache.detector.loaded(t.model, now, setup)
            work = c.compute_s(1 + len(t.batch))
            if self.cache is not None and self.cache.detector is not None:
                self.cache.detector.worked(t.model, now, work)
                self.scheduler.batch_factor = self.cache.detector.batch_factor(now)
            job = _Job(t, setup, work, work, 1.0)
        else:
            setup = c.startup_s if t.done == 0 and t.preemptions == 0 else self.resume_s
            work = (t.work - t.done) * c.unit_s
            job = _Job(t, setup, c.unit_s, work, c.utilization)
        self._jobs[t.id] = job

    def _complete(self, job: _Job, now: float) -> None:
        del self._jobs[job.task.id]
        t = job.task
        sched = self.scheduler
        res = self._res
        if job.stop_at is not None and job.stop_at < t.work:
            res.useful_s += (job.stop_at - job.done0) * job.unit_s
            sched.update(Stopped(t.id, now, job.stop_at))
        else:
            res.useful_s += job.compute
            for x in (t, *t.batch):
                res.kinds.append("i" if x.kind is Kind.INFERENCE else "t")
                res.arrivals.append(x.arrival)
                res.starts.append(x.started_at)
                res.finishes.append(now)
                res.deadlines.append(math.nan if x.deadline is None else x.deadline)
                sched.update(Finished(x.id, now))
        self._rates(now)
