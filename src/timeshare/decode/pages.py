"""Key/value caches in pages at fixed device addresses, as the model that computes sees
them: a region of the arena cut into pages (``PagedLayout``). Tensors only; runs where
the model's weights are (``decode/runner.py``). Which page is whose is the controller's
(``llm/pages.py``).

# NOTE [Paged key/value caches]
A language model's caches live in a *page pool*: a region of the runtime's arena (NOTE
[Regions of the arena]) that never moves or goes while its models decode, cut into pages
of ``page_bytes``, so that a captured decode graph may read them at their addresses for
as long as the pool lives. Every model that decodes on the device takes its pages from
a pool (its own, or one shared with the runtime's other language models, as the server
makes under ``kv_memory``). A model sees each page as ``block`` positions of all its
layers' keys and values (``PagedLayout``: the block is the page's bytes over the bytes
one position takes, so models of different shapes share the pages). A sequence holds the
pages of its positions, in order: position ``p`` is slot ``p % block`` of the sequence's
page ``p // block``, and a row of the *block table* lists a sequence's pages. The
controller decides which page is whose (``llm/pages.py``: integers only, prefix caching
there); a step (``decode/step.py``) carries each row's table. A step reads a sequence's
positions by gathering its pages through the table, and a mask hides the slots past the
sequence's length. The pool is only read while the model computes: each layer attends to
its gathered positions with the new keys and values put in their place in that copy, and
the new keys and values of every layer go into their slots after the forward
(``PagedLayout.put``, ``PagedLayout.write``), so that a compiled forward (``runner.py``)
never mutates the pool (a compiler would copy the whole pool for that). Page 0 is
nobody's: the rows that pad a batch up to a captured size write there, and the table's
unused entries point there. A page is zeroed by the step that first writes it (``Step.zero``)
so that the slots a mask hides hold finite numbers (a hidden slot's value is multiplied
by a zero weight, and zero times NaN is NaN): a page another model or sequence had, or
poison, never leaks.

# NOTE [No waiting on the device]
A step's host work (the block tables, the tokens in, the pages to zero) never waits for
the device: the host runs ahead and queues the next kernels while the device computes,
and the one wait of a step is the read of its tokens. ``torch.tensor(values, device=cuda)``
copies from pageable memory and waits for the stream to drain first, so lists of page
numbers, tokens and sampling parameters go to the device through page-locked memory and
an asynchronous copy (``to_device``); a boolean mask as an index waits too (its count is
read back), so rows and positions are indexed by integers. The GPU tier runs the steps
under ``torch.cuda.set_sync_debug_mode("error")``, which fails on any such wait.
"""

from __future__ import annotations

import torch

from timeshare.decode.step import KVShape
from timeshare.errors import ConfigError

MAX_BLOCK = 64  # positions a page holds at most: a step gathers whole pages, the hidden slots too


def to_device(values: list[int] | list[float] | tuple, device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a tensor on ``device``, queued without waiting for it (NOTE [No
    waiting on the device]): on CUDA copied from page-locked memory, asynchronously
    (the caching host allocator keeps that memory until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)  # the tensor itself on the CPU


def page_bytes_for(shape: KVShape, positions: int = 32) -> int:
    """Pages of ``positions`` positions of a model of ``shape`` (in whole KiB, at least 4 KiB)."""
    return max(4096, -(-shape.position_bytes * positions // 1024) * 1024)


def pool_footprint(nbytes: int, page_bytes: int) -> int:
    """The bytes a pool of ``nbytes`` in pages of ``page_bytes`` takes: its whole pages and
    the scratch page; a ``ConfigError`` for sizes it refuses."""
    if page_bytes < 1024 or page_bytes % 1024:
        raise ConfigError(f"page_bytes must be a positive multiple of 1 KiB, got {page_bytes}")
    if nbytes < page_bytes:
        raise ConfigError(f"a key/value page pool needs at least one page of {page_bytes} bytes, got {nbytes} bytes")
    return (nbytes // page_bytes + 1) * page_bytes


def block_of(page_bytes: int, shape: KVShape) -> int:
    """The positions a page of ``page_bytes`` holds of a model of ``shape`` (``ConfigError``: none)."""
    block = min(page_bytes // shape.position_bytes, MAX_BLOCK)
    if block < 1:
        raise ConfigError(f"a page of {page_bytes} bytes holds no position of a model whose position "
                          f"takes {shape.position_bytes} bytes: raise page_bytes")
    return block


class PagedLayout:
    """A model's view of a pool's ``memory`` (uint8, whole pages of ``page_bytes``, page 0
    the scratch page): each page ``block`` positions of every layer's keys and values,
    ``[pages, layers, block, 2, kv_heads, head_dim]`` (at most ``MAX_BLOCK`` positions:
    the rest of a larger page is left unused). A position's key and value are side by
    side, so that one layer's pages gathered end to end hold its keys and its values as
    two views of one copy (``layer_of``)."""

    def __init__(self, memory: torch.Tensor, page_bytes: int, shape: KVShape):
        if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < 2 * page_bytes:
            raise ConfigError(f"a key/value page pool needs uint8 bytes for two pages of {page_bytes} at least, "
                              f"got {memory.dtype} {tuple(memory.shape)}")
        self.block = block_of(page_bytes, shape)
        self.pages = memory.numel() // page_bytes
        self.memory, self.page_bytes, self.shape = memory[:self.pages * page_bytes], page_bytes, shape
        self.device = memory.device
        self._by_page = self.memory.view(self.pages, page_bytes)
        item = shape.dtype.itemsize
        h, d, block = shape.kv_heads, shape.head_dim, self.block
        typed = self.memory.view(shape.dtype)
        self.kv = typed.as_strided((self.pages, shape.layers, block, 2, h, d),
                                   (page_bytes // item, 2 * block * h * d, 2 * h * d, h * d, d, 1))

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def zero(self, pages: tuple[int, ...] | list[int]) -> None:
        """Zero ``pages`` (NOTE [Paged key/value caches]), queued without waiting."""
        if pages:
            self._by_page[to_device(list(pages), self.device)] = 0

    def write(self, table: torch.Tensor, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One row's keys and values of positions ``start`` on (per layer, ``[positions,
        kv_heads, head_dim]``) into its pages (``table``, the row's pages on the device)."""
        n = layers[0][0].shape[0]
        at = torch.arange(start, start + n, device=self.device)
        page = table[at // self.block]
        slot = at % self.block
        for index, (k, v) in enumerate(layers):
            keys, values = self.layer(index)
            keys[page, slot] = k.to(keys.dtype)
            values[page, slot] = v.to(values.dtype)

    def put(self, page: torch.Tensor, slot: torch.Tensor, new: torch.Tensor) -> None:
        """A decode step's new keys and values, ``[rows, layers, 2, kv_heads, head_dim]``,
        into each row's ``page`` and ``slot``: one write for every layer."""
        self.kv[page, :, slot] = new.to(self.kv.dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values, each ``[pages, block, kv_heads, head_dim]``."""
        return self.kv[:, index, :, 0], self.kv[:, index, :, 1]

    def layer_of(self, index: int) -> torch.Tensor:
        """Layer ``index``'s keys and values together, ``[pages, block, 2, kv_heads, head_dim]``."""
        return self.kv[:, index]
