"""How a request chooses its tokens and when it stops: the per-request parameters of the
OpenAI API (temperature, top_p, top_k, seed, max_tokens, stop strings, log-probabilities,
penalties, logit bias, min_tokens), checked once; the tokens are chosen where the model
runs (NOTE [One sampler] and NOTE [Logit processing] in ``decode/sampler.py``), the stop
strings found here. Pure; runs in the controller."""

from __future__ import annotations

from dataclasses import dataclass, field

from timeshare.errors import ConfigError
from timeshare.llm.constrained import OutputFormat

MAX_STOPS = 4  # as OpenAI's API
MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI's API (top_logprobs)
MAX_BIAS = 100.0  # a logit bias's magnitude, as OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens. ``temperature`` 0 is greedy decoding (the
    most likely token, as ``transformers``' ``generate`` without sampling); otherwise
    the logits are divided by it, cut to the ``top_k`` most likely (0: all) and to the
    smallest set whose probability reaches ``top_p``, and sampled with noise drawn from
    ``seed`` (None: a random one) and each token's index (NOTE [One sampler]), so that a
    seeded request gives the same text whatever else runs beside it, in-process or in a
    worker. ``logprobs``: how many of each generated token's most likely alternatives to
    report with its own log-probability (None: none); ``prompt_logprobs`` the same for the
    prompt's tokens; ``presence_penalty``, ``frequency_penalty`` (-2 to 2),
    ``repetition_penalty`` (above 0; 1 is none), ``logit_bias`` ((token, -100 to 100)
    pairs) and ``min_tokens`` (no end token and no stop before that many tokens): NOTE
    [Logit processing]."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    output: OutputFormat | None = None  # NOTE [Constrained decoding]

    def __post_init__(self):
        least = 0 if self.prompt_logprobs is not None else 1  # 0: the prompt scored, nothing generated
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise ConfigError(f"max_tokens must be a positive integer (0 only with the prompt's log-probabilities: "
                              f"echo), got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ConfigError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if len(self.stop) > MAX_STOPS or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be at most {MAX_STOPS} non-empty strings, got {list(self.stop)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be a whole number from 0 to {MAX_LOGPROBS}, got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ConfigError(f"repetition_penalty must be above 0 (1: none), got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ConfigError(f"logit_bias keys must be token ids, got {token!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ConfigError(f"logit_bias values must be between -100 and 100, got {bias} for token {token}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be a whole number from 0 to max_tokens ({self.max_tokens}), "
                              f"got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def asks_more(self) -> bool:
        """Whether it asks for anything past temperature, top-k, top-p and the seed
        (NOTE [Logit processing]): log-probabilities, penalties, a bias, min_tokens."""
        return self.logprobs is not None or self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or \
            self.output is not None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Where the first stop string begins in ``text`` (looking from ``start``; a stop
    that began before ``start`` was found earlier), or None."""
    found = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` a stream must hold back: the longest
    tail that begins a stop string (it may complete with the next token, and a stop
    string is never sent), or a character still being decoded (U+FFFD)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, 1)
    return hold
