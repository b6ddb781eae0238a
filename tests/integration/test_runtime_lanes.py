"""Salus's lanes in the runtime (NOTE [Lanes in the runtime]): models of different lanes
run side by side, each bounded by its lane; one that outgrows its lane fails alone."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from timeshare.errors import ConfigError, LaneExceededError
from timeshare.runtime.facade import Runtime

X = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


class Meeting(nn.Module):
    """A linear layer whose forward, while ``barrier`` is set, waits for the forwards of
    the other models sharing the barrier: it completes only if they run at the same time."""

    barrier: threading.Barrier | None = None

    def __init__(self, seed: int, meet: bool = True):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        g = torch.Generator().manual_seed(seed)  # not the global state, which running jobs swap
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(64, 64, generator=g) * 0.1)
            self.lin.bias.copy_(torch.randn(64, generator=g) * 0.1)
        self.meet = meet

    def forward(self, x):
        y = self.lin(x)
        if self.meet and Meeting.barrier is not None:
            Meeting.barrier.wait(timeout=10)
        return torch.relu(y)


class Greedy(nn.Module):
    """Allocates as many floats as its input's first value says: same shape, any size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        scratch = torch.ones(int(x[0, 0].item()), 1024)
        return self.lin(x) + scratch.sum() * 0


@pytest.fixture
def packed():
    # Up to 4 lanes at once whatever the cores: these tests meet several forwards at a
    # barrier (NOTE [Lanes at once] caps them at the cores by default).
    rt = Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", lane_slots=4)
    yield rt
    Meeting.barrier = None
    rt.close()


