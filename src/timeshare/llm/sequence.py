"""A generation as its callers see it: the events of one sequence (text deltas, its
finish), its tokens and text as they grow, and the checks a prompt passes before it
queues. Runs in the controller; the engine (``engine.py``) writes, callers read.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from timeshare.decode.step import TokenLogprobs
from timeshare.errors import ConfigError, Timeout, TimeshareError
from timeshare.llm.adapters import Adapter
from timeshare.llm.constrained import Matcher
from timeshare.llm.sampling import SamplingParams

log = logging.getLogger(__name__)

class ContextLengthError(ConfigError):
    """A prompt, with the tokens asked for, longer than the model's context."""


@dataclass(frozen=True)
class Delta:
    """New text of a sequence: ``tokens``, how many it has generated so far; ``ids``, the
    tokens this text came from (since the previous delta; the last may add no text, an
    end token), and with ``logprobs`` asked, theirs (one per id); the first delta carries
    the prompt's, when asked (its tokens after the first)."""

    text: str
    tokens: int
    ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # the first delta's, when asked


@dataclass(frozen=True)
class Finish:
    """A sequence's end: ``reason`` is "stop" (an end token or a stop string), "length"
    (max_tokens or the context), "cancelled" or "error"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: BaseException | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs | None] | None = None  # one per token, when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # the prompt's tokens after the first, when asked


@dataclass(frozen=True)
class TokenTiming:
    """For listeners (metrics): ``first`` — time to the first token since arrival, else
    the time since the sequence's previous token."""

    model: str
    first: bool
    seconds: float


@dataclass(frozen=True)
class SequenceDone:
    model: str
    finish: Finish


Event = TokenTiming | SequenceDone


class Detokenizer:
    """Text of a token stream, a piece per token, each decoded over a few tokens only
    (the last ones already shown and the new ones): a tokenizer's text for a token may
    depend on the tokens around it (a word's leading space, a character's bytes split
    over tokens), so each new piece is the text of the window after the text of its
    first part. A piece that ends in an incomplete character (U+FFFD) waits for the
    next token. The pieces only grow the text: what was shown is never taken back."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens up to here are in the text

    def add(self, token: int) -> str:
        self._tokens.append(token)
        shown = self._decode(self._tokens[self._prefix:self._read])
        now = self._decode(self._tokens[self._prefix:])
        if len(now) <= len(shown) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return now[len(shown):]

    def flush(self) -> str:
        """What the last tokens decode to, complete or not (the sequence ends)."""
        shown = self._decode(self._tokens[self._prefix:self._read])
        now = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return now[len(shown):] if len(now) > len(shown) else ""


def read_events(events: queue.Queue[Delta | Finish], timeout_s: float, cancel: Callable[[], None],
                what: str) -> Iterator[Delta | Finish]:
    """A generation's deltas from ``events``, then its finish, each waited for at most
    ``timeout_s``; past that, the generation is cancelled and ``Timeout`` raised."""
    while True:
        try:
            event = events.get(timeout=timeout_s)
        except queue.Empty:
            cancel()
            raise Timeout(f"{what}: no token in {timeout_s:g} s") from None
        yield event
        if isinstance(event, Finish):
            return


def collect(events: Iterable[Delta | Finish], tokens: list[int]) -> Completion:
    """The whole completion from a generation's events; raises its error if it failed."""
    text: list[str] = []
    logprobs: list[TokenLogprobs | None] = []
    prompt: tuple[TokenLogprobs, ...] | None = None
    for event in events:
        if isinstance(event, Delta):
            text.append(event.text)
            logprobs.extend(event.logprobs)
            prompt = prompt or event.prompt_logprobs
        elif event.error is not None:
            raise event.error
        else:
            return Completion("".join(text), list(tokens), event.reason, event.prompt_tokens,
                              event.completion_tokens, logprobs or None, prompt)
    raise TimeshareError("the generation's events ended without its finish")


class Sequence:
    """One request's generation. Read it with ``events`` (streaming) or ``result``, or
    give ``on_event`` (called in the engine's thread, for each event, instead);
    ``cancel`` frees it at the next step."""

    def __init__(self, sid: int, prompt: list[int], params: SamplingParams, detokenizer: Detokenizer,
                 on_event: Callable[[Delta | Finish], None] | None = None):
        self.id, self.prompt, self.params, self.detokenizer = sid, prompt, params, detokenizer
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []  # one per token when asked (NOTE [Logit processing])
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # once its prefill computed them
        self.text = ""
        self.sent = 0  # characters of ``text`` sent
        self.sent_tokens = 0  # tokens whose ids (and log-probabilities) were sent
        self.finish: Finish | None = None
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # The noise of token i is a hash of (seed, i) (NOTE [One sampler]).
        self.seed = params.seed % (1 << 62) if params.seed is not None else secrets.randbits(31)
        self._events: queue.Queue[Delta | Finish] = queue.Queue()
        self._on_event = on_event
        self.matcher: Matcher | None = None  # its grammar's state (NOTE [Constrained decoding])
        self.adapter: Adapter | None = None  # the adapter it is generated with (NOTE [Adapter residency])
        self._cancelled = threading.Event()

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def events(self, timeout_s: float) -> Iterator[Delta | Finish]:
        """The sequence's deltas, then its finish; each waited for at most ``timeout_s``."""
        return read_events(self._events, timeout_s, self.cancel, f"sequence {self.id}")

    def result(self, timeout_s: float) -> Completion:
        """The whole completion; raises the sequence's error if it failed."""
        return collect(self.events(timeout_s), self.tokens)

    def _put(self, event: Delta | Finish) -> None:
        if self._on_event is None:
            self._events.put(event)
            return
        try:
            self._on_event(event)
        except Exception:  # the reader's bug must not stop the engine
            log.exception("sequence %d: on_event failed", self.id)
            self.cancel()


def check_prompt(model: str, prompt: list[int], params: SamplingParams, vocab: int, max_context: int) -> None:
    """A prompt that cannot be generated from: a clear error before it queues anywhere."""
    if not prompt:
        raise ConfigError("the prompt is empty")
    if any(not 0 <= t < vocab for t in prompt):
        raise ConfigError(f"prompt token ids must be in [0, {vocab})")
    if any(not 0 <= t < vocab for t, _ in params.logit_bias):
        raise ConfigError(f"logit_bias token ids must be in [0, {vocab})")
    if len(prompt) + params.max_tokens > max_context:
        raise ContextLengthError(
            f"model {model!r} has a context of {max_context} tokens; the prompt has {len(prompt)} "
            f"and max_tokens asks for {params.max_tokens} more")
