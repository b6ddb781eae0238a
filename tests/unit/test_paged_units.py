"""Pages (issue 35, 45): the controller's pool of pages with prefix caching, a model's view
of the pages on the device, and choosing tokens on the device (the one sampler)."""

from __future__ import annotations

import pytest
import torch

from timeshare.decode.cache import DecodeView
from timeshare.decode.pages import PagedLayout, pool_footprint, to_device
from timeshare.decode.runner import compile_cache, placement_epoch, relaid_out
from timeshare.decode.sampler import choose
from timeshare.decode.step import Draw, KVShape
from timeshare.errors import ConfigError
from timeshare.llm.pages import KVMemoryError, PagePool, page_keys


def draw(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
         index: int = 0) -> Draw:
    return Draw((temperature,) * rows, (top_k,) * rows, (top_p,) * rows, tuple(seed + i for i in range(rows)),
                (index,) * rows)


def pool_of(pages: int, page_bytes: int = 1024) -> PagePool:
    """A pool of ``pages`` pages besides the scratch page, in memory of its own."""
    return PagePool(torch.zeros(pool_footprint(pages * page_bytes, page_bytes), dtype=torch.uint8), 0, page_bytes)


def test_pages_are_taken_and_given_back_and_page_zero_is_nobodys():
    pool = pool_of(3)
    assert pool.nbytes == 4 * 1024 and pool.pages == 4  # and the scratch page
    pages = pool.take(3)
    assert sorted(pages) == [1, 2, 3] and pool.free_pages == 0
    with pytest.raises(KVMemoryError, match="kv_memory"):
        pool.take(1)
    pool.give(pages[:2])
    assert sorted(pool.take(2)) == sorted(pages[:2])
    with pytest.raises(KVMemoryError):
        pool.take(1)
    assert pool.free_pages == 0
    with pytest.raises(ConfigError, match="more often"):
        pool.give([pages[2], pages[2]])


def test_a_pool_refuses_sizes_it_cannot_hold():
    with pytest.raises(ConfigError, match="one page"):
        pool_footprint(1000, 1024)
    with pytest.raises(ConfigError, match="multiple of 1 KiB"):
        pool_footprint(1 << 20, 1000)
    shape = KVShape(layers=2, kv_heads=2, head_dim=512, dtype=torch.float32)  # 16 KiB a position
    with pytest.raises(ConfigError, match="raise page_bytes"):
        PagedLayout(torch.zeros(8192, dtype=torch.uint8), 4096, shape)


def test_page_keys_name_a_page_by_its_tokens_everything_before_them_and_the_model():
    tokens = list(range(100))
    keys = page_keys(b"m", tokens, 32)
    assert len(keys) == 3 and len(set(keys)) == 3  # three full pages, the last 4 tokens none
    assert page_keys(b"m", tokens[:64] + [7] * 36, 32)[:2] == keys[:2]  # the same first pages
    changed = page_keys(b"m", [1] + tokens[1:], 32)
    assert all(a != b for a, b in zip(changed, keys))  # a token changed: every page after it differs
    assert all(a != b for a, b in zip(page_keys(b"other", tokens, 32), keys))  # another model's
    assert page_keys(b"m", tokens, 32, keys[:1]) == keys  # extended from the first page's key


def test_a_published_prefix_is_shared_kept_after_its_holders_and_reclaimed_last():
    pool = pool_of(4)
    a = pool.take(2)
    keys = page_keys(b"m", list(range(64)), 32)
    for page, key in zip(a, keys):
        pool.publish(page, key, b"m")
    assert pool.share(keys) == (a, [])  # a second holder of both
    assert pool.snapshot().hits == 2
    pool.give(a)
    pool.give(a)  # no holder left: both cached, free to reclaim
    snap = pool.snapshot()
    assert (snap.free, snap.cached) == (4, 2)
    assert sorted(pool.take(2)) == [p for p in range(1, 5) if p not in a]  # never-published pages first
    # Both cached pages are free, but sharing them leaves none for a third page: refused whole.
    with pytest.raises(KVMemoryError):
        pool.share(keys, more=1)
    assert pool.snapshot() == snap.__class__(4, 2, 2, 2, 0)  # nothing held, nothing counted
    assert pool.share(keys) == (a, [])  # still cached
    pool.give(a)
    assert pool.share([keys[1]]) == ([a[1]], [])  # found by key alone
    pool.give([a[1]])
    assert pool.take(1) == [a[0]]  # the least recently used cached page is reclaimed first
    assert pool.share(keys[1:]) == ([a[1]], [])  # the other is still published
    with pytest.raises(KVMemoryError):  # the first's is gone, and no page is left to compute it
        pool.share(keys[:1])
    snap = pool.snapshot()
    assert (snap.free, snap.cached, snap.hits, snap.misses) == (0, 0, 6, 0)


