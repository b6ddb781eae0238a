"""Host memory on the CPU: exact-size page-locking and its release (through a fake
registrar that implements the real interface), the input staging buffer, outputs
copied once, and the device handling a worker on cuda:N relies on."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

import timeshare.device
from tests import models
from timeshare.device import CudaHostRegistrar, host_registrar, loaded_cudart, make_current, resolve_device
from timeshare.errors import DeviceError
from timeshare.memory.allocator import align_up
from timeshare.memory.arena import Arena
from timeshare.models.binding import collect, unbind
from timeshare.transfer.copy import CpuCopyEngine
from timeshare.transfer.host_store import HostStore, InputStaging, TensorEntry, aligned_offsets
from timeshare.worker.worker import Worker

CPU = torch.device("cpu")


class FakeRegistrar:
    """Implements ``HostRegistrar``; refuses what CUDA refuses (a range registered twice,
    an unregister of a range it does not know) and records what is locked now."""

    def __init__(self):
        self.live: dict[int, int] = {}  # ptr -> bytes
        self.registered: list[int] = []  # sizes, in order
        self.unregistered = 0
        self.on_unregister = lambda ptr: None

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr not in self.live, "registered twice"
        self.live[ptr] = nbytes
        self.registered.append(nbytes)

    def unregister(self, ptr: int) -> None:
        self.on_unregister(ptr)
        assert self.live.pop(ptr, None) is not None, "unregistered a range that is not registered"
        self.unregistered += 1

    @property
    def locked(self) -> int:
        return sum(self.live.values())


def entries(*specs) -> list[TensorEntry]:
    return [TensorEntry(key, (key,), "parameter", shape, dtype, False) for key, shape, dtype in specs]


SPECS = (("a", (1000, 3), torch.float32), ("b", (7,), torch.int64), ("c", (5, 5), torch.float16))
EXACT = align_up(12_000, 512) + align_up(56, 512) + align_up(50, 512)  # 13,312 bytes; the next power of two is 16,384


def packed(registrar: FakeRegistrar | None) -> tuple[HostStore, dict[str, torch.Tensor]]:
    es = entries(*SPECS)
    tensors = {e.key: torch.arange(e.nbytes // e.dtype.itemsize).to(e.dtype).view(e.shape) for e in es}
    return HostStore.pack(es, tensors, pin=registrar is not None, registrar=registrar, alignment=512), tensors


# ------------------------------------------------------------------ host stores
def test_a_store_is_page_locked_at_its_exact_size_and_release_unlocks_it_once():
    fake = FakeRegistrar()
    store, tensors = packed(fake)
    assert store.nbytes == EXACT and fake.live == {store.buffer.data_ptr(): EXACT}
    assert store.pinned and store.pinned_nbytes == EXACT
    assert all(torch.equal(store.tensor(k), t) for k, t in tensors.items())
    store.release()
    store.release()  # idempotent
    assert fake.live == {} and fake.unregistered == 1
    assert not store.pinned and store.pinned_nbytes == 0
    assert all(torch.equal(store.tensor(k), t) for k, t in tensors.items())  # still readable, pageable


def test_a_store_dropped_unreleased_unlocks_its_memory_before_the_memory_can_go():
    fake = FakeRegistrar()
    store, _ = packed(fake)
    buffer = weakref.ref(store.buffer)
    alive_at_unregister = []
    fake.on_unregister = lambda ptr: alive_at_unregister.append(buffer() is not None)
    del store
    gc.collect()
    assert fake.live == {} and alive_at_unregister == [True]
    assert buffer() is None


def test_pinning_needs_a_registrar_and_the_layout_is_the_one_the_arena_uses():
    with pytest.raises(ValueError, match="needs a registrar"):
        HostStore.pack(entries(*SPECS), {}, pin=True)
    assert aligned_offsets([12_000, 56, 50], 512) == ([0, 12_288, 12_800], EXACT)
    assert aligned_offsets([], 512) == ([], 512)
    assert host_registrar(CPU) is None


def _worker(registrar: FakeRegistrar) -> tuple[Worker, Arena, CpuCopyEngine]:
    arena = Arena(CPU, 1 << 20)
    engine = CpuCopyEngine(deadline_s=10)
    return Worker(CPU, arena, engine, profile_repeats=1, registrar=registrar), arena, engine


def test_a_worker_unlocks_the_store_it_repacks_and_the_store_it_removes():
    """The first load repacks the store in execution order: the old one is unlocked, the
    new one locked at its exact size; removing the model unlocks everything."""
    fake = FakeRegistrar()
    worker, arena, engine = _worker(fake)
    try:
        module = models.out_of_order().eval()
        x = torch.randn(2, 8)
        with torch.no_grad():
            expected = module(x)
        layout = collect(module)
        store = HostStore.pack(layout.entries, layout.tensors(), pin=True, registrar=fake, alignment=512)
        unbind(layout)
        worker.add("m", module, layout, store)
        assert worker.pinned_host_bytes() == store.nbytes == fake.locked
        block = arena.allocate(store.nbytes, "m")
        assert block is not None
        out = worker.to_host(worker.run("m", block.offset, False, (x,), {}, "optimal"))
        assert torch.equal(out["y"], expected["y"])
        assert len(fake.registered) == 2 and fake.unregistered == 1  # repacked: the first store is unlocked
        assert fake.locked == worker.pinned_host_bytes() == store.nbytes  # one store, exact, not counted twice
        current = worker.models["m"].store
        worker.release("m")
        worker.remove("m")
        assert not current.pinned  # unlocked by the removal itself, not left to the garbage collector
        assert fake.live == {} and worker.pinned_host_bytes() == 0
    finally:
        engine.close()
        arena.close()


def test_outputs_are_copied_at_most_once_on_their_way_to_the_host():
    fake = FakeRegistrar()
    worker, arena, engine = _worker(fake)
    try:
        own = torch.randn(3)
        in_arena = arena.buffer[:16].view(torch.float32)
        in_arena.copy_(torch.arange(4.0))
        out = worker.to_host({"own": own, "weight": in_arena, "nested": (own,)})
        for kept in (out["own"], out["nested"][0]):  # already on the host, not the arena's: not copied
            assert kept.data_ptr() == own.data_ptr()
        assert torch.equal(out["weight"], torch.arange(4.0)) and not worker.aliases_arena(out)
    finally:
        engine.close()
        arena.close()


# ------------------------------------------------------------------ input staging
def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, 3, generator=g),
        torch.arange(5),  # int64
        torch.tensor(True),  # zero-dim bool
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        torch.randn(4, 6, generator=g).t(),  # transposed
        torch.randn(4, 6, generator=g)[:, ::2],  # not dense
        torch.randn(3, generator=g).expand(4, 3),  # overlapping
        torch.empty(0, 3),
        torch.randn(5, generator=g).half(),
    ]


def test_staging_packs_every_input_aligned_into_one_locked_buffer_equal_to_the_inputs():
    fake = FakeRegistrar()
    staging = InputStaging(fake, alignment=512)
    xs = inputs()
    staged = staging.stage(xs)
    base = staging.buffer.data_ptr()
    offsets, total = aligned_offsets([t.nbytes for t in xs], 512)
    assert fake.live == {base: total} and staging.pinned_nbytes == total  # exact, not rounded
    for x, s, offset in zip(xs, staged, offsets, strict=True):
        assert s.dtype == x.dtype and s.shape == x.shape and torch.equal(s, x)
        assert s.stride() == x.to("meta").stride()  # the layout x.to(device) would have
        assert s.untyped_storage().data_ptr() == base and offset % 512 == 0
        assert s.numel() == 0 or s.data_ptr() - base == offset
    assert staging.staged_nbytes == sum(t.nbytes for t in xs)


def test_staging_reuses_its_buffer_grows_it_exactly_and_unlocks_the_old_one():
    fake = FakeRegistrar()
    staging = InputStaging(fake, alignment=512)
    staging.stage([torch.randn(1000)])  # 4,000 bytes -> 4,096
    first = staging.buffer.data_ptr()
    smaller = [torch.randn(10), torch.arange(3)]
    assert all(torch.equal(a, b) for a, b in zip(staging.stage(smaller), smaller, strict=True))
    assert staging.buffer.data_ptr() == first and fake.registered == [4096]  # reused, not registered again
    bigger = [torch.randn(3000)]
    assert torch.equal(staging.stage(bigger)[0], bigger[0])
    assert fake.registered == [4096, 12_288] and fake.live == {staging.buffer.data_ptr(): 12_288}
    staging.release()
    assert fake.live == {} and staging.pinned_nbytes == 0


class Fence:
    """Stands in for the CUDA event after the uploads: records what the buffer held and
    what was locked at the moment something waited for it."""

    def __init__(self, staging: InputStaging, fake: FakeRegistrar):
        self.staging, self.fake = staging, fake
        self.seen: list[tuple[torch.Tensor, dict]] = []

    def synchronize(self) -> None:
        self.seen.append((self.staging.buffer.clone(), dict(self.fake.live)))


def test_staging_never_rewrites_or_unlocks_bytes_a_copy_may_still_read():
    fake = FakeRegistrar()
    staging = InputStaging(fake, alignment=512)
    first = [torch.full((10,), 1.0)]
    staging.stage(first)
    before = staging.buffer.clone()
    fence = Fence(staging, fake)
    staging.mark_in_flight(fence)
    staging.stage([torch.full((10,), 2.0)])
    assert len(fence.seen) == 1 and torch.equal(fence.seen[0][0], before)  # waited before writing

    old = staging.buffer.data_ptr()
    fence = Fence(staging, fake)
    staging.mark_in_flight(fence)
    staging.stage([torch.randn(5000)])  # grows
    assert len(fence.seen) == 1 and old in fence.seen[0][1]  # waited while the old buffer was still locked
    fence = Fence(staging, fake)
    staging.mark_in_flight(fence)
    staging.release()
    assert len(fence.seen) == 1 and fence.seen[0][1] != {} and fake.live == {}


def test_upload_leaves_inputs_alone_on_the_cpu():
    staging = InputStaging(FakeRegistrar())
    xs = inputs()
    assert all(a is b for a, b in zip(staging.upload(xs, CPU), xs, strict=True))
    assert staging.buffer.numel() == 0


# ------------------------------------------------------------------ cuda:N
@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as a machine with two GPUs would show it, for the code that only asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_worker_resolves_the_device_it_was_started_with(two_gpus):
    dev = resolve_device("cuda:1")
    assert dev == torch.device("cuda", 1)
    assert resolve_device(str(dev)) == dev  # what Start carries, as the worker reads it
    assert resolve_device(torch.device("cuda", 1)) == dev
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_a_worker_makes_its_device_current_and_pins_through_it(two_gpus, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    @contextmanager
    def guard(d):
        calls.append(("enter", d))
        yield
        calls.append(("exit", d))

    class Cudart:
        def __init__(self):
            self.errors = {"register": 0, "unregister": 0}

        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return self.errors["register"]

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return self.errors["unregister"]

    cudart = Cudart()
    cleared = []
    monkeypatch.setattr(timeshare.device, "clear_cuda_error", lambda: cleared.append(True))
    monkeypatch.setattr(torch.cuda, "device", guard)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    dev = torch.device("cuda", 1)
    make_current(CPU)
    assert calls == []
    make_current(dev)
    assert calls == [("set_device", dev)]

    calls.clear()
    registrar = host_registrar(dev)
    assert isinstance(registrar, CudaHostRegistrar)
    registrar.register(4096, 13_312)
    registrar.unregister(4096)
    portable = 1  # cudaHostRegisterPortable: locked for every context of the process
    assert calls == [("enter", dev), ("register", 4096, 13_312, portable), ("exit", dev),
                     ("enter", dev), ("unregister", 4096), ("exit", dev)]
    assert cleared == []
    cudart.errors = {"register": 2, "unregister": 1}
    with pytest.raises(DeviceError, match="cannot page-lock 13,312 bytes of host memory for cuda:1"):
        registrar.register(4096, 13_312)
    assert len(cleared) == 1  # the pending error must not fail the next kernel launch
    registrar.unregister(4096)  # logged, never raised: it runs from finalizers
    assert len(cleared) == 2
    with pytest.raises(DeviceError, match="for a CUDA device, not cpu"):
        CudaHostRegistrar(CPU)


def test_a_handled_cuda_error_is_consumed_in_every_cuda_runtime_the_process_loaded():
    torch_lib = "/venv/lib/python3.11/site-packages/torch/lib/libcudart-9335f6a2.so.12"
    maps = [
        f"7f00a000-7f00b000 r-xp 00000000 08:01 123 {torch_lib}",
        f"7f00b000-7f00c000 r--p 00001000 08:01 123 {torch_lib}",
        "7f00c000-7f00d000 r-xp 00000000 08:01 456   /opt/cuda/lib64/libcudart.so.12.4.99 (deleted)",
        "7f00d000-7f00e000 r-xp 00000000 08:01 789 /opt/cuda/lib64/libcudnn.so.9",
        "7f00e000-7f00f000 rw-p 00000000 00:00 0",
        "7f00f000-7f010000 r-xp 00000000 08:01 790 /home/me/libcudart_notes/libfoo.so",
    ]
    assert loaded_cudart(maps) == [torch_lib, "/opt/cuda/lib64/libcudart.so.12.4.99"]
    timeshare.device.clear_cuda_error()  # nothing loaded here: a no-op, never an error
