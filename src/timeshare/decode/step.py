"""A language model's step as it crosses from the engine (``llm/engine.py``, in the
controller) to where the model's weights are (``decode/runner.py``: the controller for an
in-process runtime, the model's home worker process with workers): small typed records,
pickled by value in ``RunModel.step`` (``protocol.py``). Imported by both sides.

# NOTE [One step, two places]
A step is an operation of the runtime, as a model call is: ``ModelTurn.step`` takes the
device turn, the pipelined reload of evicted weights, the binding, lanes, deadlines and
a record exactly as ``ModelTurn.call``, and the executor runs it where the model runs
(``Worker.run(..., step=...)``). What crosses is this ``Step``: the rows' new tokens,
their first positions, their block tables, the pages to zero and each row's sampling
state; what comes back is a ``StepOutcome``: one token id per row and what the step did
(replayed, eager, captured). The controller keeps the sequences, the block tables and
the text; the pages (an arena region, NOTE [Regions of the arena]), the captured graphs
and the sampler live with the weights. Caches and logits never cross. One implementation
runs in both places, so the same request gives the same tokens in-process and with
workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Protocol

import torch

from timeshare.decode.lora import LoraSpec, LoraUse
from timeshare.dtypes import parse_dtype
from timeshare.errors import GenerationError


class StepKind(str, Enum):
    PREFILL = "prefill"  # one row's prompt (the part no cached page holds) into its pages, its first token
    DECODE = "decode"  # one token of every row
    CAPTURE = "capture"  # capture the decode graphs (no row): the model resident and idle


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one position of one sequence takes in a model's caches."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: str | torch.dtype | None) -> KVShape:
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        parsed = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
        return cls(int(config.num_hidden_layers), kv_heads, head_dim, parsed or torch.float32)

    @property
    def position_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """How one model decodes, fixed for its life: its page pool (the region of the arena of
    ``nbytes`` from ``offset``, whole pages of ``page_bytes``, page 0 the scratch page), the shape of a
    position, its batch and context limits, and its graphs ("cuda", "emulate" or "off",
    NOTE [Decode graphs]) and the compiler of the step they capture (a backend's name, a
    callable backend, or None: NOTE [Compiled decode steps])."""

    offset: int
    nbytes: int
    page_bytes: int
    shape: KVShape
    max_sequences: int
    max_context: int
    graphs: str = "off"
    compile: str | Callable[..., Any] | None = None
    lora: LoraSpec | None = None  # NOTE [Adapters in slots]: its adapter slots, if it serves adapters


@dataclass(frozen=True, slots=True)
class Penalties:
    """One row's penalties (NOTE [Logit processing]): ``presence`` and ``frequency`` (OpenAI's,
    over the tokens it generated), ``repetition`` (transformers' and vLLM's, over its prompt
    and what it generated: 1 is none); ``history`` is its prompt and then its tokens so far,
    the first ``prompt`` of them its prompt."""

    presence: float
    frequency: float
    repetition: float
    history: tuple[int, ...]
    prompt: int


@dataclass(frozen=True, slots=True)
class Draw:
    """How each row chooses its next token: per row temperature (0: greedy), top-k (0:
    all), top-p, seed and the token's index in its sequence (NOTE [One sampler]). The
    rest is per row too, and empty when no row uses it, so that such a step pays
    nothing for it (NOTE [Logit processing]): ``logprobs``, the row's top log-probabilities
    to report besides its chosen token's (-1: none); ``penalties`` (None: none); ``bias``,
    (token, bias) pairs added to its logits; ``banned``, tokens it may not choose in its
    next ``steps`` tokens, as (tokens, steps) (min_tokens' end tokens); ``allowed``, the
    only tokens it may choose next, a bitmask (little-endian 32-bit words; empty: any;
    NOTE [Constrained decoding])."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]
    index: tuple[int, ...]
    logprobs: tuple[int, ...] = ()
    penalties: tuple[Penalties | None, ...] = ()
    bias: tuple[tuple[tuple[int, float], ...], ...] = ()
    banned: tuple[tuple[tuple[int, ...], int], ...] = ()
    allowed: tuple[bytes, ...] = ()

    @property
    def greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)

    @property
    def processed(self) -> bool:
        """Whether any row's logits are changed before its choice (NOTE [Logit processing])."""
        return any(p is not None for p in self.penalties) or any(self.bias) or \
            any(s > 0 for _, s in self.banned) or any(self.allowed)

    @property
    def top_logprobs(self) -> int:
        """The most top log-probabilities a row asks for; -1: no row asks for any."""
        return max(self.logprobs, default=-1)


class MasksFollow:
    """A step's late masks as it crosses to a worker: they follow it on the worker's pipe
    (``StepMasks``), and the worker puts its reader of them in this one's place."""

    def __call__(self) -> tuple[bytes, ...]:
        raise GenerationError("a step's grammar masks were to follow it to its worker, and no reader was set")


