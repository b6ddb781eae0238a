"""Log-probabilities in OpenAI's shapes (NOTE [Logit processing] says what they are: the
model's raw ones): a completion's ``logprobs`` (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and a chat's (``content``: ``token``, ``logprob``,
``bytes``, ``top_logprobs``), whole or a streamed chunk's part. Pure; runs in the
server's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from timeshare.decode.step import TokenLogprobs


class TokenTexts:
    """Each token's text where it stands: what it adds to the text of the few tokens before
    it (a SentencePiece token decoded alone loses its leading space; in context it keeps
    it). A token that is part of a character reads U+FFFD, as vLLM reports it too."""

    WINDOW = 4  # tokens of context a token's text is decoded after

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._head: tuple[tuple[int, ...], str] = ((), "")  # the last context decoded, and its text

    def __call__(self, token: int, before: Sequence[int] = ()) -> str:
        context = list(before[-self.WINDOW:])
        if not context:
            return self._decode([token])
        if self._head[0] != tuple(context):  # a token's alternatives share its context: decoded once
            self._head = (tuple(context), self._decode(context))
        head = self._head[1]
        whole = self._decode(context + [token])
        return whole[len(head):] if whole.startswith(head) else self._decode([token])


@dataclass
class CompletionLogprobs:
    """A completion choice's ``logprobs``, grown part by part; ``offset`` is where the next
    token's text begins in the choice's text; ``context``, the tokens before the next one."""

    texts: TokenTexts
    context: list[int] = field(default_factory=list)
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], *, first_unknown: bool = False) -> dict:
        """Tokens ``ids`` with theirs (``first_unknown``: the first has none, a prompt's first
        token); the part they make, in the shape of the whole (a streamed chunk's)."""
        start = len(self.tokens)
        for i, token in enumerate(ids):
            before = self.context[-TokenTexts.WINDOW:]
            text = self.texts(token, before)
            self.context = before + [token]
            got = None if first_unknown and i == 0 else logprobs[i - 1 if first_unknown else i]
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if got is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(got.logprob)
            # As OpenAI's legacy completions: the top ones and always the chosen token.
            top = {self.texts(t, before): lp for t, lp in got.top}
            top.setdefault(text, got.logprob)
            self.top_logprobs.append(top)
        return self.since(start)

    def since(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


def chat_logprobs(texts: TokenTexts, ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None],
                  context: list[int]) -> list[dict]:
    """A chat choice's ``logprobs.content`` entries for tokens ``ids``, which follow the
    tokens of ``context`` (grown with them)."""
    content: list[dict[str, Any]] = []
    for token, got in zip(ids, logprobs):
        before = context[-TokenTexts.WINDOW:]
        context[:] = before + [token]
        if got is None:
            continue
        content.append({**_entry(texts(token, before), got.logprob),
                        "top_logprobs": [_entry(texts(t, before), lp) for t, lp in got.top]})
    return content


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
