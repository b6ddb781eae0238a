"""Which page of a key/value page pool is whose, and which hold a prompt's prefix that a
later request may share: the controller's side of a pool (its bytes are a region of the
arena, seen by the model that computes through ``decode/pages.py``). Integers only, but
for moving a row's pages to host memory and back. Runs in the controller; the engines of
the language models that share the pool call it from their threads.

# NOTE [Prefix caching]
A full page of a sequence's positions is keyed by a hash of its tokens, of every token
before them and of the model that computed it (``page_keys``: a chain, each page's key
hashing the one before, rooted in the model's ``tag``, unique to one load of one model:
cached pages never outlive a change of its weights, and models sharing a pool never read
each other's). After a prefill, the row's full pages of the prompt are published
(``publish``), and the pages a decode step fills are too, so that a follow-up turn that
resends the answer finds it. A new sequence shares the longest run of its prompt's full
pages that is published (``share``: read only; the page is counted once per holder), and
computes the rest from there (at least its last token: the first token's logits come
from it). A page whose last holder lets it go stays published in a least-recently-used
set of free pages: ``take`` uses the never-published free pages first, then reclaims
cached ones, least recent first, so that under memory pressure cached pages go before
any running sequence is preempted or moved out. A model that closes forgets its pages
(``forget``). ``enabled`` false (``prefix_caching: false`` on an ``llms`` entry) keys
nothing for that model: its engine neither shares nor publishes.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from timeshare.errors import ConfigError, TimeshareError


class KVMemoryError(TimeshareError):
    """The page pool has no room for a sequence's next positions."""