def test_a_closed_models_pages_are_forgotten():
    pool = pool_of(3)
    pages = pool.take(2)
    mine, theirs = page_keys(b"m", list(range(32)), 32)[0], page_keys(b"n", list(range(32)), 32)[0]
    pool.publish(pages[0], mine, b"m")
    pool.publish(pages[1], theirs, b"n")
    pool.give(pages)
    assert pool.forget(b"m") == 1
    assert pool.share([theirs]) == ([pages[1]], [])
    assert pool.snapshot().cached == 0  # the other's page is held again; mine is plain free
    assert pool.share([mine])[0] == []


def test_a_models_view_puts_each_position_of_each_layer_in_its_own_slot():
    shape = KVShape(layers=3, kv_heads=2, head_dim=4, dtype=torch.float16)  # 96 bytes a position
    memory = torch.zeros(5 * 1024, dtype=torch.uint8)
    layout = PagedLayout(memory, 1024, shape)
    assert layout.block == 1024 // 96 and layout.pages_for(layout.block + 1) == 2
    seen = set()
    for layer in range(3):
        keys, values = layout.layer(layer)
        for t in (keys, values):
            for page in range(1, 4):
                for slot in range(layout.block):
                    ptr = t[page, slot].data_ptr()
                    assert ptr not in seen
                    seen.add(ptr)
                    base = memory.data_ptr() + page * 1024
                    assert base <= ptr < base + 1024  # inside its page


def test_a_steps_new_keys_and_values_go_into_each_rows_slot_of_every_layer_and_nowhere_else():
    shape = KVShape(layers=3, kv_heads=2, head_dim=4, dtype=torch.float32)  # 192 bytes a position
    memory = torch.zeros(9 * 1024, dtype=torch.uint8)
    layout = PagedLayout(memory, 1024, shape)
    before = memory.clone()
    new = torch.randn(2, 3, 2, 2, 4)  # [rows, layers, keys and values, kv_heads, head_dim]
    page, slot = torch.tensor([1, 3]), torch.tensor([1, layout.block - 1])
    layout.put(page, slot, new)
    for row in range(2):
        for layer in range(3):
            keys, values = layout.layer(layer)
            assert torch.equal(keys[page[row], slot[row]], new[row, layer, 0])
            assert torch.equal(values[page[row], slot[row]], new[row, layer, 1])
    changed = (memory != before).nonzero().flatten()
    assert changed.numel() > 0 and changed.numel() <= 2 * 3 * 2 * 2 * 4 * 4  # those slots' bytes alone


def test_a_prompts_keys_and_values_go_to_its_positions_pages_from_its_start_and_zeroed_pages_are_zero():
    shape = KVShape(layers=2, kv_heads=1, head_dim=8, dtype=torch.float32)  # 128 bytes a position
    memory = torch.full((6 * 1024,), 0xFF, dtype=torch.uint8)  # poison, as another model's bytes
    layout = PagedLayout(memory, 1024, shape)  # 8 positions a page
    layout.zero([4, 2])
    assert not memory.view(6, 1024)[[2, 4]].any() and memory.view(6, 1024)[3].all()
    table = torch.tensor([5, 2, 4])  # positions 0-7 in page 5, 8-15 in page 2, 16-23 in page 4
    layers = [(torch.randn(7, 1, 8), torch.randn(7, 1, 8)) for _ in range(2)]
    layout.write(table, 6, layers)  # positions 6 to 12
    for i, (k, v) in enumerate(layers):
        keys, values = layout.layer(i)
        assert torch.equal(keys[5, 6:8], k[:2]) and torch.equal(keys[2, :5], k[2:])
        assert torch.equal(values[5, 6:8], v[:2]) and torch.equal(values[2, :5], v[2:])


