"""Key/value caches in pages at fixed device addresses, and the one adapter through
which a ``transformers`` model reads and writes them. Tensors only; runs where the
model computes (the controller, for an in-process runtime).

# NOTE [Paged key/value caches]
A ``PagePool`` is device memory that never moves or goes while models decode (a region
of the runtime's arena, NOTE [Regions of the arena]), cut into pages of ``page_bytes``:
every language model that decodes on the device takes its pages from it, so one budget
(``kv_memory``) bounds them all and a captured decode graph (``decoding.py``) may read
them at their addresses for as long as the pool lives. A model sees each page as ``block`` positions
of all its layers' keys and values (``PagedLayout``: the block is the page's bytes over
the bytes one position takes, so models of different shapes share the pages). A
sequence holds the pages of its positions, in order: position ``p`` is slot
``p % block`` of the sequence's page ``p // block``, and a row of the *block table*
lists a sequence's pages. A step reads a sequence's positions by gathering its pages
through the table, and a mask hides the slots past the sequence's length. The pool is
only read while the model computes: each layer attends to its gathered positions with
the new key and value put in their place in that copy, and the new keys and values of
every layer go into their slots in one write after the forward (``PagedLayout.put``),
so that a compiled forward (``decoding.py``) never mutates the pool (a compiler would
copy the whole pool for that). Page 0 is nobody's: the rows that pad a batch up to a
captured size write there, and the table's unused entries point there. Pages are
zeroed when a sequence takes them, so that the slots a mask hides hold finite numbers
(a hidden slot's value is multiplied by a zero weight, and zero times NaN is NaN): a
page another model or sequence had, or poison, never leaks.

``PagedCache`` is the adapter: a ``transformers`` ``Cache`` whose ``update`` keeps the
new keys and values for the write and returns what the attention reads. A
transformers release that changes its cache interface changes this file alone.

# NOTE [No waiting on the device]
A step's host work (taking pages, the block tables, the tokens in) never waits for the
device: the host runs ahead and queues the next kernels while the device computes, and
the one wait of a step is the read of its tokens. ``torch.tensor(values, device=cuda)``
copies from pageable memory and waits for the stream to drain first, so lists of page
numbers, tokens and sampling parameters go to the device through page-locked memory and
an asynchronous copy (``to_device``); a boolean mask as an index waits too (its count is
read back), so rows and positions are indexed by integers. The GPU tier runs the steps
under ``torch.cuda.set_sync_debug_mode("error")``, which fails on any such wait.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, GenerationError, TimeshareError

DEFAULT_PAGE_BYTES = 1 << 20
MAX_BLOCK = 64  # positions a page holds at most: a step gathers whole pages, the hidden slots too


def to_device(values: list[int] | list[float], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a tensor on ``device``, queued without waiting for it (NOTE [No
    waiting on the device]): on CUDA copied from page-locked memory, asynchronously
    (the caching host allocator keeps that memory until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)  # the tensor itself on the CPU


class KVMemoryError(TimeshareError):
    """The page pool has no room for a sequence's next positions."""


@dataclass(frozen=True)
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


