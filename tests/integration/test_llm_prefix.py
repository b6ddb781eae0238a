"""Automatic prefix caching (issue 45, NOTE [Prefix caching]) and what happens when a
pool's pages run short (NOTE [Preemption under memory pressure]): a prompt whose first
pages were computed before shares them and gives transformers' own tokens, in-process and
with workers; ``prefix_caching: false`` shares nothing; cached pages are reclaimed before
any running sequence is preempted; a preempted sequence recomputes and goes on exactly;
a model's cached pages never outlive its weights."""

from __future__ import annotations

import pytest

from tests.llm_reference import greedy_tokens
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")

SYSTEM = " ".join(["the model switch fast load weights layer token"] * 12)  # 96 tokens: three pages of 32
TURNS = ["a gpu", "memory host device", "slow slow fast"]
TEXTS = ["the model switch fast", "a gpu share", "load weights layer token", "memory host device slow",
         "fast slow memory the"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {arch: hfdir.write_model_dir(root / arch, arch, seed=5, hidden=96, layers=3, max_positions=512)
            for arch in ("llama", "gpt2")}


@pytest.mark.parametrize("arch, workers", [("llama", 0), ("gpt2", 0), ("llama", 2)],
                         ids=["llama", "gpt2", "llama-workers"])
def test_a_cached_prefix_is_shared_and_gives_the_tokens_of_transformers(paths, arch, workers):
    path = paths[arch]
    reference = greedy_tokens(path)
    with Runtime("cpu", "64MiB", workers=workers) as rt:
        m = lm.load(rt, "m", path, max_context=512)
        plain = lm.load(rt, "plain", path, max_context=512, prefix_caching=False)
        for i, turn in enumerate(TURNS):
            prompt = f"{SYSTEM} {turn}"
            assert m.generate(m.encode(prompt), greedy(20)).result(60).tokens == reference(prompt, 20)
            snap = m.engine.snapshot()
            # The system prompt's three pages: computed by the first turn, found by the others.
            assert (snap.prefix_hits, snap.prefix_misses) == (3 * i, 3)
            assert plain.generate(plain.encode(prompt), greedy(20)).result(60).tokens == reference(prompt, 20)
            assert (plain.engine.snapshot().prefix_hits, plain.engine.snapshot().prefix_misses) == (0, 0)
        # A whole prompt seen before: every full page but the one its last token is in.
        again = f"{SYSTEM} {TURNS[0]}"
        assert m.generate(m.encode(again), greedy(20)).result(60).tokens == reference(again, 20)
        assert m.engine.snapshot().prefix_hits == 3 * len(TURNS)
        m.close()
        plain.close()


def _fill(m, reference) -> None:
    """Four short generations: their full pages stay cached after them."""
    for text in TEXTS[:4]:
        assert m.generate(m.encode(text), greedy(20)).result(60).tokens == reference(text, 20)


def test_under_pressure_cached_pages_are_reclaimed_before_any_sequence_is_preempted(paths):
    path = paths["llama"]
    reference = greedy_tokens(path)
    with Runtime("cpu", "64MiB") as rt:
        # Pages of 3 positions; the two long generations need 60 pages together, which only the
        # cached pages' room gives.
        pool = lm.arena_pool(rt, "kv", 60 * 4096, 4096)
        m = lm.load(rt, "m", path, max_context=256, pages=pool)
        _fill(m, reference)
        cached = m.engine.snapshot().cached_pages
        assert cached >= 20 and pool.free_pages == 60
        with rt.turn(m.name):  # both start together
            seqs = [m.generate(m.encode(t), greedy(80)) for t in TEXTS[3:5]]
        for seq, text in zip(seqs, TEXTS[3:5]):
            assert seq.result(60).tokens == reference(text, 80)
        snap = m.engine.snapshot()
        assert snap.preemptions == 0 and snap.kv_bytes == 0
        assert pool.free_pages == 60  # every page back: free, or cached for later
        m.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_rows_that_find_no_page_preempt_the_newest_which_recomputes_and_goes_on_exactly(paths, workers):
    path = paths["llama"]
    reference = greedy_tokens(path)
    with Runtime("cpu", "64MiB", workers=workers) as rt:
        pool = lm.arena_pool(rt, "kv", 40 * 4096, 4096)  # room for one of the two at full length
        m = lm.load(rt, "m", path, max_context=256, pages=pool)
        _fill(m, reference)
        with rt.turn(m.name):
            seqs = [m.generate(m.encode(t), greedy(80)) for t in TEXTS[3:5]]
        for seq, text in zip(seqs, TEXTS[3:5]):
            assert seq.result(60).tokens == reference(text, 80)
        snap = m.engine.snapshot()
        assert snap.preemptions >= 1 and snap.running == 0 and snap.kv_bytes == 0
        assert pool.free_pages == 40
        m.close()


def test_a_models_cached_pages_never_outlive_its_weights(paths, tmp_path):
    """Two models of one name, one after the other, on one pool: the second (other
    weights) finds none of the first's pages, and gives its own tokens."""
    other = hfdir.write_model_dir(tmp_path / "other", "llama", seed=9, hidden=96, layers=3, max_positions=512)
    prompt = f"{SYSTEM} {TURNS[0]}"
    with Runtime("cpu", "64MiB") as rt:
        pool = lm.arena_pool(rt, "kv", 1 << 20, 36864)
        first = lm.load(rt, "m", paths["llama"], max_context=512, pages=pool)
        first.generate(first.encode(prompt), greedy(4)).result(60)
        assert pool.snapshot().cached >= 3
        first.close()
        assert pool.snapshot().cached == 0  # forgotten with their model
        second = lm.load(rt, "m", other, max_context=512, pages=pool)
        assert second.generate(second.encode(prompt), greedy(20)).result(60).tokens == greedy_tokens(other)(prompt, 20)
        assert second.engine.snapshot().prefix_hits == 0
        second.close()
