"""CUDA: a measured shape runs unmetered in a pool of the caching allocator (NOTE [Lane
pools]); a call that takes its pool beyond its lane fails with ``LaneExceededError``,
alone, and the lanes go on. Marked ``cuda``; skipped on machines without a GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from timeshare.errors import LaneExceededError
from timeshare.memory.ephemeral import LaneBound, cuda_pools, pooled
from timeshare.memory.lane_pool import CudaLanePool, pool_allowance
from timeshare.runtime.facade import Runtime
from timeshare.runtime.lanes import CONFIRMING_CALLS

pytestmark = pytest.mark.cuda
MIB = 1 << 20


class Greedy(nn.Module):
    """Allocates as many MiB on its device as its input's first value says."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        scratch = torch.ones(int(x[0, 0].item()) * MIB // 4, device=x.device)
        metered = _get_current_dispatch_mode() is not None
        return self.lin(x) + scratch.sum() * 0, torch.tensor(metered)


def test_a_pool_holds_what_its_calls_allocate_and_fails_the_call_that_goes_beyond_its_lane():
    device = torch.device("cuda")
    pool = CudaLanePool(device)
    with pool.activate():
        x = torch.empty(8 * MIB, dtype=torch.uint8, device=device)
    assert pool.held_bytes() >= 8 * MIB
    del x
    pools = cuda_pools(device)
    lane = LaneBound("greedy", 0, 4 * MIB, metered=False)
    with pooled(pools, lane):
        y = torch.empty(3 * MIB, dtype=torch.uint8, device=device)
    del y
    big = pool_allowance(4 * MIB) + 64 * MIB
    with pytest.raises(LaneExceededError) as info, pooled(pools, lane):
        z = torch.empty(big, dtype=torch.uint8, device=device)
        del z
    assert info.value.task == "greedy" and info.value.asked >= big


def test_a_fresh_thread_and_stream_multiply_in_a_small_lane():
    """NOTE [Library workspaces outside pools]: cuBLAS's workspace for a (thread, stream)
    first seen in a pooled call is made outside the pool; made inside, the pool held 34-36
    MiB after a product of a few KiB and the call failed against a 1 MiB lane (H200)."""
    device = torch.device("cuda")
    pools = cuda_pools(device)
    a = torch.randn(64, 64, device=device)
    b = torch.randn(64, device=device)
    failures, dropped = [], pools.dropped

    def lane_call():
        stream = torch.cuda.Stream(device)
        try:
            with torch.cuda.stream(stream), pooled(pools, LaneBound("mm", 0, 1 * MIB, metered=False)):
                out = torch.addmm(b, a, a) @ a
                out16 = (a.bfloat16() @ a.bfloat16()).float()
            stream.synchronize()
            torch.testing.assert_close(out, (b + a @ a) @ a)
            assert out16.shape == (64, 64)
        except BaseException as exc:  # noqa: BLE001 - the main thread reports it
            failures.append(exc)

    for _ in range(2):
        t = threading.Thread(target=lane_call)
        t.start()
        t.join(60)
    assert not failures, failures
    assert pools.dropped == dropped  # no pool went over its lane


def test_a_confirmed_shape_runs_unmetered_and_a_call_beyond_its_lane_fails_alone():
    with Runtime("cuda", "256MiB", scheduling="pack", lane_memory="512MiB") as rt:
        rt.register("g", Greedy, example_inputs=(torch.full((8, 64), 1.0),))
        small = torch.full((8, 64), 1.0)
        seen = [bool(rt.infer("g", small)[1]) for _ in range(1 + CONFIRMING_CALLS + 1)]
        assert seen == [True] * (1 + CONFIRMING_CALLS) + [False]  # the last one ran in a pool
        with pytest.raises(LaneExceededError) as info:
            rt.infer("g", torch.full((8, 64), 256.0))  # same shape, 256 MiB: far beyond the pool's allowance
        assert info.value.task == "g" and info.value.asked > info.value.lane_bytes
        assert bool(rt.infer("g", small)[1])  # the model goes on, metered again: the shape confirms anew
        assert rt.diagnostics().lanes.lanes == []
