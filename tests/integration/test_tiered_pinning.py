"""Page-locking under a host budget, through the runtime (NOTE [Locked host tier]): with a
recording registrar standing in for cudaHostRegister in the in-process worker, exactly
the stores that hold bytes are locked, each before its bytes are written (read from
disk, converted, or kept from the device) and unlocked before its pages go, through
drop and read-back cycles, with nothing left locked at the end."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from tests.integration.test_host_tier import NBYTES, X, reference, stores, write
from tests.models import seeded_tier_net
from tests.unit.test_tiered_pinning import LockLedger, RefusingRegistrar
from timeshare.errors import WeightsError
from timeshare.executor.testing import in_process_worker
from timeshare.runtime.facade import Runtime


def locked_by_name(rt: Runtime, ledger: LockLedger) -> dict[str, int]:
    worker = in_process_worker(rt)
    assert worker is not None
    ptrs = {wm.store.buffer.data_ptr(): name for name, wm in worker.models.items()}
    return {ptrs[ptr]: n for ptr, n in ledger.live.items()}


def check_exact(rt: Runtime, ledger: LockLedger) -> None:
    """Locked: every store that holds bytes, at its size, and nothing else; the pinned
    bytes metric says so, and so does the budget's count."""
    filled = {name: s.nbytes for name, s in stores(rt).items() if s.filled}
    assert locked_by_name(rt, ledger) == filled
    snap = rt.snapshot()
    assert snap.host_pinned_bytes == ledger.locked == snap.host_tier.used


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["streamed", "converted"])
def test_every_store_is_locked_before_its_bytes_come_back_and_unlocked_before_they_go(tmp_path, dtype):
    # Converted stores are filled whole before their load; the others are streamed by it.
    # The arena holds two models, host memory two stores, three models: loads drop
    # stores, read them back from disk, and keep evicted models' bytes (demotions).
    paths = [write(tmp_path, i) for i in range(3)]
    x = X if dtype is None else X.to(torch.bfloat16)
    nbytes = NBYTES if dtype is None else NBYTES // 2
    ledger = LockLedger()
    with Runtime("cpu", 2 * nbytes + (64 << 10), host_memory=int(2.2 * nbytes), poison_evicted=True) as rt:
        worker = in_process_worker(rt)
        assert worker is not None
        worker.host_registrar = ledger  # before any registration: what CUDA would lock
        for i, path in enumerate(paths):
            rt.register(f"m{i}", "tests.models:tier_net", path, (x,), dtype=dtype)
        check_exact(rt, ledger)
        for i in (0, 1, 2, 0, 1, 2, 1, 0):
            out = rt.infer(f"m{i}", x)
            assert torch.equal(out, reference(i, dtype=None if dtype is None else torch.bfloat16)), i
            check_exact(rt, ledger)
        for i in (2, 0):
            rt.evict(f"m{i}", host=True)
            check_exact(rt, ledger)
            assert torch.equal(rt.infer(f"m{i}", x), reference(i, dtype=None if dtype is None else torch.bfloat16))
            check_exact(rt, ledger)
        tier = rt.snapshot().host_tier
        assert tier.drops >= 3 and tier.demotions >= 1
        assert (tier.streamed_fills >= 3) == (dtype is None)
        # Every store came from a file, so each lock found its pages blank: it came before
        # the reads (or the copy from the device) wrote anything; every unlock found them
        # still holding the bytes: it came before they were given back.
        assert len(ledger.registered) == tier.fills + tier.demotions
        assert all(ledger.blank_at_lock) and all(ledger.held_at_unlock)
        for i in range(3):
            rt.unregister(f"m{i}")
        assert ledger.live == {} and rt.snapshot().host_pinned_bytes == 0
    assert ledger.unregistered == len(ledger.registered)


def test_a_spilled_store_is_locked_from_registration_and_again_each_time_it_is_read_back(tmp_path):
    ledger = LockLedger()
    with Runtime("cpu", "4MiB", host_memory=int(1.5 * NBYTES), spill_dir=str(tmp_path)) as rt:
        worker = in_process_worker(rt)
        assert worker is not None
        worker.host_registrar = ledger
        rt.register("s", functools.partial(seeded_tier_net, 5), None, (X,))
        assert locked_by_name(rt, ledger) == {"s": stores(rt)["s"].nbytes}  # its weights are in memory
        want = reference(5)
        assert torch.equal(rt.infer("s", X), want)
        for _ in range(3):
            rt.evict("s", host=True)  # written to its spill file, then its pages given back
            check_exact(rt, ledger)
            assert torch.equal(rt.infer("s", X), want)
            check_exact(rt, ledger)
            assert ledger.blank_at_lock[-1]  # locked before the read from the spill file
        assert ledger.blank_at_lock == [False, True, True, True] and all(ledger.held_at_unlock)
        assert rt.snapshot().host_tier.streamed_fills == 3
    assert ledger.live == {}


def test_a_failed_read_back_leaves_nothing_locked(tmp_path):
    path = write(tmp_path, 1)
    ledger = LockLedger()
    with Runtime("cpu", "4MiB", host_memory=4 * NBYTES) as rt:
        worker = in_process_worker(rt)
        assert worker is not None
        worker.host_registrar = ledger
        rt.register("a", "tests.models:tier_net", path, (X,))
        assert torch.equal(rt.infer("a", X), reference(1))
        rt.evict("a", host=True)
        os.truncate(path, os.path.getsize(path) - 64)  # cut short after registration
        with pytest.raises(WeightsError, match="changed size"):
            rt.infer("a", X)  # its store was locked for the read back, which failed
        check_exact(rt, ledger)
        assert ledger.live == {} and len(ledger.registered) == ledger.unregistered == 2


def test_a_store_that_cannot_be_locked_is_read_back_unlocked(tmp_path, caplog):
    """cudaHostRegister failing is no reason to fail a load: it copies from pageable
    memory, as without a lock, with one warning, and nothing counts as locked."""
    caplog.set_level(logging.WARNING, logger="timeshare")
    path = write(tmp_path, 1)
    with Runtime("cpu", "4MiB", host_memory=int(1.5 * NBYTES)) as rt:
        worker = in_process_worker(rt)
        assert worker is not None
        worker.host_registrar = RefusingRegistrar()
        rt.register("a", "tests.models:tier_net", path, (X,))
        for _ in range(3):
            assert torch.equal(rt.infer("a", X), reference(1))
            assert not worker.store_pinned("a") and rt.snapshot().host_pinned_bytes == 0
            rt.evict("a", host=True)
        assert rt.snapshot().host_tier.fills == 3
    said = [r.getMessage() for r in caplog.records if "cannot page-lock the host store of a" in r.getMessage()]
    assert len(said) == 1 and "cudaHostRegister failed" in said[0]


def test_workers_on_the_cpu_lock_nothing_and_each_load_says_so(tmp_path):
    paths = [write(tmp_path, i) for i in range(2)]
    with Runtime("cpu", NBYTES + (64 << 10), workers=2, host_memory=int(1.5 * NBYTES)) as rt:
        for i, path in enumerate(paths):
            rt.register(f"m{i}", "tests.models:tier_net", path, (X,))
        for i in (0, 1, 0, 1):
            call = rt.call(f"m{i}", (X,))
            assert call.record.loaded and torch.equal(call.output, reference(i))
            t = call.record.timings
            assert isinstance(t.worker, int) and t.store_pinned is False and t.lock_s is None
            assert t.host_pinned_bytes == 0
        assert rt.snapshot().host_tier.drops >= 3 and rt.snapshot().host_pinned_bytes == 0
