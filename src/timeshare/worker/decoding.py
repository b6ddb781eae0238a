"""A language model's decode batch on paged caches (NOTE [Paged key/value caches] in
``paged.py``), its steps run eagerly or replayed from captured CUDA graphs, and the next
tokens chosen on the device. Tensors only; runs where the model computes (the
controller, for an in-process runtime), inside the runtime's calls of the model.

# NOTE [Decode graphs]
A decode step of ``b`` rows whose longest row needs ``n`` pages runs as the graph of
the bucket ``(B, N)``: ``B`` the least of 1, 2, 4, 8, 16, 32 at least ``b``, ``N`` the
least power of two at least ``n``. A graph reads every input from one device buffer
(each row's last token, its position and its block table; the rows past ``b`` point at
the scratch page) and writes the logits into another, so a replay is one copy of the
inputs in, the replay, and the choice of the next tokens. The graphs are captured when
the model is resident and idle: after registration (``Runtime.profile`` loaded it) or,
once invalidated, at the end of a turn with nothing left to do; never on the wake path.
Eviction leaves the module's tensors where they were (NOTE [Sticky placement]) and a
reload into the same offsets binds nothing, so a graph captured before an eviction reads
the reloaded weights: no recapture. A model bound anywhere else bumps its *placement
epoch* (the worker's ``_bind``); a graph captured under another epoch is never replayed:
steps run eagerly until the graphs are captured again. Constants the graph reads (the
rotary tables) are the module's buffers: the runtime stores and restores them with the
weights. Sampling runs after the graph, on the device: greedy rows take the argmax;
the others a Gumbel-max draw whose noise is a hash of the request's seed and the
token's index, so that a seeded request gets the same tokens whatever batch it is in,
and no generator state lives on the host. Off CUDA the same steps run eagerly; the
``emulate`` mode stands in for a graph with the module's tensors as they were at
capture (``functional_call``), so that the CPU tests see what a stale graph would read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from timeshare.errors import ConfigError, GenerationError
from timeshare.worker.paged import PagedLayout, PagedStep, cache_key, paged_cache_class, prompt_layers, to_device

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
COMPILE_MODES = ("auto", "inductor", "aot_eager", "eager", "off")  # or a torch.compile backend (a callable)
GRAPH_MODES = ("auto", "cuda", "emulate", "off")
DEFAULT_GRAPH_CONTEXT = 4096  # positions up to which decode graphs are captured (longer rows run eagerly)

_epochs: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def relaid_out(module: nn.Module) -> None:
    """The module's tensors were bound somewhere new: its placement epoch moves on."""
    _epochs[module] = _epochs.get(module, 0) + 1


def placement_epoch(module: nn.Module) -> int:
    return _epochs.get(module, 0)


def install_paged_forward(module: nn.Module) -> nn.Module:
    """Let the runtime's calls of ``module`` run a decoding step: a call with ``paged=step``
    runs ``step(module)`` (the module loaded and bound as for any call); any other call
    is the module's own forward."""
    original = type(module).forward

    def forward(*args: Any, paged: Callable[[nn.Module], Any] | None = None, **kwargs: Any) -> Any:
        if paged is not None:
            return paged(module)
        return original(module, *args, **kwargs)

    module.forward = forward
    return module


