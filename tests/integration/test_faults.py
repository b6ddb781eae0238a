"""Faults never cost a wrong answer: with workers killed at any moment (the inference
worker mid-request, the training job's home, a replacement still booting), every reply
that comes back is the output of its own request's inputs, and the pool heals."""

import functools
import os
import random
import signal
import threading
import time

import pytest
import torch

import timeshare
from tests import models
from timeshare.errors import TimeshareError


def _reference(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return models.slow()(x, delay_s=0.0)


def test_every_reply_answers_its_own_request_while_workers_are_killed():
    rng = random.Random(0)
    wrong, failures, ok = [], 0, 0
    killed = set()  # the workers a kill reached
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2, profile_repeats=1, task_timeout_s=20,
                           startup_timeout_s=60) as rt:
        rt.register("slow", "tests.models:slow", None, (torch.randn(4, 64),), example_kwargs={"delay_s": 0.0})
        job = rt.train("bg", models.train_net, models.adam, models.endless_batches, models.train_step)
        for i in range(40):
            if job.wait(0):  # its home was killed: start it again, so training keeps contending
                job = rt.train(f"bg{i}", models.train_net, models.adam, models.endless_batches, models.train_step)
            if i % 4 == 0:
                rt.evict("slow")  # the next call loads, pipelined
            x = torch.randn(4, 64)
            if i % 3 == 1:  # kill a worker while the request is in flight
                pids = rt.worker_pids()
                victim = rng.choice(pids)
                timer = threading.Timer(rng.uniform(0.005, 0.08),
                                        functools.partial(lambda p: _kill(p) and killed.add(p), victim))
                timer.start()
            try:
                out = rt.infer("slow", x, delay_s=0.002)
            except TimeshareError:
                failures += 1
                continue
            finally:
                if i % 3 == 1:
                    timer.join()
            ok += 1
            if not torch.equal(out, _reference(x)):
                wrong.append(i)
        job.cancel()
        # Healed: the pool is back at its size and answers correctly.
        for _ in range(5):
            x = torch.randn(4, 64)
            assert torch.equal(rt.infer("slow", x, delay_s=0.0), _reference(x))
        assert len(rt.worker_pids()) == 2
        # The kills happened: each worker killed was replaced, and some requests failed with them.
        deadline = time.monotonic() + 60
        while rt.snapshot().workers.replacements < len(killed):
            assert time.monotonic() < deadline, (len(killed), rt.snapshot().workers)
            time.sleep(0.05)
    assert not wrong, f"wrong answers at requests {wrong} ({ok} correct, {failures} failed)"
    assert ok >= 20 and len(killed) >= 10 and failures >= 1, (ok, len(killed), failures)


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``pid``; whether the process was there to get it."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_worker_costs_one_call_deadline_not_the_request_timeout():
    """NOTE [Call deadlines]: once a model has answered a few calls, a worker that stops
    answering (SIGSTOP) is killed after the call's deadline (here 1 s: the floor, as the
    calls take milliseconds), far below the 60 s cap; the next call is served by the
    standby, correctly, while the replacement boots."""
    from timeshare.errors import WorkerTimeoutError

    with timeshare.Runtime(device="cpu", memory="4MiB", workers=2, profile_repeats=1, task_timeout_s=60,
                           task_deadline_min_s=1.0, task_deadline_factor=5.0, startup_timeout_s=60) as rt:
        rt.register("slow", "tests.models:slow", None, (torch.randn(4, 64),), example_kwargs={"delay_s": 0.0})
        x = torch.randn(4, 64)
        for _ in range(3):
            rt.infer("slow", x, delay_s=0.0)
        first = rt.worker_pids()[0]  # the pool's first ready worker takes a call when no training runs
        _kill(first, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(WorkerTimeoutError, match="did not answer within 1 s"):
                rt.infer("slow", x, delay_s=0.0)
        finally:
            _kill(first)  # the pool killed it already; never leave a stopped process behind
        assert time.monotonic() - t0 < 30  # one short deadline, not the 60 s cap
        assert first not in rt.worker_pids()
        assert torch.equal(rt.infer("slow", x, delay_s=0.0), _reference(x))
        workers = rt.snapshot().workers
        assert workers.failures["hung"] == 1 and workers.last_failure.kind == "hung"
        assert "did not answer within 1 s" in workers.last_failure.cause


def test_a_hung_training_worker_is_found_by_its_iteration_deadline():
    """A training segment's heartbeat is its Progress after every iteration: once the
    job's iterations are timed, a home worker that stops answering is killed after a
    short deadline, not the cap; the job fails with that cause."""
    from timeshare.errors import WorkerTimeoutError

    with timeshare.Runtime(device="cpu", memory="4MiB", workers=2, profile_repeats=1, task_timeout_s=60,
                           task_deadline_min_s=1.0, task_deadline_factor=5.0, startup_timeout_s=60) as rt:
        job = rt.train("bg", models.train_net, models.adam, models.endless_batches, models.train_step)
        deadline = time.monotonic() + 60
        while job.stats.iterations < 5:
            assert time.monotonic() < deadline and not job.wait(0), job.error
            time.sleep(0.01)
        before = set(rt.worker_pids())
        for pid in before:  # the home is one of the two; stopping both leaves no doubt which
            _kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            assert job.wait(30), "the job still waits on a stopped worker"
        finally:
            for pid in before:
                _kill(pid, signal.SIGCONT)
        assert time.monotonic() - t0 < 30
        assert isinstance(job.error, WorkerTimeoutError) and "training bg" in str(job.error), job.error
        assert rt.snapshot().workers.failures["hung"] == 1


def test_a_worker_killed_before_its_handshake_is_replaced():
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=2, profile_repeats=1, task_timeout_s=20,
                           startup_timeout_s=60) as rt:
        rt.register("slow", "tests.models:slow", None, (torch.randn(4, 64),), example_kwargs={"delay_s": 0.0})
        for _ in range(3):
            victim = rt.worker_pids()[0]
            _kill(victim)
            x = torch.randn(4, 64)
            deadline = time.monotonic() + 60
            while True:  # the call that meets the dead worker fails; the next ones are served
                try:
                    out = rt.infer("slow", x, delay_s=0.0)
                    break
                except TimeshareError:
                    assert time.monotonic() < deadline, "the pool did not heal"
            assert torch.equal(out, _reference(x))
            while victim in rt.worker_pids():  # replaced by whoever saw it die first
                assert time.monotonic() < deadline, "the dead worker was not replaced"
                time.sleep(0.05)
            assert len(rt.worker_pids()) == 2
        # With no request at all, the pool returns to its size, every worker ready.
        idle = rt.worker_pids()[1]
        _kill(idle)
        deadline = time.monotonic() + 60
        while idle in rt.worker_pids() or rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline, rt.snapshot().workers
            time.sleep(0.1)
        assert rt.snapshot().workers.replacements >= 4


