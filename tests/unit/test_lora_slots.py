"""NOTE [Adapters in slots], on a module of two layers of projections: each row gets its
own slot's correction, PEFT's ``x @ A^T @ B^T * scale``, and nothing of another slot's,
not even an inf; NOTE [Adapters streamed in]: a slot written layer by layer, a write cut
short taken up again, a failed copy, and a worker's reader of the write's news."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from timeshare.decode import lora
from timeshare.decode.lora import (
    LoraLayers,
    LoraSpec,
    LoraStacks,
    LoraUse,
    SlotWrite,
    group_rows,
    layer_ends,
    layers_holding,
    pack,
)
from timeshare.errors import ConfigError, GenerationError


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _setup(slots: int = 4, rank: int = 3, always: bool = False, rows: int = 4):
    torch.manual_seed(0)
    module = _Tiny().eval()
    spec = LoraSpec.of(module, slots, rank, torch.float32)
    stacks = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    layers = LoraLayers(stacks, rows=rows, device=torch.device("cpu"), always=always)
    layers.attach(module)
    return module, spec, stacks, layers


def _factors(spec: LoraSpec, rank: int, seed: int, fill: float | None = None):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in spec.targets:
        a, b = torch.randn(rank, t.fan_in, generator=gen), torch.randn(t.fan_out, rank, generator=gen)
        if fill is not None:  # what an overflow of x @ A in half precision gives
            a.fill_(fill)
        out.append((a, b, 0.5))
    return out


def _image(factors):
    return [pack(a, b, scale, torch.float32) for a, b, scale in factors]


def _reference(module: nn.Module, x: torch.Tensor, factors) -> torch.Tensor:
    """The module with each projection's output plus PEFT's correction, computed plainly."""
    i = 0
    for layer in module.layers:
        for proj in layer:
            a, b, scale = factors[i]
            x = torch.nn.functional.linear(x, proj.weight, proj.bias) + (x @ a.t() @ b.t()) * scale
            i += 1
    return x


@pytest.mark.parametrize("always", [False, True], ids=["rows-grouped-by-slot", "whole-stacks-as-graphs-run"])
def test_each_row_gets_its_own_slots_correction_and_nothing_of_another_slot(always):
    module, spec, stacks, layers = _setup(always=always)
    one, two = _factors(spec, 2, 1), _factors(spec, 3, 2)
    SlotWrite(stacks, 1, _image(one)).run()
    SlotWrite(stacks, 2, _image(two)).run()
    SlotWrite(stacks, 3, _image(_factors(spec, 3, 3, fill=float("inf")))).run()  # a slot no row uses, its x @ A all inf
    x = torch.randn(4, 1, 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # grouped products keep the team; stacked ones this small leave it, and it is put back
    try:
        with torch.no_grad():
            plain = module(x)
            layers.use([0, 1, 2, 0], LoraUse(3, (1 << len(spec.targets)) - 1))
            got = module(x)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[0], plain[0]) and torch.allclose(got[3], plain[3])  # the base's rows
    assert torch.allclose(got[1], _reference(module, x[1:2], one)[0], atol=1e-5)
    assert torch.allclose(got[2], _reference(module, x[2:3], two)[0], atol=1e-5)


def test_rows_are_grouped_by_slot_over_a_span_of_columns_or_those_used_gathered():
    """NOTE [Adapters in slots]: without graphs each used column gets ``per`` product rows
    (row 0 where it has fewer, dropped); columns spanning more than ``SPAN_PER_USED``
    times those used are gathered instead of read in place."""
    assert group_rows([0, 0], torch.device("cpu")) is None
    g = group_rows([2, 0, 3, 2], torch.device("cpu"))  # columns 1 and 2: rows 0, 3 and row 2
    assert g is not None and g.span == (1, 3) and g.columns is None and g.per == 2
    assert g.entries.tolist() == [0, 3, 2, 0] and g.keep is not None and g.keep.tolist() == [0, 1, 2]
    assert g.into.tolist() == [0, 3, 2]
    last = 2 * lora.SPAN_PER_USED  # two columns used, 0 and this: spanning exactly twice the ratio
    spanned = group_rows([1, last], torch.device("cpu"))
    assert spanned is not None and spanned.span == (0, last) and spanned.entries.shape == (last,)
    wide = group_rows([last + 1, 1], torch.device("cpu"))  # one column more: gathered
    assert wide is not None and wide.span is None and wide.columns is not None
    assert wide.columns.tolist() == [0, last] and wide.keep is None
    assert wide.entries.tolist() == [1, 0] and wide.into.tolist() == [1, 0]


@pytest.mark.parametrize("gathered", [False, True])
def test_grouped_rows_of_several_positions_each_get_their_slots_correction(gathered, monkeypatch):
    """Rows sharing a slot, a base row, padding rows past the step's, positions past the
    first (a prefill's), and an inf in a spanned column no row uses and in the dropped
    products of a column with fewer rows: each row is PEFT's, none is touched by another's."""
    if gathered:
        monkeypatch.setattr(lora, "SPAN_PER_USED", 0)
    module, spec, stacks, layers = _setup(slots=6, rows=6)
    one, two = _factors(spec, 2, 11), _factors(spec, 3, 12)
    SlotWrite(stacks, 1, _image(one)).run()
    SlotWrite(stacks, 2, _image(_factors(spec, 3, 13, fill=float("inf")))).run()  # spanned, unused
    SlotWrite(stacks, 3, _image(two)).run()
    x = torch.randn(6, 3, 6)
    x[0].fill_(1e38)  # row 0 fills the column of fewer rows: its product (inf) is dropped
    with torch.no_grad():
        plain = module(x)
        layers.use([3, 1, 0, 1], None)
        got = module(x)
    assert torch.isfinite(got[1:]).all()
    assert torch.equal(got[2], plain[2]) and torch.equal(got[4:], plain[4:])  # the base's row and padding
    assert torch.allclose(got[1], _reference(module, x[1:2], one)[0], atol=1e-5)
    assert torch.allclose(got[3], _reference(module, x[3:4], one)[0], atol=1e-5)
    want0 = _reference(module, x[:1], two)[0]
    assert torch.equal(torch.isfinite(got[0]), torch.isfinite(want0))


def test_a_batch_of_one_adapter_and_a_rank_prefix_give_the_same_numbers(monkeypatch):
    """And the thread count each runs its products with: one adapter's this small on the
    calling thread alone, grouped ones on the team; the count is put back."""
    module, spec, stacks, layers = _setup()
    low = _factors(spec, 2, 4)
    SlotWrite(stacks, 2, _image(low)).run()
    x = torch.randn(3, 2, 6)
    seen: list[tuple[str, int]] = []
    linear, bmm = torch.nn.functional.linear, torch.bmm

    def counted_linear(x, weight, bias=None):
        if weight.shape[0] == 2:  # an adapter's A at rank 2 (no projection here is 2 wide)
            seen.append(("one", torch.get_num_threads()))
        return linear(x, weight, bias)

    def counted_bmm(a, b):
        seen.append(("grouped", torch.get_num_threads()))
        return bmm(a, b)

    monkeypatch.setattr(torch.nn.functional, "linear", counted_linear)
    monkeypatch.setattr(torch, "bmm", counted_bmm)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            layers.use([2, 2, 2], LoraUse(2, (1 << len(spec.targets)) - 1))  # one adapter, its rank only
            got = module(x)
            layers.use([2, 2, 0], None)  # mixed, every rank
            mixed = module(x)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    count = len(spec.targets)
    assert seen == [("one", 1)] * count + [("grouped", 2)] * 2 * count
    want = _reference(module, x, low)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(mixed[:2], want[:2], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lower_rank_written_over_a_higher_one_on_the_cpu_is_what_the_device_path_writes(dtype):
    """NOTE [Adapters in slots]: the CPU writes slots through numpy's views of the stacks
    (bfloat16 as 16-bit words); a rank-2 image over a rank-3 one leaves the ranks past 2
    zero, and an image in another type is converted, as the device's copies do."""
    torch.manual_seed(0)
    module = _Tiny().eval()
    spec = LoraSpec.of(module, 3, 3, dtype)
    stacks = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    SlotWrite(stacks, 1, [pack(a, b, scale, dtype) for a, b, scale in _factors(spec, 3, 14)]).run()
    low = [pack(a, b, scale, dtype) for a, b, scale in _factors(spec, 2, 15)]
    image = [low[0], None, *((a.float(), b.float()) for a, b in low[2:])]  # one target not adapted, some converted
    SlotWrite(stacks, 1, image).run()
    for i, got in enumerate(image):
        a, b = stacks.a[i][:, 0], stacks.b[i][:, 0]
        want_a, want_b = torch.zeros_like(a), torch.zeros_like(b)
        if got is not None:
            want_a[:2], want_b[:2] = got[0].to(dtype), got[1].to(dtype)
        assert torch.equal(a, want_a) and torch.equal(b, want_b), i
    stacks.clear(1)
    assert all(not a.any() and not b.any() for a, b in zip(stacks.a, stacks.b))


@pytest.mark.parametrize("converted", [False, True], ids=["numpy-views", "torch-copies"])
def test_a_write_zeroes_past_its_rank_only_as_far_as_earlier_writes_reached(converted, monkeypatch):
    """A slot's write copies its adapter's ranks and zeroes past them only as far as the
    slot's earlier writes reached (a rank-4 adapter in slots of rank 8 writes 4 ranks, not
    4 and 4 of zeros); a write cut short counts as having reached its rank. Ranks no write
    reached are left as they are: marked here to see that they are not written."""
    module = _Tiny().eval()
    spec = LoraSpec.of(module, 3, 8, torch.float32)
    stacks = LoraStacks(spec, torch.full((spec.nbytes,), 0xFF, dtype=torch.uint8))  # unknown contents (NaN)
    stacks.clear(1)
    assert all(not a[:, 0].any() and not b[:, 0].any() for a, b in zip(stacks.a, stacks.b))
    for a, b in zip(stacks.a, stacks.b):
        a[6:, 0], b[6:, 0] = 7.0, 7.0  # known zero to the stacks: never written again

    def image(rank, seed):
        packed = _image(_factors(spec, rank, seed))
        return [(a.double(), b.double()) for a, b in packed] if converted else packed

    def expect(got, rank, zero_to):
        for i, (a, b) in enumerate(zip(stacks.a, stacks.b)):
            for stack, want in ((a[:, 0], None if got is None else got[i][0]),
                                (b[:, 0], None if got is None else got[i][1])):
                if want is not None:
                    assert torch.equal(stack[:rank], want.float()), i
                assert not stack[rank:zero_to].any() and (stack[6:] == 7.0).all(), i

    four, two = image(4, 1), image(2, 2)
    SlotWrite(stacks, 1, four).run()
    expect(four, 4, 6)
    SlotWrite(stacks, 1, two).run()
    expect(two, 2, 6)  # ranks 2 and 3 zeroed: the rank-4 write reached them
    if not converted:  # a copy that fails after writing: its ranks count as reached
        copy = lora.numpy.copyto

        def cut_short(dst, src):
            copy(dst, src)
            raise OSError("cut short")

        monkeypatch.setattr(lora.numpy, "copyto", cut_short)
        with pytest.raises(GenerationError, match="cut short"):
            SlotWrite(stacks, 1, image(5, 3)).finish()
        monkeypatch.undo()
    stacks.clear(1)
    expect(None, 0, 6)


def test_slot_zero_is_the_bases_and_has_no_column_to_write_or_clear():
    _, spec, stacks, _ = _setup()
    SlotWrite(stacks, spec.slots - 1, _image(_factors(spec, 2, 5))).run()
    kept = [a.clone() for a in stacks.a]
    for bad in (0, spec.slots):
        with pytest.raises(ConfigError, match="is not one of 1.."):
            stacks.clear(bad)
        with pytest.raises(ConfigError, match="is not one of 1.."):
            SlotWrite(stacks, bad, _image(_factors(spec, 2, 6)))
    assert all(torch.equal(a, k) for a, k in zip(stacks.a, kept))  # the last slot's column untouched


def test_a_slot_is_written_layer_by_layer_and_a_write_cut_short_is_taken_up_where_it_stopped():
    """NOTE [Adapters streamed in]: a write tells after each layer how many targets are in
    place; one whose listener failed (the worker it told died) is taken up by the next
    run, which first says where it stood, and ends as a whole write does."""
    _, spec, stacks, _ = _setup()
    image = _image(_factors(spec, 2, 7))
    assert layer_ends(spec) == (2, 4)
    assert [layers_holding((2, 4), n) for n in range(5)] == [0, 1, 1, 2, 2]
    whole = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    SlotWrite(whole, 2, image).run()
    write = SlotWrite(stacks, 2, image)
    told: list[int] = []

    def dies(n: int) -> None:
        told.append(n)
        raise OSError("the worker's pipe is gone")

    with pytest.raises(OSError):
        write.run(dies)
    assert told == [2] and write.written == 2 and write.error is None and not write.done
    assert not write.wait(2)  # in place already: no wait
    told.clear()
    write.run(told.append)
    assert told == [2, 4] and write.done and write.wait(4) is False
    assert all(torch.equal(a, w) for a, w in zip(stacks.a + stacks.b, whole.a + whole.b))


def test_a_copy_that_fails_fails_the_waits_and_the_finish_with_its_reason(monkeypatch):
    _, spec, stacks, _ = _setup()
    write = SlotWrite(stacks, 1, _image(_factors(spec, 2, 8)))
    real = LoraStacks.write_target

    def broken(self, slot, i, got, non_blocking=False):
        if i == 2:
            raise RuntimeError("copy fault")
        real(self, slot, i, got, non_blocking)

    monkeypatch.setattr(LoraStacks, "write_target", broken)
    write.start()
    write.wait(2)  # the first layer is written; the second's copy fails
    with pytest.raises(GenerationError, match="could not be written: copy fault"):
        write.wait(3)
    with pytest.raises(GenerationError, match="could not be written: copy fault"):
        write.finish()
    assert write.written == 2 and isinstance(write.error, RuntimeError)


def test_a_workers_reader_of_the_slots_news_waits_only_for_what_has_not_come():
    from timeshare.protocol import SlotReady
    from timeshare.worker.proc import SlotReader

    feed = [SlotReady(1, 2), SlotReady(1, 2), SlotReady(1, 4)]  # a write taken up again says 2 twice
    reader = SlotReader(lambda: feed.pop(0), lambda: True, 4)
    assert reader.wait(1) is False and reader.written == 2  # already there: not waited for
    reader.drain()
    assert reader.written == 4 and not feed
    news = [SlotReady(1, -1), SlotReady(1, 4)]
    failed = SlotReader(lambda: news.pop(0), lambda: False, 4)
    with pytest.raises(GenerationError, match="could not write"):
        failed.wait(1)
    failed.drain()
    assert news == [SlotReady(1, 4)]  # nothing more is read once the controller said it failed
    late = [SlotReady(1, 4)]
    assert SlotReader(lambda: late.pop(0), lambda: False, 4).wait(3) is True  # it had not come: waited


def test_a_slot_whose_write_never_ended_is_kept_out_of_use_until_it_does():
    """NOTE [Adapters streamed in]: an adapter removed while its slot's write is still under
    way (stuck past the step's deadline) leaves the slot neither cleared nor handed out;
    once that write ends, the next adapter gets the slot, cleared and written whole."""
    from pathlib import Path

    from timeshare.llm.adapters import Adapter, AdapterSlots, AdapterSlotsFull

    _, spec, stacks, _ = _setup(slots=2)
    slots = AdapterSlots(stacks, stream=True)
    x = Adapter("x", Path("/x"), 2, _image(_factors(spec, 2, 9)))
    y = Adapter("y", Path("/y"), 2, _image(_factors(spec, 2, 10)))
    slot = slots.take(x)
    stuck = slots.writing(slot)
    assert stuck is not None and not stuck.ended  # its prefill's step never ran it
    slots.release(slot)
    slots.drop("x")
    with pytest.raises(AdapterSlotsFull):
        slots.take(y)  # the slot may still be written: not handed out
    stuck.run()
    assert slots.take(y) == slot
    slots.settle(slot)
    whole = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    SlotWrite(whole, slot, y.factors).run()
    assert all(torch.equal(a, w) for a, w in zip(stacks.a + stacks.b, whole.a + whole.b))


def test_an_adapter_removed_while_its_failed_write_held_its_slot_is_let_go(monkeypatch):
    """An adapter removed while a row held its slot, whose write then fails: its row's
    release leaves nothing of it behind (its host copy can go), and the slot is free for
    the next adapter, written whole."""
    import gc
    import weakref
    from pathlib import Path

    from timeshare.llm.adapters import Adapter, AdapterSlots

    _, spec, stacks, _ = _setup(slots=2)
    slots = AdapterSlots(stacks, stream=True)
    x = Adapter("x", Path("/x"), 2, _image(_factors(spec, 2, 11)))
    slot = slots.take(x)
    slots.drop("x")  # removed while its row holds the slot
    assert slots.snapshot().on_device == 0 and slots.slot_of("x") is None

    def broken(self, slot, i, got, non_blocking=False):
        raise OSError("copy engine fault")

    with monkeypatch.context() as patched:
        patched.setattr(LoraStacks, "write_target", broken)
        with pytest.raises(GenerationError, match="copy engine fault"):
            slots.settle(slot)
    slots.release(slot)
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None  # the slots keep nothing of it
    y = Adapter("x", Path("/x"), 2, _image(_factors(spec, 2, 12)))  # the name served again
    assert slots.take(y) == slot and slots.slot_of("x") == slot
    slots.settle(slot)
    whole = LoraStacks(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    SlotWrite(whole, slot, y.factors).run()
    assert all(torch.equal(a, w) for a, w in zip(stacks.a + stacks.b, whole.a + whole.b))