def test_lists_go_to_the_device_as_given_and_an_eager_step_needs_each_rows_position():
    # NOTE [No waiting on the device]: the CUDA path (page-locked, asynchronous) is in the GPU tier.
    ints = to_device([3, -1, 2**40], torch.device("cpu"))
    assert ints.dtype == torch.int64 and ints.tolist() == [3, -1, 2**40]
    floats = to_device([0.5, 1.0], torch.device("cpu"), torch.float32)
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 1.0]
    table, at = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.bool)
    assert DecodeView(table, at).length is None  # a graph's step reads every slot
    with pytest.raises(ConfigError, match="position"):
        DecodeView(table, at, 5)


def test_compiled_code_is_kept_in_timeshares_cache_unless_told_otherwise(monkeypatch, tmp_path):
    monkeypatch.setenv("TIMESHARE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache() == str(tmp_path / "mine")


def test_greedy_rows_take_the_argmax_and_top_k_one_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(choose(logits, draw(5, temperature=0.0)), logits.argmax(-1))
    assert torch.equal(choose(logits, draw(5, temperature=1.5, top_k=1)), logits.argmax(-1))
    mixed = Draw((0.0, 1.0, 0.0, 1.0, 0.0), (0,) * 5, (1.0,) * 5, (1, 2, 3, 4, 5), (0,) * 5)
    got = choose(logits, mixed)
    assert torch.equal(got[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])


def test_a_draw_is_a_function_of_seed_and_index_and_follows_the_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None].repeat(4000, 1)
    d = Draw((1.0,) * 4000, (0,) * 4000, (1.0,) * 4000, tuple(range(4000)), (3,) * 4000)
    first = choose(logits, d)
    assert torch.equal(first, choose(logits, d))  # the same seeds and indices: the same tokens
    freq = torch.bincount(first, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    later = choose(logits, Draw(d.temperature, d.top_k, d.top_p, d.seed, (4,) * 4000))
    assert 0.5 < (later != first).float().mean() < 0.9  # another index: fresh noise
    # One row alone gets what it got in the batch.
    assert int(choose(logits[:1], Draw((1.0,), (0,), (1.0,), (17,), (3,)))) == int(first[17])


def test_top_p_keeps_the_smallest_set_reaching_it_and_top_k_the_k_most_likely():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log()[None].repeat(2000, 1)
    seeds = tuple(range(2000))
    top_p = choose(logits, Draw((1.0,) * 2000, (0,) * 2000, (0.5,) * 2000, seeds, (0,) * 2000))
    assert set(top_p.tolist()) == {1, 3}  # 0.4, then 0.3 (0.4 before it is short of 0.5)
    top_k = choose(logits, Draw((1.0,) * 2000, (3,) * 2000, (1.0,) * 2000, seeds, (0,) * 2000))
    assert set(top_k.tolist()) == {1, 2, 3}


def test_a_relayout_moves_the_placement_epoch_on():
    module = torch.nn.Linear(2, 2)
    before = placement_epoch(module)
    relaid_out(module)
    assert placement_epoch(module) == before + 1


def test_a_row_whose_logits_hold_nan_gets_no_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = float("nan")
    for d in (draw(3, temperature=0.0), draw(3, temperature=0.8, top_p=0.9)):
        got = choose(logits, d)
        assert int(got[1]) == -1 and int(got[0]) >= 0 and int(got[2]) >= 0


def test_a_lean_steps_projection_is_onednns_where_it_runs_and_agrees_within_rounding():
    """NOTE [Lean decode steps]: on a CPU build with oneDNN the lean step's projections are
    oneDNN's matmul, within rounding of ``F.linear``'s; ``agrees`` takes rounding and
    refuses an error a step could make (a bias left out, a shape, NaN where there was none)."""
    import torch.nn.functional as F

    from timeshare.decode.lean import agrees, linear_of

    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64) * 0.05, torch.randn(96) * 0.01, torch.randn(8, 1, 64)
    linear = linear_of(weight)
    if torch.backends.mkldnn.is_available():
        assert linear is not F.linear
    want = F.linear(x, weight, bias)
    got = linear(x, weight, bias)
    assert agrees(got, want)
    assert not agrees(linear(x, weight, None), want)  # the bias left out
    assert not agrees(got + 1e-3 * want.abs().max(), want)
    assert not agrees(got[:4], want) and not agrees(got.double(), want)
    broken = got.clone()
    broken[0, 0, 0] = float("nan")
    assert not agrees(broken, want) and agrees(broken, broken.clone())
    assert linear_of(weight.to(torch.float64))(x.double(), weight.double(), None).dtype == torch.float64


