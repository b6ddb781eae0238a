"""Multi-step decode (NOTE [Multi-step decode]): a burst of decode steps in one runtime
call gives every row the tokens it gets one step a call, greedy (``transformers``' own)
and seeded, rows ending inside a burst (their length, a stop string) among rows that go
on, in-process and with workers; a waiting request is admitted at the next call; and a
follow-up turn that resends a burst's answer reads its published pages and gets the
tokens of the same request computed whole."""

from __future__ import annotations

import pytest

from tests.llm_reference import greedy_tokens
from timeshare.decode.pages import block_of
from timeshare.decode.step import KVShape
from timeshare.errors import ConfigError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

pytest.importorskip("transformers")

PROMPTS = ["the model switch fast load weights layer token a gpu share time memory host device cache group "
           "stream copy wake sleep serve request answer", "a gpu", "load weights layer token fast slow memory"]
# Lengths that end inside bursts, a stop string, greedy and seeded rows.
PARAMS = [SamplingParams(max_tokens=40, temperature=0), SamplingParams(max_tokens=7, temperature=0),
          SamplingParams(max_tokens=29, temperature=1.0, seed=5), SamplingParams(max_tokens=33, temperature=0.8,
                                                                                top_k=20, seed=9),
          SamplingParams(max_tokens=40, temperature=0, stop=("UI",))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("burst") / "llama", "llama", seed=4, hidden=96, layers=3,
                                 max_positions=512)


def _generate(model, prompts=PROMPTS, params=PARAMS):
    seqs = [model.generate(model.encode(prompts[i % len(prompts)]), p) for i, p in enumerate(params)]
    return [(c.tokens, c.text, c.finish_reason) for c in (s.result(120) for s in seqs)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_burst_gives_each_row_the_tokens_of_one_step_a_call(llama, workers):
    with Runtime("cpu", "256MiB", workers=workers) as rt:
        burst = lm.load(rt, "burst", llama, multi_step_s=10.0)  # bursts of up to MAX_MULTI_STEP steps
        single = lm.load(rt, "single", llama, multi_step_s=0)
        want = _generate(single)
        got = _generate(burst)
        assert got == want
        a, b = burst.engine.snapshot(), single.engine.snapshot()
        assert b.decode_calls == b.steps
        assert a.steps == b.steps and a.decode_calls < a.steps / 4  # most steps ran in bursts
        reference = greedy_tokens(llama)
        assert got[0][0] == reference(PROMPTS[0], 40) and got[1][0] == reference(PROMPTS[1], 7)
        assert got[1][2] == "length" and len(got[1][0]) == 7
        assert got[4][2] == "stop" and "UI" not in got[4][1] and len(got[4][0]) < 40
        for m in (burst, single):
            m.close()


def test_a_follow_up_turn_reads_the_pages_a_burst_filled(llama):
    """The answer's pages, filled by bursts and published, are read by a turn that resends
    it: its tokens are those of the same request on a model with no cache."""
    with Runtime("cpu", "256MiB") as rt:
        burst = lm.load(rt, "burst", llama, multi_step_s=10.0)
        plain = lm.load(rt, "plain", llama, multi_step_s=0, prefix_caching=False)
        first = burst.generate(burst.encode(PROMPTS[0]), PARAMS[0]).result(120)
        follow = burst.encode(PROMPTS[0]) + first.tokens + burst.encode(" a gpu share")
        before = burst.engine.snapshot().prefix_hits
        got = burst.generate(follow, SamplingParams(max_tokens=12, temperature=0)).result(120)
        hits = burst.engine.snapshot().prefix_hits - before
        want = plain.generate(follow, SamplingParams(max_tokens=12, temperature=0)).result(120)
        assert got.tokens == want.tokens
        # Every full page of the first request's positions: its answer's last token was
        # never fed, and the pages past the prompt's were filled by bursts.
        block = block_of(burst.pages.page_bytes, KVShape.of(burst.config, None))
        prompt = len(burst.encode(PROMPTS[0]))
        assert prompt < block and hits == (prompt + len(first.tokens) - 1) // block >= 1
        for m in (burst, plain):
            m.close()


def test_a_burst_length_below_zero_is_refused_and_the_model_is_not_left_registered(llama):
    with Runtime("cpu", "256MiB") as rt:
        for bad in (-0.01, float("nan")):
            with pytest.raises(ConfigError, match="multi_step_s"):
                lm.load(rt, "bad", llama, multi_step_s=bad)
            assert rt.models() == []
