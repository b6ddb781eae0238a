"""Pipelined loads never read a weight before it arrived, and failures leave the
runtime consistent. Copies are slowed down and the arena poisoned before each load,
so an early read shows up as a wrong output instead of passing by luck."""

import os
import threading
import time

import pytest
import torch
from torch import nn

import timeshare
from tests import models
from tests.exact import nan_free, same
from timeshare.errors import MemoryBudgetError, PipelineError
from timeshare.executor.testing import in_process_worker
from timeshare.models.zoo import ZOO, weights_path
from timeshare.transfer import copy as copy_mod
from timeshare.transfer.planner import STRATEGIES

_original_copy_group = copy_mod.CpuLoad.copy_group


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


class WithEmptyBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.register_buffer("empty", torch.empty(0))

    def forward(self, x):
        return self.fc(x)


def with_empty_buffer():
    torch.manual_seed(0)
    m = WithEmptyBuffer()
    m.unused.register_buffer("nothing", torch.empty(0, 3))
    return m


CASES = {
    **{name: (fn, (torch.randn(3, 8),), {}) for name, fn in models.CASES.items()},
    "optional_head_used": (models.optional_head, (torch.randn(3, 8),), {"use_head": True}),
    "transformer": (transformer, (torch.randn(2, 5, 32),), {}),
    "empty_buffers": (with_empty_buffer, (torch.randn(3, 8),), {}),
    **{n: (ZOO[n].builder, ZOO[n].example_inputs(2), {}) for n in ("tiny_cnn", "tiny_bert", "tied_lm")},
}


# Every case in-process, and BERT in a worker process too: there the controller poisons
# the shared arena and the worker's copy thread is slowed.
MODES = [pytest.param(case, 0, id=f"{case}-in-process") for case in sorted(CASES)] \
    + [pytest.param("tiny_bert", 1, id="tiny_bert-workers")]


@pytest.mark.parametrize("case, workers", MODES)
def test_no_weight_is_read_before_it_arrives(case, workers):
    """NOTE [Poisoned reloads]: an evicted model's block is NaN before each reload and
    every group arrives late, so a layer that ran before its group arrived would give NaN."""
    build, x, kwargs = CASES[case]
    weights = weights_path(case) if case in ZOO else None
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1, poison_evicted=True,
                           copy_delay_s=0.003, workers=workers, startup_timeout_s=60) as rt:
        # profile with plain inputs; optional_head_used then takes a path the trace never saw
        rt.register(case, build, weights, x)
        rt.infer(case, *x)
        ready = rt.infer(case, *x, **kwargs)
        assert nan_free(ready)
        for strategy in STRATEGIES:
            rt.strategy = strategy
            rt.evict(case)
            assert same(rt.infer(case, *x, **kwargs), ready), strategy


def test_modules_wait_for_their_own_layer_not_the_tail():
    """Eval-mode BatchNorm never reads num_batches_tracked: it must stay in the
    BatchNorm's layer, or the BatchNorm would wait for the last group."""
    zoo = ZOO["tiny_cnn"]
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1) as rt:
        rt.register("cnn", zoo.builder, weights_path("tiny_cnn"), zoo.example_inputs(2))
        prof = rt.profile("cnn")
        assert prof.tail_bytes == 0
        plan = in_process_worker(rt).load_plan("cnn", prof.shape_key, "per_layer")
        assert sorted(plan.wait_of.values()) == list(range(len(prof.layer_bytes)))
        assert len(plan.ranges) == len(prof.layer_bytes)


def test_a_failed_copy_fails_the_call_and_loses_nothing(monkeypatch):
    x = torch.randn(2, 8)
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1) as rt:
        rt.register("m", models.out_of_order, None, (x,))
        ready = rt.infer("m", x)

        def broken(self, k):
            if k == 1:
                raise OSError("disk on fire")
            _original_copy_group(self, k)

        monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", broken)
        rt.evict("m")
        with pytest.raises(PipelineError, match=r"copying group 1 failed.*disk on fire.*loading m, group 1"):
            rt.call("m", (x,), strategy="per_layer")
        assert rt.resident() == [] and rt.stats()["used_bytes"] == 0
        monkeypatch.undo()
        assert same(rt.infer("m", x), ready) and nan_free(ready)