def page_bytes_for(shape: KVShape, positions: int = 32) -> int:
    """Pages of ``positions`` positions of a model of ``shape`` (in whole KiB, at least 4 KiB)."""
    return max(4096, -(-shape.position_bytes * positions // 1024) * 1024)


def pool_footprint(nbytes: int, page_bytes: int) -> int:
    """The bytes a ``PagePool`` of ``nbytes`` in pages of ``page_bytes`` takes: its whole
    pages and the scratch page; a ``ConfigError`` for sizes it refuses."""
    if page_bytes < 1024 or page_bytes % 1024:
        raise ConfigError(f"page_bytes must be a positive multiple of 1 KiB, got {page_bytes}")
    if nbytes < page_bytes:
        raise ConfigError(f"a key/value page pool needs at least one page of {page_bytes} bytes, got {nbytes} bytes")
    return (nbytes // page_bytes + 1) * page_bytes


class PagePool:
    """``nbytes`` of device memory for caches in pages of ``page_bytes`` (NOTE [Paged
    key/value caches]), and the scratch page (page 0) beside them: the uint8 tensor
    ``memory`` (a region of the runtime's arena, ``pool_footprint`` bytes at least), or
    else one allocation of its own."""

    def __init__(self, device: torch.device | str, nbytes: int, page_bytes: int = DEFAULT_PAGE_BYTES, *,
                 memory: torch.Tensor | None = None):
        footprint = pool_footprint(nbytes, page_bytes)
        pages = footprint // page_bytes
        self.device = torch.device(device)
        self.page_bytes, self.pages = page_bytes, pages
        # Not zeroed as a whole: a page is zeroed when taken (on the CPU the pages a pool
        # never uses are never touched), the scratch page now.
        if memory is None:
            self.raw = torch.empty(footprint, dtype=torch.uint8, device=self.device)
        elif memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < footprint \
                or memory.device != self.device:
            raise ConfigError(f"a key/value page pool of {footprint} bytes on {self.device} needs as many uint8 "
                              f"bytes there, got {memory.dtype} {tuple(memory.shape)} on {memory.device}")
        else:
            self.raw = memory[:footprint]
        self._by_page = self.raw.view(pages, page_bytes)
        self._by_page[0].zero_()
        self._free = list(range(pages - 1, 0, -1))  # pop() takes the lowest
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The bytes for caches (the scratch page aside)."""
        return (self.pages - 1) * self.page_bytes

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` pages, zeroed (NOTE [Paged key/value caches]); ``KVMemoryError`` if
        fewer are free (none is taken then)."""
        if n <= 0:
            return []
        with self._lock:
            if n > len(self._free):
                raise KVMemoryError(f"the key/value page pool ({self.pages - 1} pages of {self.page_bytes} bytes) "
                                    f"has {len(self._free)} free, {n} needed: raise kv_memory or lower "
                                    "max_sequences")
            pages = [self._free.pop() for _ in range(n)]
        self._by_page[to_device(pages, self.device)] = 0
        return pages

    def give(self, pages: list[int]) -> None:
        with self._lock:
            self._free.extend(pages)

    def read(self, pages: list[int]) -> torch.Tensor:
        """The bytes of ``pages``, in order (on the device)."""
        return self._by_page[to_device(pages, self.device)]

    def write(self, pages: list[int], data: torch.Tensor) -> None:
        self._by_page[to_device(pages, self.device)] = data.to(self.device, non_blocking=True)


class PagedLayout:
    """A model's view of a pool: each page ``block`` positions of every layer's keys and
    values, ``[pages, layers, 2, block, kv_heads, head_dim]`` (at most ``MAX_BLOCK``
    positions: the rest of a larger page is left unused)."""

    def __init__(self, pool: PagePool, shape: KVShape):
        per_position = shape.position_bytes
        block = min(pool.page_bytes // per_position, MAX_BLOCK)
        if block < 1:
            raise ConfigError(f"a page of {pool.page_bytes} bytes holds no position of a model whose position "
                              f"takes {per_position} bytes: raise page_bytes")
        self.pool, self.shape, self.block = pool, shape, block
        item = shape.dtype.itemsize
        h, d = shape.kv_heads, shape.head_dim
        typed = pool.raw.view(shape.dtype)
        self.kv = typed.as_strided((pool.pages, shape.layers, 2, block, h, d),
                                   (pool.page_bytes // item, 2 * block * h * d, block * h * d, h * d, d, 1))

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def write(self, pages: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A prompt's keys and values (per layer, ``[positions, kv_heads, head_dim]``) into
        ``pages``, from their first slot."""
        n = layers[0][0].shape[0]
        at = torch.arange(n, device=self.pool.device)
        page = to_device(pages, self.pool.device)[at // self.block]
        slot = at % self.block
        for index, (k, v) in enumerate(layers):
            keys, values = self.layer(index)
            keys[page, slot] = k.to(keys.dtype)
            values[page, slot] = v.to(values.dtype)

    def put(self, page: torch.Tensor, slot: torch.Tensor, new: torch.Tensor) -> None:
        """A decode step's new keys and values, ``[rows, layers, 2, kv_heads, head_dim]``,
        into each row's ``page`` and ``slot``: one write for every layer."""
        self.kv[page, :, :, slot] = new.to(self.kv.dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values, each ``[pages, block, kv_heads, head_dim]``."""
        return self.kv[:, index, 0], self.kv[:, index, 1]


class PagedStep:
    """What a decode step's attention reads: the block table its keys and values are
    gathered through, how many positions of them (None: every slot of the table's pages,
    as a graph must) and, over those, where each row's new position is: ``at`` (``[rows,
    positions]``, true there) for a graph, which replaces the gathered copy's slot with
    ``torch.where``; ``positions`` (``[rows]``) for an eager step, which writes the slot
    (by integers: a boolean index would wait for the device, NOTE [No waiting on the
    device])."""

    __slots__ = ("table", "at", "length", "positions", "rows")

    def __init__(self, table: torch.Tensor, at: torch.Tensor, length: int | None = None,
                 positions: torch.Tensor | None = None):
        if length is not None and positions is None:
            raise ConfigError("an eager decode step (its length given) needs each row's position")
        self.table, self.at, self.length, self.positions = table, at, length, positions
        # An eager step's row indices, made once for every layer's write.
        self.rows = None if length is None else torch.arange(table.shape[0], device=table.device)


def _gather(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The positions of each row's pages, ``[rows, pages * block, kv_heads, head_dim]``,
    from one layer's keys or values ``[pages, block, kv_heads, head_dim]``: one
    ``index_select`` of whole pages (a page's slots are contiguous), 2.5 times faster
    on the CPU than indexing by the table (which copies element by element)."""
    rows = table.shape[0]
    return pages.index_select(0, table.reshape(-1)).reshape(rows, -1, *pages.shape[2:])


@functools.cache
def paged_cache_class() -> type:
    """The adapter's class (``PagedCache(layout, step)``): what a model calls is its
    ``update``, and ``written()`` is the step's new keys and values after its forward.
    Made once, on first use (``transformers`` is imported then)."""
    from transformers import Cache

    class PagedCache(Cache):
        """The adapter (NOTE [Paged key/value caches]): ``update`` is all a model calls."""

        def __init__(self, layout: PagedLayout, step: PagedStep):
            try:
                super().__init__(layers=[])
            except TypeError:  # a release whose Cache takes no layers
                super().__init__()
            self.paged, self.step = layout, step
            self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layout.shape.layers

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            # Read only (NOTE [Paged key/value caches]): the new position joins the gathered
            # copy, and goes into the pool with every layer's after the forward (``new``).
            keys, values = self.paged.layer(layer_idx)
            w = self.step
            new_k, new_v = key_states[:, :, -1], value_states[:, :, -1]
            self.new[layer_idx] = (new_k, new_v)
            if w.length is None:  # every slot of the table's pages, as a graph (maybe compiled) reads them
                k, v = _gather(keys, w.table), _gather(values, w.table)
                at = w.at[:, :, None, None]
                k = torch.where(at, new_k[:, None].to(k.dtype), k)
                v = torch.where(at, new_v[:, None].to(v.dtype), v)
            else:  # an eager step, never compiled: only the pages its positions are in, and
                # the new position written into that copy in place (not a second copy of it)
                table = w.table[:, :-(-w.length // keys.shape[1])]
                k, v = _gather(keys, table)[:, :w.length], _gather(values, table)[:, :w.length]
                k[w.rows, w.positions] = new_k.to(k.dtype)
                v[w.rows, w.positions] = new_v.to(v.dtype)
            return k.transpose(1, 2), v.transpose(1, 2)

        def written(self) -> torch.Tensor:
            """Every layer's new keys and values of the step, ``[rows, layers, 2, kv_heads,
            head_dim]``, for ``PagedLayout.put``."""
            missing = [i for i, kv in enumerate(self.new) if kv is None]
            if missing:
                raise GenerationError(f"the model's step wrote no keys and values for layers {missing}")
            return torch.stack([torch.stack(kv, 1) for kv in self.new if kv is not None], 1)

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return 0  # positions are given with every step: nothing asks

    return PagedCache


def prompt_layers(cache: Any, positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values of one sequence from a model's own ``transformers``
    cache after its prefill, ``[positions, kv_heads, head_dim]``."""
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    if not layers or layers[0][0].shape[2] != positions:
        got = layers[0][0].shape[2] if layers else 0
        raise GenerationError(f"the model's cache holds {got} positions after the prefill, not {positions}")
    return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in layers]


@functools.cache
def cache_key() -> str:
    """The name under which the installed ``transformers`` passes a model's key/value cache
    into its forward and back in its output: ``cache`` in newer releases (5.24 warns on the
    old name, and our tests turn warnings into errors), ``past_key_values`` in older ones
    (5.17, the GPU image's). Read off the causal-LM output record, which has exactly one."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
