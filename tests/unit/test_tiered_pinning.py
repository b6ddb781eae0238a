"""Page-locking under a host budget (NOTE [Locked host tier]) on the CPU: a worker locks a
droppable store at its loads, before their reads from disk, and unlocks it on request or
when a load it locked for fails; the multi-process executor unlocks a store in exactly
the workers whose results said they hold it, before its pages go. A recording registrar
implements the real ``HostRegistrar`` interface and reads the memory it is handed."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models import seeded_tier_net
from tests.unit.test_host_memory import FakeRegistrar
from timeshare import protocol as P
from timeshare.decode.step import DecoderSpec, Draw, KVShape, Step, StepKind
from timeshare.errors import DeviceError, PipelineError
from timeshare.executor.interface import Packed, Ran
from timeshare.executor.packing import Tiered, build_tiered
from timeshare.executor.pool import ProcessPool
from timeshare.executor.pool_executor import PoolExecutor
from timeshare.executor.segments import Segments
from timeshare.memory.arena import Arena
from timeshare.runtime.registration import model_spec
from timeshare.transfer.copy import CpuCopyEngine
from timeshare.worker.proc import worker_main
from timeshare.worker.worker import Worker

CPU = torch.device("cpu")
X = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))


class LockLedger(FakeRegistrar):
    """A ``FakeRegistrar`` that also reads the range: whether it was blank (all zero
    bytes: nothing written yet) when locked, and whether it still held bytes when unlocked."""

    def __init__(self):
        super().__init__()
        self.blank_at_lock: list[bool] = []
        self.held_at_unlock: list[bool] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.blank_at_lock.append(not any(ctypes.string_at(ptr, nbytes)))
        super().register(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        nbytes = self.live.get(ptr)
        if nbytes is not None:
            self.held_at_unlock.append(any(ctypes.string_at(ptr, nbytes)))
        super().unregister(ptr)


class RefusingRegistrar(FakeRegistrar):
    """cudaHostRegister failing (out of lockable memory, say): locks nothing."""

    def register(self, ptr: int, nbytes: int) -> None:
        raise DeviceError(f"cannot page-lock {nbytes:,} bytes of host memory: cudaHostRegister failed")


def tiered(tmp_path: Path, seed: int = 1) -> Tiered:
    spec, _ = model_spec("m", lambda: seeded_tier_net(seed), None, (X,), None, None, "be", None)
    return build_tiered(spec, tmp_path)


def reference(seed: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return seeded_tier_net(seed).eval()(X)


@pytest.fixture
def worker():
    ledger = LockLedger()
    arena = Arena(CPU, 1 << 20)
    engine = CpuCopyEngine(deadline_s=10)
    w = Worker(CPU, arena, engine, profile_repeats=1, registrar=ledger)
    yield w, ledger, arena
    engine.close()
    arena.close()


def test_a_worker_locks_a_droppable_store_at_its_loads_before_the_reads_from_disk(tmp_path, worker):
    w, ledger, arena = worker
    t = tiered(tmp_path)
    w.add("m", t.module, t.layout, t.store, order=t.order, droppable=True)
    assert ledger.live == {} and not w.store_pinned("m")  # not when added: its pages may be empty
    block = arena.allocate(t.store.nbytes, "m")
    assert block is not None
    out = w.run("m", block.offset, False, (X,), {}, "optimal")  # the first load
    assert torch.allclose(out, reference(), atol=1e-6)
    ptr = t.store.buffer.data_ptr()
    assert ledger.live == {ptr: t.store.nbytes} and w.pinned_host_bytes() == t.store.nbytes  # exact
    assert w.lock_s is not None  # what the load spent locking, reported with its timings
    w.run("m", block.offset, True, (X,), {}, "optimal")  # resident: nothing more locked
    assert len(ledger.registered) == 1 and w.lock_s is None

    for cycle in range(3):  # dropped and read back from its spill file, streamed by the load
        t.backing.save(t.store)
        w.unpin_store("m")
        assert ledger.live == {} and ledger.held_at_unlock[-1]  # unlocked while its bytes were there
        t.pages.drop()
        t.pages.reserve()
        fill = t.backing.stream(t.store)
        assert fill is not None
        out = w.run("m", block.offset, False, (X,), {}, "optimal", fill=fill)
        assert torch.allclose(out, reference(), atol=1e-6), cycle
        assert w.last_fill is not None and w.last_fill.bytes_read == t.store.nbytes  # really read from disk
        assert ledger.blank_at_lock[-1]  # locked before the reads wrote anything
        assert ledger.live == {ptr: t.store.nbytes} and w.lock_s is not None
    assert len(ledger.registered) == 4 and ledger.unregistered == 3
    w.unpin_store("m")
    w.unpin_store("m")  # idempotent
    assert ledger.unregistered == 4
    w.remove("m")
    assert ledger.live == {}


def test_a_failed_load_unlocks_only_what_it_locked(tmp_path, worker):
    """The controller learns of a lock from a result only: a load that locked and failed
    unlocks, one that found the store locked (reported earlier) leaves it so."""
    w, ledger, arena = worker
    t = tiered(tmp_path)
    w.add("m", t.module, t.layout, t.store, order=t.order, droppable=True)
    block = arena.allocate(t.store.nbytes, "m")
    assert block is not None
    bad = torch.randn(4, 31)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        w.run("m", block.offset, False, (bad,), {}, "optimal")
    assert ledger.live == {} and len(ledger.registered) == 1 and ledger.unregistered == 1
    w.run("m", block.offset, False, (X,), {}, "optimal")
    assert w.store_pinned("m")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        w.run("m", block.offset, False, (bad,), {}, "optimal")
    assert w.store_pinned("m") and ledger.live == {t.store.buffer.data_ptr(): t.store.nbytes}
    w.remove("m")
    assert ledger.live == {}


def test_a_store_without_a_budget_is_locked_when_added_and_not_by_loads(tmp_path, worker):
    w, ledger, arena = worker
    t = tiered(tmp_path)
    t.store.pin(ledger)  # as a worker process does for a store added without a budget
    w.add("m", t.module, t.layout, t.store, order=t.order)
    block = arena.allocate(t.store.nbytes, "m")
    assert block is not None
    w.run("m", block.offset, False, (X,), {}, "optimal")
    assert len(ledger.registered) == 1 and w.store_pinned("m")
    w.remove("m")
    assert ledger.live == {}


def test_a_store_that_cannot_be_locked_loads_from_pageable_memory_and_says_so_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="timeshare")
    arena = Arena(CPU, 1 << 20)
    engine = CpuCopyEngine(deadline_s=10)
    try:
        w = Worker(CPU, arena, engine, profile_repeats=1, registrar=RefusingRegistrar())
        t = tiered(tmp_path)
        w.add("m", t.module, t.layout, t.store, order=t.order, droppable=True)
        block = arena.allocate(t.store.nbytes, "m")
        assert block is not None
        for _ in range(2):
            out = w.run("m", block.offset, False, (X,), {}, "optimal")
            assert torch.equal(out, w.run("m", block.offset, True, (X,), {}, "optimal"))
            assert torch.allclose(out, reference(), atol=1e-6)
            assert not w.store_pinned("m") and w.pinned_host_bytes() == 0 and w.lock_s is None
            w.unpin_store("m")
        said = [r.getMessage() for r in caplog.records if "cannot page-lock the host store of m" in r.getMessage()]
        assert len(said) == 1 and "cudaHostRegister failed" in said[0]
    finally:
        engine.close()
        arena.close()


class FailedTail:
    """A load's tail whose copies failed: waiting for it raises."""

    def wait_all(self) -> None:
        raise PipelineError("a group did not arrive before its deadline")