@dataclass(frozen=True, slots=True)
class Draw:
    """How each row chooses its next token: per row temperature (0: greedy), top-k (0:
    all), top-p, seed and the token's index in its sequence."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]
    index: tuple[int, ...]

    @property
    def greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (each product stays below 2**63 in int64)."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    return x ^ (x >> 16)


def choose(logits: torch.Tensor, draw: Draw) -> torch.Tensor:
    """Each row's next token from ``logits`` ([rows, vocab]) on their device (NOTE [Decode
    graphs]): the argmax for greedy rows, else a Gumbel-max draw over the logits divided
    by the temperature, cut to the top-k and to the smallest set reaching top-p; -1 for a
    row whose logits hold a NaN (a token would be a wrong answer)."""
    best = logits.argmax(dim=-1)
    broken = logits.isnan().any(dim=-1)  # no token for a row whose logits are NaN: -1, an error for its sequence
    if draw.greedy:
        return torch.where(broken, -1, best)
    device, rows, vocab = logits.device, logits.shape[0], logits.shape[1]
    # Two copies in, queued without waiting (NOTE [No waiting on the device]).
    top_k, seed, index = to_device([*(k if 0 < k < vocab else vocab for k in draw.top_k), *draw.seed, *draw.index],
                                   device).view(3, rows)
    temperature, top_p = to_device([*draw.temperature, *draw.top_p], device, torch.float32).view(2, rows)
    scores = logits.float() / temperature.clamp_min(1e-6)[:, None]
    if any(0 < k < vocab for k in draw.top_k) or any(p < 1.0 for p in draw.top_p):
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # the first token is always kept
        cut = (rank >= top_k[:, None]) | (before >= top_p[:, None])
        scores = scores.scatter(1, order, ordered.masked_fill(cut, float("-inf")))
    key = _mix(_mix(seed) ^ _mix(index * 0x9E3779B1 + 1))
    bits = _mix(key[:, None] ^ _mix(torch.arange(vocab, device=device, dtype=torch.int64)[None, :] + 0x632BE5AB))
    uniform = (bits.double() + 0.5) / 4294967296.0
    gumbel = -torch.log(-torch.log(uniform))
    sampled = (scores.double() + gumbel).argmax(dim=-1)
    return torch.where(broken, -1, torch.where(temperature == 0.0, best, sampled)).view(rows)


@dataclass
class DecodeCounts:
    """Steps so far: graphs captured (and of those, of a compiled step: NOTE [Compiled
    decode steps]), the seconds capturing took (compiling too), steps replayed and run
    eagerly, captures dropped because the model was laid out elsewhere."""

    captures: int = 0
    compiled: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager: int = 0
    invalidations: int = 0


class _Row:
    __slots__ = ("pages", "length")

    def __init__(self, pages: list[int], length: int):
        self.pages, self.length = pages, length


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _StandIn:
    """A captured step on the CPU (``emulate``): the module's tensors as they were at
    capture, as a CUDA graph keeps their addresses."""

    def __init__(self, module: nn.Module, run: Callable[[nn.Module], None]):
        self.tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        self.tensors.update(module.named_buffers(remove_duplicate=False))
        self._run = run

    def replay(self, module: nn.Module) -> None:
        torch.func.functional_call(module, self.tensors, (), {"paged": self._run})


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
# cache on disk (timeshare's cache: ``llm.model.compile_cache``) spares a restart the code
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
    """The rows of one model's decode batch on ``layout``'s pages (NOTE [Decode graphs]).
    ``graphs``: "cuda" (captured graphs), "emulate" (stand-ins), "off", or "auto"
    (cuda on a CUDA device, else off)."""

    def __init__(self, layout: PagedLayout, *, max_sequences: int, max_context: int, graphs: str = "auto",
                 graph_context: int = DEFAULT_GRAPH_CONTEXT, compile: str | Callable[..., Any] = "auto"):
        if graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
        if isinstance(compile, str) and compile not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
        device = layout.pool.device
        if graphs == "auto":
            graphs = "cuda" if device.type == "cuda" else "off"
        if graphs == "cuda" and device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device")
        if compile == "auto":
            compile = "inductor" if graphs == "cuda" else "off"
        # NOTE [Compiled decode steps]: only what graphs capture is compiled.
        self.compiled: str | Callable[..., Any] | None = None if compile == "off" or graphs == "off" else compile
        self.layout, self.device, self.mode = layout, device, graphs
        self.max_context = max_context
        self.rows: list[_Row] = []
        self.counts = DecodeCounts()
        # Compiled, no bucket has one row or one page (NOTE [Compiled decode steps]).
        least = 1 if self.compiled is None else 2
        width = self._width = max(least, layout.pages_for(max_context + 1))
        self._batches = tuple(b for b in BATCH_BUCKETS if least <= b < max_sequences) + (
            max(least, _bucket(max_sequences, BATCH_BUCKETS) or max_sequences),)
        top = self._batches[-1]
        # One buffer of inputs: each row's token, position and block table (NOTE [Decode graphs]),
        # a row more than the largest bucket: every bucket's inputs are then a part of it, as
        # a compiled step was first traced with (else it is traced again for the whole).
        self._host = torch.zeros(top + 1, 2 + width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._inputs = torch.zeros(top + 1, 2 + width, dtype=torch.int64, device=device)
        self._dirty = True  # the host table no longer says the rows' pages
        self._arange = torch.arange(width * layout.block, device=device)
        self._logits: torch.Tensor | None = None
        graph_pages = min(width, layout.pages_for(min(max_context, graph_context) + 1))
        self._contexts = tuple(sorted({min(max(least, 1 << i), width)
                                       for i in range(_pow2(graph_pages).bit_length())}))
        self._graphs: dict[tuple[int, int], Any] = {}
        self._epoch: int | None = None  # the placement epoch the graphs were captured under
        self._pool = torch.cuda.graph_pool_handle() if graphs == "cuda" else None
        self._cache_key, self._cache_class = cache_key(), paged_cache_class()
        self._logits_of: Callable[..., tuple[torch.Tensor, torch.Tensor]] = decode_logits
        if self.compiled is not None:
            self._logits_of = compiled_step(self.compiled)

    # ------------------------------------------------------------------ state
    @property
    def nbytes(self) -> int:
        return sum(len(r.pages) for r in self.rows) * self.layout.pool.page_bytes

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def wants_capture(self) -> bool:
        """Whether its graphs are to be captured (never yet, or dropped since)."""
        return self.mode != "off" and not self._graphs

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order); the others' pages go back to the pool."""
        kept = set(rows)
        for i, row in enumerate(self.rows):
            if i not in kept:
                self.layout.pool.give(row.pages)
        self.rows = [self.rows[i] for i in rows]
        self._dirty = True

    def clear(self) -> None:
        self.keep([])

    def move_out(self) -> tuple[torch.Tensor, list[int]] | None:
        """Every row's pages to host memory (page-locked on CUDA), their pages given back;
        what ``move_in`` takes to bring them back."""
        pages = [p for r in self.rows for p in r.pages]
        if not pages:
            return None
        data = self.layout.pool.read(pages)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(data)
        self.layout.pool.give(pages)
        counts = [len(r.pages) for r in self.rows]
        for r in self.rows:
            r.pages = []
        return host, counts

    def move_in(self, saved: tuple[torch.Tensor, list[int]]) -> None:
        """The rows' caches back, bit for bit, in pages taken now (maybe other pages:
        the block tables change, the graphs do not)."""
        host, counts = saved
        pages = self.layout.pool.take(sum(counts))
        self.layout.pool.write(pages, host)
        at = 0
        for row, n in zip(self.rows, counts):
            row.pages, at = pages[at:at + n], at + n
        self._dirty = True

    # ------------------------------------------------------------------ steps (run inside the model's call)
    def prefill(self, prompt: list[int], draw: Draw) -> Callable[[nn.Module], torch.Tensor]:
        """The step that prefills ``prompt`` into a new last row (eagerly: a cold model's
        weights may still be arriving); its first token. No cache goes in: the model makes
        its own, then copied into the row's pages."""
        made: list[_Row] = []  # the row, once made: a call may run its step twice (a first load profiles)

        def step(module: nn.Module) -> torch.Tensor:
            n = len(prompt)
            if made:
                row = made[0]
                if self.rows and self.rows[-1] is row:
                    self.rows.pop()
                pages = row.pages
            else:
                pages = self.layout.pool.take(self.layout.pages_for(n))
                made.append(_Row(pages, n))
            try:
                # The model's own cache for the prompt, as transformers' generate computes
                # it (its causal kernels: generate's mask of ones is dropped for them, after
                # a check that waits for the device, which no mask spares), then copied into
                # the row's pages.
                ids = to_device(prompt, self.device)[None]
                out = type(module).forward(module, input_ids=ids, use_cache=True, logits_to_keep=1)
                self.layout.write(pages, prompt_layers(out[cache_key()], n))
                token = choose(out.logits[:, -1], draw)
            except BaseException:
                self.layout.pool.give(pages)
                made.clear()
                raise
            self.rows.append(made[0])
            self._dirty = True
            return token
        return step

    def decode(self, tokens: list[int], draw: Draw) -> Callable[[nn.Module], torch.Tensor]:
        """The step that decodes one token of every row (``tokens``: each row's last);
        each row's next token."""
        ran: list[bool] = []  # a call may run its step twice (a first load profiles): positions once

        def step(module: nn.Module) -> torch.Tensor:
            if ran:
                for row in self.rows:
                    row.length -= 1
            rows = len(self.rows)
            if len(tokens) != rows:
                raise GenerationError(f"a decode step of {len(tokens)} tokens for {rows} rows")
            for row in self.rows:  # the new position's page
                if row.length >= len(row.pages) * self.layout.block:
                    row.pages += self.layout.pool.take(1)
                    self._dirty = True
            batch = _bucket(rows, self._batches) or rows
            pages = max(self._contexts[0], min(_pow2(max(len(r.pages) for r in self.rows)), self._width))
            self._load_inputs(tokens, batch)
            self._run(module, rows, batch, pages)
            assert self._logits is not None
            token = choose(self._logits[:rows], draw)
            for row in self.rows:
                row.length += 1
            ran.append(True)
            return token
        return step

    def capture(self) -> Callable[[nn.Module], int]:
        """The step that captures the graphs of every bucket (the model resident and
        idle); the number captured."""
        def step(module: nn.Module) -> int:
            if self.mode == "off" or (self._graphs and self._epoch == placement_epoch(module)):
                return 0
            self._graphs.clear()
            self._epoch = placement_epoch(module)
            self._inputs.zero_()  # every row at the scratch page
            self._dirty = True
            while True:
                try:
                    self._capture_all(module)
                    break
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
            return len(self._graphs)
        return step

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

    # ------------------------------------------------------------------ internals
    def _load_inputs(self, tokens: list[int], batch: int) -> None:
        host = self._host
        if self._dirty:
            host[:, 2:] = 0
            for i, row in enumerate(self.rows):
                host[i, 2:2 + len(row.pages)] = torch.tensor(row.pages)
            host[len(self.rows):, :2] = 0
            self._dirty = False
        rows = len(self.rows)
        host[:rows, 0] = torch.tensor(tokens)
        host[:rows, 1] = torch.tensor([r.length for r in self.rows])
        self._inputs[:batch].copy_(host[:batch], non_blocking=True)

    def _run(self, module: nn.Module, rows: int, batch: int, pages: int) -> None:
        graph = self._graphs.get((batch, pages))
        if graph is not None and self._epoch != placement_epoch(module):
            # NOTE [Decode graphs]: laid out elsewhere since the capture; never replay it.
            self._graphs.clear()
            self.counts.invalidations += 1
            graph = None
        if graph is None:
            self._step(module, rows, pages, max(r.length for r in self.rows) + 1)
            self.counts.eager += 1
        elif isinstance(graph, _StandIn):
            graph.replay(module)
            self.counts.replays += 1
        else:
            graph.replay()
            self.counts.replays += 1

    def _step(self, module: nn.Module, batch: int, pages: int, length: int | None = None) -> None:
        """One decode step of the first ``batch`` rows of the inputs, attending to
        ``pages`` pages each (what a graph captures, compiled if the runner compiles), or
        run eagerly to the first ``length`` positions only (the longest row's): without
        hidden slots, a row alone is computed as ``transformers`` computes it."""
        inputs = self._inputs[:batch]
        positions = inputs[:, 1]
        table = inputs[:, 2:2 + pages]
        block = self.layout.block
        span = self._arange[:length or pages * block][None, :]
        dtype = self.layout.shape.dtype
        mask = torch.zeros(span.shape[1:], dtype=dtype, device=self.device)[None, :].masked_fill(
            span > positions[:, None], torch.finfo(dtype).min)[:, None, None, :]
        forward = decode_logits if length is not None else self._logits_of
        logits, new = forward(module, self.layout, self._cache_class, self._cache_key, inputs[:, :1], mask,
                              positions[:, None], table, span == positions[:, None], length)
        # The pool is written here, after the forward (NOTE [Paged key/value caches]).
        self.layout.put(table.gather(1, (positions // block)[:, None])[:, 0], positions % block, new)
        if self._logits is None or self._logits.shape[1] != logits.shape[1] or self._logits.dtype != logits.dtype:
            self._logits = torch.empty(self._batches[-1], logits.shape[1], dtype=logits.dtype, device=self.device)
        self._logits[:batch].copy_(logits)

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


def decode_logits(module: nn.Module, layout: PagedLayout, adapter: type, key: str, ids: torch.Tensor,
                  mask: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, at: torch.Tensor,
                  length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward for one decode step on ``layout``'s pages through the cache
    ``adapter`` (passed as ``key``): what is compiled (NOTE [Compiled decode steps]). It
    reads the pool and writes nothing but its outputs: the last position's logits and
    every layer's new keys and values."""
    cache = adapter(layout, PagedStep(table, at, length, positions[:, 0]))
    out = type(module).forward(module, input_ids=ids, attention_mask=mask, position_ids=positions,
                               use_cache=True, logits_to_keep=1, **{key: cache})
    return out.logits[:, -1], cache.written()
