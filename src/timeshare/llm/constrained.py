"""Structured outputs: a request's answer held to a JSON schema (``response_format``) by
a grammar library, behind one interface (``Grammars``, a ``Matcher`` per sequence). Runs
in the controller, in the model's engine thread; the mask a matcher gives crosses with
the step and is applied where the model runs (``decode/sampler.py``).

# NOTE [Constrained decoding]
A constrained sequence's next token is chosen among those its grammar allows: before
each of its steps the engine asks its matcher for the mask of allowed tokens (one bit per
token, the library's own layout), which the step's ``Draw`` carries (``allowed``) and the
sampler applies after every other processing and before the choice (NOTE [Logit
processing]); the token chosen is then given to the matcher, and the sequence stops
("stop") when its grammar is complete or its end token comes (allowed only where the
grammar may end). A step with a constrained row is never a burst (each mask depends on
the token before it). The library is llguidance (``LLGuidance``): one abi3 wheel with no
Python dependencies, a schema compiled in about 1 ms, a mask in 40-60 us at the median
and 0.4 ms at the 99th percentile over a 32,000-token vocabulary, all of 100 drawn
schemas compiled (xgrammar: about 3 ms, 7-16 us and 0.4 ms, 100 of 100, but a wheel per
Python and a runtime of its own; ``scripts/grammar_libraries.py``,
``bench/results/grammar-libraries-cpu-epyc-2core.json``). Another library fits behind
``Grammars``.

# NOTE [Masks while the device runs]
A step's masks are needed only by its sampler, after its forward: so they are computed
while the forward runs. The step crosses with ``Step.masks``, a function the runner
calls once it has queued the forward (``Step.drawn``; ``Batch.masks_of`` makes it, timing
the masks). In-process on CUDA the forward's kernels run meanwhile; on the CPU the one
thread does both, one after the other. With workers the step is sent with
``MasksFollow`` in its place; ``WorkerHandle.call`` computes the masks as soon as the
step is posted, while the worker's forward runs, and sends them as ``StepMasks``, which
the worker's step reads from its pipe (``WorkerProcess._step_masks``, under a deadline)
before its choice. A step that fails before reading them still takes them off the pipe;
masks that could not be computed are sent empty and fail the step. The mask of a step
depends on the token of the step before, so it cannot be computed earlier than this.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from timeshare.errors import ConfigError


class GrammarError(ConfigError):
    """A format the grammar library cannot compile (a 400 naming why)."""


@dataclass(frozen=True)
class OutputFormat:
    """What a request's answer must be: ``kind`` "json_schema" with its ``schema``, or
    "json_object" (any JSON object)."""

    kind: str
    schema: str = "{}"  # the JSON schema, as JSON text

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> OutputFormat:
        return cls("json_schema", json.dumps(schema))  # its order kept: properties are written in it

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls("json_object", json.dumps({"type": "object"}))


class Matcher(Protocol):
    """One sequence's place in its grammar."""

    def mask(self) -> bytes:
        """The tokens allowed next: bit ``t % 32`` of little-endian 32-bit word ``t // 32``."""

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""

    def done(self) -> bool:
        """Whether the grammar is complete: nothing more may follow."""


class Grammars(Protocol):
    """A model's grammar library, over its tokenizer."""

    def check(self, fmt: OutputFormat) -> None:
        """Raise ``GrammarError`` saying why ``fmt`` cannot be compiled."""

    def matcher(self, fmt: OutputFormat) -> Matcher:
        """A new sequence's matcher for ``fmt``."""


class LLGuidance:
    """``Grammars`` by llguidance, over a Hugging Face tokenizer (the library's view of it
    made here, at the model's load: not on the server's event loop at a first request).
    Several threads may compile (a cluster replica's)."""

    def __init__(self, tokenizer: Any):
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self._compiled: dict[OutputFormat, str] = {}
        self._lock = threading.Lock()

    def _grammar(self, fmt: OutputFormat) -> str:
        with self._lock:
            return self._compile(fmt)

    def _compile(self, fmt: OutputFormat) -> str:
        import llguidance

        grammar = self._compiled.get(fmt)
        if grammar is None:
            try:
                schema = json.loads(fmt.schema)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            except (ValueError, TypeError) as exc:
                raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
            error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
            if error:
                raise GrammarError(f"the JSON schema cannot be compiled: {error}")
            if len(self._compiled) >= 256:  # a bounded memo of recent formats
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[fmt] = grammar
        return grammar

    def check(self, fmt: OutputFormat) -> None:
        self._grammar(fmt)

    def matcher(self, fmt: OutputFormat) -> Matcher:
        import llguidance

        grammar = self._grammar(fmt)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be used: {matcher.get_error()}")
        return _LLMatcher(matcher)


class _LLMatcher:
    def __init__(self, matcher: Any):
        self._m = matcher

    def mask(self) -> bytes:
        return bytes(self._m.compute_bitmask())

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def done(self) -> bool:
        return bool(self._m.is_stopped())
