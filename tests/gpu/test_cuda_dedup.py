"""Shared tensors on CUDA (NOTE [Shared tensors]): variants that share a base answer
exactly with the sets' copies on the copy stream, the sets' stores are page-locked and
given back. Marked ``cuda``; skipped on machines without a GPU."""

import functools

import pytest
import torch

import timeshare
from tests.models import variant_net

pytestmark = pytest.mark.cuda

IDS = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))


def want(v: int) -> torch.Tensor:
    net = variant_net(v).to("cuda")
    with torch.no_grad():
        return net(IDS.to("cuda")).cpu()


@pytest.mark.parametrize("workers", [0, 2])
def test_variants_on_cuda_are_exact_and_give_pinned_memory_back(workers):
    # NOTE [Poisoned reloads]: NaN in every freed block and each group's copy held back: a
    # forward that reads a set before its copy, or a set that was not copied, reads NaN.
    with timeshare.Runtime(device="cuda", memory="64MiB", workers=workers, dedup=True, profile_repeats=1,
                           poison_evicted=True, copy_delay_s=0.002) as rt:
        for v in range(3):
            rt.register(f"v{v}", functools.partial(variant_net, v), example_inputs=(IDS,))
        shared = rt.snapshot().shared
        assert shared.sets == 1
        assert rt.snapshot().host_pinned_bytes >= shared.shared_bytes + shared.own_bytes
        ready = {}
        for v in range(3):  # resident outputs: what every later load must give, bit for bit
            rt.infer(f"v{v}", IDS)
            ready[v] = rt.infer(f"v{v}", IDS)
            assert torch.allclose(ready[v], want(v), rtol=1e-4, atol=1e-5)
        for rep in range(3):
            for v in (0, 1, 2):
                # Its own block poisoned, the others resident beside the set: in 64 MiB
                # every variant fits, so only its own eviction makes this call load it.
                rt.evict(f"v{v}")
                call = rt.call(f"v{v}", (IDS,))
                assert call.record.loaded and torch.equal(call.output, ready[v]), (rep, v)
        for v in range(3):
            rt.unregister(f"v{v}")
        assert rt.snapshot().host_pinned_bytes == 0 and rt.snapshot().shared.sets == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_variants_under_a_host_budget_on_cuda_read_their_own_bytes_back_exactly(tmp_path, workers):
    # NOTE [Shared tensors under a host budget]: the set stays pinned in host memory; each
    # variant's own store is dropped (unpinned first) and read back from its spill file
    # while its load copies it, then pinned again.
    from tests.integration.test_dedup import BASE_BYTES, OWN_BYTES

    budget = BASE_BYTES + OWN_BYTES * 5 // 2
    with timeshare.Runtime(device="cuda", memory="64MiB", workers=workers, dedup=True, profile_repeats=1,
                           host_memory=budget, spill_dir=str(tmp_path), poison_evicted=True) as rt:
        for v in range(4):
            rt.register(f"v{v}", functools.partial(variant_net, v), example_inputs=(IDS,))
        ready = {}
        for v in range(4):
            rt.infer(f"v{v}", IDS)
            ready[v] = rt.infer(f"v{v}", IDS)
            assert torch.allclose(ready[v], want(v), rtol=1e-4, atol=1e-5)
        for v in (0, 2, 1, 3, 0):
            rt.evict(f"v{v}", host=True)
            call = rt.call(f"v{v}", (IDS,))
            assert call.record.loaded and torch.equal(call.output, ready[v]), v
            assert rt.snapshot().host_tier.used <= budget
        assert rt.snapshot().host_tier.fills >= 5
        for v in range(4):
            rt.unregister(f"v{v}")
        assert rt.snapshot().host_pinned_bytes == 0 and rt.snapshot().host_tier.used == 0