def _reference(seed: int, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return Meeting(seed, meet=False)(x)


def test_models_of_different_lanes_run_at_the_same_time(packed):
    names = [f"m{i}" for i in range(3)]
    for i, n in enumerate(names):
        packed.register(n, lambda i=i: Meeting(i), example_inputs=(X,))
        packed.infer(n, X)  # the first call of a shape runs alone and measures it
    Meeting.barrier = threading.Barrier(len(names))
    outs: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def call(n):
        try:
            outs[n] = packed.infer(n, X)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors  # a broken barrier: the forwards did not overlap
    for i, n in enumerate(names):
        assert torch.equal(outs[n], _reference(i, X))
    lanes = packed.diagnostics().lanes
    assert lanes is not None and lanes.capacity == 4 << 20 and lanes.lanes == []  # all given back


def test_time_slicing_runs_them_one_at_a_time():
    with Runtime("cpu", "16MiB", scheduling="fifo") as rt:
        for i in range(2):
            rt.register(f"m{i}", lambda i=i: Meeting(i), example_inputs=(X,))
            rt.infer(f"m{i}", X)
        Meeting.barrier = threading.Barrier(2, timeout=1)
        errors: list[BaseException] = []

        def call(n):
            try:
                rt.infer(n, X)
            except BaseException as exc:
                errors.append(exc)

        try:
            threads = [threading.Thread(target=call, args=(f"m{i}",)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        finally:
            Meeting.barrier = None
        assert errors and all(isinstance(e, threading.BrokenBarrierError) for e in errors)


def test_a_task_that_outgrows_its_lane_fails_alone(packed):
    packed.register("greedy", Greedy, example_inputs=(torch.full((8, 64), 4.0),))
    small = torch.full((8, 64), 4.0)  # 16 KiB of scratch
    packed.infer("greedy", small)  # measured: the lane holds about this much
    for i in range(2):
        packed.register(f"m{i}", lambda i=i: Meeting(i), example_inputs=(X,))
        packed.infer(f"m{i}", X)
    Meeting.barrier = threading.Barrier(2)  # m0 and m1 meet while greedy overflows
    huge = torch.full((8, 64), 512.0)  # 2 MiB of scratch: same shape, far beyond its profile
    results: dict[str, object] = {}

    def call(n, x):
        try:
            results[n] = packed.infer(n, x)
        except BaseException as exc:
            results[n] = exc

    threads = [threading.Thread(target=call, args=a) for a in (("greedy", huge), ("m0", X), ("m1", X))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    err = results["greedy"]
    assert isinstance(err, LaneExceededError), err
    assert err.task == "greedy" and err.asked > err.lane_bytes and err.lane_bytes < (1 << 20)
    for i in range(2):
        assert torch.equal(results[f"m{i}"], _reference(i, X))
    # The failed task left its model usable and nothing held.
    assert torch.equal(packed.infer("greedy", small), _ref_greedy(packed, small))
    assert packed.diagnostics().lanes.lanes == []


def _ref_greedy(rt: Runtime, x: torch.Tensor) -> torch.Tensor:
    return rt.infer("greedy", x)  # deterministic: the same call twice gives the same bits


def test_evicting_a_running_model_waits_for_its_call(packed):
    packed.register("m0", lambda: Meeting(0), example_inputs=(X,))
    packed.infer("m0", X)
    Meeting.barrier = threading.Barrier(2)
    out: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: out.append(packed.infer("m0", X)))
    t.start()
    evicted: list[bool] = []
    e = threading.Thread(target=lambda: evicted.append(packed.evict("m0")))
    e.start()
    e.join(0.5)
    assert e.is_alive() and "m0" in packed.resident()  # the eviction waits for the running call
    Meeting.barrier.wait(timeout=10)  # let the forward finish
    t.join(10)
    e.join(10)
    assert evicted == [True] and torch.equal(out[0], _reference(0, X))


def test_the_profile_carries_ephemeral_bytes_and_sets_the_lane(packed):
    packed.register("m0", lambda: Meeting(0), example_inputs=(X,))
    profile = packed.profile("m0")
    assert profile.ephemeral_bytes == 2 * 8 * 64 * 4  # the linear's output and the relu's
    assert profile.summary()["ephemeral_bytes"] == profile.ephemeral_bytes


def _meeting_model() -> nn.Module:
    """The meeting jobs' model, its weights from a generator of its own.

    NOTE [Models built before jobs start]: every job's model is built before any job
    starts. ``nn.Linear`` draws its initial weights from the process's random state, which
    a running job's first iteration has swapped for its own (NOTE [One random state per
    process]): a model built meanwhile in this thread advanced that job's state, the job
    then counted as one that draws and held the random state's lock through every later
    iteration, barrier wait included, so the other job's first iteration waited for it
    and the barrier broke (about 1 run in 70 on a loaded machine)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _meeting_job(rt: Runtime, name: str, model: nn.Module, barrier: threading.Barrier, iterations: int = 8,
                 scratch=None):
    """A job whose iterations from the fourth on wait at ``barrier`` for the other job's
    (so both finish only if they run side by side); ``scratch(i)``: floats iteration i
    allocates besides. ``model``: from :func:`_meeting_model`, built before any job started."""
    done = [0]

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = model(batch).square().mean()
        if scratch is not None:
            loss = loss + torch.ones(scratch(done[0])).sum() * 0
        loss.backward()
        optimizer.step()
        done[0] += 1
        if done[0] >= 4:
            barrier.wait(timeout=30)  # a deadline only: met at once when the jobs run side by side
        return loss

    batches = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(iterations)]
    return rt.train(name, model, lambda p: torch.optim.SGD(p, lr=0.01), batches, step, iterations=iterations)


def test_training_jobs_in_different_lanes_run_side_by_side_and_train_as_alone(packed):
    alone = _meeting_job(packed, "alone", _meeting_model(), threading.Barrier(1))
    alone.wait(60)
    assert alone.error is None, alone.error
    want = alone.state_dict()
    barrier = threading.Barrier(2)
    models = [_meeting_model() for _ in range(2)]  # NOTE [Models built before jobs start]
    jobs = [_meeting_job(packed, f"job{i}", model, barrier) for i, model in enumerate(models)]
    for job in jobs:
        job.wait(60)
    for job in jobs:
        assert job.error is None, job.error  # a broken barrier: the iterations did not overlap
        got = job.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert jobs[0].stats.persistent_bytes > 0 and jobs[0].stats.ephemeral_bytes > 0


def test_a_job_that_outgrows_its_lane_fails_alone(packed):
    # Built before the jobs start: an in-process job's step swaps the process's random
    # state, which a module built meanwhile in another thread would draw its weights from
    # (NOTE [Models built before jobs start]).
    packed.register("m0", lambda: Meeting(0), example_inputs=(X,))
    models = [_meeting_model() for _ in range(3)]
    barrier = threading.Barrier(2)
    # From its sixth iteration on, the greedy job asks for 2 MiB more than it measured.
    greedy = _meeting_job(packed, "greedy", models[0], threading.Barrier(1),
                          scratch=lambda i: (1 << 19) if i >= 5 else 16)
    steady = [_meeting_job(packed, f"steady{i}", models[1 + i], barrier) for i in range(2)]
    for job in (greedy, *steady):
        job.wait(60)
    assert isinstance(greedy.error, LaneExceededError) and greedy.error.task == "greedy", greedy.error
    assert greedy.stats.iterations == 5
    for job in steady:
        assert job.error is None and job.stats.iterations == 8
    assert torch.equal(packed.infer("m0", X), _reference(0, X))


@pytest.mark.parametrize("options, words", [
    ({"lane_threads": 0}, "lane_threads must be a positive integer"),
    ({"lane_slots": 0}, "lane_slots must be a positive integer"),
    ({"lane_memory": "lots"}, "lane_memory"),
    ({"lane_memory": 0}, "lane_memory must be positive"),
])
def test_bad_lane_options_are_refused_before_anything_is_taken(options, words):
    with pytest.raises(ConfigError, match=words):
        Runtime("cpu", "16MiB", scheduling="pack", **options)


@pytest.mark.parametrize("ephemeral", [-1, 1.5, True, "8MiB"])
def test_a_turn_asking_for_a_bad_number_of_lane_bytes_is_refused_before_it_queues(ephemeral):
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", lane_slots=4) as rt:
        rt.register("m", lane_net, example_inputs=(torch.randn(2, 64),))
        with pytest.raises(ConfigError, match="ephemeral must be"):
            with rt.turn("m", ephemeral=ephemeral):
                pass
        with rt.turn("m", ephemeral=1 << 20) as turn:  # nothing was held: a good ask gets its turn
            assert torch.equal(turn.call((torch.ones(2, 64),)).output, lane_net()(torch.ones(2, 64)).detach())


def test_a_turns_first_load_is_bounded_by_its_lane_but_the_runtimes_link_probe_is_not():
    # The turn's first call loads and profiles the model: the worker's one-off link probe
    # (64 MiB of scratch) is the runtime's, not the turn's; the forward's bytes are the turn's.
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", lane_slots=4) as rt:
        rt.register("m", lane_net, example_inputs=(torch.randn(2, 64),))
        x = torch.ones(2, 64)
        with rt.turn("m", ephemeral=1 << 20) as turn:
            assert torch.equal(turn.call((x,)).output, lane_net()(x).detach())
        with rt.turn("m", ephemeral=1 << 20) as turn:
            with pytest.raises(LaneExceededError):
                turn.call((torch.ones(8192, 64),))  # 2 MiB of activations per layer: over its 1 MiB


def lane_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def lane_batches(scratch_from: int | None = None, n: int = 8) -> list:
    """Batches of (index, input, floats of scratch): from ``scratch_from`` on, 2 MiB."""
    g = torch.Generator().manual_seed(5)
    return [(i, torch.randn(16, 64, generator=g), (1 << 19) if scratch_from is not None and i >= scratch_from else 16)
            for i in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def meeting_step(model, optimizer, batch):
    """One SGD step; once ``$TS_MEET_DIR/go`` exists, iterations from the fourth on leave
    a mark and wait for one of another process: the job finishes only if another job's
    iterations run at the same time, in another worker.

    The fourth waits 2 s at most, then goes on: a job admitted before it measured its
    memory holds every lane's bytes until its next preemption point, where it is resized,
    and under load its stop can come after the fourth iteration has begun (seen in CI).
    From the fifth on, a job that meets no other fails."""
    i, x, scratch = batch
    optimizer.zero_grad()
    loss = model(x).square().mean() + torch.ones(scratch).sum() * 0
    loss.backward()
    optimizer.step()
    where = Path(os.environ["TS_MEET_DIR"])
    if i >= 3 and (where / "go").exists():
        (where / f"mark-{os.getpid()}-{time.monotonic_ns()}").touch()
        deadline = time.monotonic() + (2 if i == 3 else 30)  # the other's start under a loaded CI: 10 s was short
        while len({m.name.split("-")[1] for m in where.glob("mark-*")}) < 2:
            if time.monotonic() > deadline:
                if i == 3:
                    break
                raise TimeoutError("no other job's iteration ran at the same time")
            time.sleep(0.005)
    return loss


def test_with_workers_training_jobs_run_in_lanes_side_by_side_and_one_that_outgrows_its_lane_fails_alone(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TS_MEET_DIR", str(tmp_path))  # the workers inherit it
    here = "tests.integration.test_runtime_lanes"
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", workers=3) as rt:
        alone = rt.train("alone", f"{here}:lane_net", sgd, lane_batches(), meeting_step, iterations=8)
        assert alone.wait(60) and alone.error is None, alone.error
        want = alone.state_dict()
        rt.register("m0", f"{here}:file_meeting_0", example_inputs=(X,))
        (tmp_path / "go").touch()
        # From its sixth iteration on, the greedy job asks for 2 MiB more than it measured.
        greedy = rt.train("greedy", f"{here}:lane_net", sgd, lane_batches(scratch_from=5), meeting_step,
                          iterations=8)
        # Resized alone (its lane from its measured memory), it runs on at once in the new lane.
        deadline = time.monotonic() + 30
        while greedy.stats.iterations < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        steady = rt.train("steady", f"{here}:lane_net", sgd, lane_batches(), meeting_step, iterations=8)
        for job in (greedy, steady):
            assert job.wait(60)
        assert isinstance(greedy.error, LaneExceededError) and greedy.error.task == "greedy", greedy.error
        assert greedy.stats.iterations == 5 and greedy.error.asked > greedy.error.lane_bytes
        assert steady.error is None, steady.error  # a timeout: the two jobs' iterations did not overlap
        got = steady.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert steady.stats.persistent_bytes > 0 and steady.stats.ephemeral_bytes > 0
        # The pool is whole: an inference in another lane gives the model's own output.
        (tmp_path / "go").unlink()
        with torch.no_grad():
            assert torch.equal(rt.infer("m0", X), torch.relu(FileMeeting(0).lin(X)))


class FileMeeting(nn.Module):
    """``Meeting`` across processes: once ``$TS_MEET_DIR/go`` exists, each forward leaves
    a mark in that directory and waits until two marks are there."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        where = Path(os.environ["TS_MEET_DIR"])
        if (where / "go").exists():
            (where / f"mark-{os.getpid()}-{time.monotonic_ns()}").touch()
            deadline = time.monotonic() + 10
            while len(list(where.glob("mark-*"))) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("the other model's forward never ran at the same time")
                time.sleep(0.005)
        return y


def file_meeting_0() -> FileMeeting:
    return FileMeeting(0)


def file_meeting_1() -> FileMeeting:
    return FileMeeting(1)


def test_with_workers_lanes_run_in_worker_processes_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("TS_MEET_DIR", str(tmp_path))  # the workers inherit it
    here = "tests.integration.test_runtime_lanes"
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", workers=2) as rt:
        for i in range(2):
            rt.register(f"m{i}", f"{here}:file_meeting_{i}", example_inputs=(X,))
            rt.infer(f"m{i}", X)
            rt.infer(f"m{i}", X)  # measured: no longer asks for every lane's bytes
        (tmp_path / "go").touch()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {i: pool.submit(rt.infer, f"m{i}", X) for i in range(2)}
            outs = {i: f.result(60) for i, f in futures.items()}
        for i in range(2):
            with torch.no_grad():
                assert torch.equal(outs[i], torch.relu(FileMeeting(i).lin(X)))
        # A worker's lane guard fails its call with the lane's own error, fields and all.
        (tmp_path / "go").unlink()
        rt.register("greedy", f"{here}:greedy", example_inputs=(torch.full((8, 64), 4.0),))
        rt.infer("greedy", torch.full((8, 64), 4.0))
        rt.infer("greedy", torch.full((8, 64), 4.0))
        with pytest.raises(LaneExceededError) as info:
            rt.infer("greedy", torch.full((8, 64), 512.0))
        assert info.value.task == "greedy" and info.value.asked > info.value.lane_bytes
        assert torch.equal(rt.infer("m0", X), outs[0])  # the pool is whole


def greedy() -> Greedy:
    torch.manual_seed(0)
    return Greedy()


def test_training_jobs_measure_their_persistent_and_ephemeral_memory():
    from tests.models import adam, train_batches, train_net, train_step

    with Runtime("cpu", "16MiB") as rt:
        job = rt.train("job", train_net, adam, train_batches(4), train_step, iterations=4)
        job.wait(60)
        assert job.error is None
        params = sum(p.numel() for p in train_net().parameters()) * 4
        # Parameters, their gradients, Adam's two moments, and one 4-byte step count per tensor.
        assert job.stats.persistent_bytes == 4 * params + 4 * 4
        # One iteration's activations (a batch of 8 through 64 hidden units) and gradients, at least.
        assert 8 * 64 * 4 * 2 < job.stats.ephemeral_bytes < 1 << 20


def test_with_lanes_two_jobs_that_share_a_home_take_turns_on_it():
    """With workers=2 both jobs live on the second worker (the first stays free for
    inference): the one that waits stops the other's segment after a while, in turn."""
    from tests.models import adam, endless_batches, train_batches, train_net, train_step

    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="4MiB", workers=2) as rt:
        endless = rt.train("endless", train_net, adam, endless_batches, train_step)
        deadline = time.monotonic() + 30
        while endless.stats.iterations < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        short = rt.train("short", train_net, adam, train_batches(40), train_step, iterations=40)
        assert short.wait(30), "the job waiting for the shared home never got a turn"
        assert short.error is None and short.stats.iterations == 40
        assert endless.status == "running" and endless.stats.preemptions >= 1
        endless.cancel()
        assert endless.wait(30)


class Crowded(nn.Module):
    """Counts the forwards running at once (each sleeps a while, so that they overlap
    when they may)."""

    now = 0
    most = 0
    lock = threading.Lock()

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        with Crowded.lock:
            Crowded.now += 1
            Crowded.most = max(Crowded.most, Crowded.now)
        time.sleep(0.03)
        with Crowded.lock:
            Crowded.now -= 1
        return self.lin(x)


@pytest.mark.parametrize("slots", [None, 1, 3])
def test_lanes_at_once_are_capped_in_process_at_the_cores_or_lane_slots(slots):
    """NOTE [Lanes at once]: by default on the CPU in-process, at most the cores over
    lane_threads lanes run at once; ``lane_slots`` sets it."""
    from timeshare.memory.ephemeral import cores

    options = {} if slots is None else {"lane_slots": slots}
    with Runtime("cpu", "16MiB", scheduling="pack", lane_memory="8MiB", lane_threads=1, **options) as rt:
        names = [f"c{i}" for i in range(5)]
        for n in names:
            rt.register(n, Crowded, example_inputs=(X,))
            for _ in range(3):  # measured, then confirmed: unmetered
                rt.infer(n, X)
        Crowded.most = 0
        threads = [threading.Thread(target=lambda n=n: [rt.infer(n, X) for _ in range(4)]) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        expected = max(1, cores()) if slots is None else slots
        assert Crowded.most == min(expected, len(names)), (Crowded.most, expected)
