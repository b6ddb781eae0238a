"""Direct host access (NOTE [Direct host access]): leading embedding layers computed from
the host copy, never copied to the arena, with outputs exact, and their host copy kept
while the model is resident."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch

from tests.integration.test_host_tier import NBYTES, X, reference, seeded_tier_net
from tests.models import EmbedNet, embed_rows_variant, embed_variant, seeded_embed_net
from timeshare.errors import ConfigError
from timeshare.executor.testing import in_process_worker
from timeshare.models.weights import save_weights
from timeshare.runtime.facade import Runtime

IDS = torch.randint(0, 80_000, (2, 12), generator=torch.Generator().manual_seed(5))
EMBED_BYTES = sum(t.numel() * t.element_size() for t in EmbedNet().state_dict().values())


def want(ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return seeded_embed_net(0)(ids)


@pytest.fixture
def weights(tmp_path):
    return save_weights(seeded_embed_net(0), tmp_path / "embed.safetensors")


def in_host_store(rt: Runtime, name: str, tensor: torch.Tensor) -> bool:
    store = in_process_worker(rt).models[name].store.buffer
    start = store.data_ptr()
    return start <= tensor.data_ptr() < start + store.numel()


@pytest.mark.parametrize("direct", [True, False])
def test_leading_embeddings_are_computed_from_host_memory_with_exact_outputs(weights, direct):
    # Evicted blocks poisoned, every group's copy held back: an embedding read from the
    # arena without being copied there, or before its copy, would give other outputs.
    with Runtime("cpu", "64MiB", poison_evicted=True, copy_delay_s=0.002, direct_host_access=direct) as rt:
        rt.register("e", "tests.models:embed_net", weights, (IDS,))
        assert torch.equal(rt.infer("e", IDS), want())
        profile = rt.profile("e")
        assert profile.direct_layers == (1 if direct else 0)  # 20 MB to copy, a few rows to read
        assert len(profile.direct_compute_s) == profile.direct_layers
        for _ in range(3):
            rt.evict("e")
            assert torch.equal(rt.infer("e", IDS), want())  # a pipelined reload
            module = in_process_worker(rt).models["e"].module
            assert in_host_store(rt, "e", module.embed.weight) == direct
            assert not in_host_store(rt, "e", module.fc1.weight)
            assert torch.equal(rt.infer("e", IDS), want())  # resident


def test_the_host_tier_keeps_the_store_a_resident_model_computes_from(tmp_path, weights):
    # Room in host memory for the embedding net's copy and one small net, in the arena for all.
    with Runtime("cpu", "64MiB", host_memory=EMBED_BYTES + int(1.3 * NBYTES)) as rt:
        rt.register("e", "tests.models:embed_net", weights, (IDS,))
        for i in range(2):
            path = save_weights(seeded_tier_net(i), tmp_path / f"{i}.safetensors")
            rt.register(f"n{i}", "tests.models:tier_net", path, (X,))
        assert torch.equal(rt.infer("e", IDS), want())  # the first load copies all and profiles
        rt.evict("e")
        assert torch.equal(rt.infer("e", IDS), want())  # then loads leave the embedding on the host
        assert in_process_worker(rt).reads_host("e")
        for i in (0, 1, 0, 1):  # LRU would drop the embedding net's copy first: it is kept
            assert torch.equal(rt.infer(f"n{i}", X), reference(i))
        diag = rt.diagnostics()
        assert diag.host_stores["e"].filled and diag.host_tier is not None and diag.host_tier.drops >= 1
        assert torch.equal(rt.infer("e", IDS), want())


def test_embeddings_computed_from_a_store_still_being_read_from_disk_wait_for_their_bytes(weights, monkeypatch):
    # A load from disk streams the store while the forward runs: the embedding computed
    # from the store itself must wait for its bytes like any copied group.
    from timeshare.transfer import disk as backing

    real = backing.os.preadv

    def slow(fd, buffers, offset):
        import time
        time.sleep(0.002)
        return real(fd, buffers, offset)

    with Runtime("cpu", "64MiB", host_memory=2 * EMBED_BYTES) as rt:
        rt.register("e", "tests.models:embed_net", weights, (IDS,))
        assert torch.equal(rt.infer("e", IDS), want())  # first load: copied whole, profiled
        monkeypatch.setattr(backing, "READ_CHUNK", 64 << 10)
        monkeypatch.setattr(backing.os, "preadv", slow)
        for _ in range(2):
            rt.evict("e", host=True)
            assert torch.equal(rt.infer("e", IDS), want())
            assert in_process_worker(rt).reads_host("e")


def test_with_workers_a_resident_model_keeps_its_embedding_on_the_host_in_every_worker(weights):
    # The load that left the embedding on the host store ran in one worker; after both
    # workers die, their replacements run the resident model: they must bind the
    # embedding to the host store too (its bytes were never copied to the arena, whose
    # block holds poison from an earlier eviction).
    with Runtime("cpu", "64MiB", workers=2, poison_evicted=True) as rt:
        rt.register("e", "tests.models:embed_net", weights, (IDS,))
        assert torch.equal(rt.infer("e", IDS), want())  # first load: copied whole, profiled
        rt.evict("e")
        assert torch.equal(rt.infer("e", IDS), want())  # pipelined: the embedding stays on the host
        assert rt.profile("e").direct_layers == 1
        replaced = rt.snapshot().workers.replacements
        for pid in rt.worker_pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while rt.snapshot().workers.replacements < replaced + 2 or rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline, rt.snapshot().workers
            time.sleep(0.05)
        assert rt.is_resident("e")
        for _ in range(3):
            assert torch.equal(rt.infer("e", IDS), want())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shared_embedding_is_read_from_its_sets_host_store_and_its_set_still_arrives_whole(workers):
    # Variants that share only the embedding table (NOTE [Shared tensors]); the arena holds
    # the set or "other", not both, so each round e0 loads with its set freed (poisoned).
    # Computed from the set's host store, the table is copied last, and must arrive whole
    # all the same: a variant loaded for the first time next reads it in the arena.
    def variant(v: int) -> torch.Tensor:
        with torch.no_grad():
            return embed_variant(v)(IDS)

    other = functools.partial(seeded_embed_net, 7)
    with Runtime("cpu", "32MiB", dedup=True, workers=workers, poison_evicted=True, copy_delay_s=0.002) as rt:
        for v in range(3):
            rt.register(f"e{v}", functools.partial(embed_variant, v), example_inputs=(IDS,))
        rt.register("other", other, example_inputs=(IDS,))
        assert rt.snapshot().shared.sets == 1
        assert torch.equal(rt.infer("e0", IDS), variant(0))  # the first load copies whole and profiles
        assert rt.profile("e0").direct_layers == 1
        for v in (1, 2):
            rt.evict("e0")
            with torch.no_grad():
                assert torch.equal(rt.infer("other", IDS), other()(IDS))
            assert all(s.offset is None for s in rt.diagnostics().shared_sets.values())
            assert torch.equal(rt.infer("e0", IDS), variant(0))
            if not workers:
                worker = in_process_worker(rt)
                table = next(iter(worker.shared.values())).buffer
                weight = worker.models["e0"].module.embed.weight
                assert table.data_ptr() <= weight.data_ptr() < table.data_ptr() + table.numel()
            assert torch.equal(rt.infer(f"e{v}", IDS), variant(v))  # its first load: the set in the arena
            assert torch.equal(rt.infer("e0", IDS), variant(0))  # resident


def test_an_output_that_views_a_shared_table_on_the_host_is_a_copy():
    # The table is read from the set's host store, which every variant reads: an output
    # viewing it must be the caller's own bytes, or writing to it changes every variant.
    with Runtime("cpu", "64MiB", dedup=True) as rt:
        for v in range(2):
            rt.register(f"r{v}", functools.partial(embed_rows_variant, v), example_inputs=(IDS,))
        rt.infer("r0", IDS)
        rt.evict("r0")
        _, rows = rt.infer("r0", IDS)  # pipelined: the table on the set's host store
        assert rt.profile("r0").direct_layers == 1
        rows.fill_(0.0)
        with torch.no_grad():
            want_rows = embed_rows_variant(0)(IDS)[1]
        assert torch.equal(rt.infer("r0", IDS)[1], want_rows)  # resident, still on the host store
        rt.evict("r0")
        assert torch.equal(rt.infer("r0", IDS)[1], want_rows)


def test_direct_host_access_is_refused_where_it_does_not_run():
    from timeshare.options import RuntimeOptions
    from timeshare.runtime import assembly

    # Refused before the arena or a worker is touched (no device-visible mapping on CUDA yet).
    with pytest.raises(ConfigError, match="CUDA"):
        assembly.make_executor(RuntimeOptions(direct_host_access=True), torch.device("cuda"),
                               None)  # type: ignore[arg-type]
