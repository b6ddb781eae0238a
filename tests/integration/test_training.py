"""Training jobs time-share the device with inference and keep their state."""

import threading
import time

import pytest
import torch
from torch import nn

import timeshare
from tests import models
from timeshare.errors import ConfigError, TimeshareError

# The same job as the worker tests' (importable, in tests/models.py).
net, batches, step, adam = models.train_net, models.train_batches, models.train_step, models.adam


def train_alone(**kwargs):
    with timeshare.Runtime(device="cpu", memory="8MiB") as rt:
        job = rt.train("t", net, adam, batches(), step, seed=3, **kwargs)
        job.result(timeout=120)
        return job.state_dict(), job.stats.losses


class Noisy(nn.Module):
    """An inference that draws from the global random generator, as sampling does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) + torch.rand_like(x)


@pytest.fixture
def rt():
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1) as r:
        r.register("inf", models.out_of_order, None, (torch.randn(2, 8),))
        r.register("noisy", Noisy, None, (torch.randn(2, 8),))
        yield r


@pytest.mark.parametrize("offload", [False, True])
def test_preempted_training_ends_exactly_like_an_uninterrupted_run(rt, offload):
    expected, expected_losses = train_alone()
    x = torch.randn(2, 8)  # before the job starts: PyTorch's default generator is process-wide
    ref = rt.infer("inf", x)
    job = rt.train("t", net, adam, batches(), step, seed=3, offload=offload)
    paused_once = False
    while not job.wait(0):
        rt.infer("noisy", x)  # draws from the global RNG between training steps
        assert torch.equal(rt.infer("inf", x)["y"], ref["y"])
        rt.evict("inf")  # and reload: a switch each time
        if not paused_once and job.stats.iterations > 10:
            job.pause()
            seen = job.stats.iterations
            time.sleep(0.2)
            assert job.status == "paused" and job.stats.iterations <= seen + 1
            job.resume()
            paused_once = True
    stats = job.result(timeout=120)
    assert job.status == "finished" and stats.iterations == 150
    assert stats.preemptions >= 10 and paused_once
    if offload:
        assert stats.offloads == stats.preemptions
    got = job.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert stats.losses == expected_losses


def test_cancel_and_failure_are_reported(rt):
    job = rt.train("endless", net, adam, iter(lambda: batches(1)[0], None), step)
    models.wait_until(lambda: job.stats.iterations >= 3, what="3 iterations")
    job.cancel()
    assert job.wait(30) and job.status == "cancelled"

    def broken(model, optimizer, batch):
        raise RuntimeError("step exploded")

    bad = rt.train("bad", net, adam, batches(5), broken)
    with pytest.raises(RuntimeError, match="step exploded"):
        bad.result(timeout=30)
    assert bad.status == "failed"
    assert rt.infer("inf", torch.randn(2, 8))["y"].shape == (2, 8)  # the runtime still serves


def test_training_arguments_are_checked(rt):
    with pytest.raises(ConfigError, match="optimizer must be a callable"):
        rt.train("t", net, "sgd", batches(), step)
    with pytest.raises(ConfigError, match="iterations must be a positive integer"):
        rt.train("t", net, adam, batches(), step, iterations=0)
    with pytest.raises(ConfigError, match="data must be iterable"):
        rt.train("t", net, adam, 42, step)
    with pytest.raises(ConfigError, match="not an nn.Module"):
        rt.train("t", lambda: 3, adam, batches(), step)
    with pytest.raises(TimeshareError, match="did not finish within"):
        rt.train("t", net, adam, iter(lambda: batches(1)[0], None), step).result(timeout=0.2)


def test_close_stops_running_jobs():
    rt = timeshare.Runtime(device="cpu", memory="8MiB")
    job = rt.train("endless", net, adam, iter(lambda: batches(1)[0], None), step)
    models.wait_until(lambda: job.stats.iterations >= 2, what="2 iterations")
    rt.close()
    assert job.status == "cancelled"
    assert not any(t.name.startswith("timeshare-train") for t in threading.enumerate())


def test_submit_returns_futures_in_order(rt):
    xs = [torch.randn(2, 8) for _ in range(10)]
    futures = [rt.submit("inf", x) for x in xs]
    for f, x in zip(futures, xs):
        assert torch.equal(f.result(timeout=30)["y"], rt.infer("inf", x)["y"])
    bad = rt.submit("inf", torch.randn(2, 9))  # the model raises: the future carries it
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x9 and 8x8\)"):
        bad.result(timeout=30)
    with pytest.raises(TimeshareError, match="no model named"):
        rt.submit("nope", xs[0])
