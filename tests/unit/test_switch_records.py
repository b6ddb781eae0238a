"""One decider and one owner of a switch (NOTE [Switch records], NOTE [Switch protocol]):
the dispatcher decides every stop, makes the switch's record, hands it to the
inference's turn and fills it in from what the job's stop and the inference's call
report; a running segment alone sends its stop, once, and reads its worker's replies."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from timeshare import protocol as P
from timeshare.executor.deadline import Deadlines
from timeshare.executor.segments import Segment, Segments
from timeshare.runtime.dispatch import SHARE_S, Dispatcher
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
        self.stops = 0
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stops += 1
        self.stopped.set()


def _timings(received_at: float, sent_at: float, load_s: float | None) -> P.CallTimings:
    return P.CallTimings(received_at, 0.0, 0.0, 0.0, 0.0, 0.0, worker=1, load_s=load_s, sent_at=sent_at)


def test_a_preemption_for_an_inference_makes_one_record_that_the_dispatcher_fills_in():
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
    assert job.stops == 1
    [record] = gate.switches()
    assert (record["job"], record["model"]) == ("train", "resnet") and record["stop_s"] is None
    now = time.perf_counter()
    gate.job_stopped(job, now, now + 0.03, now + 0.05)  # what its worker's reply said
    resumed = threading.Thread(target=gate.wait_for_training_turn, args=(job,))
    resumed.start()  # the job reports its stop, if the inference waits for it, and waits for its turn
    caller.join(10)
    resumed.join(10)
    assert not caller.is_alive() and not resumed.is_alive()
    switch = turns[0].switch  # the inference's turn holds the same record
    assert switch is not None and switch.as_dict()["stop_s"] == pytest.approx(0.03)
    gate.served(switch, _timings(received_at=now + 0.01, sent_at=now, load_s=0.2))
    [record] = gate.switches()
    assert record["clean_s"] == pytest.approx(0.02) and record["start_s"] == pytest.approx(0.01)
    assert record["load_s"] == 0.2 and record["total_s"] > 0
    # A stop for anything but an inference makes no record.
    with gate.hold():
        pass
    assert len(gate.switches()) == 1


def test_a_job_still_stopping_when_an_inference_starts_is_the_switch_it_made():
    """A job stopped for a control call (an eviction, say) that has not yet reported its
    stop when an inference starts: that inference is the switch, recorded once; after the
    job has reported, an inference is no switch."""
    gate = Dispatcher("priority")
    job = _Job("train")
    gate.job_task(job)
    gate.wait_for_training_turn(job)
    with gate.hold():  # a control call stops the job: no record
        pass
    assert job.stopped.wait(10) and gate.switches() == []
    with gate.hold("resnet", Kind.INFERENCE) as turn:
        assert turn.switch is not None and (turn.switch.job, turn.switch.model) == ("train", "resnet")
    with gate.hold("resnet", Kind.INFERENCE) as again:
        assert again.switch is None  # one record per stop
    assert len(gate.switches()) == 1
    now = time.perf_counter()
    gate.job_stopped(job, now, now + 0.01, now + 0.01)
    assert gate.switches()[0]["stop_s"] == pytest.approx(0.01)
    gate.job_ended(job)


def test_a_stop_no_segment_reported_is_timed_when_the_job_stops_here_and_leaves_nothing_behind():
    """A job paused after an inference stopped it (no segment reports a stop: it stopped
    in this process, or before its segment began): the record gets the time until the job
    stopped, and a later inference's stop has its own record."""
    gate = Dispatcher("priority")
    job = _Job("train")
    gate.job_task(job)
    gate.wait_for_training_turn(job)
    turns = []

    def inference(model):
        with gate.hold(model, Kind.INFERENCE) as turn:
            turns.append(turn)

    first = threading.Thread(target=inference, args=("a",))
    first.start()
    assert job.stopped.wait(10)
    job.paused = True  # then paused, before it reports its stop: the pause's branch reports it
    parked = threading.Thread(target=gate.wait_for_training_turn, args=(job,))
    parked.start()
    first.join(10)
    assert not first.is_alive()
    [record] = gate.switches()
    assert record["model"] == "a" and record["stop_s"] is not None and record["clean_s"] == 0.0
    job.paused = False
    job.stopped.clear()
    gate.notify()
    parked.join(10)
    assert not parked.is_alive() and gate.holds_turn(job)
    [second] = _stopped_by(gate, job, "b", 0.04)
    records = gate.switches()
    assert [r["model"] for r in records] == ["a", "b"] and records[1]["stop_s"] == pytest.approx(0.04)
    assert second.switch is not None and second.switch.model == "b"
    gate.job_ended(job)


