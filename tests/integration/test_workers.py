"""The multi-process runtime: the zoo's outputs exact in-process and in worker processes,
errors as data, crashes and hangs."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import timeshare
from tests import models
from tests.exact import nan_free, plain_outputs, same
from timeshare.errors import ConfigError, RemoteError, WorkerCrashedError, WorkerTimeoutError
from timeshare.executor.interface import WorkerRow
from timeshare.models.zoo import ZOO, weights_path
from timeshare.transfer.planner import STRATEGIES

X = torch.randn(4, 64)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def rt():
    with timeshare.Runtime(device="cpu", memory="64MiB", workers=2, profile_repeats=1, task_timeout_s=20,
                           poison_evicted=True) as r:  # NOTE [Poisoned reloads]
        r.register("slow", "tests.models:slow", None, (X,), example_kwargs={"delay_s": 0.0})
        yield r


@pytest.fixture
def runtime(request, workers):
    """A runtime of the test's mode with nothing resident: a fresh in-process one, or this
    module's worker runtime (spawning workers takes seconds) with its models evicted."""
    if workers:
        rt = request.getfixturevalue("rt")
        for name in rt.resident():
            rt.evict(name)
        yield rt
        return
    with timeshare.Runtime(device="cpu", memory="64MiB", profile_repeats=1,
                           poison_evicted=True) as r:  # NOTE [Poisoned reloads]
        yield r


# The small zoo in-process, and all of it but the plain MLP in worker processes.
EXACT = [pytest.param(name, 0, id=f"{name}-in-process") for name in ("tiny_mlp", "tiny_cnn", "tiny_bert", "tied_lm")] \
    + [pytest.param(name, 2, id=f"{name}-workers") for name in ("tiny_cnn", "tied_lm", "tiny_bert")]


@pytest.mark.parametrize("name, workers", EXACT)
def test_every_strategy_returns_exactly_the_plain_modules_outputs(runtime, name, workers):
    zoo = ZOO[name]
    w = weights_path(name)
    x = zoo.example_inputs(2)
    runtime.register(name, zoo.builder, w, x)
    try:
        first = runtime.infer(name, *x)  # the first load: whole copy, trace, profile
        ready = runtime.infer(name, *x)  # resident
        assert same(first, ready) and same(ready, plain_outputs(name, w, *x)) and nan_free(ready)
        for strategy in STRATEGIES:
            runtime.evict(name)  # the next load is pipelined into a poisoned block
            assert name not in runtime.resident()
            assert same(runtime.call(name, x, strategy=strategy).output, ready), strategy
            assert runtime.resident() == [name]
    finally:
        runtime.unregister(name)


def test_the_models_own_errors_come_back_with_where_they_happened(rt):
    with pytest.raises(RemoteError) as err:
        rt.infer("slow", X, delay_s=0.0, fail=True)
    assert err.value.remote_type == "builtins.ValueError" and err.value.in_task  # the model's, not the worker's
    assert "the model itself failed" in str(err.value)
    assert "worker" in err.value.where and "run slow" in err.value.where
    assert "ValueError" in err.value.remote_traceback
    replacements = rt.snapshot().workers.replacements
    assert rt.infer("slow", X, delay_s=0.0).shape == (4, 64)  # the worker is fine
    assert rt.snapshot().workers.replacements == replacements


def first_worker(rt) -> WorkerRow:
    """The pool's first worker (the one a call goes to when nothing trains): id, pid, state."""
    return rt.snapshot().workers.workers[0]


