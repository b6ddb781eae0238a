"""Training segments on the pool's workers: which worker is each job's home and the
segments running. A running segment (``Segment``) alone sends its stop
(``PreemptSegment``, once) and reads its worker's progress and its stopped reply
(``follow``). Used by the :class:`~timeshare.executor.pool.ProcessPool`, which holds the
pipes and the lock. Runs in the controller (the caller's process).

# NOTE [Switch protocol]
One worker is active at a time; the others are standbys, fully initialized. A training
job lives in one worker (its home), which holds the job's parameters and optimizer
state between segments. When an inference arrives while a training segment runs:
  1. stop: the controller sends Preempt to the training worker, which stops at its
     next preemption point (between iterations; never a per-layer synchronize);
  2. start: at the same moment, the inference goes to a standby (never the training
     worker), which starts its pipelined load at once: nothing waits for step 1;
  3. clean: the training worker, once stopped, cleans up in parallel (offloads the
     job's state if it asked for that) and is a standby again;
  4. the job's thread parks until the runtime is free and starts a new segment.
Weights go to the arena and training memory is the job's own, so the new task never
waits for the old one's memory.

Every stop of a segment is the dispatcher's decision (a Preempt of the scheduler, or a
turn on a shared home); the pool carries it out, and stops a segment by itself only to
take its worker's pipe for a control message or a language model's step there
(``ProcessPool.claim``). With lanes
(``scheduling="pack"``) several segments run at once, each on its own home and in its
own lane, beside the inferences of other lanes on the remaining workers. Jobs that share
a home (more jobs than workers but one) take turns on it: a job that finds its home
busy says so (``HomeBusy``) and the dispatcher stops the segment there once it has run
``SHARE_S`` (``Dispatcher.share_home``). Each switch is recorded by the dispatcher
(NOTE [Switch records]). A worker that fails is replaced: a standby becomes active at
once and a new one boots behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from timeshare import protocol as P
from timeshare.errors import WorkerCrashedError, WorkerError
from timeshare.executor.deadline import Deadlines
from timeshare.executor.handle import WorkerHandle
from timeshare.memory.ephemeral import LaneBound

NEXT_TURN_KEPT_S = 1.0  # how long a shared home's next turn (``Segments.yield_to``) is kept for its job


@dataclass(frozen=True)
class HomeBusy:
    """A segment could not start: job ``holder``'s segment has held the home (shared, in
    lanes) for ``held_s``. Whether to stop it is the dispatcher's decision."""

    holder: str
    held_s: float


@dataclass
class Segment:
    """A training segment on its job's home: from ``Train`` (request ``seq``) to
    ``SegmentStopped``. The thread that started it holds the worker's lease and follows
    it; any thread may stop it."""

    job: str
    worker: WorkerHandle
    seq: int
    lane: LaneBound | None = None  # None: time-shared, the device's only task
    started_at: float = field(default_factory=time.perf_counter)
    preempted_at: float | None = None  # when its stop went out
    _stopping: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stop(self, now: float) -> None:
        """Stop the segment at its next preemption point: the one place a stop is sent, once."""
        with self._stopping:
            if self.preempted_at is None:
                self.preempted_at = now
                self.worker.post(P.PreemptSegment(self.seq))  # if already dead, ``follow`` reports it

    def follow(self, deadlines: Deadlines, cap_s: float, on_progress: Callable[[P.Progress], None]) \
            -> P.SegmentStopped:
        """Read the worker's replies until the segment stops: ``on_progress`` with each
        ``Progress`` (the heartbeat: a worker silent past its deadline raises
        WorkerTimeoutError); the ``SegmentStopped``. What ``on_progress`` raises stops the
        segment (the job's state kept in the worker) and is raised once it has."""
        what = f"training {self.job}"
        kind = (self.job, "iteration")
        last: float | None = None  # when the segment's latest Progress arrived
        failed: Exception | None = None
        while True:
            # NOTE [Call deadlines]: the first iteration of a segment may rebuild or reload
            # the job's state, and after a stop the worker cleans up (offload) before it
            # answers: those waits get the cap.
            timeout = cap_s if last is None or self.preempted_at is not None else deadlines.of(kind)
            reply = self.worker.receive(timeout, what, self.seq)
            if isinstance(reply, P.Progress):
                now = time.perf_counter()
                if last is not None:
                    deadlines.observe(kind, now - last)
                last = now
                if failed is None:
                    try:
                        on_progress(reply)
                    except Exception as exc:  # the controller's error, not the step's
                        failed = exc
                        self.stop(now)
                continue
            if not isinstance(reply, P.SegmentStopped):
                raise WorkerError(f"worker {self.worker.id} answered a training segment with "
                                  f"{type(reply).__name__}", where=f"worker {self.worker.id}, {what}")
            if failed is not None:
                raise failed
            return reply


