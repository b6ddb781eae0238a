"""The one adapter through which a ``transformers`` model reads its key/value caches from
pages and hands back the keys and values a step makes (NOTE [Paged key/value caches] in
``pages.py``). Tensors only; runs where the model's weights are (``runner.py``). A
``transformers`` release that changes its cache interface changes this file alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from timeshare.decode.pages import PagedLayout
from timeshare.errors import ConfigError, GenerationError


class DecodeView:
    """What a decode step's attention reads (one new position a row): the block table its
    keys and values are gathered through, how many positions of them (None: every slot of
    the table's pages, as a graph must) and, over those, where each row's new position is:
    ``at`` (``[rows, positions]``, true there) for a graph, which replaces the gathered
    copy's slot with ``torch.where``; ``positions`` (``[rows]``) for an eager step, which
    writes the slot (by integers: a boolean index would wait for the device, NOTE [No
    waiting on the device])."""

    __slots__ = ("table", "at", "length", "positions", "pages", "span", "slots", "_buffer")

    def __init__(self, table: torch.Tensor, at: torch.Tensor, length: int | None = None,
                 positions: torch.Tensor | None = None, block: int = 1, buffer: torch.Tensor | None = None):
        if length is not None and positions is None:
            raise ConfigError("an eager decode step (its length given) needs each row's position")
        self.table, self.at, self.length, self.positions = table, at, length, positions
        if length is not None and positions is not None:
            # An eager step's gather and write, made once for every layer: the pages its
            # positions are in, end to end, and each row's new position among them.
            pages = -(-length // block)
            self.pages = table[:, :pages].reshape(-1)
            self.span = pages * block
            self.slots = positions + torch.arange(table.shape[0], device=table.device) * self.span
        self._buffer = buffer

    def scratch(self, pages: torch.Tensor) -> torch.Tensor:
        """Where an eager step gathers a layer's pages: a part of ``buffer`` (one for every
        layer, which each overwrites in turn), so that no step allocates its copies."""
        shape = (self.pages.numel(), *pages.shape[1:])
        count = self.pages.numel() * pages[0].numel()
        if self._buffer is None or self._buffer.numel() < count or self._buffer.dtype != pages.dtype:
            return torch.empty(shape, dtype=pages.dtype, device=pages.device)
        return self._buffer[:count].view(shape)


class ExtendView:
    """What a prefill of one row after its ``past`` cached positions reads (NOTE [Prefix
    caching] in ``llm/pages.py``): those positions, gathered from the row's pages through
    ``table``, then the new ones."""

    __slots__ = ("table", "past")

    def __init__(self, table: torch.Tensor, past: int):
        self.table, self.past = table, past


def gather(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The positions of each row's pages, ``[rows, pages * block, ...]``, from one layer's
    pages ``[pages, block, ...]`` (its keys and values side by side): one ``index_select``
    of whole pages (a page's slots are contiguous), 2.5 times faster on the CPU than
    indexing by the table (which copies element by element)."""
    rows = table.shape[0]
    return pages.index_select(0, table.reshape(-1)).reshape(rows, -1, *pages.shape[2:])


@functools.cache
def paged_cache_class() -> type:
    """The adapter's class (``PagedCache(layout, view)``): what a model calls is its
    ``update``; ``written()`` (a decode step) and ``extended()`` (a prefill) are the
    step's new keys and values after its forward. Made once, on first use
    (``transformers`` is imported then)."""
    from transformers import Cache

    class PagedCache(Cache):
        """The adapter (NOTE [Paged key/value caches]): ``update`` is all a model calls."""

        def __init__(self, layout: PagedLayout, view: DecodeView | ExtendView):
            try:
                super().__init__(layers=[])
            except TypeError:  # a release whose Cache takes no layers
                super().__init__()
            self.paged, self.view = layout, view
            # Each layer's new keys and values side by side, [rows or positions, 2, heads, dim].
            self.new: list[torch.Tensor | None] = [None] * layout.shape.layers

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            # Read only (NOTE [Paged key/value caches]): the new positions join the gathered
            # copy (a layer's keys and values gathered together: their pages hold them side
            # by side), and go into the pool with every layer's after the forward.
            pages = self.paged.layer_of(layer_idx)  # [pages, block, 2, heads, dim]
            w = self.view
            if isinstance(w, ExtendView):
                new = torch.stack([key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)], 1).to(
                    pages.dtype)  # [positions, 2, heads, dim]
                self.new[layer_idx] = new
                table = w.table[:-(-w.past // pages.shape[1])][None]
                both = torch.cat([gather(pages, table)[0, :w.past], new])[None]
            elif w.length is None:  # every slot of the table's pages, as a graph (maybe compiled) reads them
                new = torch.stack([key_states[:, :, -1], value_states[:, :, -1]], 1).to(pages.dtype)
                self.new[layer_idx] = new
                both = torch.where(w.at[:, :, None, None, None], new[:, None], gather(pages, w.table))
            else:  # an eager step, never compiled: only the pages its positions are in, and the
                # new position written into that copy in place (not a second copy of it)
                new = torch.stack([key_states[:, :, -1], value_states[:, :, -1]], 1).to(pages.dtype)
                self.new[layer_idx] = new
                both = torch.index_select(pages, 0, w.pages, out=w.scratch(pages))
                rows = new.shape[0]
                both = both.view(rows * w.span, *both.shape[2:])
                both.index_copy_(0, w.slots, new)
                both = both.view(rows, w.span, *both.shape[1:])[:, :w.length]
            return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)

        def _all(self) -> list[torch.Tensor]:
            missing = [i for i, kv in enumerate(self.new) if kv is None]
            if missing:
                raise GenerationError(f"the model's step wrote no keys and values for layers {missing}")
            return [kv for kv in self.new if kv is not None]

        def written(self) -> torch.Tensor:
            """A decode step's new keys and values of every layer, ``[rows, layers, 2,
            kv_heads, head_dim]``, for ``PagedLayout.put``."""
            return torch.stack(self._all(), 1)

        def extended(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
            """A prefill's new keys and values, per layer ``[positions, kv_heads,
            head_dim]``, for ``PagedLayout.write``."""
            return [(kv[:, 0], kv[:, 1]) for kv in self._all()]

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
