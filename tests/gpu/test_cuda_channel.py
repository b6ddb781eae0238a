"""A call's tensors through worker processes' tensor channels on CUDA (NOTE [Tensor
channel]): the channel page-locked in the worker (CUDA says so), inputs uploaded from it
with no staging copy, outputs written from the device into it and copied out, all bitwise
the in-process outputs. Marked ``cuda``; skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

import timeshare
from tests.exact import nan_free, same
from timeshare.runtime.events import CallRecord
from timeshare.tree import tensors_in

pytestmark = pytest.mark.cuda

BIG = (8, 3, 299, 299)  # 8.6 MB: more than a channel's first 8 MiB


def test_worker_outputs_through_the_page_locked_channel_are_the_in_process_ones():
    g = torch.Generator().manual_seed(0)
    small = torch.randn(6, 16, generator=g)
    kwargs = {"mask": torch.rand(6, generator=g) > 0.5, "ids": torch.tensor([0, 5, 2]),
              "side": torch.randn(16, 5, generator=g).t()}
    big = [torch.randn(*BIG, generator=g) for _ in range(2)]
    models = {"nested": "tests.channel_models:nested", "echo": "tests.channel_models:echo",
              "reader": "tests.channel_models:reader"}
    examples = {"nested": (small,), "echo": (big[0][:1],), "reader": (big[0][:1],)}
    calls = [("nested", (small,), kwargs)] + [(m, (x,), {}) for m in ("reader", "echo") for x in big * 2]
    with timeshare.Runtime(device="cuda", memory="512MiB", profile_repeats=1) as local:
        for name, builder in models.items():
            local.register(name, builder, None, examples[name])
        expected = [local.infer(m, *a, **k) for m, a, k in calls]
    assert nan_free(expected)
    records: list[CallRecord] = []
    with timeshare.Runtime(device="cuda", memory="512MiB", workers=2, profile_repeats=1) as rt:
        rt.subscribe(lambda r: records.append(r) if isinstance(r, CallRecord) else None)
        for name, builder in models.items():
            rt.register(name, builder, None, examples[name])
        got = [rt.infer(m, *a, **k) for m, a, k in calls]
        for (m, a, _), out, want, rec in zip(calls, got, expected, records[-len(calls):]):
            assert same(out, want), m
            assert all(not t.is_cuda for t in tensors_in(out))  # outputs come back on the host
            t = rec.timings
            assert t.channel_page_locked and t.channel_pinned_bytes > 0  # CUDA sees the pages locked
            assert t.input_staged_bytes == 0  # uploaded from the channel itself, no staging copy
            assert t.input_channel_bytes >= sum(x.nbytes for x in a)
        first = got[-2]
        kept = first.clone()
        rt.infer("echo", big[0] * 2)  # the channel overwritten: the output copied out stays
        assert torch.equal(first, kept)
        assert records[-1].timings.outputs_in_channel == 1