class Segments:
    """Homes and the running segments: the pool's records, which it reads and changes
    with its lock held."""

    def __init__(self) -> None:
        self._running: dict[str, Segment] = {}  # job -> its segment running (several only in lanes)
        self._next_on: dict[WorkerHandle, tuple[str, float]] = {}  # a shared home -> the job whose turn is next
        self._homes: dict[str, WorkerHandle] = {}  # job -> the worker holding its state
        self._lost: dict[str, str] = {}  # job -> why its state is gone

    # ------------------------------------------------------------------ the running segments
    def running(self, job: str) -> Segment | None:
        return self._running.get(job)

    def training_workers(self) -> set[WorkerHandle]:
        """The workers segments run on: no task goes there."""
        return {seg.worker for seg in self._running.values()}

    def on(self, worker: WorkerHandle) -> Segment | None:
        """The segment running on ``worker``, if any."""
        return next((s for s in self._running.values() if s.worker is worker), None)

    def may_start(self, home: WorkerHandle, lane: LaneBound | None, job: str = "") -> bool:
        """Whether ``job``'s segment may start on ``home`` now: a time-shared one when no
        other runs, one in a lane when no segment runs on its home, none runs
        time-shared, and the home's next turn (``yield_to``) is not another job's."""
        if lane is None:
            return not self._running
        nxt = self._next_on.get(home)
        if nxt is not None and nxt[0] != job and time.perf_counter() - nxt[1] < NEXT_TURN_KEPT_S:
            return False
        return all(seg.worker is not home and seg.lane is not None for seg in self._running.values())

    def yield_to(self, home: WorkerHandle, job: str) -> None:
        """``job`` waits for ``home``: its next segment there is ``job``'s (for a while)."""
        self._next_on[home] = (job, time.perf_counter())

    def start(self, job: str, home: WorkerHandle, seq: int, lane: LaneBound | None = None) -> Segment:
        """Record the segment whose ``Train`` (``seq``) went to ``home``."""
        seg = self._running[job] = Segment(job, home, seq, lane)
        if self._next_on.get(home, ("",))[0] == job:
            del self._next_on[home]
        return seg

    def end(self, seg: Segment) -> None:
        if self._running.get(seg.job) is seg:
            del self._running[seg.job]

    def stop(self, now: float, *, job: str | None = None, worker: WorkerHandle | None = None) -> None:
        """Stop the running segment of ``job``, or the one on ``worker``, if any."""
        seg = self._running.get(job) if job is not None else self.on(worker) if worker is not None else None
        if seg is not None:
            seg.stop(now)

    # ------------------------------------------------------------------ homes
    def new_home(self, job: str, workers: list[WorkerHandle]) -> WorkerHandle:
        """Choose the job's home among ``workers``: the least used, never the first."""
        if len(workers) < 2:
            raise WorkerError("training with workers needs at least 2 workers (one stays free for inference)")
        kept = self._homes.get(job)
        if kept is not None and kept in workers[1:]:
            return kept  # chosen when its first segment could not start yet: it stays, or jobs would swap homes
        # Not the first worker: inference goes there while the job runs.
        counts = {id(w): 0 for w in workers}
        for other, h in self._homes.items():
            if other != job:
                counts[id(h)] = counts.get(id(h), 0) + 1
        home = min(workers[1:], key=lambda w: counts[id(w)])
        self._homes[job] = home
        self._lost.pop(job, None)
        return home

    def home(self, job: str, workers: list[WorkerHandle]) -> WorkerHandle:
        """The job's home, still one of ``workers``; an error saying why the state is gone."""
        kept = self._homes.get(job)
        if kept is None or kept not in workers:
            why = self._lost.get(job, "its worker is gone")
            raise WorkerCrashedError(f"training job {job!r} lost its state: {why}", where=f"training {job}")
        return kept

    def forget(self, job: str) -> WorkerHandle | None:
        """Forget the job; its home, if it had one, still holds its state."""
        self._lost.pop(job, None)
        return self._homes.pop(job, None)

    def state_dropped(self, job: str) -> None:
        """The job's step raised: its home dropped the job's state."""
        self._homes.pop(job, None)

    def worker_lost(self, w: WorkerHandle) -> None:
        """``w`` failed: the jobs it was home to lose their state."""
        for job, home in list(self._homes.items()):
            if home is w:
                del self._homes[job]
                self._lost[job] = f"worker {w.id} held it and failed"

    def home_workers(self) -> list[WorkerHandle]:
        """The workers that hold some job's state (one entry per job)."""
        return list(self._homes.values())

    def homes(self) -> dict[str, int]:
        """Job -> its home worker's id."""
        return {job: w.id for job, w in self._homes.items()}
