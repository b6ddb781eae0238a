"""A language model's steps on its paged caches (NOTE [Paged key/value caches] in
``pages.py``), where its weights are: prefills, decode steps run eagerly or replayed
from captured CUDA graphs, and the next tokens chosen on the device by the one sampler
(``sampler.py``). Tensors only; runs in the process that computes (the controller for an
in-process runtime, the model's home worker with workers), inside the runtime's step of
the model (``Worker.run(..., step=...)``, NOTE [One step, two places] in ``step.py``).

# NOTE [Decode graphs]
A decode step of ``b`` rows whose longest row needs ``n`` pages runs as the graph of
the bucket ``(B, N)``: ``B`` the least of 1, 2, 4, 8, 16, 32 at least ``b``, ``N`` the
least power of two at least ``n``. A graph reads every input from one device buffer
(each row's last token, its position and its block table; the rows past ``b`` point at
the scratch page) and writes the logits into another, so a replay is one copy of the
inputs in, the replay, and the choice of the next tokens. The graphs are captured when
the model is resident and idle: after registration (``lm.load``) or, once invalidated or
never captured in this process (a new home worker), at the end of a turn with nothing
left to do (the engine asks when a step's outcome says ``wants_capture``); never on the
wake path. Eviction leaves the module's tensors where they were (NOTE [Sticky
placement]) and a reload into the same offsets binds nothing, so a graph captured before
an eviction reads the reloaded weights: no recapture. A model bound anywhere else bumps
its *placement epoch* (the worker's ``_bind``); a graph captured under another epoch is
never replayed: steps run eagerly until the graphs are captured again. A decode step
whose model is still arriving (a load) waits for the whole load first, since a replay
calls no module and so meets no layer's wait. Constants the graph reads (the rotary
tables) are the module's buffers: the runtime stores and restores them with the weights.
Off CUDA the same steps run eagerly; the ``emulate`` mode stands in for a graph with the
module's tensors as they were at capture (``functional_call``), so that the CPU tests
see what a stale graph would read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from timeshare.decode.cache import DecodeView, ExtendView, cache_key, paged_cache_class, prompt_layers
from timeshare.decode.lean import Adapt, LeanStep, agrees
from timeshare.decode.lora import LoraLayers, LoraStacks
from timeshare.decode.pages import PagedLayout, to_device
from timeshare.decode.sampler import Processing, choose, log_probabilities
from timeshare.decode.step import DecodeCounts, DecoderSpec, Draw, Loading, Step, StepKind, StepOutcome, TokenLogprobs
from timeshare.device import step_threads
from timeshare.errors import ConfigError, GenerationError
from timeshare.models.zoo.registry import cache_dir

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
COMPILE_MODES = ("auto", "inductor", "aot_eager", "eager", "off")  # or a torch.compile backend (a callable)
GRAPH_MODES = ("auto", "cuda", "emulate", "off")
DEFAULT_GRAPH_CONTEXT = 4096  # positions up to which decode graphs are captured (longer rows run eagerly)
PROMPT_CHUNK = 256  # positions whose logits a scored prompt holds at once (``DecodeRunner._prefill_scored``)

_epochs: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def relaid_out(module: nn.Module) -> None:
    """The module's tensors were bound somewhere new: its placement epoch moves on."""
    _epochs[module] = _epochs.get(module, 0) + 1


def placement_epoch(module: nn.Module) -> int:
    return _epochs.get(module, 0)


def resolve_modes(graphs: str, compile: str | Callable[..., Any], device: torch.device
                  ) -> tuple[str, str | Callable[..., Any] | None]:
    """``graphs`` and ``compile`` as a ``DecoderSpec`` takes them on ``device``: "auto"
    graphs are "cuda" on a CUDA device, else "off"; "auto" compilation is inductor where
    graphs are captured on CUDA; only what graphs capture is compiled (NOTE [Compiled
    decode steps]); None: not compiled."""
    if graphs not in GRAPH_MODES:
        raise ConfigError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
    if isinstance(compile, str) and compile not in COMPILE_MODES:
        raise ConfigError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    if graphs == "auto":
        graphs = "cuda" if device.type == "cuda" else "off"
    if graphs == "cuda" and device.type != "cuda":
        raise ConfigError("CUDA graphs need a CUDA device")
    if compile == "auto":
        compile = "inductor" if graphs == "cuda" else "off"
    return graphs, None if compile == "off" or graphs == "off" else compile