def test_a_burst_takes_the_pages_of_its_last_position_zeroes_those_it_reaches_and_publishes_only_tokens():
    """NOTE [Multi-step decode]: a burst of steps takes each row's pages up to its last
    position, zeroes the pages it first writes (not the partly written one), and after it
    publishes the pages a row filled with its own tokens: a row that ended inside the
    burst publishes no page holding positions past its last token."""
    from timeshare.decode.step import DecoderSpec, StepKind
    from timeshare.llm.batch import Batch, Row
    from timeshare.llm.sampling import SamplingParams
    from timeshare.llm.sequence import Detokenizer, Sequence

    shape = KVShape(1, 1, 32, torch.float32)  # 256 bytes a position
    pool = pool_of(8, page_bytes=4 * shape.position_bytes)  # 4 positions a page
    spec = DecoderSpec(0, pool.nbytes, pool.page_bytes, shape, 4, 64)
    batch = Batch(pool, spec, b"m")
    rows = []
    for n in (6, 5):  # contexts of 6 and 5 tokens, the last one chosen, not yet in the cache
        seq = Sequence(n, list(range(10 * n, 11 * n - 1)), SamplingParams(max_tokens=8), Detokenizer(str))
        row = Row(seq, pool.take(2), [])
        batch.joined(row)  # its prompt's full page published
        seq.tokens.append(99)
        rows.append(row)
    assert batch.short(4) == []  # positions up to 5+3 and 4+3: three pages and two
    assert [len(r.pages) for r in rows] == [3, 2]
    step = batch.decode(4)
    assert step.kind is StepKind.DECODE and step.count == 4 and step.starts == (5, 4)
    # Row 0 first writes page 2 (positions 8..); row 1 first writes page 1 (positions 4..7).
    assert step.zero == (rows[0].pages[2], rows[1].pages[1])
    # Row 0 takes all four tokens; row 1 ends with its second.
    rows[0].seq.tokens += [1, 2, 3, 4]
    rows[1].seq.tokens += [5, 6]
    batch.stepped(4)
    assert [r.length for r in rows] == [9, 8]
    published = [pool.share([k])[0] for k in page_keys(b"m", rows[0].context(), 4)[:2]]
    assert published == [[rows[0].pages[0]], [rows[0].pages[1]]]  # its prompt's page, and the one the burst filled
    # Row 1 holds positions 0..7, but only 0..6 are its tokens': its page 1 is not published.
    keys = page_keys(b"m", rows[1].context() + [0], 4)
    assert pool.share(keys[:1])[0] == [rows[1].pages[0]]
    assert pool.share(keys[1:2])[0] == []  # not found: a request with those tokens computes them


def test_a_lean_step_uses_onednn_only_for_projections_large_enough_to_pay_its_call():
    """NOTE [Lean decode steps]: a oneDNN call costs more than ``F.linear``'s before it
    reads a byte, so only projections of at least ``ONEDNN_MIN_BYTES`` use it; the others,
    and a model's small head, stay ``F.linear``."""
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from timeshare.decode.lean import ONEDNN_MIN_BYTES, LeanStep, linear_of

    config = LlamaConfig(hidden_size=256, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config).eval()
    lean = LeanStep.of(model)
    assert lean is not None and len(lean.kernels) == 2
    fast = linear_of(model.lm_head.weight)
    assert 256 * 2048 * 4 >= ONEDNN_MIN_BYTES > 256 * 256 * 4
    for q, k, v, o, gate, up, down in lean.kernels:
        assert q is k is v is o is F.linear  # 256 KiB and less
        assert gate is up is down is fast  # 2 MiB each
    assert lean.head is F.linear
