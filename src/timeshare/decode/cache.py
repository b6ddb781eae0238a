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

    __slots__ = ("table", "at", "length", "positions", "pages", "span", "slots")

    def __init__(self, table: torch.Tensor, at: torch.Tensor, length: int | None = None,
                 positions: torch.Tensor | None = None, block: int = 1):
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


class ExtendView:
    """What a prefill of one row after its ``past`` cached positions reads (NOTE [Prefix
    caching] in ``llm/pages.py``): those positions, gathered from the row's pages through
    ``table``, then the new ones."""

    __slots__ = ("table", "past")

    def __init__(self, table: torch.Tensor, past: int):
        self.table, self.past = table, past


def gather(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The positions of each row's pages, ``[rows, pages * block, kv_heads, head_dim]``,
    from one layer's keys or values ``[pages, block, kv_heads, head_dim]``: one
    ``index_select`` of whole pages (a page's slots are contiguous), 2.5 times faster
    on the CPU than indexing by the table (which copies element by element)."""
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
            self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layout.shape.layers

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            # Read only (NOTE [Paged key/value caches]): the new positions join the gathered
            # copy, and go into the pool with every layer's after the forward.
            keys, values = self.paged.layer(layer_idx)
            w = self.view
            if isinstance(w, ExtendView):
                new_k, new_v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [n, heads, dim]
                self.new[layer_idx] = (new_k, new_v)
                table = w.table[:-(-w.past // keys.shape[1])][None]
                k = torch.cat([gather(keys, table)[0, :w.past], new_k.to(keys.dtype)])[None]
                v = torch.cat([gather(values, table)[0, :w.past], new_v.to(values.dtype)])[None]
                return k.transpose(1, 2), v.transpose(1, 2)
            new_k, new_v = key_states[:, :, -1], value_states[:, :, -1]
            self.new[layer_idx] = (new_k, new_v)
            if w.length is None:  # every slot of the table's pages, as a graph (maybe compiled) reads them
                k, v = gather(keys, w.table), gather(values, w.table)
                at = w.at[:, :, None, None]
                k = torch.where(at, new_k[:, None].to(k.dtype), k)
                v = torch.where(at, new_v[:, None].to(v.dtype), v)
            else:  # an eager step, never compiled: only the pages its positions are in, keys and
                # values in one copy, and the new position written into it in place
                both = self.paged.layer_of(layer_idx).index_select(0, w.pages)  # [pages, block, 2, heads, dim]
                rows = new_k.shape[0]
                both = both.view(rows * w.span, *both.shape[2:])
                both.index_copy_(0, w.slots, torch.stack([new_k, new_v], 1).to(both.dtype))
                both = both.view(rows, w.span, *both.shape[1:])[:, :w.length]
                k, v = both[:, :, 0], both[:, :, 1]
            return k.transpose(1, 2), v.transpose(1, 2)

        def _all(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
            missing = [i for i, kv in enumerate(self.new) if kv is None]
            if missing:
                raise GenerationError(f"the model's step wrote no keys and values for layers {missing}")
            return [kv for kv in self.new if kv is not None]

        def written(self) -> torch.Tensor:
            """A decode step's new keys and values of every layer, ``[rows, layers, 2,
            kv_heads, head_dim]``, for ``PagedLayout.put``."""
            return torch.stack([torch.stack(kv, 1) for kv in self._all()], 1)

        def extended(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
            """A prefill's new keys and values, per layer ``[positions, kv_heads,
            head_dim]``, for ``PagedLayout.write``."""
            return self._all()

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
