"""Placement of blocks inside the arena, as plain integers. No torch; runs wherever
the decisions are made (the controller in the multi-process runtime).

The allocator never touches memory: it hands out ``(offset, size)`` ranges of a
fixed capacity, aligned, first-fit over an address-ordered free list that is
coalesced on every free. Keeping it free of torch makes it exhaustively testable
and lets the controller plan placements for memory that lives in another process.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from timeshare.errors import ConfigError, TimeshareError

DEFAULT_ALIGNMENT = 512  # bytes; covers every dtype and CUDA's 256-byte preference


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Block:
    """A placed range of the arena, owned by ``owner``."""

    offset: int
    size: int
    owner: str

    @property
    def end(self) -> int:
        return self.offset + self.size


class Allocator:
    """First-fit allocator over ``[0, capacity)`` with coalescing frees."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a positive power of two, got {alignment}")
        if capacity < alignment:
            raise ConfigError(f"capacity {capacity} is smaller than one aligned block ({alignment})")
        self.capacity = capacity // alignment * alignment
        self.alignment = alignment
        # Free ranges sorted by offset: parallel lists of starts and sizes.
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [self.capacity]
        self._blocks: dict[int, Block] = {}

    # -- queries -------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(b.size for b in self._blocks.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes, default=0)

    def blocks(self) -> list[Block]:
        return sorted(self._blocks.values(), key=lambda b: b.offset)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._free_starts, self._free_sizes))

    def rounded(self, size: int) -> int:
        """The bytes a request of ``size`` really takes."""
        return align_up(max(size, 1), self.alignment)

    def fits(self, size: int) -> bool:
        return self.rounded(size) <= self.largest_free

    # -- mutation ------------------------------------------------------------------
    def allocate(self, size: int, owner: str) -> Block | None:
        """Place ``size`` bytes; return the block, or None when no free range is large enough."""
        if size < 0:
            raise ConfigError(f"cannot allocate a negative size ({size})")
        need = self.rounded(size)
        for i, (start, avail) in enumerate(zip(self._free_starts, self._free_sizes)):
            if avail >= need:
                if avail == need:
                    del self._free_starts[i]
                    del self._free_sizes[i]
                else:
                    self._free_starts[i] = start + need
                    self._free_sizes[i] = avail - need
                block = Block(start, need, owner)
                self._blocks[start] = block
                return block
        return None

    def allocate_at(self, offset: int, size: int, owner: str) -> Block | None:
        """Place ``size`` bytes exactly at ``offset`` if that range is free, else None.

        Used to put a model back where it lived before, so that its bound views are
        still valid (see NOTE [Sticky placement] in worker/worker.py).
        """
        need = self.rounded(size)
        if offset % self.alignment or offset < 0 or offset + need > self.capacity:
            return None
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i < 0:
            return None
        start, avail = self._free_starts[i], self._free_sizes[i]
        if offset + need > start + avail:
            return None
        # split the free range into [start, offset) and [offset + need, start + avail)
        del self._free_starts[i]
        del self._free_sizes[i]
        if offset + need < start + avail:
            self._free_starts.insert(i, offset + need)
            self._free_sizes.insert(i, start + avail - offset - need)
        if offset > start:
            self._free_starts.insert(i, start)
            self._free_sizes.insert(i, offset - start)
        block = Block(offset, need, owner)
        self._blocks[offset] = block
        return block

    def release(self, block: Block) -> None:
        """Give ``block`` back, merging it with free neighbours."""
        if self._blocks.get(block.offset) != block:
            raise TimeshareError(f"block {block} is not allocated here (double free?)")
        del self._blocks[block.offset]
        i = bisect.bisect_left(self._free_starts, block.offset)
        start, size = block.offset, block.size
        # merge with the next free range
        if i < len(self._free_starts) and self._free_starts[i] == start + size:
            size += self._free_sizes[i]
            del self._free_starts[i]
            del self._free_sizes[i]
        # merge with the previous free range
        if i > 0 and self._free_starts[i - 1] + self._free_sizes[i - 1] == start:
            self._free_sizes[i - 1] += size
        else:
            self._free_starts.insert(i, start)
            self._free_sizes.insert(i, size)

    def check(self) -> None:
        """Assert the invariants: blocks and free ranges tile the capacity exactly."""
        spans = sorted([(b.offset, b.size) for b in self._blocks.values()] + self.free_ranges())
        pos = 0
        for start, size in spans:
            assert start == pos, f"gap or overlap at {pos} (next span starts at {start})"
            assert size > 0 and start % self.alignment == 0
            pos = start + size
        assert pos == self.capacity, f"spans end at {pos}, capacity is {self.capacity}"
        for a, b in zip(self.free_ranges(), self.free_ranges()[1:]):
            assert a[0] + a[1] < b[0], f"adjacent free ranges {a} and {b} were not merged"
