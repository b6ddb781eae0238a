"""A training segment in a worker process: a :class:`~timeshare.worker.trainer.TrainingTask`'s
iterations until the job ends or the controller preempts the segment, with a ``Progress``
after each (runs in the worker; the controller's end is ``runtime/segments.py``).

The task itself knows nothing of who preempts it; this loop is where a worker process reads
what the controller said meanwhile, at each iteration boundary (NOTE [Preemption points] in
``runtime/training.py``).
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from timeshare import protocol as P
from timeshare.memory.ephemeral import in_lane
from timeshare.worker.trainer import TrainingTask


class SegmentShutdown(Exception):
    """Shutdown arrived in the middle of a training segment."""


class TaskFlag(Protocol):
    """Who reports a failure: ``in_task`` is set while the task's own code runs (a training
    step), so that its errors are told apart as the task's."""

    in_task: bool


def run_segment(conn: Connection, msg: P.Train, task: TrainingTask, device: torch.device,
                flag: TaskFlag) -> P.SegmentStopped:
    """Run a training segment: iterations until the job ends or a Preempt for this
    segment arrives (NOTE [Preemption points]). Progress after every iteration is
    also the controller's heartbeat. Raises :class:`SegmentShutdown` on a Shutdown."""
    reason = "finished"
    while not task.finished:
        if conn.poll(0):  # a preemption point: what the controller said meanwhile
            ctl = P.loads(conn.recv_bytes())
            if isinstance(ctl, P.Shutdown):
                raise SegmentShutdown
            if isinstance(ctl, P.PreemptSegment) and ctl.seq == msg.seq:
                reason = "preempted"
                break
            if not isinstance(ctl, P.PreemptSegment):
                raise TypeError(f"{type(ctl).__name__} arrived while training {msg.job}")
        t0 = time.perf_counter()
        flag.in_task = True
        try:
            with in_lane(msg.lane, device):  # NOTE [Lanes in the runtime]: no lane, no meter
                loss = task.step_once()
        except StopIteration:
            break
        flag.in_task = False
        seconds = time.perf_counter() - t0
        task.stats.step_seconds += seconds
        conn.send_bytes(P.dumps(P.Progress(msg.seq, task.stats.iterations, loss, seconds,
                                           task.stats.ephemeral_bytes, task.stats.persistent_bytes)))
    stopped = time.perf_counter()
    if reason == "preempted":
        task.preempted()  # cleaning: offload if the job asked for it
    return P.SegmentStopped(msg.seq, reason, task.stats, stopped, time.perf_counter())
