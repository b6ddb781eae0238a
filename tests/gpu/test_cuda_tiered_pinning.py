"""The host tier on CUDA (NOTE [Locked host tier]): stores under a host budget are
page-locked while they hold bytes, in the process that copies from them, so that a load
read back from disk copies asynchronously and computes while its later groups are still
on their way, as without a budget; no load warns that its store is not pinned, and the
locked bytes are exactly the stores in memory. Marked ``cuda``; skipped on machines
without a GPU."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

import timeshare
from timeshare.device import BackendFlags
from timeshare.executor.testing import in_process_worker

pytestmark = pytest.mark.cuda

LAYERS = 8  # one group each under the per-layer plan
WIDTH = 1024
NBYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4  # about 33.6 MB: each weight and bias 512-byte aligned already
DELAY_S = 0.005  # a device-side spin before each group's copy (NOTE [Poisoned reloads])
X = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))


def chain(on_layer0: Callable[[], None] | None = None) -> nn.Module:
    """``LAYERS`` linear layers; ``on_layer0`` is called after each CUDA forward of the
    first layer, on the host, right after its kernels were queued."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if on_layer0 is not None:
        def hook(_mod, _args, out):
            if out.is_cuda:
                on_layer0()

        net[0].register_forward_hook(hook)
    return net


@pytest.fixture(autouse=True)
def deterministic():
    before = BackendFlags.capture()
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    yield
    before.apply()


def not_pinned(caplog, capfd) -> list[str]:
    """The copy engine's warning, from this process (logs) or a worker's (its stderr)."""
    said = [r.getMessage() for r in caplog.records] + capfd.readouterr().err.splitlines()
    return [line for line in said if "not pinned" in line]


@pytest.mark.parametrize("workers", [0, 2])
def test_stores_read_back_from_disk_are_page_locked_exactly_while_they_hold_bytes(tmp_path, workers, caplog,
                                                                                   capfd):
    caplog.set_level(logging.WARNING, logger="timeshare")
    # Host memory for one store and a half: each load of a model evicted from device and
    # host memory drops the other's store and reads its own back from its spill file.
    with timeshare.Runtime(device="cuda", memory="256MiB", workers=workers, host_memory=int(1.5 * NBYTES),
                           spill_dir=str(tmp_path), profile_repeats=1, poison_evicted=True,
                           copy_delay_s=0.001) as rt:
        for name in ("a", "b"):
            rt.register(name, "tests.gpu.test_cuda_tiered_pinning:chain", None, (X,))
        ready = {}
        loaders = set()  # with workers: the workers that ran a load
        for name in ("a", "b"):
            first = rt.call(name, (X,))  # the first load traces and profiles
            if workers:
                loaders.add(first.record.timings.worker)
            ready[name] = rt.infer(name, X)
        for rep in range(3):
            for name in ("a", "b"):
                rt.evict(name, host=True)
                call = rt.call(name, (X,))
                assert call.record.loaded and torch.equal(call.output, ready[name]), (rep, name)
                snap = rt.snapshot()
                store = snap.host_tier.used
                assert store >= NBYTES and snap.host_pinned_bytes == store  # exactly the store in memory
                if workers:
                    # Locked by this load, not left locked from before: the drop unlocked it
                    # in the worker (UnpinStore), so the device never reads pages given back.
                    t = call.record.timings
                    assert t.store_pinned is True and t.lock_s is not None
                    # ``host_pinned_bytes`` above is the controller's record, so it cannot
                    # check itself; this is measured in the worker: it holds exactly the
                    # store in memory locked, the other's having been unlocked before its
                    # pages went. A worker locks a droppable store only at its loads, and
                    # all of them ran in this one (tasks go to the first ready worker,
                    # asserted below): no other worker holds anything locked.
                    assert t.host_pinned_bytes == store
                    loaders.add(t.worker)
                else:
                    worker = in_process_worker(rt)
                    assert worker is not None
                    s = worker.models[name].store
                    assert s.buffer.is_pinned() and all(t.is_pinned() for t in s.state().values())
                    other = worker.models["b" if name == "a" else "a"].store
                    assert not other.pinned  # dropped: unlocked before its pages went
        tier = rt.snapshot().host_tier
        assert tier.drops >= 6 and tier.streamed_fills >= 6  # really read back from disk
        if workers:
            assert len(loaders) == 1, loaders
        for name in ("a", "b"):
            rt.unregister(name)
        assert rt.snapshot().host_pinned_bytes == 0 and rt.snapshot().host_tier.used == 0
    assert not_pinned(caplog, capfd) == []


def test_a_load_read_back_from_disk_computes_while_its_later_groups_copy(tmp_path, caplog):
    """A spin before each group's copy makes the copies take LAYERS spins. From locked
    memory every copy is queued at once and the forward starts at once: when the host has
    queued the first layer, the middle group has not arrived, and the first layer's compute
    ends before the last group does. From pageable memory each copy call waits for the
    spin before it, so the forward would start only once the middle group was long there."""
    caplog.set_level(logging.WARNING, logger="timeshare")
    seen: list[tuple[torch.cuda.Event, object, bool | None]] = []
    with timeshare.Runtime(device="cuda", memory="256MiB", host_memory=int(1.5 * NBYTES), spill_dir=str(tmp_path),
                           profile_repeats=1, poison_evicted=True, copy_delay_s=DELAY_S) as rt:
        worker = in_process_worker(rt)
        assert worker is not None

        def on_layer0() -> None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            load = worker.last_load
            middle = load.events[LAYERS // 2].query() if load is not None and load.n_groups > LAYERS // 2 else None
            seen.append((done, load, middle))

        rt.register("m", functools.partial(chain, on_layer0), None, (X,))
        rt.infer("m", X)  # the first load traces and profiles
        ready = rt.infer("m", X)
        for rep in range(2):
            rt.evict("m", host=True)  # out of device and host memory: its bytes only in its spill file
            assert not worker.models["m"].store.pinned  # unlocked before its pages went
            torch.cuda.synchronize()
            seen.clear()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            call = rt.call("m", (X,), strategy="per_layer")
            torch.cuda.synchronize()
            assert call.record.loaded and torch.equal(call.output, ready), rep
            assert worker.models["m"].store.buffer.is_pinned()
            assert len(seen) == 1
            done, load, middle = seen[0]
            assert load is worker.last_load and load is not None and load.n_groups >= LAYERS
            assert middle is False, rep  # the host queued the first layer while the copies were far behind
            computed, last = start.elapsed_time(done), start.elapsed_time(load.events[-1])
            assert computed < last, (rep, computed, last)
        assert rt.snapshot().host_tier.streamed_fills == 2
    assert [r.getMessage() for r in caplog.records if "not pinned" in r.getMessage()] == []
