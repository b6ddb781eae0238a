"""The host weight store: one model's tensors packed once into one contiguous host
buffer, in execution order, pinned when the device is CUDA. Lives with the arena.

Each tensor sits at an aligned offset; the arena copy of the model uses the *same*
relative offsets, so any run of consecutive layers is one contiguous byte range and
a layer group is moved with a single copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from timeshare.memory.allocator import DEFAULT_ALIGNMENT, align_up


@dataclass(frozen=True)
class TensorEntry:
    """One unique tensor of a model: where it sits and what it is.

    ``names`` lists every qualified name under which the module holds it; tied
    weights have several names and one entry (one copy in memory).
    """

    key: str
    names: tuple[str, ...]
    kind: str  # "parameter" or "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class HostStore:
    """A model's tensors packed into one host buffer; ``entries`` in storage order."""

    def __init__(self, entries: Sequence[TensorEntry], buffer: torch.Tensor, alignment: int):
        self.entries = list(entries)
        self.buffer = buffer
        self.alignment = alignment
        self.by_key = {e.key: e for e in self.entries}

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @property
    def pinned(self) -> bool:
        return bool(self.buffer.is_pinned()) if self.buffer.numel() else False

    @classmethod
    def pack(
        cls,
        entries: Sequence[TensorEntry],
        tensors: dict[str, torch.Tensor],
        *,
        pin: bool,
        alignment: int = DEFAULT_ALIGNMENT,
        buffer: torch.Tensor | None = None,
    ) -> "HostStore":
        """Lay ``tensors`` (by entry key) out in the order of ``entries`` and copy them in,
        into ``buffer`` when given (shared memory, say), else a new (pinned) one."""
        placed: list[TensorEntry] = []
        pos = 0
        for e in entries:
            placed.append(TensorEntry(e.key, e.names, e.kind, e.shape, e.dtype, e.requires_grad, pos))
            pos = align_up(pos + e.nbytes, alignment)
        total = max(pos, alignment)
        if buffer is None:
            buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        elif buffer.numel() < total:
            raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than the store ({total})")
        else:
            buffer = buffer[:total]
        store = cls(placed, buffer, alignment)
        for e in placed:
            store.view(buffer, e).copy_(tensors[e.key].detach().to("cpu"))
        return store

    @staticmethod
    def view(region: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """``entry``'s tensor as a view of ``region``, a uint8 buffer laid out like the store."""
        raw = region[entry.offset : entry.offset + entry.nbytes]
        return raw.view(entry.dtype).view(entry.shape)

    def spans(self, base: int) -> list[tuple[int, int, str]]:
        """``(start, end, key)`` addresses of every non-empty tensor of a copy of this
        store that begins at address ``base`` (for tracing by address)."""
        return [(base + e.offset, base + e.offset + e.nbytes, e.key) for e in self.entries if e.nbytes]

    def tensor(self, key: str) -> torch.Tensor:
        return self.view(self.buffer, self.by_key[key])

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the store by key (views, no copies)."""
        return {e.key: self.view(self.buffer, e) for e in self.entries}