def _stopped_by(gate: Dispatcher, job: _Job, model: str, stop_s: float) -> list:
    """An inference of ``model`` stops the running ``job``, whose worker reports a stop of
    ``stop_s``; then the job waits for its turn again. The inference's grant."""
    seen = []

    def inference():
        with gate.hold(model, Kind.INFERENCE) as grant:
            seen.append(grant)

    job.stopped.clear()
    caller = threading.Thread(target=inference)
    caller.start()
    assert job.stopped.wait(10), "the job was never told to stop"
    now = time.perf_counter()
    gate.job_stopped(job, now, now + stop_s, now + stop_s)
    resumed = threading.Thread(target=gate.wait_for_training_turn, args=(job,))
    resumed.start()
    caller.join(10)
    resumed.join(10)
    assert not caller.is_alive() and not resumed.is_alive()
    return seen


class _SlowToLook:
    """A job thread's waiter whose wake-up is seen late: the thread named ``J`` holds on
    after it is released until ``go`` is set, so that more happens before it looks."""

    def __init__(self, go: threading.Event):
        self.go, self.grant = go, None
        self.lock = self
        self._lock = threading.Lock()
        self._lock.acquire()

    def acquire(self, timeout: float = -1) -> bool:
        got = self._lock.acquire(timeout=timeout)
        if got and threading.current_thread().name == "J":
            self.go.wait(10)
        return got

    def release(self) -> None:
        self._lock.release()


class _SlowJobDispatcher(Dispatcher):
    def __init__(self, go: threading.Event):
        super().__init__("priority")
        self.go = go

    def _new_waiter(self):
        return _SlowToLook(self.go)


def test_a_job_stopped_then_paused_before_it_looked_leaves_no_record_behind():
    """The job's thread, woken to run, is slow to look; meanwhile an inference stops it
    and it is paused: it reports its stop from the pause, and the next inference's
    switch gets a record of its own, filled in with that stop's times."""
    go = threading.Event()
    gate = _SlowJobDispatcher(go)
    job = _Job("t")
    gate.job_task(job)
    gate.wait_for_training_turn(job)
    release = threading.Event()

    def control():
        with gate.hold():
            release.wait(10)

    holder = threading.Thread(target=control)
    holder.start()
    assert job.stopped.wait(10)
    looker = threading.Thread(target=gate.wait_for_training_turn, args=(job,), name="J")
    looker.start()
    time.sleep(0.2)  # it sleeps in the queue
    release.set()
    holder.join(10)  # its end starts the job again; the job's thread has yet to look
    with gate.hold("m", Kind.INFERENCE) as first:
        assert first.switch is not None  # the job stops again, for this inference
    job.paused = True
    go.set()  # it looks now: paused, it reports its stop there
    time.sleep(0.3)
    job.paused = False
    gate.notify()
    looker.join(10)
    assert not looker.is_alive() and gate.holds_turn(job)
    [second] = _stopped_by(gate, job, "m2", 0.5)
    assert second.switch is not None and second.switch.model == "m2"
    records = gate.switches()
    assert [r["model"] for r in records] == ["m", "m2"]
    assert records[1]["stop_s"] == pytest.approx(0.5)  # its own stop, not written into the first record
    gate.job_ended(job)


def test_jobs_sharing_a_home_take_turns_the_dispatcher_decides():
    gate = Dispatcher("priority")
    waiting, holder = _Job("a"), _Job("b")
    gate.job_task(waiting)
    gate.job_task(holder)
    gate.share_home(waiting, "b", SHARE_S / 2)
    assert holder.stops == 0  # it has not had its turn yet
    gate.share_home(waiting, "b", SHARE_S)
    assert holder.stops == 1 and waiting.stops == 0
    gate.share_home(waiting, "a", SHARE_S * 10)  # a job never stops itself for itself
    assert waiting.stops == 0


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


def test_a_segment_sends_its_stop_once():
    now = time.perf_counter()
    worker = _Worker([P.Progress(7, 1, 0.5, 0.01), _stopped(7, now + 0.03, now + 0.05)])
    seg = Segment("train", worker, 7)  # type: ignore[arg-type]
    seg.stop(now)
    seg.stop(now + 1)
    assert [type(m) for m in worker.posted] == [P.PreemptSegment] and worker.posted[0].seq == 7
    assert seg.preempted_at == now  # the first stop's time: what the job reports to the dispatcher
    seen = []
    reply = seg.follow(Deadlines(60.0), 60.0, seen.append)
    assert reply.reason == "preempted" and [p.iterations for p in seen] == [1]
    assert reply.stopped_at == pytest.approx(now + 0.03)


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


def test_segments_stop_only_the_one_named():
    segments = Segments()
    first, second = _Worker(id=1), _Worker(id=2)
    segments.start("a", first, 1)  # type: ignore[arg-type]
    segments.start("b", second, 2)  # type: ignore[arg-type]
    now = time.perf_counter()
    segments.stop(now)  # nothing named: nothing stops
    assert not first.posted and not second.posted
    segments.stop(now, job="a")
    segments.stop(now, worker=second)  # type: ignore[arg-type]
    assert [m.seq for m in first.posted] == [1] and [m.seq for m in second.posted] == [2]


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