class Loading(Protocol):
    """A prefill's cold adapter slot being written while the step runs (NOTE [Adapters
    streamed in]): in-process the controller's ``decode.lora.SlotWrite``, in a worker a
    reader of the ``SlotReady`` messages that follow the step."""

    count: int  # the targets to write

    def start(self) -> None:
        """Begin (in-process: the write's own thread; in a worker: nothing to begin)."""

    def wait(self, written: int) -> bool:
        """Until the first ``written`` targets are in place (a deadline of its own);
        whether it had to wait."""


class LoadFollows:
    """A step's cold adapter slot as the step crosses to a worker: the controller writes it
    after sending the step, and ``SlotReady`` messages follow on the pipe; the worker puts
    its reader of them in this one's place."""

    def __init__(self, count: int):
        self.count = count

    def start(self) -> None:
        return None

    def wait(self, written: int) -> bool:
        raise GenerationError("a step's adapter slot was to be told ready on its worker's pipe, and no reader was set")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability under the model (raw: before any processing, NOTE
    [Logit processing]) and the most likely tokens' with theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a model's rows (NOTE [One step, two places]). ``tokens``: each row's new
    tokens (a prefill's prompt from its first uncached position; a decode step's last
    token); ``starts``: the position of each row's first new token (a prefill's cached
    positions); ``tables``: each row's pages, covering every position up to its last new
    one; ``zero``: pages newly taken for this step, zeroed before it (NOTE [Paged
    key/value caches]); ``count``: a decode step's burst of steps, each feeding the
    tokens the one before chose (NOTE [Multi-step decode]), its tables covering the
    last one's positions."""

    kind: StepKind
    spec: DecoderSpec
    tokens: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] = ()
    tables: tuple[tuple[int, ...], ...] = ()
    draw: Draw | None = None
    zero: tuple[int, ...] = ()
    count: int = 1
    prompt_logprobs: tuple[int, ...] = ()  # a prefill: per row, top log-probabilities of its prompt (-1: none)
    # NOTE [Masks while the device runs]: the constrained rows' grammar masks (as ``Draw.allowed``,
    # which is then empty), asked for once the step's forward is queued; None: none are late.
    masks: Callable[[], tuple[bytes, ...]] | None = None
    adapters: tuple[int, ...] = ()  # NOTE [Adapters in slots]: each row's adapter slot (empty: all the base's)
    lora: LoraUse | None = None  # and what those adapters use (ranks, projections)
    # NOTE [Adapters streamed in]: a prefill's cold adapter slot, written while the step runs.
    load: Loading | None = None

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def drawn(self) -> Draw:
        """Its draw, with the late masks in it once asked for (a runner asks once per step,
        after queueing the forward)."""
        assert self.draw is not None
        if self.masks is None:
            return self.draw
        masks = self.masks()
        if len(masks) != self.rows:
            raise GenerationError(f"a step of {self.rows} rows got {len(masks)} grammar masks")
        return replace(self.draw, allowed=masks if any(masks) else ())

    def example(self) -> tuple[tuple, dict]:
        """Inputs of a plain forward of the model like this step's: what a first load
        traces and profiles with before it runs the step."""
        first = self.tokens[0] if self.tokens else (0,)
        return (torch.tensor([list(first)], dtype=torch.long),), {"use_cache": False}


@dataclass(slots=True)
class DecodeCounts:
    """Steps so far (or of one step): graphs captured (and of those, of a compiled step:
    NOTE [Compiled decode steps]), the seconds capturing took (compiling too), steps
    replayed and run eagerly (and of those, by the lean step: NOTE [Lean decode steps]),
    captures dropped because the model was laid out elsewhere."""

    captures: int = 0
    compiled: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager: int = 0
    invalidations: int = 0
    lean: int = 0
    slot_waits: int = 0  # corrections that waited for their cold adapter's layer (NOTE [Adapters streamed in])

    def add(self, other: DecodeCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, before: DecodeCounts) -> DecodeCounts:
        """What was counted since ``before`` (a copy of these counts taken then)."""
        return DecodeCounts(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a step gave: each row's next token (-1: its logits held NaN, no token is made
    up from them; a burst of ``count`` steps: step 0's of every row, then step 1's, ...),
    what the step did (``DecodeCounts`` of this step alone) and whether
    the model's graphs are to be captured (NOTE [Decode graphs]: never yet in the process
    that runs its steps, or dropped since)."""

    tokens: tuple[int, ...]
    counts: DecodeCounts
    wants_capture: bool = False
    # Aligned with ``tokens`` when the step's draw asked for any (None: that row did not).
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # A prefill: per row, its prompt's tokens after the first, when asked (else empty).
    prompt_logprobs: tuple[tuple[TokenLogprobs, ...], ...] = ()
