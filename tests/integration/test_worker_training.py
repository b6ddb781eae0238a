"""Training jobs in worker processes: the switch protocol, exact state across
preemptions, and faults during training."""

import functools
import os
import signal
import time

import pytest
import torch

import timeshare
from tests import models
from timeshare.errors import ConfigError, RemoteError, UnknownModelError, WorkerCrashedError, WorkerTimeoutError
from timeshare.executor.interface import WorkerRow

X = torch.randn(2, 8)


def uninterrupted():
    with timeshare.Runtime(device="cpu", memory="8MiB") as rt:
        job = rt.train("t", models.train_net, models.adam, models.train_batches(), models.train_step, seed=3)
        job.result(timeout=120)
        return job.state_dict(), job.stats.losses


@pytest.fixture(scope="module")
def expected():
    return uninterrupted()


@pytest.fixture(scope="module")
def rt():
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2, profile_repeats=1, task_timeout_s=20) as r:
        r.register("inf", "tests.models:out_of_order", None, (X,))
        yield r


def home_of(rt, job) -> WorkerRow:
    """The job's home worker as the pool reports it: its id, pid and state."""
    workers = rt.snapshot().workers
    home = workers.homes[job]
    return next(w for w in workers.workers if w.id == home)


@pytest.mark.parametrize("offload", [False, True])
def test_a_job_in_a_worker_preempted_many_times_ends_exactly_like_an_uninterrupted_run(rt, expected, offload):
    ref = rt.infer("inf", X)
    before = len(rt.switches())
    job = rt.train("t", models.train_net, models.adam, functools.partial(models.train_batches, 150),
                   models.train_step, seed=3, offload=offload)
    paused_once = False
    while not job.wait(0):
        rt.evict("inf")  # a switch with a pipelined load each time
        assert torch.equal(rt.infer("inf", X)["y"], ref["y"])
        if not paused_once and job.stats.iterations > 10:
            job.pause()
            time.sleep(0.3)
            seen = job.stats.iterations
            time.sleep(0.2)
            assert job.status == "paused" and job.stats.iterations == seen
            job.resume()
            paused_once = True
    stats = job.result(timeout=120)
    assert job.status == "finished" and stats.iterations == 150 and paused_once
    assert stats.preemptions >= 10
    # Measured in the worker at the second iteration, reported with the segment's end.
    assert stats.persistent_bytes is not None and stats.persistent_bytes > 0 and stats.ephemeral_bytes > 0
    if offload:
        # A segment preempted before its first step finds the state still offloaded: no move.
        assert 0 < stats.offloads <= stats.preemptions
    got = job.state_dict()
    want, want_losses = expected
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert stats.losses == want_losses

    # Every switch from the job to an inference was measured, component by component.
    switches = [s for s in rt.switches()[before:] if s["job"] == "t"]
    assert len(switches) >= 10
    for s in switches:
        assert s["model"] == "inf" and s["total_s"] > 0 and s["start_s"] >= 0
        assert s["load_s"] is not None and s["load_s"] >= 0  # evicted each time: a real load
    stopped = [s for s in switches if s["stop_s"] is not None]
    assert len(stopped) >= len(switches) - 1 and all(s["clean_s"] >= 0 for s in stopped)


def test_inference_never_runs_on_the_training_worker(rt):
    job = rt.train("endless", models.train_net, models.adam, models.endless_batches, models.train_step)
    try:
        models.wait_until(lambda: job.stats.iterations >= 3, what="3 iterations")
        home = home_of(rt, "endless")
        assert home.id != rt.snapshot().workers.workers[0].id  # the first worker stays free
        for _ in range(5):
            rt.infer("inf", X)
        # A request that lands between two of the job's segments finds the device free and
        # preempts nothing (a loaded machine once did so five times running): more requests
        # come until one finds a segment running, each on the free worker.
        def preempted() -> bool:
            rt.infer("inf", X)
            return job.stats.preemptions >= 1

        models.wait_until(preempted, timeout_s=30, what="a preemption by an inference")
        assert job.status == "running"
        assert home_of(rt, "endless").id == home.id  # the job never moved
    finally:
        job.cancel()
    assert job.wait(30) and job.status == "cancelled"


