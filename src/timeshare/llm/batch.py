"""A language model's running rows as the controller keeps them: each row's sequence, its
pages and how many of its positions they hold, and the steps (``decode/step.py``) made
from them. Runs in the controller, in the model's engine thread (``engine.py``); what a
step computes runs where the weights are (NOTE [One step, two places]).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from timeshare.decode.lora import LoraUse
from timeshare.decode.pages import block_of
from timeshare.decode.step import DecoderSpec, Draw, Penalties, Step, StepKind
from timeshare.errors import GenerationError
from timeshare.llm.adapters import AdapterSlots
from timeshare.llm.pages import KVMemoryError, PagePool, page_keys
from timeshare.llm.sequence import Sequence


class Row:
    """One sequence in the batch: its pages (its block table), the positions they hold,
    and the keys of its full pages (NOTE [Prefix caching])."""

    __slots__ = ("seq", "pages", "length", "keys", "saved", "slot")

    def __init__(self, seq: Sequence, pages: list[int], keys: list[bytes], slot: int = 0):
        self.seq, self.pages, self.keys = seq, pages, keys
        self.slot = slot  # its adapter's slot (NOTE [Adapters in slots]; 0: the base)
        self.length = 0
        self.saved: torch.Tensor | None = None  # its pages' bytes while in host memory

    def context(self) -> list[int]:
        """The tokens at its positions: the prompt, then what it generated."""
        return self.seq.prompt + self.seq.tokens


def draw(seqs: Seq[Sequence], eos: frozenset[int] = frozenset()) -> Draw:
    """How each sequence chooses its next token: its params, its seed, its token's index,
    and what it asks beyond them (NOTE [Logit processing]; each left empty when no
    sequence asks for it): log-probabilities, penalties over its history, its logit bias,
    the end tokens ``eos`` while it is short of ``min_tokens``. Its grammar's mask comes
    later (``Batch.masks_of``)."""
    params = [s.params for s in seqs]
    plain = Draw(tuple(p.temperature for p in params), tuple(p.top_k for p in params),
                 tuple(p.top_p for p in params), tuple(s.seed for s in seqs), tuple(len(s.tokens) for s in seqs))
    if not any(p.asks_more for p in params):
        return plain
    logprobs = tuple(-1 if p.logprobs is None else p.logprobs for p in params)
    penalties = tuple(Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                                tuple(s.prompt + s.tokens), len(s.prompt)) if p.penalized else None
                      for s, p in zip(seqs, params))
    bias = tuple(p.logit_bias for p in params)
    ends = tuple(sorted(eos))
    banned = tuple((ends, max(0, p.min_tokens - len(s.tokens))) for s, p in zip(seqs, params))
    return replace(plain, logprobs=logprobs if any(k >= 0 for k in logprobs) else (),
                   penalties=penalties if any(p is not None for p in penalties) else (),
                   bias=bias if any(bias) else (),
                   banned=banned if ends and any(steps for _, steps in banned) else ())


class Batch:
    """The rows of one model on ``pool`` (``spec``: how it decodes there), prefix caching
    with ``tag`` unless ``caching`` is off (NOTE [Prefix caching])."""

    def __init__(self, pool: PagePool, spec: DecoderSpec, tag: bytes, caching: bool = True,
                 eos: frozenset[int] = frozenset(), adapters: AdapterSlots | None = None):
        self.pool, self.spec, self.tag, self.caching = pool, spec, tag, caching
        self.adapters = adapters  # NOTE [Adapter residency]: its adapter slots, if it serves adapters
        self.eos = eos  # the end tokens a sequence short of its min_tokens may not choose
        self.block = block_of(pool.page_bytes, spec.shape)
        self.rows: list[Row] = []
        self.hits = 0  # full pages of prompts found cached, and not (NOTE [Prefix caching])
        self.misses = 0
        self.prefilled = 0  # positions its prefills computed (those found cached were not)
        self.masks = 0  # NOTE [Constrained decoding]: the masks its rows' grammars computed, and the seconds
        self.mask_s = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """The bytes of the pages its rows hold on the device (none of those in host memory)."""
        return sum(len(r.pages) for r in self.rows) * self.pool.page_bytes

    @property
    def host_bytes(self) -> int:
        return sum(r.saved.numel() for r in self.rows if r.saved is not None)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.block)

    # ------------------------------------------------------------------ prefills
    def prefill(self, seq: Sequence) -> tuple[Row, Step]:
        """The step that prefills ``seq`` (its prompt, and what it generated before a
        preemption) into a new row: the pages of its cached prefix shared, the others
        taken, at once (``KVMemoryError``: too few, nothing taken). The row joins with ``joined``
        once the step succeeded, else its pages go back with ``abandon``."""
        context = seq.prompt + seq.tokens
        keys = page_keys(self._tag_of(seq), context, self.block) if self.caching else []
        # A prompt's log-probabilities are computed from the whole prompt: no cached page
        # is read for them (its pages are still published for others).
        whole = seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None
        # The last token is always computed: its logits give the first token.
        shareable = [] if whole else keys[:(len(context) - 1) // self.block]
        # NOTE [Adapter residency]: its adapter's slot first (AdapterSlotsFull: it waits).
        slot = self.adapters.take(seq.adapter) if seq.adapter is not None and self.adapters is not None else 0
        if seq.adapter is not None and self.adapters is None:
            raise GenerationError(f"sequence {seq.id} names an adapter of a model served without adapter slots")
        try:
            shared, new = self.pool.share(shareable, self.pages_for(len(context)) - len(shareable))
        except BaseException:
            if slot and self.adapters is not None:  # a write it began is finished: the slot says what it holds
                with contextlib.suppress(GenerationError):
                    self.adapters.settle(slot)
            self._let_go(slot)
            raise
        self.hits += len(shared)
        self.misses += len(shareable) - len(shared)
        start = len(shared) * self.block
        self.prefilled += len(context) - start
        row = Row(seq, shared + new, keys, slot)
        # Only a page the prefill leaves partly written is zeroed (NOTE [Paged key/value caches]).
        zero = tuple(new[-1:]) if len(context) % self.block else ()
        asked = (seq.params.prompt_logprobs or 0,) if whole else ()
        return row, Step(StepKind.PREFILL, self.spec, (tuple(context[start:]),), (start,), (tuple(row.pages),),
                         draw([seq], self.eos), zero, prompt_logprobs=asked, masks=self.masks_of([seq]),
                         adapters=(slot,) if slot else (), lora=self._use_of((slot,)),
                         load=self.adapters.writing(slot) if slot and self.adapters is not None else None)

    def _tag_of(self, seq: Sequence) -> bytes:
        """The root of its pages' keys: the model's load's, and its adapter's (NOTE [Prefix
        caching], NOTE [Adapter residency])."""
        return self.tag if seq.adapter is None else self.tag + b"#" + seq.adapter.key

    def _use_of(self, slots: tuple[int, ...]) -> LoraUse | None:
        return self.adapters.use_of(slots) if self.adapters is not None and any(slots) else None

    def _let_go(self, slot: int) -> None:
        if slot and self.adapters is not None:
            self.adapters.release(slot)

    def settle(self, row: Row) -> None:
        """``row``'s prefill ended, well or not: its adapter's slot is written whole
        (NOTE [Adapters streamed in]; ``GenerationError``: it could not be)."""
        if row.slot and self.adapters is not None:
            self.adapters.settle(row.slot)

    def joined(self, row: Row) -> None:
        """``row``'s prefill succeeded: it joins the batch, its full pages published."""
        row.length = len(row.seq.prompt) + len(row.seq.tokens)
        self.rows.append(row)
        self._publish(row, 0)

    def abandon(self, row: Row) -> None:
        """``row``'s prefill failed: its pages go back, and its adapter's slot."""
        self.pool.give(row.pages)
        self._let_go(row.slot)

    # ------------------------------------------------------------------ decode steps
    def short(self, count: int = 1) -> list[int]:
        """The rows (indices) whose next ``count`` positions need pages, taking them for
        each while the pool has them; those left short, in order (empty: the step can run)."""
        left = []
        for i, row in enumerate(self.rows):
            need = self.pages_for(row.length + count) - len(row.pages)
            if need > 0:
                try:
                    row.pages += self.pool.take(need)
                except KVMemoryError:
                    left.append(i)
        return left

    def decode(self, count: int = 1) -> Step:
        """``count`` tokens of every row (NOTE [Multi-step decode]; each has the pages of
        its next ``count`` positions: ``short``). The pages a row first writes in this step
        are zeroed before it."""
        rows, block = self.rows, self.block
        fresh = tuple(p for r in rows for p in r.pages[-(-r.length // block):self.pages_for(r.length + count)])
        slots = tuple(r.slot for r in rows)
        return Step(StepKind.DECODE, self.spec, tuple((r.seq.tokens[-1],) for r in rows),
                    tuple(r.length for r in rows), tuple(tuple(r.pages) for r in rows),
                    draw([r.seq for r in rows], self.eos), fresh, count, masks=self.masks_of([r.seq for r in rows]),
                    adapters=slots if any(slots) else (), lora=self._use_of(slots))

    def masks_of(self, seqs: list[Sequence]) -> Callable[[], tuple[bytes, ...]] | None:
        """The step's late masks (NOTE [Masks while the device runs]): its rows' grammar
        masks, computed when the runner asks for them, the time they take counted; None
        when no row is constrained."""
        matchers = tuple(s.matcher for s in seqs)
        if all(m is None for m in matchers):
            return None

        def masks() -> tuple[bytes, ...]:
            t0 = time.perf_counter()
            got = tuple(m.mask() if m is not None else b"" for m in matchers)
            self.mask_s += time.perf_counter() - t0
            self.masks += sum(1 for m in got if m)
            return got

        return masks

    def stepped(self, count: int = 1) -> None:
        """A decode step of ``count`` tokens succeeded and its tokens were taken: each row
        holds ``count`` more positions, and a page it filled with its sequence's tokens is
        published (NOTE [Prefix caching]). A row that ended inside a burst wrote positions
        past its last token: only those of its tokens count."""
        for row in self.rows:
            before = row.length // self.block
            row.length += count
            if self.caching:
                valid = min(row.length, len(row.seq.prompt) + len(row.seq.tokens) - 1)
                self._publish(row, before, valid // self.block)

    def _publish(self, row: Row, first: int, full: int | None = None) -> None:
        """Publish ``row``'s full pages from page ``first`` on (up to page ``full``, default
        every page its positions fill)."""
        if not self.caching:
            return
        full = row.length // self.block if full is None else full
        if len(row.keys) < full:
            row.keys = page_keys(self._tag_of(row.seq), row.context()[:full * self.block], self.block, row.keys)
        for i in range(first, full):
            self.pool.publish(row.pages[i], row.keys[i], self.tag)

    # ------------------------------------------------------------------ rows leaving
    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order); the others' pages go back."""
        kept = set(rows)
        for i, row in enumerate(self.rows):
            if i not in kept:
                self._release(row)
        self.rows = [self.rows[i] for i in rows]

    def clear(self) -> None:
        self.keep([])

    def _release(self, row: Row) -> None:
        if row.saved is None:
            self.pool.give(row.pages)
        row.pages, row.saved = [], None
        self._let_go(row.slot)
        row.slot = 0

    # ------------------------------------------------------------------ host memory
    # NOTE [Key/value caches off the device]
    def move_out(self) -> int:
        """Every row's pages to host memory (page-locked on CUDA), their pages given back;
        the bytes moved."""
        moved = 0
        for row in self.rows:
            if row.saved is None and row.pages:
                row.saved = self.pool.read(row.pages)
                self.pool.give(row.pages)
                moved += row.saved.numel()
                row.pages = []
        return moved

    def move_in(self) -> None:
        """The rows' caches back, bit for bit, in pages taken now (``KVMemoryError``: too
        few free; nothing taken then)."""
        out = [(r, r.saved) for r in self.rows if r.saved is not None]
        if not out:
            return
        pages = self.pool.take(sum(saved.shape[0] for _, saved in out))
        self.pool.write(pages, torch.cat([saved for _, saved in out]))
        at = 0
        for row, saved in out:
            row.pages, row.saved, at = pages[at:at + saved.shape[0]], None, at + saved.shape[0]
