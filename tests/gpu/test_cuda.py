"""CUDA paths: exact pipelined outputs, no allocation on the load path, overlap.
Marked ``cuda``; skipped on machines without a GPU."""

import pytest
import torch

import timeshare
from timeshare.device import BackendFlags
from tests import models
from timeshare.models.zoo import ZOO, names, weights_path
from timeshare.runtime.tree import tensors_in
from timeshare.transfer.planner import STRATEGIES

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def deterministic():
    """Deterministic kernels for every test here; the flags are given back afterwards."""
    before = BackendFlags.capture()
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    yield
    before.apply()


def same(a, b):
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("name", names())
def test_zoo_pipelined_outputs_are_bitwise_exact_on_cuda(name):
    zoo = ZOO[name]
    x = zoo.example_inputs(2)
    # NOTE [Poisoned reloads]: NaN in the block before each reload, and each group's copy
    # held back by a device-side spin on the copy stream: a missing device-side wait reads NaN.
    with timeshare.Runtime(device="cuda", memory="2GiB", profile_repeats=2, poison_evicted=True,
                           copy_delay_s=0.002) as rt:
        rt.register(name, zoo.builder, weights_path(name), x)
        rt.infer(name, *x)
        ready = rt.infer(name, *x)
        assert rt._worker.models[name].store.pinned
        for strategy in STRATEGIES:
            for _ in range(3):
                rt.evict(name)
                assert same(rt._infer(name, x, {}, strategy), ready), strategy


@pytest.mark.parametrize("case", sorted(models.CASES))
def test_weight_sharing_cases_on_cuda(case):
    build = models.CASES[case]
    x = (torch.randn(4, 8),)
    with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1, poison_evicted=True) as rt:
        rt.register(case, build, None, x)
        ready = rt.infer(case, *x)
        for strategy in STRATEGIES:
            rt.evict(case)
            assert same(rt._infer(case, x, {}, strategy), ready), strategy


def test_a_load_allocates_nothing_from_the_cuda_allocator():
    """The pipelined first inference makes exactly the allocations of a resident
    inference (activations): weights land in the arena, nothing else is allocated."""
    zoo = ZOO["resnet152"]
    x = zoo.example_inputs(2)
    with timeshare.Runtime(device="cuda", memory="1GiB", profile_repeats=1) as rt:
        rt.register("r", zoo.builder, weights_path("resnet152"), x)
        rt.infer("r", *x)
        rt.infer("r", *x)

        def allocations(fn):
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["allocation.all.allocated"]
            fn()
            torch.cuda.synchronize()
            return torch.cuda.memory_stats()["allocation.all.allocated"] - before

        resident = allocations(lambda: rt.infer("r", *x))
        rt.evict("r")
        pipelined = allocations(lambda: rt.infer("r", *x))
        assert pipelined == resident
        assert rt.stats()["blocks"] == 1


def test_copies_overlap_compute():
    """With the per-layer plan the first group's compute can start before the last
    group has arrived: the first inference is faster than copy-then-run."""
    zoo = ZOO["bert_base"]
    x = zoo.example_inputs(8)
    with timeshare.Runtime(device="cuda", memory="2GiB", profile_repeats=3) as rt:
        rt.register("b", zoo.builder, weights_path("bert_base"), x)
        rt.profile("b")
        import time

        def first(strategy):
            best = float("inf")
            for _ in range(5):
                rt.evict("b")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                rt._infer("b", x, {}, strategy)
                best = min(best, time.perf_counter() - t0)
            return best

        assert first("optimal") < first("whole")


def test_workers_share_the_cuda_arena_and_switch_without_device_allocation():
    """The arena is shared once (CUDA IPC); outputs from the worker are bitwise the
    in-process ones; after warm-up, switches (evict + pipelined load, with a training
    job preempted) make no new device allocation in the worker."""
    zoo = ZOO["resnet152"]
    x = zoo.example_inputs(2)
    with timeshare.Runtime(device="cuda", memory="1GiB", profile_repeats=1) as local:
        local.register("r", zoo.builder, weights_path("resnet152"), x)
        expected = local.infer("r", *x)
    with timeshare.Runtime(device="cuda", memory="1GiB", workers=2, profile_repeats=1, poison_evicted=True) as rt:
        rt.register("r", zoo.builder, weights_path("resnet152"), x)
        assert same(rt.infer("r", *x), expected)
        job = rt.train("bg", models.train_net, models.adam, models.endless_batches, models.train_step)
        segments = []
        for _ in range(6):
            rt.evict("r")
            while job.stats.iterations < 2:
                pass
            assert same(rt.infer("r", *x), expected)
            reply_timings = rt._pool.last_timings
            segments.append(reply_timings["cuda_segments"])
        job.cancel()
        assert job.wait(60)
        assert len(set(segments[2:])) == 1, segments  # no cudaMalloc on the switch path once warm
        assert any(s["stop_s"] is not None for s in rt.switches())


def test_killing_a_cuda_worker_mid_load_leaves_device_memory_as_it_was():
    import os
    import signal

    zoo = ZOO["bert_base"]
    x = zoo.example_inputs(8)
    with timeshare.Runtime(device="cuda", memory="1GiB", workers=2, profile_repeats=1, task_timeout_s=60) as rt:
        rt.register("b", zoo.builder, weights_path("bert_base"), x)
        ref = rt.infer("b", *x)
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        for _ in range(3):
            rt.evict("b")
            victim = rt._pool.workers[0]
            import threading

            threading.Timer(0.005, lambda: os.kill(victim.os_pid, signal.SIGKILL)).start()
            try:
                rt.infer("b", *x)
            except timeshare.TimeshareError:
                pass
            for w in rt._pool.workers:  # let replacements boot
                rt._pool._ready(w)
            assert same(rt.infer("b", *x), ref)
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        # Each worker holds one context and its activations cache; killed ones gave theirs back.
        assert abs(free_after - free_before) < 256 << 20


def test_a_finished_cuda_load_lets_go_of_its_buffers():
    """A load keeps its source and destination alive only while copies are queued: once
    done() has seen it finish, dropping the caller's references frees them (an unload
    must be able to close the host store's shared memory)."""
    import gc
    import weakref

    from timeshare.transfer.copy import CudaCopyEngine

    engine = CudaCopyEngine(torch.device("cuda", 0))
    src = torch.randn(1 << 20).view(torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    alive_src, alive_dst = weakref.ref(src), weakref.ref(dst)
    handle = engine.start(src, dst, [(0, src.numel() // 2), (src.numel() // 2, src.numel())], "test")
    torch.cuda.synchronize()
    assert handle.done()
    assert torch.equal(dst.cpu(), src)
    del src, dst
    gc.collect()
    assert alive_src() is None and alive_dst() is None