def test_a_failing_step_fails_its_job_with_where_it_happened(rt):
    job = rt.train("bad", models.train_net, models.adam, models.train_batches(3), models.exploding_step)
    with pytest.raises(RemoteError, match="step exploded") as info:
        job.result(timeout=60)
    assert "train bad (iteration 1)" in info.value.where and info.value.in_task
    assert job.status == "failed"
    assert rt.infer("inf", X)["y"].shape == (2, 8)


def test_training_with_workers_needs_picklable_parts_and_a_free_worker(rt):
    with pytest.raises(ConfigError, match="model must be picklable"):
        rt.train("t2", lambda: models.train_net(), models.adam, models.train_batches(2), models.train_step)
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=1) as one:
        with pytest.raises(ConfigError, match="needs workers >= 2"):
            one.train("t", models.train_net, models.adam, models.train_batches(2), models.train_step)


def kill(pid):
    os.kill(pid, signal.SIGKILL)


def test_killing_the_training_worker_fails_the_job_and_keeps_everything_else(rt):
    """3 times (each spawns a replacement worker: seconds on 2 cores; a descriptor left
    open per dead worker passes the bound of 2 below): the job fails saying where; queued
    inference runs; a fresh worker replaces the dead one; nothing leaks (the suite checks
    shared memory too)."""
    ref = rt.infer("inf", X)
    fds = len(os.listdir("/proc/self/fd"))
    replaced = rt.snapshot().workers.replacements
    for i in range(3):
        job = rt.train(f"k{i}", models.train_net, models.adam, models.endless_batches, models.train_step)
        while job.stats.iterations < 2 and not job.wait(0):
            time.sleep(0.005)
        home = home_of(rt, f"k{i}")
        queued = [rt.submit("inf", X) for _ in range(3)]
        kill(home.pid)
        with pytest.raises(WorkerCrashedError, match="killed by signal 9") as info:
            job.result(timeout=60)
        assert f"training k{i}" in info.value.where and f"worker {home.id}" in info.value.where
        assert job.status == "failed"
        for f in queued:
            assert torch.equal(f.result(timeout=60)["y"], ref["y"])
        workers = rt.snapshot().workers.workers
        assert home.id not in [w.id for w in workers] and len(workers) == 2
        with pytest.raises(WorkerCrashedError, match="lost its state"):
            job.state_dict()
    assert rt.snapshot().workers.replacements == replaced + 3
    assert torch.equal(rt.infer("inf", X)["y"], ref["y"])
    assert len(os.listdir("/proc/self/fd")) <= fds + 2


def test_a_hung_training_step_is_killed_at_the_deadline():
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=2, profile_repeats=1, task_timeout_s=2) as rt:
        rt.register("inf", "tests.models:out_of_order", None, (X,))
        job = rt.train("hang", models.train_net, models.adam, models.train_batches(3), models.hanging_step)
        with pytest.raises(WorkerTimeoutError, match="did not answer within 2 s"):
            job.result(timeout=60)
        assert rt.infer("inf", X)["y"].shape == (2, 8)
        assert all(w.state != "dead" for w in rt.snapshot().workers.workers)


def test_a_finished_job_is_forgotten_with_the_state_its_worker_held(rt):
    job = rt.train("short", models.train_net, models.adam, models.train_batches(2), models.train_step)
    job.result(timeout=60)
    assert job.state_dict()  # its home worker still holds the state
    rt.forget_job("short")
    assert "short" not in rt.jobs()
    with pytest.raises(WorkerCrashedError, match="lost its state"):
        job.state_dict()  # gone from the worker too
    with pytest.raises(UnknownModelError):
        rt.forget_job("short")