def compile_cache() -> str:
    """Where inductor keeps compiled decode steps (NOTE [Compiled decode steps]):
    ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``inductor`` in timeshare's cache
    (``$TIMESHARE_CACHE``, ``~/.cache/timeshare``), which outlives a reboot as inductor's
    default under /tmp may not."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Bound(nn.Module):
    """Runs ``run(model)`` as a module call, so that ``functional_call`` can swap the
    model's tensors for a stand-in's replay."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[nn.Module], None]) -> None:
        run(self.model)


class _StandIn:
    """A captured step on the CPU (``emulate``): the module's tensors as they were at
    capture, as a CUDA graph keeps their addresses."""

    def __init__(self, module: nn.Module, run: Callable[[nn.Module], None]):
        self.tensors: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in
                                                 module.named_parameters(remove_duplicate=False)}
        self.tensors.update((f"model.{k}", v) for k, v in module.named_buffers(remove_duplicate=False))
        self._run = run

    def replay(self, module: nn.Module) -> None:
        torch.func.functional_call(_Bound(module), self.tensors, (self._run,))


# NOTE [Compiled decode steps]
# A graph replays the kernels of a step, and a transformers model's step in eager
# PyTorch is some 40 small kernels a layer (norms, rotary embeddings and activations,
# each a few element-wise kernels): at one sequence a replay's time is mostly those, one
# after the other, not the weights' bytes (H200: 500 kernels, 1.35 ms, for a 100M
# model). So on CUDA the model's forward for a step (``decode_logits``) is compiled
# (``torch.compile``, inductor) before its graphs are captured, to fuse them. What is
# compiled reads the pool and writes nothing but its outputs (NOTE [Paged key/value
# caches]): the step's new keys and values go into the pages after it, still inside the
# captured graph. A compiled function that writes into a view of an input may copy the
# whole input (a first version wrote each layer's slots inside: 14 tokens/s on an H200,
# and copying the pool is the likely cause). Shapes are dynamic and no bucket has one
# row or one page (a size of 1 would be compiled apart; a second row or page costs next
# to nothing), so one trace serves every bucket of a model. There is one compiled
# function for every runner, and the weights are its graph's inputs: a model shaped as
# one traced before takes that trace (dynamo's guards check that it may), and inductor's
# cache on disk (timeshare's cache: ``compile_cache``) spares a restart the code
# generation. Eager steps (CPU, or a graph dropped after a relayout) are never compiled:
# they stay exact. A compilation that fails leaves the graphs captured uncompiled. The
# CPU tests compile with ``aot_eager`` (dynamo's trace, functionalized as inductor would
# get it, run by PyTorch's kernels).
@functools.cache
def compiled_step(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """``decode_logits`` compiled by ``backend``: one for every runner, so that a model of a
    shape traced before takes the code traced for it (dynamo's guards check that it is)."""
    import torch._dynamo

    # Each model may compile its own graph (its weights are other tensors): more than
    # dynamo's default number per function.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    casts: Callable[[], Any] = contextlib.nullcontext
    if backend == "inductor":
        with warnings.catch_warnings():  # torch 2.11's inductor imports a module that warns at import
            warnings.simplefilter("ignore", DeprecationWarning)
            import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor import config as inductor

        # Round where eager PyTorch rounds (a bf16 product of a float32 norm, say), so that
        # the compiled step's tokens part from transformers' as rarely as they can.
        casts = functools.partial(inductor.patch, emulate_precision_casts=True)
    from torch.fx.experimental import _config as shapes

    compiled = torch.compile(decode_logits, backend=backend, dynamic=True)

    def run(*args: Any) -> Any:
        # Sizes equal by chance at the first trace (the largest batch and the widest table)
        # are not taken for one size, which would trace again at the next bucket; a module's
        # float constants (an embedding's norm_type) are constants, not inputs, which would
        # restart the trace once they turn out to be.
        with warnings.catch_warnings():
            # Inductor's advice to allow TF32 matmuls in float32: we keep eager's precision.
            warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores", category=UserWarning)
            with shapes.patch(use_duck_shape=False), config.patch(specialize_float=True), casts():  # type: ignore[attr-defined]
                return compiled(*args)
    return run


class DecodeRunner:
    """One model's steps on its pages (``spec``: NOTE [Decode graphs]), in ``memory`` (the
    pool's bytes, the arena's region at ``spec.offset``)."""

    def __init__(self, spec: DecoderSpec, memory: torch.Tensor, *, graph_context: int = DEFAULT_GRAPH_CONTEXT,
                 adapters: torch.Tensor | None = None):
        if spec.graphs not in ("cuda", "emulate", "off"):
            raise ConfigError(f"a decoder's graphs are cuda, emulate or off, got {spec.graphs!r}")
        self.spec = spec
        self.layout = layout = PagedLayout(memory, spec.page_bytes, spec.shape)
        device = self.device = layout.device
        layout.zero([0])  # the scratch page: finite, whatever the region held (NOTE [Paged key/value caches])
        if spec.graphs == "cuda" and device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device")
        self.mode = spec.graphs
        self.compiled = spec.compile
        if self.compiled is not None:
            compile_cache()
        self.max_context = spec.max_context
        self.counts = DecodeCounts()
        # Compiled, no bucket has one row or one page (NOTE [Compiled decode steps]).
        least = 1 if self.compiled is None else 2
        width = self._width = max(least, layout.pages_for(spec.max_context + 1))
        self._batches = tuple(b for b in BATCH_BUCKETS if least <= b < spec.max_sequences) + (
            max(least, _bucket(spec.max_sequences, BATCH_BUCKETS) or spec.max_sequences),)
        top = self._batches[-1]
        # One buffer of inputs: each row's token, position and block table (NOTE [Decode graphs]),
        # a row more than the largest bucket: every bucket's inputs are then a part of it, as
        # a compiled step was first traced with (else it is traced again for the whole).
        self._host = torch.zeros(top + 1, 2 + width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._inputs = torch.zeros(top + 1, 2 + width, dtype=torch.int64, device=device)
        self._tables: list[tuple[int, ...] | None] = [None] * (top + 1)  # each input row's table as written
        self._arange = torch.arange(width * layout.block, device=device)
        self._logits: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None  # an eager step's gathers (``_scratch``)
        # NOTE [Lean decode steps]: the lean step, once the first eager step found it agree.
        self._lean: LeanStep | None = None
        self._lean_checked = False
        graph_pages = min(width, layout.pages_for(min(spec.max_context, graph_context) + 1))
        self._contexts = tuple(sorted({min(max(least, 1 << i), width)
                                       for i in range(_pow2(graph_pages).bit_length())}))
        self._graphs: dict[tuple[int, int], Any] = {}
        self._epoch: int | None = None  # the placement epoch the graphs were captured under
        self._pool = torch.cuda.graph_pool_handle() if self.mode == "cuda" else None
        self._cache_key, self._cache_class = cache_key(), paged_cache_class()
        self._logits_of: Callable[..., tuple[torch.Tensor, torch.Tensor]] = decode_logits
        if self.compiled is not None:
            self._logits_of = compiled_step(self.compiled)
        # The log-probabilities a step's rows asked for, on the device until ``run`` reads
        # them: per token step (chosen, top ids, top values), per prefill row its prompt's.
        self._asked: list[tuple[torch.Tensor, ...]] = []
        self._prompt_asked: list[tuple[torch.Tensor, ...] | None] = []
        # Prompts' log-probabilities by the model's body and its output layer in chunks
        # (``_prefill_scored``): None until the first one checks that they agree.
        self._by_body: bool | None = None
        # NOTE [Adapters in slots]: the adapter slots' bytes, a region of the arena.
        self._lora: LoraLayers | None = None
        if spec.lora is not None:
            if adapters is None:
                raise ConfigError("a decoder with adapter slots needs their region")
            self._lora = LoraLayers(LoraStacks(spec.lora, adapters), top + 1, device, always=self.mode != "off")

    def close(self) -> None:
        """Take its hooks off the model's projections (NOTE [Adapters in slots])."""
        if self._lora is not None:
            self._lora.detach()

    @property
    def wants_capture(self) -> bool:
        """Whether its graphs are to be captured (never yet, or dropped since)."""
        return self.mode != "off" and not self._graphs

    def run(self, module: nn.Module, step: Step) -> StepOutcome:
        """Run ``step`` on ``module`` (loaded and bound by the caller); its outcome. The
        read of its tokens is the step's one wait for the device (NOTE [No waiting on the
        device]); the log-probabilities asked for are read with them."""
        before = replace(self.counts)
        self._asked = []
        self._prompt_asked = []
        chosen = self.launch(module, step)
        tokens = () if chosen is None else tuple(chosen.tolist())
        logprobs = _token_logprobs(self._asked, step.draw) if self._asked else ()
        prompt = tuple(() if got is None else _prompt_logprobs(got) for got in self._prompt_asked) \
            if any(got is not None for got in self._prompt_asked) else ()
        self._asked, self._prompt_asked = [], []
        return StepOutcome(tokens, self.counts.since(before), self.wants_capture, logprobs, prompt)

    def launch(self, module: nn.Module, step: Step) -> torch.Tensor | None:
        """Queue ``step``'s work on the device: each row's next token, on the device (None
        for a capture), not waited for; the log-probabilities its rows ask for are kept
        for ``run`` to read. In inference mode: no tensor of a step is ever
        differentiated, and its kernels skip autograd's bookkeeping."""
        step_threads(self.device, step.kind is not StepKind.PREFILL, step.rows)  # NOTE [A core for the front end]
        if self._lora is not None:
            self._lora.attach(module)
        elif step.adapters and any(step.adapters):
            raise GenerationError("a step of rows with adapters for a model served without adapter slots")
        with torch.inference_mode():
            self.layout.zero(step.zero)
            if step.kind is StepKind.PREFILL:
                return self._prefill(module, step)
            if step.kind is StepKind.DECODE:
                return self._decode(module, step)
            if step.kind is StepKind.CAPTURE:
                self._capture(module)
                return None
        raise ConfigError(f"unknown step {step.kind!r}")

    # ------------------------------------------------------------------ prefills
    def _prefill(self, module: nn.Module, step: Step) -> torch.Tensor:
        """Each row's prompt from its first uncached position into its pages (eagerly: a
        cold model's weights may still be arriving), then the rows' first tokens."""
        if step.draw is None or len(step.tables) != step.rows or len(step.starts) != step.rows:
            raise GenerationError(f"a prefill of {step.rows} rows needs a table, a start and a draw for each")
        asked = step.prompt_logprobs or (-1,) * step.rows
        slots = step.adapters or (0,) * step.rows
        load = step.load  # NOTE [Adapters streamed in]: a cold adapter's slot, written as the prefill runs
        if load is not None:
            if self._lora is None or load.count != self._lora.stacks.spec.count:
                raise GenerationError("a prefill's adapter slot is written for other adapter slots than this model's")
            load.start()
        try:
            return self._prefill_rows(module, step, slots, asked, load)
        finally:
            if load is not None and self._lora is not None:
                self._lora.use(())  # its waits end with the step (a capture must not meet them)

    def _prefill_rows(self, module: nn.Module, step: Step, slots: tuple[int, ...], asked: tuple[int, ...],
                      load: Loading | None) -> torch.Tensor:
        logits = []
        waits = self._lora.waits if self._lora is not None else 0
        for tokens, start, table, top, slot in zip(step.tokens, step.starts, step.tables, asked, slots):
            if self._lora is not None:
                self._lora.use((slot,), step.lora, load.wait if load is not None and slot else None)
            if top < 0:
                logits.append(self._prefill_row(module, tokens, start, table))
                self._prompt_asked.append(None)
                continue
            if start:
                raise GenerationError("a prompt's log-probabilities need its whole prompt computed, not cached pages")
            last, scored = self._prefill_scored(module, tokens, table, top)
            logits.append(last)
            self._prompt_asked.append(scored)
        if load is not None:  # every target in place before the step ends (the next steps read them all)
            load.wait(load.count)
        if self._lora is not None:
            self.counts.slot_waits += self._lora.waits - waits
        rows = torch.cat(logits)
        draw = step.drawn()  # NOTE [Masks while the device runs]: the forward is queued
        processing = Processing(draw, rows.shape[1], self.device) if draw.processed else None
        return self._choose(rows, draw, processing)

    def _choose(self, logits: torch.Tensor, draw: Draw, processing: Processing | None = None,
                step: int = 0) -> torch.Tensor:
        """The rows' tokens from ``logits`` (NOTE [One sampler]), keeping the raw
        log-probabilities the rows ask for (NOTE [Logit processing])."""
        chosen = choose(logits, draw, processing, step)
        top = draw.top_logprobs
        if top >= 0:
            self._asked.append(log_probabilities(logits, chosen, top))
        return chosen

    def _prefill_row(self, module: nn.Module, tokens: tuple[int, ...], start: int,
                     table: tuple[int, ...]) -> torch.Tensor:
        """A row's prompt from ``start`` into its pages; the logits of its last position
        ([1, vocab])."""
        n = len(tokens)
        ids, pages = self._prompt_inputs(tokens, start, table)
        if start == 0:
            # The model's own cache for the prompt, as transformers' generate computes it
            # (its causal kernels: generate's mask of ones is dropped for them, after a
            # check that waits for the device, which no mask spares), then copied into the
            # row's pages.
            out = module(input_ids=ids, use_cache=True, logits_to_keep=1)
            self.layout.write(pages, 0, prompt_layers(out[self._cache_key], n))
            return out.logits[:, -1]
        # NOTE [Prefix caching]: the first ``start`` positions are cached pages; the rest
        # attend to them through the adapter, each to the positions up to its own.
        span = torch.arange(start + n, device=self.device)
        dtype = self.layout.shape.dtype
        hidden = span[None, :] > span[start:, None]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=self.device).masked_fill(
            hidden, torch.finfo(dtype).min)[None, None]
        cache = self._cache_class(self.layout, ExtendView(pages, start))
        out = module(input_ids=ids, attention_mask=mask, position_ids=span[start:][None], use_cache=True,
                     logits_to_keep=1, **{self._cache_key: cache})
        self.layout.write(pages, start, cache.extended())
        return out.logits[:, -1]

    def _prompt_inputs(self, tokens: tuple[int, ...], start: int,
                       table: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(tokens)
        if not n or len(table) < self.layout.pages_for(start + n):
            raise GenerationError(f"a prefill of {n} tokens from position {start} needs their pages, got {len(table)}")
        return to_device(tokens, self.device)[None], to_device(table, self.device)

    def _prefill_scored(self, module: nn.Module, tokens: tuple[int, ...], table: tuple[int, ...],
                        top: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A row's whole prompt into its pages, and its prompt's log-probabilities (NOTE
        [Logit processing]): the last position's logits ([1, vocab]) and, for each token
        after the first, ``log_probabilities`` of it. The model's body keeps every
        position's hidden state; its output layer runs ``PROMPT_CHUNK`` positions at a
        time, so a long prompt's logits are never held whole (2,048 positions of a
        128,000-token vocabulary would be 1 GiB in float32). The first time, the last
        position's logits are checked against the model's own forward; a model whose
        head does more than its output layer and a soft cap (``_head``) is scored from
        its forward's every logit instead, with a warning."""
        n = len(tokens)
        ids, pages = self._prompt_inputs(tokens, 0, table)
        targets = to_device(tokens[1:], self.device)
        if self._by_body is not False:
            try:
                body = cast(Any, module).get_decoder()(input_ids=ids, use_cache=True)
                hidden = body.last_hidden_state[0]
                last = _head(module, hidden[-1:])
                cache = body[self._cache_key]
            except (AttributeError, TypeError, KeyError, IndexError) as exc:  # a model without these pieces
                log.warning("%s cannot be scored by its body and output layer (%s); prompts are scored from "
                            "every position's logits at once", type(module).__name__, exc)
                self._by_body = False
            else:
                if self._by_body is None:  # the first prompt scored here: the body and head agree with the forward?
                    self._by_body = agrees(last, module(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0])
                    if not self._by_body:
                        log.warning("%s's logits are not its output layer's over its body's last hidden state; "
                                    "prompts are scored from every position's logits at once", type(module).__name__)
                if self._by_body:
                    self.layout.write(pages, 0, prompt_layers(cache, n))
                    parts = [log_probabilities(_head(module, hidden[i:min(i + PROMPT_CHUNK, n - 1)]),
                                               targets[i:i + PROMPT_CHUNK], top, PROMPT_CHUNK)
                             for i in range(0, max(n - 1, 1), PROMPT_CHUNK)]
                    return last, tuple(torch.cat([p[k] for p in parts]) for k in range(3))
        out = module(input_ids=ids, use_cache=True, logits_to_keep=0)
        self.layout.write(pages, 0, prompt_layers(out[self._cache_key], n))
        return out.logits[0, -1:], log_probabilities(out.logits[0, :-1], targets, top, PROMPT_CHUNK)

    # ------------------------------------------------------------------ decode steps
    def _decode(self, module: nn.Module, step: Step) -> torch.Tensor:
        """``step.count`` tokens of every row (NOTE [Multi-step decode]), each step
        replayed from a graph or run eagerly: the tokens of step 0 of every row, then of
        step 1, and so on."""
        rows, count = step.rows, step.count
        if step.draw is None or not rows or len(step.tables) != rows or len(step.starts) != rows:
            raise GenerationError(f"a decode step of {rows} rows needs a table, a position and a draw for each")
        if rows > self._batches[-1]:
            raise GenerationError(f"a decode step of {rows} rows, more than the {self.spec.max_sequences} "
                                  "sequences this model decodes together")
        widest = max(len(t) for t in step.tables)
        last = max(step.starts) + count - 1
        if widest > self._width or last >= self.max_context:
            raise GenerationError(f"a decode step past the model's context of {self.max_context} positions")
        if count < 1 or any(len(t) * self.layout.block <= start + count - 1
                            for t, start in zip(step.tables, step.starts)):
            raise GenerationError(f"a burst of {count} decode steps needs each row's pages to its last position")
        batch = _bucket(rows, self._batches) or rows
        pages = max(self._contexts[0], min(_pow2(widest), self._width))
        self._load_inputs(step, batch)
        if self._lora is not None:
            self._lora.use(step.adapters, step.lora)
        level = min(step.starts) == max(step.starts)
        if step.masks is not None and count > 1:
            raise GenerationError("a burst of decode steps cannot take late grammar masks (each needs its token)")
        chosen: list[torch.Tensor] = []
        processing: Processing | None = None
        first = step.draw
        for j in range(count):
            if j:
                self._advance(chosen[-1], rows, batch)
            self._run(module, rows, batch, pages, max(step.starts) + j + 1, level)
            assert self._logits is not None
            if not j and step.masks is not None:  # NOTE [Masks while the device runs]: the forward is queued
                first = step.drawn()
            if processing is None and first.processed:  # NOTE [Logit processing]
                processing = Processing(first, self._logits.shape[1], self.device)
            draw = first if not j else replace(first, index=tuple(i + j for i in first.index))
            chosen.append(self._choose(self._logits[:rows], draw, processing, j))
            if processing is not None:
                processing.advance(chosen[-1])
        return chosen[0] if count == 1 else torch.cat(chosen)

    def _advance(self, chosen: torch.Tensor, rows: int, batch: int) -> None:
        """The inputs of a burst's next step: each row's token the one just chosen (a row
        whose logits held NaN feeds token 0: its later tokens are never used), its position
        one on, on the device without a wait, and in the host's copy (the CPU's pool
        writes read positions there)."""
        self._host[:rows, 1] += 1
        if self.device.type == "cpu":
            self._host[:rows, 0] = chosen.clamp_min(0)
            self._inputs[:batch].copy_(self._host[:batch])
        else:
            self._inputs[:rows, 0] = chosen.clamp_min(0)
            self._inputs[:rows, 1] += 1

    def _load_inputs(self, step: Step, batch: int) -> None:
        """The step's tokens, positions and tables into the input buffer: a row's table
        is written only when it changed (a new page, another row there)."""
        host, tables = self._host, self._tables
        rows = step.rows
        for i, table in enumerate(step.tables):
            if tables[i] != table:
                host[i, 2:] = 0
                host[i, 2:2 + len(table)] = torch.tensor(table)
                tables[i] = table
        for i in range(rows, len(tables)):  # the rows past the step's point at the scratch page
            if tables[i] != ():
                host[i] = 0
                tables[i] = ()
        host[:rows, 0] = torch.tensor([t[0] for t in step.tokens])
        host[:rows, 1] = torch.tensor(step.starts)
        self._inputs[:batch].copy_(host[:batch], non_blocking=True)

    def _run(self, module: nn.Module, rows: int, batch: int, pages: int, length: int, level: bool) -> None:
        graph = self._graphs.get((batch, pages))
        if graph is not None and self._epoch != placement_epoch(module):
            # NOTE [Decode graphs]: laid out elsewhere since the capture; never replay it.
            self._graphs.clear()
            self.counts.invalidations += 1
            graph = None
        if graph is None:
            self._step(module, rows, pages, length, level)
            self.counts.eager += 1
        elif isinstance(graph, _StandIn):
            graph.replay(module)
            self.counts.replays += 1
        else:
            graph.replay()
            self.counts.replays += 1

    def _step(self, module: nn.Module, batch: int, pages: int, length: int | None = None,
              level: bool = False) -> None:
        """One decode step of the first ``batch`` rows of the inputs, attending to
        ``pages`` pages each (what a graph captures, compiled if the runner compiles), or
        run eagerly to the first ``length`` positions only (the longest row's): without
        hidden slots, a row alone is computed as ``transformers`` computes it, and rows
        all at one position (``level``) need no mask, as ``transformers`` passes none."""
        inputs = self._inputs[:batch]
        positions = inputs[:, 1]
        table = inputs[:, 2:2 + pages]
        block = self.layout.block
        span = self._arange[:length or pages * block][None, :]
        dtype = self.layout.shape.dtype
        mask = None
        if length is None or not level:
            mask = torch.zeros(span.shape[1:], dtype=dtype, device=self.device)[None, :].masked_fill(
                span > positions[:, None], torch.finfo(dtype).min)[:, None, None, :]
        at = span == positions[:, None] if length is None else span
        if length is None:
            logits, new = self._logits_of(module, self.layout, self._cache_class, self._cache_key, inputs[:, :1],
                                          mask, positions[:, None], table, at, None)
        else:
            logits, new = self._eager(module, inputs[:, :1], mask, positions[:, None], table, at, length,
                                      self._scratch(batch, length))
        # The pool is written here, after the forward (NOTE [Paged key/value caches]): on the
        # CPU a row at a time from the host's copy of the inputs (an indexed write into
        # the pool's strided view costs more than the step's gathers), else in one write.
        if self.device.type == "cpu":
            written: list[list[int]] = self._host[:new.shape[0], 1:].tolist()
            for row, inputs_of_row in enumerate(written):
                position, table_of_row = inputs_of_row[0], inputs_of_row[1:]
                self.layout.kv[table_of_row[position // block], :, position % block].copy_(new[row])
        else:
            self.layout.put(table.gather(1, (positions // block)[:, None])[:, 0], positions % block, new)
        if self._logits is None or self._logits.shape[1] != logits.shape[1] or self._logits.dtype != logits.dtype:
            self._logits = torch.empty(self._batches[-1], logits.shape[1], dtype=logits.dtype, device=self.device)
        self._logits[:batch].copy_(logits)

    def _eager(self, module: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
               table: torch.Tensor, at: torch.Tensor, length: int, scratch: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager step's logits and new keys and values: by the lean step once it has
        agreed with ``transformers``' forward on this runner's first eager step (NOTE [Lean
        decode steps]), else by ``transformers``' forward."""
        def hf() -> tuple[torch.Tensor, torch.Tensor]:
            return decode_logits(module, self.layout, self._cache_class, self._cache_key, ids, mask, positions,
                                 table, at, length, scratch)

        # NOTE [Adapters in slots]: the lean step corrects its projections as the hooks do.
        lora = self._lora.apply if self._lora is not None and self._lora.active else None
        if not self._lean_checked:  # this runner's first eager step: both, compared
            self._lean_checked = True
            want = hf()
            # On CUDA eager steps are the rare ones (graphs replay), and comparing would wait.
            lean = LeanStep.of(module) if self.device.type == "cpu" else None
            if lean is not None:
                got = lean_logits(lean, module, self.layout, self._cache_class, ids, mask, positions, table, at,
                                  length, scratch, lora)
                if agrees(got[0], want[0]) and agrees(got[1], want[1]) \
                        and torch.equal(got[0].argmax(-1), want[0].argmax(-1)):
                    self._lean = lean
                else:
                    log.warning("the lean decode step of %s differs from transformers' forward; its steps run "
                                "through transformers' forward", type(module).__name__)
            return want
        if self._lean is None:
            return hf()
        self.counts.lean += 1
        return lean_logits(self._lean, module, self.layout, self._cache_class, ids, mask, positions, table, at,
                           length, scratch, lora)

    def _scratch(self, rows: int, length: int) -> torch.Tensor:
        """The buffer an eager step gathers each layer's pages into (NOTE [Paged key/value
        caches]), grown to the step's rows and pages: a step allocates no copy of its own."""
        need = rows * self.layout.pages_for(length) * self.layout.kv[0, 0].numel()
        if self._gathered is None or self._gathered.numel() < need:
            self._gathered = torch.empty(max(need, 2 * (0 if self._gathered is None else self._gathered.numel())),
                                         dtype=self.layout.shape.dtype, device=self.device)
        return self._gathered

    # ------------------------------------------------------------------ graphs
    def _capture(self, module: nn.Module) -> None:
        """Capture the graphs of every bucket (the model resident and idle). A failed
        compiled capture is taken again uncompiled; a failed capture leaves the steps eager."""
        if self.mode == "off" or (self._graphs and self._epoch == placement_epoch(module)):
            return
        self._graphs.clear()
        self._epoch = placement_epoch(module)
        self._inputs.zero_()  # every row at the scratch page
        self._host.zero_()
        self._tables = [()] * len(self._tables)
        while True:
            try:
                self._capture_all(module)
                return
            except Exception as exc:
                self._graphs.clear()
                if self.compiled is None:
                    self.mode = "off"  # not tried again: the steps run eagerly
                    raise
                # NOTE [Compiled decode steps]: the step as transformers runs it, captured.
                log.warning("compiling the decode step (%s) failed; its graphs are captured uncompiled: %s: %s",
                            self.compiled, type(exc).__name__, exc)
                self.compiled, self._logits_of = None, decode_logits
            except BaseException:
                self._graphs.clear()
                self.mode = "off"
                raise

    def _capture_all(self, module: nn.Module) -> None:
        start = time.perf_counter()
        try:
            for batch in reversed(self._batches):
                for pages in reversed(self._contexts):
                    self._graphs[batch, pages] = self._capture_one(module, batch, pages)
                    self.counts.captures += 1
                    self.counts.compiled += self.compiled is not None
        finally:
            self.counts.capture_s += time.perf_counter() - start

    def _capture_one(self, module: nn.Module, batch: int, pages: int) -> Any:
        if self.mode == "emulate":
            self._step(module, batch, pages)
            return _StandIn(module, lambda m: self._step(m, batch, pages))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: lazily made handles and workspaces, off the graph
            self._step(module, batch, pages)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(module, batch, pages)
        return graph


def _head(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A causal language model's logits from its body's final hidden states: its output
    layer, then its soft cap where it has one (Gemma 2's ``final_logit_softcapping``)."""
    logits = cast(Any, module).get_output_embeddings()(hidden)
    cap = getattr(module.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def _token_logprobs(asked: list[tuple[torch.Tensor, ...]], draw: Draw | None) -> tuple[TokenLogprobs | None, ...]:
    """Each token's log-probabilities as read from the device: per step of a burst, each
    row's (None for a row that asked for none), in the order of the step's tokens."""
    wanted = draw.logprobs if draw is not None else ()
    out: list[TokenLogprobs | None] = []
    for mine, ids, values in asked:
        mine_l, ids_l, values_l = mine.tolist(), ids.tolist(), values.tolist()
        for r, top in enumerate(wanted):
            out.append(None if top < 0 else
                       TokenLogprobs(mine_l[r], tuple(zip(ids_l[r][:top], values_l[r][:top]))))
    return tuple(out)


def _prompt_logprobs(got: tuple[torch.Tensor, ...]) -> tuple[TokenLogprobs, ...]:
    """A prompt's tokens after the first, each with its log-probability given those before."""
    mine, ids, values = (t.tolist() for t in got)
    return tuple(TokenLogprobs(m, tuple(zip(i, v))) for m, i, v in zip(mine, ids, values))


def decode_logits(module: nn.Module, layout: PagedLayout, adapter: type, key: str, ids: torch.Tensor,
                  mask: torch.Tensor | None, positions: torch.Tensor, table: torch.Tensor, at: torch.Tensor,
                  length: int | None, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward for one decode step on ``layout``'s pages through the cache
    ``adapter`` (passed as ``key``): what is compiled (NOTE [Compiled decode steps]). It
    reads the pool and writes nothing but its outputs: the last position's logits and
    every layer's new keys and values."""
    cache = adapter(layout, DecodeView(table, at, length, positions[:, 0], layout.block, scratch))
    out = type(module).forward(module, input_ids=ids, attention_mask=mask, position_ids=positions,
                               use_cache=True, logits_to_keep=1, **{key: cache})
    return out.logits[:, -1], cache.written()


def lean_logits(lean: LeanStep, module: nn.Module, layout: PagedLayout, adapter: type, ids: torch.Tensor,
                mask: torch.Tensor | None, positions: torch.Tensor, table: torch.Tensor, at: torch.Tensor,
                length: int, scratch: torch.Tensor, lora: Adapt | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_logits`` of an eager step by ``lean`` (NOTE [Lean decode steps]), its
    projections corrected by ``lora`` (NOTE [Adapters in slots])."""
    cache = adapter(layout, DecodeView(table, at, length, positions[:, 0], layout.block, scratch))
    return lean.logits(module, ids, positions, mask, cache, lora), cache.written()


class Decoders:
    """The runners of the models this process computes, by model, over the arena's bytes
    (``arena()``, read when a runner is made: every pool is a region of the arena, NOTE
    [Regions of the arena]; nothing here keeps the arena mapped once its runners go)."""

    def __init__(self, arena: Callable[[], torch.Tensor]):
        self._arena = arena
        self._runners: dict[str, DecodeRunner] = {}

    def run(self, model: str, module: nn.Module, step: Step) -> StepOutcome:
        """``step`` of ``model`` (its module loaded and bound), on the runner of its spec: a
        model given another spec (registered again, another pool) gets a new runner."""
        runner = self._runners.get(model)
        if runner is None or runner.spec != step.spec:
            if runner is not None:
                runner.close()
            spec, arena = step.spec, self._arena()
            if spec.offset < 0 or spec.offset + spec.nbytes > arena.numel():
                raise ConfigError(f"model {model!r}: its page pool ({spec.nbytes} bytes at {spec.offset}) is not "
                                  "inside the arena")
            memory = arena[spec.offset:spec.offset + spec.nbytes]
            adapters = None
            if spec.lora is not None:  # NOTE [Adapters in slots]
                lora = spec.lora
                if lora.offset < 0 or lora.offset + lora.nbytes > arena.numel():
                    raise ConfigError(f"model {model!r}: its adapter slots are not inside the arena")
                adapters = arena[lora.offset:lora.offset + lora.nbytes]
            runner = self._runners[model] = DecodeRunner(spec, memory, adapters=adapters)
        return runner.run(module, step)

    def drop(self, model: str) -> None:
        """Forget ``model``'s runner and its graphs (the model left)."""
        runner = self._runners.pop(model, None)
        if runner is not None:
            runner.close()