def _kill_during(rt, call, delay_s: float):
    """Run ``call`` in a thread and SIGKILL the active worker ``delay_s`` into it."""
    deadline = time.monotonic() + 60
    while rt.snapshot().workers.ready < 2:  # a replacement still starting would not be the active one
        assert time.monotonic() < deadline
        time.sleep(0.02)
    victim = first_worker(rt)
    result = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    time.sleep(delay_s)
    os.kill(victim.pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    return victim, result


@pytest.mark.parametrize("phase", ["inference", "load"])
def test_killed_workers_fail_their_task_and_are_replaced(rt, phase):
    fds_before = len(os.listdir("/proc/self/fd"))
    reference = rt.infer("slow", X, delay_s=0.0)
    assert nan_free(reference)
    dead = []
    # Each round spawns a replacement worker (seconds on 2 cores). Three rounds: a dead
    # worker's pipe or sentinel left open would pass the bound of 2 fds below.
    for _ in range(3):
        if phase == "load":
            rt.evict("slow")  # the killed call is loading the model
        else:
            rt.infer("slow", X, delay_s=0.0)  # resident: the killed call only computes
        victim, result = _kill_during(rt, lambda: rt.infer("slow", X, delay_s=0.01), 0.05)
        err = result.get("error")
        assert isinstance(err, WorkerCrashedError), result
        assert f"worker {victim.id} was killed by signal 9" in str(err) and "running slow" in str(err)
        dead.append(victim.pid)
        assert same(rt.infer("slow", X, delay_s=0.0), reference)  # a standby took over, nothing lost
    assert not any(alive(pid) for pid in dead)
    workers = rt.snapshot().workers.workers
    assert len(workers) == 2 and all(w.state != "dead" for w in workers)
    assert len(os.listdir("/proc/self/fd")) - fds_before <= 2  # pipes and sentinels of dead workers are closed


def test_killing_every_worker_mid_load_fails_the_call_and_gives_its_block_back(tmp_path):
    """The CPU twin of the CUDA kill mid-load (tests/gpu/test_cuda.py). A task whose worker
    dies is not run again on a replacement: the caller gets WorkerCrashedError, the block
    placed for the load is given back, and the replacements load the model exactly."""
    begun = tmp_path / "begun"
    # Every group's copy held back (a layer-by-layer load of 64 groups), evicted blocks
    # poisoned (NOTE [Poisoned reloads]); the killed call's forward holds once it has begun
    # (tests.models.Held), so the kill surely lands before any answer, whatever the load.
    with timeshare.Runtime(device="cpu", memory="64MiB", workers=2, profile_repeats=1, task_timeout_s=20,
                           copy_delay_s=0.005, poison_evicted=True) as rt:
        rt.register("held", "tests.models:held", None, (X,), example_kwargs={"begun": ""})
        reference = rt.infer("held", X)  # the first load: profiled
        assert nan_free(reference)
        rt.evict("held")
        used, health = rt.stats()["used_bytes"], rt.snapshot().workers
        pids = rt.worker_pids()
        result: dict = {}

        def load():
            try:
                result["call"] = rt.call("held", (X,), {"begun": str(begun)}, strategy="per_layer")
            except BaseException as exc:  # handed to the test
                result["error"] = exc

        t = threading.Thread(target=load)
        t.start()
        models.wait_until(begun.exists, 60, "the load's forward to begin")
        serving = [w.id for w in rt.snapshot().workers.workers if w.state == "busy"]
        for pid in pids:  # both: no standby is left to take the task over
            os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        err = result.get("error")
        assert isinstance(err, WorkerCrashedError), result
        assert len(serving) == 1 and f"worker {serving[0]} was killed by signal 9" in str(err), (serving, err)
        assert "running held" in str(err)
        assert not rt.is_resident("held") and rt.stats()["used_bytes"] == used  # the load's block is free
        models.wait_until(lambda: rt.snapshot().workers.replacements >= health.replacements + 2
                          and rt.snapshot().workers.ready == 2, 120, "two replacements ready")
        assert rt.snapshot().workers.failures["crashed"] == health.failures["crashed"] + 2
        assert not set(rt.worker_pids()) & set(pids)
        call = rt.call("held", (X,))  # into the poisoned block, by a replacement
        assert call.record.loaded and same(call.output, reference)


def test_a_hung_worker_is_killed_at_the_deadline_and_replaced():
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2, profile_repeats=1, task_timeout_s=1.0) as rt:
        rt.register("slow", "tests.models:slow", None, (X,), example_kwargs={"delay_s": 0.0})
        reference = rt.infer("slow", X, delay_s=0.0)
        assert nan_free(reference)
        hung = first_worker(rt).pid
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"did not answer within 1 s; it was killed"):
            rt.infer("slow", X, delay_s=1.0)  # 20 layers x 1 s
        assert time.monotonic() - t0 < 10
        assert not alive(hung)
        assert same(rt.infer("slow", X, delay_s=0.0), reference)


