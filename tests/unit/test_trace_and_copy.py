
import pytest
import torch

from tests import models
from timeshare.errors import PipelineError
from timeshare.models.binding import bind, collect
from timeshare.models.zoo.small import TiedLM
from timeshare.transfer.copy import CpuCopyEngine
from timeshare.transfer.profiler import trace_execution_order


def _trace(module, *args, **kwargs):
    module.eval()
    layout = collect(module)
    tensors = layout.tensors()
    bind(layout, tensors)
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), key)
        for key, t in tensors.items()
        if t.numel()
    ]
    owners = {e.key: [] for e in layout.entries}
    for slot in layout.slots:
        if all(slot.module is not o for o in owners[slot.key]):
            owners[slot.key].append(slot.module)
    with torch.no_grad():
        order, out = trace_execution_order(module, args, kwargs, spans, owners)
    return order, out


def test_order_follows_execution_not_registration():
    order, _ = _trace(TiedLM(), torch.randint(0, 100, (2, 5)))
    # registration order is late, embed, block, decoder; the call order differs
    assert [layer.module for layer in order.layers] == ["embed", "block", "decoder", "late"]
    # the tied weight arrives once, with the embedding; the root reads the scale buffer
    # after the decoder's call, so it waits at the decoder's hook
    assert order.layers[0].keys == ("embed.weight",)
    assert order.layers[2].keys == ("scale",)
    assert order.unused == ()


def test_parent_reading_a_child_weight_waits_before_the_read():
    order, _ = _trace(models.parent_uses_child_weight(), torch.randn(2, 8))
    # proj is never called; its weight is read right after inner ran
    assert [(layer.module, layer.keys) for layer in order.layers] == [
        ("inner", ("inner.weight", "inner.bias", "proj.weight", "proj.bias")),
    ]


def test_unused_tensors_form_the_tail():
    order, _ = _trace(models.optional_head(), torch.randn(2, 8))
    assert set(order.unused) == {"head.weight", "head.bias"}
    assert [(layer.module, layer.keys) for layer in order.layers] == [
        ("body", ("body.weight", "body.bias", "offset")),
        ("norm", ("norm.weight", "norm.bias")),
    ]


def test_unused_tensors_of_modules_that_ran_stay_with_them():
    # eval-mode BatchNorm never reads num_batches_tracked; it must not go to the tail,
    # where it would make the BatchNorm wait for the last group
    order, _ = _trace(models.out_of_order(), torch.randn(2, 8))
    assert order.unused == ()
    assert dict((layer.module, layer.keys) for layer in order.layers)["bn"] == (
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
    )


def test_fused_fast_paths_are_traced_as_they_run():
    # nn.TransformerEncoderLayer's inference fast path reads its children's weights in
    # one fused op without calling them; the trace must not switch that path off
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    x = torch.randn(2, 4, 16)
    order, traced = _trace(layer, x)
    assert [(entry.module, len(entry.keys)) for entry in order.layers] == [("", 12)]
    assert order.unused == ()
    with torch.no_grad():
        assert torch.equal(traced, layer(x))  # the same code path, bit for bit


def test_copy_engine_copies_groups_in_order():
    engine = CpuCopyEngine(deadline_s=10)
    try:
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros_like(src)
        h = engine.start(src, dst, [(0, 4096), (4096, 8192), (8192, 16384)], "test")
        h.wait(1)
        assert torch.equal(dst[:8192], src[:8192])
        h.wait_all()
        assert torch.equal(dst, src) and h.done()
    finally:
        engine.close()


def test_copy_failure_surfaces_at_the_wait_with_the_group():
    engine = CpuCopyEngine(deadline_s=10)
    try:
        src = torch.ones(1024, dtype=torch.uint8)
        dst = torch.zeros(512, dtype=torch.uint8)
        h = engine.start(src, dst, [(0, 512), (512, 1024)], "loading m")
        h.wait(0)  # the first group is fine
        with pytest.raises(PipelineError, match=r"copying group 1 failed.*at loading m, group 1"):
            h.wait(1)
    finally:
        engine.close()


def test_a_group_that_never_arrives_hits_the_deadline():
    engine = CpuCopyEngine(deadline_s=0.2, delay_s=1.0)  # the group's copy starts 1 s late
    try:
        h = engine.start(torch.ones(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), [(0, 8)], "loading m")
        with pytest.raises(PipelineError, match=r"group 0 of 1 did not arrive within 0.2 s \(at loading m\)"):
            h.wait(0)
        models.wait_until(h.done, 10, "the late copy")  # no copy thread left running past the test
    finally:
        engine.close()
