"""A call's tensors through worker processes' tensor channels (NOTE [Tensor channel]):
outputs bitwise the in-process ones for large inputs, echoes and nested outputs, outputs
that stay the caller's after the next call, the fallback to pickling, and a worker killed
mid-call failing that call alone."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

import timeshare
from tests import channel_models
from tests.exact import nan_free, same
from timeshare.errors import WorkerCrashedError
from timeshare.runtime.events import CallRecord
from timeshare.tree import tensors_in
from timeshare.worker import channel as C

BIG = (8, 3, 299, 299)  # 8.6 MB: more than a channel's first 8 MiB
MODELS = {"nested": "tests.channel_models:nested", "echo": "tests.channel_models:echo",
          "reader": "tests.channel_models:reader"}


def _examples(name: str) -> tuple:
    return (torch.randn(4, 16),) if name == "nested" else (torch.randn(2, 3, 8, 8),)


def _strides(result) -> list[tuple[int, ...]]:
    """The strides of every tensor in ``result``: a channel keeps each tensor's layout."""
    return [t.stride() for t in tensors_in(result)]


@pytest.fixture(scope="module")
def made():
    """The names of the channels made while the module runs; none is left in /dev/shm after
    (the suite's own leak check cannot tell ours from a concurrent run's)."""
    names: list[str] = []
    create = C.Channel.create

    def recording(nbytes: int) -> C.Channel:
        channel = create(nbytes)
        names.append(channel.spec.name)
        return channel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C.Channel, "create", staticmethod(recording))
        yield names
    assert names and not [n for n in names if os.path.exists(f"/dev/shm/{n.lstrip('/')}")]


@pytest.fixture(scope="module")
def runtimes(made):
    with timeshare.Runtime(device="cpu", memory="128MiB", profile_repeats=1) as local, \
            timeshare.Runtime(device="cpu", memory="128MiB", workers=2, profile_repeats=1,
                              task_timeout_s=30) as pooled:
        records: list[CallRecord] = []
        pooled.subscribe(lambda r: records.append(r) if isinstance(r, CallRecord) else None)
        for name, builder in MODELS.items():
            for rt in (local, pooled):
                rt.register(name, builder, None, _examples(name))
        yield local, pooled, records
    assert len(made) > 2  # a replacement's, and the grown ones


def test_a_large_input_is_read_from_the_channel_and_answers_exactly(runtimes):
    local, pooled, records = runtimes
    x = torch.randn(*BIG, generator=torch.Generator().manual_seed(1))
    expected = local.infer("reader", x)
    assert nan_free(expected)
    for _ in range(3):  # the first grows the channel of the worker it runs on
        got = pooled.infer("reader", x)
        assert same(got, expected) and _strides(got) == _strides(expected)
        timings = records[-1].timings
        assert timings.input_channel_bytes == x.nbytes  # in the channel, not pickled
        assert timings.output_channel_bytes > 0
        # Every call, resident ones too, says how its inputs came: none through the staging
        # copy, and whether the channel is page-locked (never on the CPU; the GPU tier: always).
        assert timings.input_staged_bytes == 0 and timings.channel_page_locked is False
        assert timings.channel_pinned_bytes == 0


def test_an_echo_comes_back_exact_and_stays_the_callers_after_the_next_call(runtimes):
    local, pooled, records = runtimes
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(*BIG, generator=g), torch.randn(*BIG, generator=g)
    pooled.infer("echo", x1)  # its output did not fit: pickled, and the channel grows for the next
    first = pooled.infer("echo", x1)
    assert records[-1].timings.outputs_in_channel == 1 and records[-1].timings.outputs_pickled == 0
    kept = first.clone()
    second = pooled.infer("echo", x2)  # same worker, same offsets in its channel
    assert records[-1].timings.outputs_in_channel == 1
    assert torch.equal(first, kept)  # not a view of the channel: the next call did not change it
    for got, want in ((first, local.infer("echo", x1)), (second, local.infer("echo", x2))):
        assert same(got, want) and _strides(got) == _strides(want) and nan_free(want)
    assert not torch.equal(first, second)


def test_nested_outputs_and_keyword_inputs_of_every_dtype_round_trip(runtimes):
    local, pooled, _ = runtimes
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=g)
    kwargs = {"mask": torch.rand(6, generator=g) > 0.5, "ids": torch.tensor([0, 5, 2]),
              "side": torch.randn(16, 5, generator=g).t()}  # a transposed input
    expected = local.infer("nested", x, **kwargs)
    assert nan_free(expected)
    got = pooled.infer("nested", x, **kwargs)
    assert set(got) == set(expected)
    assert same(got, expected)
    assert got["t"].stride() == expected["t"].stride()  # a dense layout in another order is kept
    assert isinstance(got["pair"], channel_models.Pair) and isinstance(got["heads"], channel_models.Heads)
    assert got["total"].dim() == 0 and got["none"].numel() == 0 and got["pos"].dtype == torch.bool


def test_what_outgrows_the_largest_channel_is_pickled_exactly_and_said(runtimes, monkeypatch, caplog):
    local, _, _ = runtimes
    monkeypatch.setattr(C, "DEFAULT_BYTES", 1 << 16)  # read when a worker is started
    monkeypatch.setattr(C, "MAX_BYTES", 1 << 20)
    monkeypatch.setattr(C, "_said", set())
    x = torch.randn(2, 3, 299, 299)  # 2.1 MB
    with timeshare.Runtime(device="cpu", memory="64MiB", workers=1, profile_repeats=1) as rt, \
            caplog.at_level(logging.INFO, logger="timeshare.worker.channel"):
        rt.register("echo", MODELS["echo"], None, _examples("echo"))
        small = torch.randn(2, 3, 8, 8)
        for _ in range(2):
            for y in (x, small):
                got, want = rt.infer("echo", y), local.infer("echo", y)
                assert same(got, want) and _strides(got) == _strides(want) and nan_free(want)
    said = [r.getMessage() for r in caplog.records if "pickled" in r.getMessage()]
    assert len(said) == 1 and "do not fit" in said[0]  # once, in the controller


def test_a_worker_killed_mid_call_fails_that_call_alone(runtimes):
    local, pooled, _ = runtimes
    x = torch.randn(*BIG, generator=torch.Generator().manual_seed(4))
    expected = local.infer("echo", x)
    assert nan_free(expected)
    pooled.infer("echo", x)  # resident, its channel grown
    deadline = time.monotonic() + 60
    while pooled.snapshot().workers.ready < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    victim = pooled.snapshot().workers.workers[0]
    result: dict = {}

    def target():
        try:
            result["value"] = pooled.infer("echo", x, delay_s=5.0)
        except BaseException as exc:
            result["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    time.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    assert isinstance(result.get("error"), WorkerCrashedError), result
    assert f"worker {victim.id} was killed by signal 9" in str(result["error"])
    for _ in range(3):
        got = pooled.infer("echo", x)  # the standby, then its channel again
        assert same(got, expected) and _strides(got) == _strides(expected)
