"""The tensor channel's encoding (NOTE [Tensor channel], worker/channel.py): nested
structures of tensors written into a buffer as TensorRefs and read back exactly, the
fallback to pickling for what does not fit or cannot be described, and the shared-memory
segment's life."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import warnings
from collections import namedtuple

import pytest
import torch

from tests.exact import same
from timeshare import protocol as P
from timeshare.tree import tensors_in
from timeshare.worker import channel as C

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Box:
    logits: torch.Tensor
    extra: tuple
    note: str = "kept"


class Opaque:
    """An object the walk does not open: its tensor can only travel pickled."""

    def __init__(self, t: torch.Tensor):
        self.t = t


def _layout(result) -> list[tuple[tuple[int, ...], bool]]:
    """Each tensor's strides and ``requires_grad`` in ``result``: what the channel keeps
    of a tensor beside its values."""
    return [(t.stride(), t.requires_grad) for t in tensors_in(result)]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])
    return [
        x,
        x.transpose(0, 2),  # dense, another order: strides kept
        x.permute(0, 2, 1).contiguous(memory_format=torch.contiguous_format).unsqueeze(0),
        torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last),
        torch.tensor(3.5),  # 0-dim
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 4),  # empty
        torch.empty(2, 0, 3, dtype=torch.int32),
        torch.randn(4, 6, generator=g) > 0,  # bool
        torch.randint(-100, 100, (5,), dtype=torch.int8, generator=g),
        torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        torch.randint(-(2 ** 40), 2 ** 40, (3, 3), generator=g),
        x.half(), x.bfloat16(), x.double(), special, special.half(),
        torch.randn(3, generator=g, dtype=torch.complex64),
        torch.arange(12, dtype=torch.int16).reshape(3, 4),
    ]


def _structures():
    ts = _tensors()
    yield tuple(ts)
    yield [ts[0], [ts[1], (ts[4], ts[6])], {"a": ts[8]}]
    yield {"logits": ts[0], "nested": {"mask": ts[8], "ids": ts[11]}, "n": 3, "name": "x", "none": None}
    yield Pair(ts[12], Pair(ts[13], 1.5))
    yield Box(ts[3], (ts[5], "s", Pair(ts[14], ts[7])))
    yield ((ts[0],), {"w": ts[1], "k": [ts[2], ts[15]]})  # args and kwargs as the handle encodes them
    yield ()
    yield ts[4]
    yield 42
    yield {"only": "no tensors"}


@pytest.mark.parametrize("obj", list(_structures()), ids=lambda o: type(o).__name__)
def test_structures_round_trip_exactly_through_views_and_copies(obj):
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    enc = C.encode(obj, buffer)
    assert not enc.left
    assert enc.end <= buffer.numel() and enc.need == enc.end
    data = C.dumps(enc.value, enc.left)
    assert b"torch._utils" not in data and b"_rebuild_tensor" not in data  # no tensor went through pickle
    sent = pickle.loads(data)
    viewed, end = C.views(sent, buffer)
    assert end == enc.end
    assert same(viewed, obj) and _layout(viewed) == _layout(obj)
    copied = C.copies(sent, buffer)
    assert same(copied, obj) and _layout(copied) == _layout(obj)


def test_every_tensor_sits_aligned_and_counted():
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    ts = _tensors()
    enc = C.encode(ts, buffer, start=1000)
    assert enc.refs == len(ts)
    refs = enc.value
    assert all(isinstance(r, P.TensorRef) and r.offset % C.ALIGNMENT == 0 and r.offset >= 1000 for r in refs)
    assert refs[0].stride is None and refs[1].stride == ts[1].stride()  # contiguous: none sent
    assert refs[3].stride == ts[3].stride()  # channels-last kept


def test_gapped_and_overlapping_tensors_are_written_compact_with_their_values():
    x = torch.randn(6, 8)
    gapped, expanded = x[::2, 1::3], torch.randn(1, 5).expand(4, 5)
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    enc = C.encode((gapped, expanded), buffer)
    assert [r.stride for r in enc.value] == [None, None]
    out = C.copies(enc.value, buffer)
    assert torch.equal(out[0], gapped) and torch.equal(out[1], expanded)
    assert out[0].is_contiguous() and out[1].is_contiguous()


def test_requires_grad_travels_and_the_buffer_never_joins_a_graph():
    w = torch.randn(3, 3, requires_grad=True)
    y = w * 2  # not a leaf
    buffer = torch.zeros(1 << 12, dtype=torch.uint8)
    enc = C.encode((w, y), buffer)
    assert not buffer.requires_grad and buffer.grad_fn is None
    viewed, _ = C.views(enc.value, buffer)
    assert all(t.requires_grad and t.is_leaf for t in viewed)
    assert torch.equal(viewed[1].detach(), y.detach())


def test_copies_do_not_change_when_the_buffer_is_overwritten():
    """The controller's outputs are its own: the next call may overwrite the channel."""
    buffer = torch.zeros(1 << 12, dtype=torch.uint8)
    x = torch.randn(4, 4)
    enc = C.encode({"y": x}, buffer)
    out = C.copies(enc.value, buffer)
    view, _ = C.views(enc.value, buffer)
    buffer.fill_(0xFF)
    assert torch.equal(out["y"], x)
    assert not torch.equal(view["y"], x)  # a view does change: the check above can fail