def page_keys(tag: bytes, tokens: Sequence[int], block: int, done: list[bytes] | None = None) -> list[bytes]:
    """The keys of the full pages of ``tokens`` (pages of ``block`` positions) of the model
    ``tag`` (NOTE [Prefix caching]); ``done``: keys of the first pages computed before
    (extended, not recomputed)."""
    keys = list(done or [])
    parent = keys[-1] if keys else tag
    for i in range(len(keys), len(tokens) // block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[i * block:(i + 1) * block]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool for metrics: its pages (the scratch page aside), those free now (cached ones
    included), those free that hold a published prefix, and the full pages of prompts
    looked up that were found published (hits) and were not (misses), since it opened."""

    pages: int
    free: int
    cached: int
    hits: int
    misses: int


class PagePool:
    """The pages of ``memory`` (a region of the arena at ``offset``, whole pages of
    ``page_bytes``, page 0 the scratch page that is nobody's) as the controller hands them
    out (NOTE [Paged key/value caches], NOTE [Prefix caching])."""

    def __init__(self, memory: torch.Tensor, offset: int, page_bytes: int, owner: str = "kv-pages"):
        if page_bytes < 1024 or page_bytes % 1024:
            raise ConfigError(f"page_bytes must be a positive multiple of 1 KiB, got {page_bytes}")
        pages = memory.numel() // page_bytes
        if memory.dtype != torch.uint8 or memory.dim() != 1 or pages < 2:
            raise ConfigError(f"a key/value page pool needs uint8 bytes for two pages of {page_bytes} at least, "
                              f"got {memory.dtype} {tuple(memory.shape)}")
        self.owner, self.offset, self.page_bytes, self.pages = owner, offset, page_bytes, pages
        self.memory = memory[:pages * page_bytes]
        self.device = memory.device
        self._by_page = self.memory.view(pages, page_bytes)
        self._lock = threading.Lock()
        self._free = list(range(pages - 1, 0, -1))  # never published (or forgotten); pop() takes the lowest
        self._refs = [0] * pages
        self._key: list[bytes | None] = [None] * pages
        self._tag: list[bytes | None] = [None] * pages  # the model whose prefix a published page holds
        self._by_key: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # published, held by no one: least recent first
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """The region's bytes (the scratch page too)."""
        return self.pages * self.page_bytes

    @property
    def free_pages(self) -> int:
        """Pages ``take`` can hand out now: the free ones and the cached ones it may reclaim."""
        with self._lock:
            return len(self._free) + len(self._cached)

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            return PoolSnapshot(self.pages - 1, len(self._free) + len(self._cached), len(self._cached),
                                self.hits, self.misses)

    def take(self, n: int) -> list[int]:
        """``n`` pages for one holder: never-published free pages first, then cached ones,
        least recently used first, which are unpublished (NOTE [Prefix caching]);
        ``KVMemoryError`` if fewer are free (none is taken then). The caller zeroes them
        (``Step.zero``) before anything reads them."""
        if n <= 0:
            return []
        with self._lock:
            if n > len(self._free) + len(self._cached):
                raise KVMemoryError(f"the key/value page pool ({self.pages - 1} pages of {self.page_bytes} bytes) "
                                    f"has {len(self._free) + len(self._cached)} free, {n} needed: raise kv_memory "
                                    "or lower max_sequences")
            return self._take(n)

    def _take(self, n: int) -> list[int]:
        """``take`` with the lock held, the room checked."""
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._cached.popitem(last=False)
            self._unpublish(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, keys: Sequence[bytes], more: int = 0) -> tuple[list[int], list[int]]:
        """At once: the pages of the longest run of ``keys`` (from the first) that are
        published, each now held once more (read only), and ``more`` pages besides for
        the positions after them (as ``take``); the found pages are counted as hits, the
        rest of ``keys`` as misses. ``KVMemoryError`` if the pool cannot give them all:
        nothing is held or counted then."""
        with self._lock:
            found: list[int] = []
            for key in keys:
                page = self._by_key.get(key)
                if page is None:
                    break
                found.append(page)
            cached = sum(1 for p in found if self._refs[p] == 0)  # free now, held once shared
            more += len(keys) - len(found)
            if more > len(self._free) + len(self._cached) - cached:
                raise KVMemoryError(f"the key/value page pool ({self.pages - 1} pages of {self.page_bytes} bytes) "
                                    f"has {len(self._free) + len(self._cached) - cached} free, {more} needed: "
                                    "raise kv_memory or lower max_sequences")
            for page in found:
                if self._refs[page] == 0:
                    del self._cached[page]
                self._refs[page] += 1
            self.hits += len(found)
            self.misses += len(keys) - len(found)
            return found, self._take(more)

    def publish(self, page: int, key: bytes, tag: bytes) -> None:
        """``page`` (held) holds the positions ``key`` names, of the model ``tag``: later
        sequences may share it. A key published already keeps its page."""
        with self._lock:
            if self._refs[page] < 1:
                raise ConfigError(f"page {page} is published by no holder")
            if key in self._by_key or self._key[page] is not None:
                return
            self._by_key[key] = page
            self._key[page], self._tag[page] = key, tag

    def give(self, pages: Sequence[int]) -> None:
        """One holder lets ``pages`` go: a page no one holds is free, or cached if published."""
        with self._lock:
            for p in pages:
                self._refs[p] -= 1
                if self._refs[p] > 0:
                    continue
                if self._refs[p] < 0:
                    self._refs[p] = 0
                    raise ConfigError(f"page {p} was given back more often than it was taken")
                if self._key[p] is None:
                    self._free.append(p)
                else:
                    self._cached[p] = None

    def forget(self, tag: bytes) -> int:
        """Unpublish every page of the model ``tag`` (it closed: NOTE [Prefix caching]);
        the pages freed (those no one held)."""
        freed = 0
        with self._lock:
            for p in [p for p, t in enumerate(self._tag) if t == tag]:
                self._unpublish(p)
                if p in self._cached:
                    del self._cached[p]
                    self._free.append(p)
                    freed += 1
        return freed

    def _unpublish(self, page: int) -> None:
        key = self._key[page]
        if key is not None:
            del self._by_key[key]
        self._key[page] = self._tag[page] = None

    # ------------------------------------------------------------------ bytes (NOTE [Key/value caches off the device])
    def read(self, pages: Sequence[int]) -> torch.Tensor:
        """The bytes of ``pages``, in order, in host memory (page-locked on CUDA), once any
        step that wrote them is over (the device's work is waited for)."""
        data = self._by_page[torch.tensor(list(pages), device=self.device)]
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(data)
        return host

    def write(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """``data`` (from ``read``) into ``pages``, done when this returns: a step in another
        process reads them next."""
        self._by_page[torch.tensor(list(pages), device=self.device)] = data.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
