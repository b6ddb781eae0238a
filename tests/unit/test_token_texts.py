"""A token's text in the log-probabilities (``server/logprobs.py``) is what it adds where it
stands: with a SentencePiece-style tokenizer (a word's leading space is part of its token,
and decoding a token alone drops it) the tokens' texts join to the answer's text, and
``text_offset`` points into it."""

from __future__ import annotations

import pytest

from timeshare.decode.step import TokenLogprobs
from timeshare.server.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581the": 1, "\u2581model": 2, "s": 3, "\u2581switch": 4, "\u2581fast": 5, "\u2581": 6}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")


def test_a_tokens_text_keeps_its_leading_space_where_it_stands(tok):
    decode = tok.decode
    texts = TokenTexts(decode)
    assert decode([2]) == "model"  # alone, the space is dropped
    assert texts(2, [1]) == " model" and texts(3, [1, 2]) == "s"
    ids = [1, 2, 3, 4, 5]
    lp = CompletionLogprobs(texts)
    lp.add(ids[:2], [TokenLogprobs(-1.0)] * 2)
    part = lp.add(ids[2:], [TokenLogprobs(-1.0, ((5, -2.0),))] * 3)
    whole = decode(ids)
    assert "".join(lp.tokens) == whole  # the first token's own leading space aside, as the answer's text
    assert [whole[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert " fast" in part["top_logprobs"][0]  # an alternative's text where it would stand
    context = [1]
    content = chat_logprobs(texts, [2, 3], [TokenLogprobs(-0.5), TokenLogprobs(-0.1)], context)
    assert [c["token"] for c in content] == [" model", "s"] and context[-2:] == [2, 3]
    assert content[0]["bytes"] == list(b" model")