def test_registration_needs_what_workers_can_rebuild():
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=1) as rt:
        with pytest.raises(ConfigError, match="example_inputs"):
            rt.register("m", "tests.models:slow")
        with pytest.raises(ConfigError, match="'module:function' string or a top-level function"):
            rt.register("m", lambda: models.slow(), None, (X,))
        assert rt.models() == []
    with pytest.raises(ConfigError, match="workers must be a non-negative integer"):
        timeshare.Runtime(device="cpu", memory="16MiB", workers=-1)


def test_close_leaves_no_process_and_workers_die_with_their_controller(tmp_path):
    rt = timeshare.Runtime(device="cpu", memory="16MiB", workers=2)
    pids = rt.worker_pids()
    assert all(alive(p) for p in pids)
    rt.close()
    assert not any(alive(p) for p in pids)

    # A controller killed without closing: its workers notice and exit on their own.
    script = tmp_path / "controller.py"
    script.write_text(
        "import os, signal, sys, timeshare\n"
        "if __name__ == '__main__':\n"
        "    rt = timeshare.Runtime(device='cpu', memory='16MiB', workers=2)\n"
        "    print(*rt.worker_pids(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    orphans = [int(p) for p in out.stdout.split()]
    assert len(orphans) == 2, out.stderr
    deadline = time.monotonic() + 15
    while any(alive(p) for p in orphans) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in orphans)


def test_a_worker_computes_in_its_controllers_environment_as_it_is_when_the_worker_starts(monkeypatch):
    """NOTE [Fork server]: workers fork from a server started with the first of them; a
    variable set after that still reaches the workers started after it."""
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=1):
        pass  # the fork server is running now, with this environment
    monkeypatch.setenv("TIMESHARE_TEST_MARK", "after")
    x = torch.ones(1, 4)
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2) as rt:
        rt.register("env", "tests.models:env_probe", None, (x,))
        assert rt.infer("env", x).item() == 5.0
        assert rt.snapshot().workers.ready == 2


def test_a_profile_measured_by_one_worker_serves_every_other():
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2, profile_repeats=1) as rt:
        rt.register("cnn", ZOO["tiny_cnn"].builder, weights_path("tiny_cnn"), ZOO["tiny_cnn"].example_inputs(2))
        x = ZOO["tiny_cnn"].example_inputs(2)
        ref = rt.infer("cnn", *x)  # the first load profiles, in the active worker
        assert rt.snapshot().workers.profilings == 1
        first = first_worker(rt).pid
        rt.evict("cnn")
        os.kill(first, signal.SIGKILL)  # idle: the pool's watcher replaces it
        deadline = time.monotonic() + 60
        while first in rt.worker_pids() or rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Whichever worker serves now is sent the profile with its first task: it loads
        # pipelined at once and measures nothing.
        assert torch.equal(rt.infer("cnn", *x), ref)
        rt.evict("cnn")
        assert torch.equal(rt.infer("cnn", *x), ref)
        workers = rt.snapshot().workers
        assert workers.profilings == 1
        assert any(w.profiles == 1 for w in workers.workers)


def test_every_spawned_worker_gets_its_own_arena_handle(monkeypatch):
    # A CUDA IPC handle carries a reference count that one receiving process consumes, so
    # the pool asks the arena for a fresh handle per worker it spawns, replacements included.
    from timeshare.memory.arena import Arena

    made = []
    share = Arena.share

    def counting(self):
        made.append(share(self))
        return made[-1]

    monkeypatch.setattr(Arena, "share", counting)
    with timeshare.Runtime(device="cpu", memory="16MiB", workers=2, profile_repeats=1) as rt:
        deadline = time.monotonic() + 60
        while rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(made) == 2
        victim = rt.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        while victim in rt.worker_pids() or rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(made) == 3
