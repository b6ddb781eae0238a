"""Host memory as a cache over disk (NOTE [Host tier]): models beyond the host budget are
served exactly, their pages really given back, a damaged weights file fails its model
alone, and nothing is left behind."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tests.models import TierNet, seeded_tier_net
from timeshare.errors import ConfigError, MemoryBudgetError, WeightsError
from timeshare.executor.testing import in_process_worker
from timeshare.models.weights import save_weights
from timeshare.runtime.facade import Runtime
from timeshare.runtime.host_tier import StoreView

X = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
NBYTES = sum(t.numel() * t.element_size() for t in TierNet().state_dict().values())


def write(tmp_path: Path, seed: int) -> Path:
    return save_weights(seeded_tier_net(seed), tmp_path / f"net{seed}.safetensors")


def reference(seed: int, x: torch.Tensor = X, dtype: torch.dtype | None = None) -> torch.Tensor:
    net = seeded_tier_net(seed)
    if dtype is not None:
        net = net.to(dtype)
        x = x.to(dtype)
    with torch.no_grad():
        return net(x)


def stores(rt: Runtime) -> dict[str, StoreView]:
    return rt.diagnostics().host_stores


def test_a_file_registration_reads_only_the_header_until_a_load_needs_the_weights(tmp_path):
    path = write(tmp_path, 1)
    with Runtime("cpu", "4MiB", host_memory=4 * NBYTES) as rt:
        rt.register("a", "tests.models:tier_net", path, (X,))
        s = stores(rt)["a"]
        assert not s.filled and s.backing == str(path)
        assert s.resident_bytes < s.nbytes // 4  # the tracing pass read zero pages only
        assert rt.snapshot().host_tier.bytes_read == 0
        assert torch.equal(rt.infer("a", X), reference(1))
        s = stores(rt)["a"]
        assert s.filled and s.resident_bytes >= s.nbytes * 0.9
        assert rt.snapshot().host_tier.bytes_read >= NBYTES * 0.95  # the buffer lives in memory
        assert rt.evict("a", host=True)  # out of device and host memory, on request
        s = stores(rt)["a"]
        assert not s.filled and s.resident_bytes == 0
        assert torch.equal(rt.infer("a", X), reference(1))


@pytest.mark.parametrize("workers", [0, 2])
def test_models_beyond_the_host_budget_are_served_exactly_and_their_pages_given_back(tmp_path, workers):
    n = 8
    budget = int(2.5 * NBYTES)
    rng = random.Random(3)
    with Runtime("cpu", 3 * NBYTES + (1 << 20), host_memory=budget, workers=workers,
                 spill_dir=str(tmp_path / "spill")) as rt:
        for i in range(n):  # half from files (read lazily), half from state dicts (spilled)
            weights = write(tmp_path, i) if i % 2 == 0 else seeded_tier_net(i).state_dict()
            rt.register(f"m{i}", "tests.models:tier_net", weights, (X,))
        zipf = [1 / (k + 1) for k in range(n)]
        for _ in range(40):
            i = rng.choices(range(n), weights=zipf)[0]
            assert torch.equal(rt.infer(f"m{i}", X), reference(i)), f"m{i}"
            view = stores(rt)
            held = [s.resident_bytes for s in view.values()]
            assert sum(s.nbytes for s in view.values() if s.filled) <= budget
            for s in view.values():
                if not s.filled:
                    assert s.resident_bytes <= 64 << 10, s  # dropped: the pages went back
            assert sum(held) <= budget + n * (64 << 10)
        tier = rt.snapshot().host_tier
        assert tier.drops > 0 and tier.fills > n // 2 and rt.stats()["evictions"] > 0
        assert tier.streamed_fills > 0  # reloads read from disk while their groups were copied
        assert tier.spilled_bytes > 0 and len(list((tmp_path / "spill").iterdir())) > 0


@pytest.mark.parametrize("damage", ["truncated", "rewritten", "removed"])
def test_a_weights_file_damaged_after_registration_fails_its_model_alone(tmp_path, damage):
    a, b = write(tmp_path, 1), write(tmp_path, 2)
    with Runtime("cpu", NBYTES + (64 << 10), host_memory=int(1.5 * NBYTES)) as rt:
        rt.register("a", "tests.models:tier_net", a, (X,))
        rt.register("b", "tests.models:tier_net", b, (X,))
        assert torch.equal(rt.infer("a", X), reference(1))
        assert torch.equal(rt.infer("b", X), reference(2))  # a leaves host and device memory
        assert not stores(rt)["a"].filled
        if damage == "truncated":
            os.truncate(a, os.path.getsize(a) - 100)
        elif damage == "rewritten":
            save_weights(seeded_tier_net(3), a)  # same size, other values
        else:
            a.unlink()
        words = {"truncated": "changed size", "rewritten": "modified", "removed": "disappeared"}[damage]
        with pytest.raises(WeightsError, match=words):
            rt.infer("a", X)
        assert words in stores(rt)["a"].error and not stores(rt)["a"].filled
        assert torch.equal(rt.infer("b", X), reference(2))  # nothing else is lost
        rt.unregister("a")
        save_weights(seeded_tier_net(1), a)
        rt.register("a", "tests.models:tier_net", a, (X,))  # registered again, it serves
        assert torch.equal(rt.infer("a", X), reference(1))


def test_a_model_larger_than_the_host_budget_is_refused_and_leaves_nothing(tmp_path):
    with Runtime("cpu", "4MiB", host_memory=NBYTES // 2, workers=0) as rt:
        with pytest.raises(MemoryBudgetError, match="more than the whole host budget"):
            rt.register("big", "tests.models:tier_net", write(tmp_path, 1), (X,))
        assert rt.models() == [] and rt.snapshot().host_tier.models == 0


def test_spill_files_go_with_their_models_and_the_default_folder_with_the_runtime(tmp_path):
    spill = tmp_path / "spill"
    with Runtime("cpu", "4MiB", host_memory=int(1.5 * NBYTES), spill_dir=str(spill)) as rt:
        for i in range(3):
            rt.register(f"m{i}", "tests.models:tier_net", seeded_tier_net(i).state_dict(), (X,))
        assert len(list(spill.iterdir())) == 2  # two dropped to make room, written once each
        for i in range(3):
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))
        names = {p.name for p in spill.iterdir()}
        rt.unregister("m0")
        assert not any(n.startswith("m0-") for n in {p.name for p in spill.iterdir()}) and names
    assert spill.exists() and list(spill.iterdir()) == []  # the user's folder stays, empty
    with Runtime("cpu", "4MiB", host_memory=int(1.5 * NBYTES)) as rt:
        for i in range(2):
            rt.register(f"m{i}", "tests.models:tier_net", seeded_tier_net(i).state_dict(), (X,))
        folder = Path(stores(rt)["m0"].backing).parent
        assert folder.exists()
    assert not folder.exists()


def test_converted_dtypes_and_kept_buffers_match_a_registration_without_a_budget(tmp_path):
    path = write(tmp_path, 4)
    with Runtime("cpu", "4MiB") as plain, Runtime("cpu", "4MiB", host_memory=2 * NBYTES) as tiered:
        for rt in (plain, tiered):
            rt.register("a", "tests.models:tier_net", path, (X.to(torch.bfloat16),), dtype="bfloat16")
            rt.register("b", "tests.models:tier_net", write(tmp_path, 5), (X,))
        for name in ("a", "b", "a", "b"):
            x = X.to(torch.bfloat16) if name == "a" else X
            assert torch.equal(tiered.infer(name, x), plain.infer(name, x))
        assert torch.equal(tiered.infer("b", X), reference(5))


def test_bad_host_options_are_refused_up_front(tmp_path):
    for bad in (0, -5, "lots"):
        with pytest.raises(ConfigError, match="host_memory"):
            Runtime("cpu", "4MiB", host_memory=bad)
    with Runtime("cpu", "4MiB", host_memory="auto") as rt:
        assert rt.snapshot().host_tier.budget > 0
        with pytest.raises(ConfigError, match="example_inputs"):
            rt.register("a", "tests.models:tier_net", write(tmp_path, 1))
        assert rt.models() == []


def test_a_reload_streamed_from_slow_disk_computes_with_every_group_in_place(tmp_path, monkeypatch):
    # Reads slowed to a crawl and evicted blocks poisoned: a group copied before its
    # bytes were read, or computed on before it was copied, would give other outputs.
    from timeshare.transfer import disk as backing

    real = os.preadv

    def slow(fd, buffers, offset):
        import time
        time.sleep(0.003)
        return real(fd, buffers, offset)

    with Runtime("cpu", NBYTES + (64 << 10), host_memory=int(1.5 * NBYTES), poison_evicted=True) as rt:
        for i in range(2):
            rt.register(f"m{i}", "tests.models:tier_net", write(tmp_path, i), (X,))
        for i in (0, 1):  # first loads: profiled, so the reloads are pipelined
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))
        before = rt.snapshot().host_tier.streamed_fills
        monkeypatch.setattr(backing, "READ_CHUNK", 4096)
        monkeypatch.setattr(backing.os, "preadv", slow)
        for i in (0, 1, 0, 1):
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))
        assert rt.snapshot().host_tier.streamed_fills == before + 4  # each reload read from disk


def test_host_memory_keeps_what_the_device_lets_go_and_drops_second_copies_first(tmp_path):
    # Host room for two stores, the arena for two models, three models: a model's host
    # copy is redundant while it is on the device, so that copy goes first, and a model
    # leaving the device leaves its bytes in host memory (a victim cache): coming back,
    # it reads nothing from disk.
    paths = [write(tmp_path, i) for i in range(3)]
    with Runtime("cpu", 2 * NBYTES + (64 << 10), host_memory=int(2.2 * NBYTES), poison_evicted=True) as rt:
        for i, path in enumerate(paths):
            rt.register(f"m{i}", "tests.models:tier_net", path, (X,))
        for i in (0, 1, 2, 0):
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))
        tier = rt.snapshot().host_tier
        assert tier.fills == 3 and tier.demotions >= 1  # m0's second load came from host memory
        assert rt.resident() == ["m2", "m0"]
        for i in (1, 2, 0):
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))


def test_a_worker_killed_during_a_load_from_disk_fails_that_call_alone():
    from tests.integration.test_workers import _kill_during
    from timeshare.errors import WorkerCrashedError

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    with Runtime("cpu", "4MiB", workers=2, host_memory=1 << 20) as rt:
        rt.register("slow", "tests.models:slow", None, (x,), example_kwargs={"delay_s": 0.0})
        want = rt.infer("slow", x, delay_s=0.0)  # the first load traces and profiles
        for _ in range(2):
            rt.evict("slow", host=True)  # its bytes only in the spill file now
            _, result = _kill_during(rt, lambda: rt.infer("slow", x, delay_s=0.01), 0.05)
            assert isinstance(result.get("error"), WorkerCrashedError), result
            assert not stores(rt)["slow"].filled  # what the dead worker read is not trusted
            assert torch.equal(rt.infer("slow", x, delay_s=0.0), want)  # read again, by a standby
        assert rt.snapshot().host_tier.streamed_fills >= 2


def test_keeping_a_leaving_model_never_drops_the_store_being_loaded(tmp_path):
    # Converted stores are filled whole before their load (not streamed). Host memory
    # holds one, the arena one model: B's placement evicts A, whose bytes would stay in
    # host memory only by dropping B's store, which B's load is about to read.
    paths = [write(tmp_path, i) for i in range(2)]
    half = NBYTES // 2
    with Runtime("cpu", half + (64 << 10), host_memory=int(1.5 * half)) as rt:
        for i, path in enumerate(paths):
            rt.register(f"m{i}", "tests.models:tier_net", path, (X.to(torch.bfloat16),), dtype="bfloat16")
        for i in (0, 1, 0, 1):
            out = rt.infer(f"m{i}", X.to(torch.bfloat16))
            assert torch.equal(out, reference(i, dtype=torch.bfloat16)), i


def test_a_failed_first_load_keeps_the_store_its_owner_laid_out(tmp_path):
    # The layout was traced at registration: a first load that fails (a bad input) must
    # not retrace and repack the store into a buffer the host tier does not manage.
    with Runtime("cpu", "4MiB", host_memory=4 * NBYTES) as rt:
        rt.register("a", "tests.models:tier_net", write(tmp_path, 1), (X,))
        store = in_process_worker(rt).models["a"].store
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            rt.infer("a", torch.randn(4, 31))
        assert torch.equal(rt.infer("a", X), reference(1))
        assert in_process_worker(rt).models["a"].store is store
        rt.evict("a", host=True)
        assert stores(rt)["a"].resident_bytes == 0  # the tier's store is the one the worker reads
        assert torch.equal(rt.infer("a", X), reference(1))


def test_models_leaving_host_memory_are_not_kept_at_others_expense(tmp_path):
    # Host room for one store, the arena for two models: m0's copy goes when m1 needs the
    # room (m0 is on the device). Unregistering m0 must not bring its bytes back into host
    # memory by dropping m1's, only to throw them away.
    with Runtime("cpu", 2 * NBYTES + (64 << 10), host_memory=int(1.2 * NBYTES)) as rt:
        for i in range(2):
            rt.register(f"m{i}", "tests.models:tier_net", write(tmp_path, i), (X,))
        for i in range(2):
            assert torch.equal(rt.infer(f"m{i}", X), reference(i))
        assert stores(rt)["m1"].filled and not stores(rt)["m0"].filled
        rt.unregister("m0")
        assert stores(rt)["m1"].filled and rt.snapshot().host_tier.demotions == 0
        assert torch.equal(rt.infer("m1", X), reference(1))


def test_direct_io_reads_bypass_the_page_cache_and_give_the_same_outputs(tmp_path):
    # NOTE [Direct reads]: with direct_io the load's reads use O_DIRECT (on a file system
    # that allows it, as the test machine's does) and the outputs do not change.
    path = save_weights(seeded_tier_net(0), tmp_path / "m.safetensors")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("this file system does not open files with O_DIRECT")
    with Runtime("cpu", "16MiB", host_memory=2 * NBYTES, direct_io=True) as rt:
        rt.register("m", "tests.models:tier_net", path, (X,))
        assert torch.equal(rt.infer("m", X), reference(0))
        for _ in range(2):
            rt.evict("m", host=True)
            assert torch.equal(rt.infer("m", X), reference(0))  # streamed from the file
            fill = in_process_worker(rt).last_fill
            assert fill is not None and fill.direct
