"""One owner of a switch (NOTE [Switch records], NOTE [Switch protocol]): the dispatcher
decides a preemption and makes its record, which reaches both the job's stop and the
inference's turn; a running segment alone sends its stop, once, reads its worker's
replies and fills in the record's stop and clean times."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from timeshare import protocol as P
from timeshare.executor.deadline import Deadlines
from timeshare.executor.segments import Segment, Segments, Switch
from timeshare.runtime.dispatch import Dispatcher
from timeshare.scheduler.task import Kind


@dataclass
class _Stats:
    iterations: int = 2
    step_seconds: float = 0.01
    ephemeral_bytes: int | None = None
    persistent_bytes: int | None = None


class _Job:
    def __init__(self, name: str):
        self.name, self.iterations, self.stats = name, None, _Stats()
        self.cancelled = self.paused = False
        self.stops: list[Switch | None] = []
        self.stopped = threading.Event()

    def stop(self, switch: Switch | None = None) -> None:
        self.stops.append(switch)
        self.stopped.set()


def test_a_preemption_for_an_inference_gives_one_record_to_the_stop_and_to_the_turn():
    gate = Dispatcher("priority")
    job = _Job("train")
    gate.job_task(job)
    gate.wait_for_training_turn(job)  # the job has the device
    assert gate.holds_turn(job)
    turns = []

    def inference():
        with gate.hold("resnet", Kind.INFERENCE) as turn:
            turns.append(turn)

    caller = threading.Thread(target=inference)
    caller.start()
    assert job.stopped.wait(10), "the job was never told to stop"
    assert len(job.stops) == 1 and job.stops[0] is not None
    switch = job.stops[0]
    assert (switch.job, switch.model) == ("train", "resnet") and switch.stop_s is None
    resumed = threading.Thread(target=gate.wait_for_training_turn, args=(job,))
    resumed.start()  # the job reports its stop, if the inference waits for it, and waits for its turn
    caller.join(10)
    resumed.join(10)
    assert not caller.is_alive() and not resumed.is_alive()
    assert turns[0].switch is switch  # the same record: no map, no claim
    # A stop for anything but an inference carries no record.
    with gate.hold():
        pass
    assert job.stops[0] is switch and all(s is None for s in job.stops[1:])


@dataclass(eq=False)
class _Worker:
    """A worker's pipe: what the controller posts, and the replies it reads, in order."""

    replies: list = field(default_factory=list)
    posted: list = field(default_factory=list)
    id: int = 1

    def post(self, msg) -> None:
        self.posted.append(msg)

    def receive(self, timeout: float, what: str, seq: int):
        assert timeout > 0
        return self.replies.pop(0)


def _stopped(seq: int, at: float, cleaned: float) -> P.SegmentStopped:
    return P.SegmentStopped(seq, "preempted", _Stats(), at, cleaned)


def test_a_segment_sends_its_stop_once_and_fills_in_its_switch():
    now = time.perf_counter()
    worker = _Worker([P.Progress(7, 1, 0.5, 0.01), _stopped(7, now + 0.03, now + 0.05)])
    seg = Segment("train", worker, 7)  # type: ignore[arg-type]
    switch = Switch("train", "resnet", now)
    assert seg.stop(now, switch) is switch
    assert seg.stop(now + 1, Switch("train", "other", now + 1)) is None  # the first record stays
    assert [type(m) for m in worker.posted] == [P.PreemptSegment] and worker.posted[0].seq == 7
    seen = []
    reply = seg.follow(Deadlines(60.0), 60.0, seen.append)
    assert reply.reason == "preempted" and [p.iterations for p in seen] == [1]
    assert switch.stop_s == pytest.approx(0.03) and switch.clean_s == pytest.approx(0.02)


def test_an_error_in_the_controller_stops_the_segment_and_is_raised_once_it_has():
    now = time.perf_counter()
    worker = _Worker([P.Progress(3, 1, None, 0.01), P.Progress(3, 2, None, 0.01), _stopped(3, now, now)])
    seg = Segment("train", worker, 3)  # type: ignore[arg-type]

    def broken(progress):
        raise RuntimeError("the controller's own error")

    with pytest.raises(RuntimeError, match="controller's own"):
        seg.follow(Deadlines(60.0), 60.0, broken)
    assert [type(m) for m in worker.posted] == [P.PreemptSegment]
    assert not worker.replies  # it read on until the segment stopped


def test_a_task_makes_the_record_only_for_a_segment_that_has_none():
    segments = Segments()
    worker = _Worker()
    segments.start("train", worker, 1)  # type: ignore[arg-type]
    now = time.perf_counter()
    decided = Switch("train", "resnet", now)
    assert segments.preempt(now, job="train", switch=decided) is decided  # the dispatcher's stop
    assert segments.preempt(now, for_model="resnet") is None  # the task finds it stopped, with a record
    assert segments.switches == [decided] and len(worker.posted) == 1
    segments.end(segments.running("train"))  # type: ignore[arg-type]
    segments.start("other", worker, 2)  # type: ignore[arg-type]
    own = segments.preempt(now, for_model="bert")  # a stop no scheduler decided: the task records it
    assert own is not None and (own.job, own.model) == ("other", "bert")
    assert segments.switches == [decided, own] and len(worker.posted) == 2


def test_a_job_keeps_the_home_chosen_for_it_while_its_first_segment_waits():
    """A job whose first segment could not start asks for a home again: it keeps the one
    it was given, so two jobs never end up sharing a home that had room for each."""
    segments = Segments()
    workers = [_Worker(id=i) for i in range(3)]  # the first stays free for inference
    a = segments.new_home("a", workers)  # type: ignore[arg-type]
    b = segments.new_home("b", workers)  # type: ignore[arg-type]
    assert a is not b and workers[0] not in (a, b)
    for _ in range(3):  # their first segments retry
        assert segments.new_home("b", workers) is b  # type: ignore[arg-type]
        assert segments.new_home("a", workers) is a  # type: ignore[arg-type]
