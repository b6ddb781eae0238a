"""NOTE [Logit processing] element by element: ``Processing.apply`` on logits with negative
and positive values against transformers' ``RepetitionPenaltyLogitsProcessor`` and
OpenAI's presence and frequency definitions, a logit bias and banned tokens per row, the
counts of a burst's later steps, and rows that ask for nothing left exactly as they were."""

from __future__ import annotations

import pytest
import torch

from timeshare.decode.sampler import Processing, choose, log_probabilities
from timeshare.decode.step import Draw, Penalties

transformers = pytest.importorskip("transformers")

VOCAB = 50
CPU = torch.device("cpu")


def _draw(rows: int, **extra) -> Draw:
    return Draw((0.0,) * rows, (0,) * rows, (1.0,) * rows, (1,) * rows, (0,) * rows, **extra)


def _logits(rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, VOCAB, generator=g) * 3  # as many negative as positive


def test_penalties_are_transformers_repetition_then_openais_presence_and_frequency():
    prompt, made = (3, 4, 5, 3), (7, 7, 9, 4)
    pen = Penalties(presence=0.6, frequency=0.4, repetition=1.7, history=prompt + made, prompt=len(prompt))
    draw = _draw(3, penalties=(pen, None, Penalties(0.0, 0.0, 0.5, (1, 2), 2)))
    logits = _logits()
    got = Processing(draw, VOCAB, CPU).apply(logits)
    want = logits.clone()
    want[0:1] = transformers.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + made]), want[0:1].clone())
    counts = torch.zeros(VOCAB).index_add_(0, torch.tensor(made), torch.ones(len(made)))
    want[0] -= 0.4 * counts + 0.6 * (counts > 0).float()
    want[2:3] = transformers.RepetitionPenaltyLogitsProcessor(0.5)(torch.tensor([[1, 2]]), want[2:3].clone())
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert (logits[0, [3, 4, 5, 7, 9]] < 0).any() and (logits[0, [3, 4, 5, 7, 9]] > 0).any()  # both branches


def test_a_bursts_later_steps_count_the_tokens_chosen_before_them():
    pen = Penalties(presence=0.5, frequency=1.0, repetition=1.3, history=(1, 2), prompt=2)
    draw = _draw(2, penalties=(pen, None))
    logits = _logits(2)
    processing = Processing(draw, VOCAB, CPU)
    processing.advance(torch.tensor([11, 12]))
    processing.advance(torch.tensor([11, 12]))
    processing.advance(torch.tensor([-1, 12]))  # a NaN row's -1 counts for nothing
    later = Penalties(presence=0.5, frequency=1.0, repetition=1.3, history=(1, 2, 11, 11), prompt=2)
    fresh = Processing(_draw(2, penalties=(later, None)), VOCAB, CPU)
    assert torch.equal(processing.apply(logits), fresh.apply(logits))


def test_bias_and_banned_tokens_per_row_and_per_step():
    draw = _draw(2, bias=(((4, 100.0), (6, -5.0)), ()), banned=(((4, 8), 2), ((8,), 0)))
    logits = _logits(2)
    processing = Processing(draw, VOCAB, CPU)
    first = processing.apply(logits, 0)
    assert first[0, 4] == float("-inf") and first[0, 8] == float("-inf")  # banned for its next two tokens
    assert first[0, 6] == pytest.approx(float(logits[0, 6]) - 5.0)
    assert torch.equal(first[1], logits[1])  # banned for no step: nothing
    third = processing.apply(logits, 2)
    assert third[0, 4] == pytest.approx(float(logits[0, 4]) + 100.0) and third[0, 8] == logits[0, 8]
    assert int(choose(logits, draw, processing, 2)[0]) == 4 and int(choose(logits, draw, processing, 0)[0]) != 4


def test_nothing_asked_builds_nothing_and_chooses_as_before():
    draw = _draw(3)
    assert not draw.processed and draw.top_logprobs == -1
    logits = _logits()
    assert torch.equal(choose(logits, draw), logits.argmax(-1))


def test_log_probabilities_are_the_raw_ones_with_their_top_in_order():
    logits = _logits(2)
    chosen = torch.tensor([3, -1])
    mine, ids, values = log_probabilities(logits, chosen, 4)
    want = torch.log_softmax(logits, -1)
    assert torch.allclose(mine, want[[0, 1], [3, 0]])
    assert torch.equal(ids, want.topk(4).indices) and torch.allclose(values, want.topk(4).values)


def test_log_probabilities_in_chunks_are_those_computed_whole():
    logits = torch.randn(7, VOCAB)
    chosen = torch.randint(0, VOCAB, (7,))
    whole = log_probabilities(logits, chosen, 3, chunk=100)
    chunked = log_probabilities(logits, chosen, 3, chunk=2)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_a_constrained_rows_mask_allows_exactly_its_bits():
    allowed = [1, 5, 31, 32, 45]  # tokens in both of the mask's 32-bit words
    words = [0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = b"".join(w.to_bytes(4, "little") for w in words)
    draw = _draw(3, allowed=(b"", mask, b""))
    processing = Processing(draw, VOCAB, CPU)
    scores = processing.apply(_logits())
    assert torch.isfinite(scores[0]).all() and torch.isfinite(scores[2]).all()  # unconstrained rows
    assert torch.isfinite(scores[1]).nonzero().flatten().tolist() == allowed  # none past its words, none else
    assert int(choose(_logits(), draw, processing)[1]) in allowed