def test_a_store_is_unlocked_even_after_a_failed_copy(tmp_path, worker):
    w, ledger, arena = worker
    t = tiered(tmp_path)
    w.add("m", t.module, t.layout, t.store, order=t.order, droppable=True)
    block = arena.allocate(t.store.nbytes, "m")
    assert block is not None
    w.run("m", block.offset, False, (X,), {}, "optimal")
    assert ledger.live
    w.models["m"].pending = FailedTail()  # type: ignore[assignment]
    w.unpin_store("m")  # the failure was the load's, reported with it: the pages must be able to go
    assert ledger.live == {} and not w.store_pinned("m")


# ------------------------------------------------------------------ a worker process's loop
class NoCacheLM(nn.Module):
    """Takes a key/value step's forward but returns no cache: the step fails after its load."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 64)

    def forward(self, ids, attention_mask=None, use_cache=None, logits_to_keep=None):
        return {"logits": self.emb(ids)}


def no_cache_lm() -> NoCacheLM:
    torch.manual_seed(0)
    return NoCacheLM()


IDS = torch.tensor([[1, 2, 3]])


def test_a_worker_process_unlocks_a_store_whose_step_failed_after_the_load(tmp_path, monkeypatch):
    """``worker_main`` on a thread, with the recording registrar as its device's: a language
    model's step loads (and locks) the store, then fails in its own bookkeeping; only a Result
    reports a lock, so the store must be unlocked. A Result reports what is locked."""
    ledger = LockLedger()
    monkeypatch.setattr("timeshare.device.host_registrar", lambda device: ledger)
    pool = FakePool()
    ex = PoolExecutor(torch.device("cuda"), pool)  # a device object only: it builds the messages
    spec, _ = model_spec("lm", no_cache_lm, None, (IDS,), None, None, "be", None)
    ex.add(ex.pack_tiered(spec, build_tiered(spec, tmp_path)))
    arena = Arena(CPU, 1 << 20)
    start = P.Start(worker=7, parent_pid=os.getppid(), device="cpu", arena=arena.share(),
                    arena_capacity=arena.capacity, profile_repeats=1, fixed_group_bytes=1 << 20, load_timeout_s=10.0)
    ours, theirs = multiprocessing.Pipe()
    loop = threading.Thread(target=worker_main, args=(start, theirs), daemon=True)
    loop.start()

    def reply():
        assert ours.poll(30), "the worker did not answer"
        return P.loads(ours.recv_bytes())

    def ask(msg):
        ours.send_bytes(P.dumps(msg))
        return reply()

    try:
        assert isinstance(reply(), P.Hello)
        assert isinstance(ask(replace(pool.added[0], seq=1)), P.Ack)
        nbytes = pool.added[0].store_nbytes
        # A page pool past the arena's end: the step fails after its load, in its own bookkeeping.
        spec = DecoderSpec(1 << 40, 8192, 4096, KVShape(1, 1, 4, torch.float32), 1, 8)
        step = Step(StepKind.PREFILL, spec, ((1, 2, 3),), (0,), ((1,),), Draw((0.0,), (0,), (1.0,), (0,), (0,)))
        failed = ask(P.RunModel(2, "lm", 0, False, (), {}, "optimal", step=step))
        assert isinstance(failed, P.Failure) and failed.error.type_name == "timeshare.errors.ConfigError", failed
        assert "not inside the arena" in failed.error.message
        assert ledger.registered == [nbytes] and ledger.live == {}  # locked by the load, unlocked by its failure
        ran = ask(P.RunModel(3, "lm", 0, False, (IDS,), {}, "optimal"))
        assert isinstance(ran, P.Result), ran
        assert ran.timings.store_pinned is True and ran.timings.worker == 7
        assert ran.timings.host_pinned_bytes == ledger.locked == nbytes  # measured in the worker
        assert isinstance(ask(P.UnpinStore(4, "lm")), P.Ack)
        assert ledger.live == {}
        ours.send_bytes(P.dumps(P.Shutdown()))
        loop.join(30)
        assert not loop.is_alive()
    finally:
        ours.close()
        arena.close()
        ex.remove("lm")


# ------------------------------------------------------------------ the controller's record
@dataclass
class FakeSegment:
    name: str
    size: int
    unlinked: bool = False

    def unlink(self) -> None:
        self.unlinked = True


@dataclass
class FakeHandle:
    id: int


@dataclass
class FakePool:
    """The part of ``ProcessPool`` the executor drives; each run is answered as the worker
    process answers (its id and whether it holds the store locked), or fails."""

    workers: list[FakeHandle] = field(default_factory=lambda: [FakeHandle(1), FakeHandle(2)])
    added: list[P.AddModel] = field(default_factory=list)
    unpinned: list[tuple[str, set[int]]] = field(default_factory=list)
    answer: dict | Exception = field(default_factory=dict)
    refuse_unpin: Exception | None = None
    retired_stops: int = 0

    def stop_retired(self) -> None:
        self.retired_stops += 1

    def add(self, msg: P.AddModel) -> None:
        self.added.append(msg)

    def remove(self, model: str) -> None:
        return None

    def run(self, model, offset, resident, args, kwargs, strategy, lane=None, fill=None, shared=None,
            host_keys=None, kv=None, switch=None) -> Ran:
        if isinstance(self.answer, Exception):
            raise self.answer
        timings = P.CallTimings(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, worker=self.answer.get("worker", 0),
                                store_pinned=self.answer.get("store_pinned", False))
        return Ran(None, timings)

    def unpin_store(self, model: str, workers: set[int]) -> None:
        if self.refuse_unpin is not None:
            raise self.refuse_unpin
        self.unpinned.append((model, set(workers)))


def packed(name: str, nbytes: int, t: Tiered | None) -> Packed:
    """What ``PoolExecutor.add`` reads of a registration; ``t``: under a host budget."""
    spec, _ = model_spec(name, "tests.models:tier_net", None, (X,), None, None, "be", None)
    return Packed(name, spec, torch.nn.Identity(), None, None, nbytes, FakeSegment(f"psm_{name}", nbytes),
                  object(), (), pages=None if t is None else t.pages, view=None if t is None else t.store)


def test_the_pool_unlocks_a_store_in_exactly_the_workers_that_reported_a_lock(tmp_path):
    pool = FakePool()
    ex = PoolExecutor(torch.device("cuda"), pool)  # a device object only: nothing touches CUDA
    t = tiered(tmp_path)
    ex.add(packed("m", 1000, t))
    ex.add(packed("plain", 300, None))
    assert [m.droppable for m in pool.added] == [True, False]  # only the budget's store waits for loads
    assert ex.pinned_host_bytes() == 300  # the plain store is locked by every worker when added

    def load(worker: int, pinned: bool, resident: bool = False) -> None:
        pool.answer = {"worker": worker, "store_pinned": pinned}
        ex.run("m", 0, resident, (), {}, "optimal")

    load(1, True)
    assert ex.pinned_host_bytes() == 1300
    ex.host_dropping("m")
    assert pool.unpinned == [("m", {1})] and ex.pinned_host_bytes() == 300
    assert pool.retired_stops == 1  # a benchmark's one-shot worker may hold it unrecorded: stopped first
    ex.host_dropping("m")  # nothing locked any more: no worker is claimed
    assert len(pool.unpinned) == 1

    load(1, True)
    load(2, True)
    load(2, False, resident=True)  # a resident run does not speak for the store
    pool.answer = RuntimeError("a load that failed")
    with pytest.raises(RuntimeError):
        ex.run("m", 0, False, (), {}, "optimal")  # the worker unlocked what it locked: no record
    ex.host_dropping("m")
    assert pool.unpinned[-1] == ("m", {1, 2})

    load(2, True)
    load(2, False)  # a worker that locks nothing (one on the CPU) says so
    assert ex.pinned_host_bytes() == 300
    ex.host_dropping("m")
    assert len(pool.unpinned) == 2

    load(2, True)
    pool.workers = [FakeHandle(1), FakeHandle(3)]  # worker 2 was replaced: its locks went with it
    assert ex.pinned_host_bytes() == 300
    pool.workers = [FakeHandle(1), FakeHandle(2)]

    pool.refuse_unpin = RuntimeError("the worker could not unlock")
    with pytest.raises(RuntimeError):
        ex.host_dropping("m")  # the host tier keeps the store: its pages must not go
    assert ex.pinned_host_bytes() == 1300  # still on record, to be unlocked by the next drop
    pool.refuse_unpin = None
    ex.remove("m")
    assert ex.pinned_host_bytes() == 300
    ex.host_dropping("m")  # a model removed is forgotten: its worker unlocked it when it removed it
    assert len(pool.unpinned) == 2


@dataclass(eq=False)
class FakeWorkerHandle:
    """A worker's handle as ``ProcessPool.unpin_store`` drives it; answers ``UnpinStore``
    or raises what the worker sent back."""

    id: int
    error: Exception | None = None
    asked: list[P.UnpinStore] = field(default_factory=list)

    def try_lease(self, timeout: float = 0.0) -> bool:
        return True

    def unlease(self) -> None:
        return None

    def request(self, msg: P.UnpinStore, timeout: float, what: str) -> P.Ack:
        self.asked.append(msg)
        if self.error is not None:
            raise self.error
        return P.Ack(msg.seq)


@dataclass
class FakeWorkerSet:
    workers: list[FakeWorkerHandle]
    replaced: list[int] = field(default_factory=list)
    seq: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def snapshot(self) -> list[FakeWorkerHandle]:
        return list(self.workers)

    def replace(self, w: FakeWorkerHandle, cause: BaseException | str) -> None:
        self.replaced.append(w.id)  # killed: its locks go with its process
        self.workers[self.workers.index(w)] = FakeWorkerHandle(100 + w.id)


def test_a_worker_that_fails_to_unlock_is_replaced_and_the_others_still_unlock():
    """A worker's own error (a failed copy, a broken device) comes back as its own type,
    not a WorkerError: the pool replaces that worker whatever the error and goes on, so
    that the store's pages can go with no process left holding them locked."""
    handles = [FakeWorkerHandle(1, PipelineError("a tail failed")), FakeWorkerHandle(2, DeviceError("gone")),
               FakeWorkerHandle(3), FakeWorkerHandle(4)]
    pool = ProcessPool.__new__(ProcessPool)  # only what unpin_store uses: no processes
    pool._set = FakeWorkerSet(list(handles))  # type: ignore[assignment]
    pool._cv = threading.Condition(threading.RLock())
    pool._segments = Segments()
    pool.task_timeout_s = pool.startup_timeout_s = 5.0
    pool.unpin_store("m", {1, 2, 3})
    assert [len(h.asked) for h in handles] == [1, 1, 1, 0]  # exactly the workers named
    assert pool._set.replaced == [1, 2]  # type: ignore[attr-defined]