def _bare_worker():
    """One worker process on a small CPU arena, outside any runtime."""
    from timeshare import protocol as P
    from timeshare.executor.handle import WorkerHandle, spawn_context
    from timeshare.memory.arena import Arena

    arena = Arena(torch.device("cpu"), 1 << 20)
    start = P.Start(worker=0, parent_pid=os.getpid(), device="cpu", arena=arena.share(), arena_capacity=arena.capacity,
                    profile_repeats=1, fixed_group_bytes=1 << 20, load_timeout_s=10.0)
    return arena, WorkerHandle(spawn_context(), start)


def test_a_reply_left_in_the_pipe_is_never_taken_for_the_next_requests():
    """A request abandoned after sending leaves its reply in the pipe; the next request
    must get its own reply, not that one."""
    from timeshare import protocol as P

    arena, w = _bare_worker()
    try:
        with w.leased(60, "test"):
            w.wait_ready(60)
            w.post(P.GetJobState(1, "no such job"))  # answered with a Failure nobody reads
            reply = w.request(P.DropJob(2, "x"), 30, "dropping x")
            assert isinstance(reply, P.Ack) and reply.seq == 2
    finally:
        w.stop()
        arena.close()


def test_only_the_lease_holder_may_talk_to_a_worker():
    from timeshare import protocol as P

    arena, w = _bare_worker()
    try:
        with w.leased(60, "test"):
            w.wait_ready(60)
            errors = []

            def intruder():
                try:
                    w.request(P.DropJob(5, "x"), 5, "intruding")
                except RuntimeError as exc:
                    errors.append(exc)
                assert not w.try_lease()  # held by the test's thread

            t = threading.Thread(target=intruder)
            t.start()
            t.join(30)
            assert errors and "does not hold its lease" in str(errors[0])
            assert w.request(P.DropJob(6, "x"), 30, "dropping x").seq == 6  # the owner is unaffected
    finally:
        w.stop()
        arena.close()


def test_the_server_reports_its_workers_and_is_not_ready_while_none_can_serve():
    import httpx

    from tests.serving import running_server, tiny_config

    cfg = tiny_config(runtime={"workers": 2}, models=[{"name": "mlp", "zoo": "tiny_mlp"}])
    with running_server(cfg) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        assert http.get("/v2/health/ready").status_code == 200
        workers = http.get("/admin/status").json()["workers"]
        assert workers["size"] == 2 and workers["ready"] == 2
        metrics = http.get("/metrics").text
        assert "timeshare_workers_ready 2.0" in metrics and "timeshare_worker_replacements_total 0.0" in metrics
        for pid in s.service.runtime.worker_pids():  # every worker at once: nothing can serve for a while
            _kill(pid)
        saw_unready, reasons = False, set()
        deadline = time.monotonic() + 60
        while True:
            ready = http.get("/v2/health/ready").status_code == 200
            saw_unready |= not ready
            whole = http.get("/admin/status").json()
            status = whole["workers"]
            if whole["not_ready_reason"]:
                reasons.add(whole["not_ready_reason"])
            if saw_unready and ready and status["ready"] == 2:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.005)
        assert status["replacements"] >= 2
        # While unready, /admin/status said why: no worker could serve, and what killed the last one.
        assert any(r.startswith("no worker can serve") and "killed by signal 9" in r for r in reasons), reasons
        assert whole["ready"] and whole["not_ready_reason"] is None
        metrics = http.get("/metrics").text
        assert f"timeshare_worker_replacements_total {float(status['replacements'])}" in metrics
        # Why: the latest replaced worker, and the replacements counted by what went wrong.
        last = status["last_failure"]
        assert last["kind"] == "crashed" and "killed by signal 9 (SIGKILL)" in last["cause"], last
        assert status["failures"]["crashed"] >= 2
        assert f'timeshare_worker_failures_total{{kind="crashed"}} {float(status["failures"]["crashed"])}' in metrics