def test_a_stuck_copy_quarantines_its_block_until_done(monkeypatch):
    x = torch.randn(2, 8)
    gate = __import__("threading").Event()
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1, load_timeout_s=0.2) as rt:
        rt.register("m", models.out_of_order, None, (x,))
        ready = rt.infer("m", x)

        def stuck(self, k):
            gate.wait(10)
            _original_copy_group(self, k)

        monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", stuck)
        rt.evict("m")
        with pytest.raises(PipelineError, match="did not arrive within 0.2 s"):
            rt.call("m", (x,), strategy="whole")
        assert rt.resident() == []
        assert rt.stats()["used_bytes"] > 0  # the copy may still write there: not reused yet
        gate.set()
        monkeypatch.undo()
        deadline = time.monotonic() + 10
        while rt.diagnostics().quarantined and time.monotonic() < deadline:
            time.sleep(0.01)
        assert same(rt.infer("m", x), ready) and nan_free(ready)
        rt.evict("m")
        assert rt.stats()["used_bytes"] == 0  # reclaimed on the next placement


def test_a_failure_while_profiling_lets_the_next_load_start_over(monkeypatch):
    from timeshare.worker import profiling

    x = torch.randn(2, 8)
    calls = {"n": 0}
    real = profiling.time_layers

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("profiler crashed")
        return real(*args, **kwargs)

    monkeypatch.setattr(profiling, "time_layers", flaky)
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1) as rt:
        rt.register("m", models.out_of_order, None, (x,))
        with pytest.raises(RuntimeError, match="profiler crashed"):
            rt.infer("m", x)
        assert rt.resident() == [] and rt.stats()["used_bytes"] == 0
        out = rt.infer("m", x)
        rt.evict("m")
        assert same(rt.infer("m", x), out) and nan_free(out)


def test_close_after_a_failed_load_leaves_nothing_behind(monkeypatch):
    x = torch.randn(2, 8)
    rt = timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1)
    name = rt.diagnostics().arena.name
    copy_threads = [t for t in threading.enumerate() if t.name == "timeshare-copy"]
    assert copy_threads
    rt.register("m", models.optional_head, None, (x,))
    rt.infer("m", x)

    def tail_breaks(self, k):
        if k == self.n_groups - 1:
            raise OSError("tail lost")
        _original_copy_group(self, k)

    monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", tail_breaks)
    rt.evict("m")
    rt.infer("m", x)  # the tail is not needed by this call; its copy fails behind it
    rt.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not any(t.is_alive() for t in copy_threads)


def test_an_arena_larger_than_shared_memory_is_refused_at_once():
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(MemoryBudgetError, match="cannot reserve a CPU arena"):
        timeshare.Runtime(device="cpu", memory=too_big)


def test_a_host_store_larger_than_shared_memory_is_refused_with_the_sizes(monkeypatch):
    """With workers, a model's host copy lives in /dev/shm: a tmpfs too small for it (64 MB
    in a default Docker container) is a clear error naming the sizes, not a SIGBUS."""
    from types import SimpleNamespace

    with timeshare.Runtime(device="cpu", memory="4MiB", workers=1, profile_repeats=1, startup_timeout_s=60) as rt:
        real = os.statvfs

        def tight(path):  # /dev/shm with one 4 KiB block free; every other file system as it is
            return SimpleNamespace(f_bavail=1, f_frsize=4096) if str(path).startswith("/dev/shm") else real(path)

        monkeypatch.setattr(os, "statvfs", tight)
        with pytest.raises(MemoryBudgetError, match=r"host copy of model 'slow' of [\d,]+ bytes in /dev/shm "
                                                    r"\(only 4,096 bytes are free\)"):
            rt.register("slow", "tests.models:slow", None, (torch.randn(4, 64),), example_kwargs={"delay_s": 0.0})
        assert rt.models() == []
        monkeypatch.setattr(os, "statvfs", real)
        rt.register("slow", "tests.models:slow", None, (torch.randn(4, 64),), example_kwargs={"delay_s": 0.0})
        assert rt.infer("slow", torch.ones(4, 64), delay_s=0.0).shape == (4, 64)