def test_what_does_not_fit_stays_in_place_and_is_logged_once(caplog):
    buffer = torch.zeros(4096, dtype=torch.uint8)
    small, big = torch.randn(10), torch.randn(2000)  # 8,000 bytes
    C._said.clear()
    with caplog.at_level(logging.INFO, logger="timeshare.worker.channel"):
        enc = C.encode({"small": small, "big": big, "again": big.clone()}, buffer)
        C.encode([big], buffer)
    assert enc.refs == 1 and isinstance(enc.value["small"], P.TensorRef)
    assert enc.value["big"] is big and len(enc.left) == 2
    assert enc.need > buffer.numel()  # the controller grows the channel from this
    said = [r for r in caplog.records if "pickled" in r.getMessage()]
    assert len(said) == 1 and "do not fit" in said[0].getMessage()
    sent = pickle.loads(C.dumps(enc.value, enc.left))  # the fallback: torch's own pickling
    got = C.copies(sent, buffer)
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)


def test_a_full_buffer_after_the_inputs_takes_no_output():
    buffer = torch.zeros(4096, dtype=torch.uint8)
    enc = C.encode(torch.randn(100), buffer, start=4000)
    assert enc.refs == 0 and len(enc.left) == 1


def test_tensors_the_descriptor_cannot_carry_fall_back(caplog):
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    sparse = torch.eye(3).to_sparse()
    with warnings.catch_warnings():  # quantized tensors are deprecated, and still sent by someone
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    odd = torch.randn(3).to(torch.float8_e5m2)  # a dtype outside DTYPES

    class Sub(torch.Tensor):
        pass

    sub = torch.randn(3).as_subclass(Sub)
    C._said.clear()
    with caplog.at_level(logging.INFO, logger="timeshare.worker.channel"):
        enc = C.encode([sparse, quantized, sub, odd, torch.ones(2)], buffer)
    assert enc.refs == 1 and isinstance(enc.value[4], P.TensorRef)
    assert all(enc.value[i] is t for i, t in enumerate([sparse, quantized, sub, odd]))
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert all(why in reasons for why in ("layout", "quantized", "subclass", "float8"))


def test_a_tensor_hidden_from_the_walk_is_pickled_and_logged(caplog):
    buffer = torch.zeros(1 << 12, dtype=torch.uint8)
    hidden = torch.randn(3)
    C._said.clear()
    with caplog.at_level(logging.INFO, logger="timeshare.worker.channel"):
        enc = C.encode({"o": Opaque(hidden), "t": torch.ones(1)}, buffer)
        data = C.dumps(enc.value, enc.left)
    assert enc.refs == 1
    assert any("does not open" in r.getMessage() for r in caplog.records)
    assert torch.equal(pickle.loads(data)["o"].t, hidden)


def test_dense_stride_rule():
    x = torch.randn(2, 3, 4)
    assert C.dense_stride(x) is None
    assert C.dense_stride(x.transpose(1, 2)) == x.transpose(1, 2).stride()
    assert C.dense_stride(x[:, :, ::2]) is None
    assert C.dense_stride(torch.randn(1, 4).expand(3, 4)) is None
    assert C.dense_stride(torch.randn(4, 1)[:, :1].t()) is None  # size-1 dims: contiguous whatever the stride


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_channel_is_shared_prefaulted_and_its_name_goes_with_unlink():
    ch = C.Channel.create(10_000)
    try:
        assert ch.nbytes % C.PAGE == 0 and ch.nbytes >= 10_000
        assert ch.spec.name.lstrip("/") in _shm_names()
        x = torch.randn(50)
        enc = C.encode(x, ch.buffer)
        other = C.Channel.attach(ch.spec)  # the worker's mapping: pre-faulting keeps what is there
        try:
            assert torch.equal(C.views(enc.value, other.buffer)[0], x)
            assert other.holds(C.views(enc.value, other.buffer)[0]) and not other.holds(x)
        finally:
            other.release()
        ch.unlink()
        ch.unlink()  # idempotent
        assert ch.spec.name.lstrip("/") not in _shm_names()
        assert torch.equal(C.views(enc.value, ch.buffer)[0], x)  # the mapping outlives the name
    finally:
        ch.release()
    assert ch.buffer.numel() == 0


class _FakeRegistrar:
    def __init__(self):
        self.live: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.live.pop(ptr, None)


def test_the_worker_page_locks_its_whole_mapping_and_unlocks_it_on_release():
    ch = C.Channel.create(1 << 16)
    reg = _FakeRegistrar()
    try:
        mapped = C.Channel.attach(ch.spec, reg)
        assert mapped.pinned and reg.live == {mapped.buffer.data_ptr(): ch.nbytes}
        mapped.release()
        assert reg.live == {} and not mapped.pinned
    finally:
        ch.release()
