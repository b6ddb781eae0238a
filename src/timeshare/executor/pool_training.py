"""Training segments through the pool of worker processes (``SegmentRunner``, runs in the
controller): a job's segment started on its home worker and followed until it stops, its
state read or dropped there, and the claim of a worker's pipe from its segment for any
other request (NOTE [One owner per pipe]). The records of the running segments, their
homes and the switches are :mod:`timeshare.executor.segments`'s; the workers themselves
:mod:`timeshare.executor.workers`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from timeshare import protocol as P
from timeshare.errors import TimeshareError, WorkerError, WorkerTimeoutError
from timeshare.executor.deadline import Deadlines
from timeshare.executor.handle import WorkerHandle
from timeshare.executor.segments import SHARE_S, Segment, Segments, Switch
from timeshare.executor.workers import WorkerSet
from timeshare.memory.ephemeral import LaneBound

if TYPE_CHECKING:
    from timeshare.worker.trainer import TrainSpec

log = logging.getLogger(__name__)


class SegmentRunner:
    """The training side of a ``ProcessPool``: it shares the pool's workers, its lock (``cv``,
    which guards the worker list and the segments) and its deadlines."""

    def __init__(self, workers: WorkerSet, cv: threading.Condition, segments: Segments, deadlines: Deadlines,
                 task_timeout_s: float, startup_timeout_s: float):
        self._set = workers
        self._cv = cv
        self._segments = segments
        self.deadlines = deadlines
        self.task_timeout_s = task_timeout_s
        self.startup_timeout_s = startup_timeout_s

    def begin_segment(self, job: str, spec: TrainSpec | None, lane: LaneBound | None) -> Segment | None:
        """Start (``spec`` given) or resume a training job in its home worker, which the
        scheduler runs now, in ``lane`` if it runs with lanes. None when the segment may
        not start yet (``Segments.may_start``): the job parks and retries."""
        home = self._home(job, spec is not None)
        self._set.ready(home)
        with self._cv:
            if not self._segments.may_start(home, lane, job):
                other = self._segments.on(home)
                now = time.perf_counter()
                if lane is not None and other is not None and other.lane is not None:
                    self._segments.yield_to(home, job)  # a shared home: turns (NOTE [Switch protocol])
                    if now - other.started_at >= SHARE_S:
                        self._segments.preempt(now, job=other.job)
                self._cv.wait(0.05)
                return None
            if home not in self._set.workers:
                return None  # replaced meanwhile; _home reports it next time
            if not home.try_lease():  # a task or a control request has its pipe
                self._cv.wait(0.05)
                return None
            try:
                seq = self._set.next_seq()
                data = P.dumps(P.Train(seq, job, spec, lane))
            except BaseException:
                home.unlease()  # a spec that cannot be sent must not keep the worker's pipe
                raise
            home.post_bytes(data)  # if the process is gone, run_segment reports it
            return self._segments.start(job, home, seq, lane)

    def run_segment(self, seg: Segment, on_progress: Callable[[P.Progress], None]) -> P.SegmentStopped:
        """Follow a segment until it stops (``Segment.follow``); a worker that failed or
        hung is replaced, a step that raised has dropped the job's state there."""
        try:
            return seg.follow(self.deadlines, self.task_timeout_s, on_progress)
        except TimeshareError as exc:
            with self._cv:
                if not seg.worker.alive() or isinstance(exc, WorkerTimeoutError):
                    self._set.replace(seg.worker, exc)
                else:  # the step raised: the worker dropped the job's state
                    self._segments.state_dropped(seg.job)
            raise
        finally:
            seg.worker.unlease()  # taken in begin_segment
            with self._cv:
                self._segments.end(seg)
                self._cv.notify_all()

    def stop(self, job: str, switch: Switch | None = None) -> None:
        """Stop the job's running segment, if any, at its next preemption point;
        ``switch``: the record of the inference it makes way for (NOTE [Switch records])."""
        with self._cv:
            self._segments.preempt(time.perf_counter(), job=job, switch=switch)

    def job_state(self, job: str, *, full: bool = False) -> dict:
        """The job's parameters and buffers, or with ``full`` its checkpoint (NOTE
        [Checkpoints]), from its home worker (between segments)."""
        home = self._home(job, False)
        with self.claim(home, f"state of {job}"):
            return home.request(P.GetJobState(self._set.next_seq(), job, full), self.task_timeout_s,
                                f"state of {job}").value

    def drop_job(self, job: str) -> None:
        self.deadlines.forget(job)
        with self._cv:
            home = self._segments.forget(job)
        if home is not None and home.alive():
            try:
                with self.claim(home, f"dropping {job}"):
                    home.request(P.DropJob(self._set.next_seq(), job), self.task_timeout_s, f"dropping {job}")
            except WorkerError as exc:
                log.warning("dropping training job %s: %s", job, exc)

    def _home(self, job: str, new: bool) -> WorkerHandle:
        with self._cv:
            workers = self._set.workers
            return self._segments.new_home(job, workers) if new else self._segments.home(job, workers)

    def _quiesce(self, w: WorkerHandle) -> None:
        """Wait until ``w`` runs no training segment, preempting it if it does."""
        deadline = time.monotonic() + self.task_timeout_s + 5
        with self._cv:
            while w in self._segments.training_workers():
                self._segments.preempt(time.perf_counter(), worker=w)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerTimeoutError(f"worker {w.id} did not stop training within {self.task_timeout_s:g} s",
                                             where=f"worker {w.id}")
                self._cv.wait(min(left, 0.5))

    @contextmanager
    def claim(self, w: WorkerHandle, what: str):
        """Hold ``w``'s pipe for a control request: stop its training segment, if any, and
        lease it before another segment can start (NOTE [One owner per pipe])."""
        deadline = time.monotonic() + max(self.task_timeout_s, self.startup_timeout_s) + 5
        while True:
            self._quiesce(w)
            if w.try_lease(0.05):
                break
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"worker {w.id} stayed busy", where=f"worker {w.id}, {what}")
        try:
            yield w
        finally:
            w.unlease()
