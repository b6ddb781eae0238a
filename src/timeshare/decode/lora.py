"""LoRA adapters as the model that computes sees them: slots of a region of the arena,
each holding one adapter's low-rank factors for every projection it may adapt, and the
projections' outputs corrected per row by the adapter of that row's slot. Tensors only;
runs where the model's weights are (``decode/runner.py``). Which adapter is in which slot
is the controller's (``llm/adapters.py``).

# NOTE [Adapters in slots]
A language model served with adapters gets a region of the arena (NOTE [Regions of the
arena]) cut into ``slots``: for each of its adaptable projections (every ``nn.Linear`` of
its decoder layers: attention and MLP), a stack ``A`` of ``[rank, slots - 1, fan_in]`` and
a stack ``B`` of ``[rank, slots - 1, fan_out]`` (``LoraSpec.layout`` places them), column
``s - 1`` slot ``s``'s. Slot 0 is the base's and has no column: a base row's correction is
zero (selected out, never multiplied by 0). An adapter's image is packed
once, when it is read (``pack``): ``A`` as PEFT stores it, ``B`` transposed with the
adapter's scale multiplied in, so that writing a slot is a copy and a product adds the
scaled term with no third operator. An adapter of a smaller rank fills its slot's first
ranks and leaves the rest zero (they add nothing); a projection it does not adapt stays
zero. Rank first, so that the first ``r`` ranks of every slot are one contiguous block and
writing a slot is ``rank`` contiguous runs. The stacks know how far each slot's earlier
writes reached, and a write zeroes past its rank only that far: writing a rank-16 adapter
on all seven projections into slots of the default rank 64 took 8.8-10.9 ms with every
rank past 16 zeroed, 2.7-3.5 ms so; one on ``q_proj`` and ``v_proj`` alone 6.8-7.9 and
0.7-1.1 ms (64M Llama, 2-core VM, ``bench/results/llm-cpu-epyc-2core-slot-writes.json``).
A step carries each row's slot and what its rows' adapters use (``LoraUse``: their
largest rank and the projections any adapts); every such projection adds
``(x @ A[s]) @ (scale * B[s])`` to its output, in place, for each row's ``s`` (PEFT
computes ``lora_B(lora_A(x)) * scaling``: the same terms, the scale rounded into ``B``
once), through a forward hook on the projection, or called by the lean step
(NOTE [Lean decode steps]), which calls no module. Without graphs (the CPU's steps) the
rows are grouped by slot (``group_rows``): every column from the first
used to the last, or the used ones alone, gathered, where they span more than
``SPAN_PER_USED`` times their number, multiplies its own rows (``per`` of them, padded
with row 0, whose products are dropped) by its factors in two batched products over
views of the stacks, and each row's correction is added to its own output: each used
factor is read once and multiplies only its rows. On the 2-core VM that halves the
stacked products' time (5.5 ms against 10.9 for a 64M Llama's step of 8 rows over 8
adapters, two threads): those multiply every row by every slot, 8x the multiply-adds,
and a product this skinny runs at 7 GB/s where a read runs at 20. Where graphs are
captured the rows' slots are read on the device and no shape may change: with up to
``STACKED_SLOTS`` slots the two products run over the used ranks of every slot at once,
each row's other slots selected out between them; with more, each row's factors are
gathered and multiplied in batches. When every row has the same adapter (a prefill, a
batch of one fine-tune) and no graph is captured, its own factors alone. On the CPU such
products, and stacked ones, this small run on the calling thread alone (``ONE_THREAD_MACS``): in a
server's process, whose teams sleep between parallel regions (NOTE [A core for the front
end]), a 64-token prefill's corrections took 14-16 ms more than the base's with the team,
5-6 without; in a worker, whose team spins, 19-39 ms with the team and 4-14 without while
another model took turns on that worker (evicted and loaded again), 2-7 and 7-9 alone
(2-core VM, six pairs each). Grouped products keep the team, which splits them by column
(in-process, 8 rows over 8 adapters decoded at 0.81x the base's rate on one thread, 0.87x
with it). The slots are read by the index in the runner's input buffer, so a captured
graph replays with new contents in a slot and needs no new capture; with graphs the
correction always runs at full rank on every projection (a base row's selected out),
without them a step whose rows are all the base's skips it. The base's weights are never
copied or changed.

What it costs on the 2-core VM (``bench llm --adapters 1,8,64``: a 64M Llama in float32,
rank 16 on all seven projections of every layer, 8 rows, 8 slots, steps as a server runs
them; ``bench/results/llm-cpu-epyc-2core-adapters*.json``, docs/results.md): one adapter
for every row decodes at 0.92-0.97x the base's rate in-process and 0.89-0.91x with
workers, 8 adapters mixed at 0.82-0.86x and 0.76-0.80x (0.73x and 0.66x while each row
was multiplied by every slot), 64 through the 8 slots at 0.81-0.83x and 0.75-0.83x
(PEFT's own mixed batch: 87-94 tokens/s where ours are 155-237). A step's factors for 8
adapters are 75 MB against the base projections' 255 MB. A prefill of an adapter pays
its products too (3.8 ms of a 64-token prompt's 64 ms of projections, measured alone),
and a cold adapter its copy (2.2 ms for 9 MiB, alone). On a GPU the products are launches in
a graph: not measured yet.

# NOTE [Adapters streamed in]
On CUDA a cold adapter is not copied before its prefill: its slot is written layer by
layer while the prefill runs, as a cold model's weights are (the pipelined loader).
Taking a slot (``AdapterSlots.take``) makes a ``SlotWrite``, which the prefill's step carries
(``Step.load``); each correction of target ``i`` first waits until the slot holds
targets ``0..i`` (``LoraLayers.use(..., ready=)``), and the step waits for the whole
slot before it ends, since the decode steps after it read every target. In-process
the write runs on a thread of its own from the step's start; on CUDA its copies run on
a stream of their own, a layer's event waited on by the correction's stream, so the
host waits only for the copy to be queued. With workers the controller, which owns the
slots, writes them once the step is sent, while the worker computes, and tells the
worker after each layer (``SlotReady`` on the pipe, each layer's copy synchronised
first on CUDA), before the step's late masks (NOTE [Masks while the device runs]: those
are then computed once the slot's last layer is told, which the forward cannot outrun); the
worker's ``SlotReader`` reads those messages as its corrections need them, and the rest
off the pipe if the step fails. Whatever became of the step, the engine then finishes
the write (``AdapterSlots.settle``): a step that failed before it began leaves the
whole copy to that, a worker that died mid-write has it taken up where it stopped (by
the step's run on its next home, or there), and a copy that fails fails its request
with the reason and leaves the slot holding no adapter, to be written whole by its next
request. ``slot_waits`` counts the corrections that waited.

On the CPU the slot is written before the step by default (``AdapterSlots.stream``;
the same ``SlotWrite``, finished at ``take``): there a copy takes the cores and the
memory bandwidth the prefill computes with, so it hides nothing. Measured on the 2-core
VM (a 64M Llama, 9 MiB adapters, 64-token prompts, 45 paired requests a side), a cold
adapter's first token less a warm one's: in-process 5.2-6.0 ms streamed against 4.2-6.5
before the step; with workers 5.8-7.1 against 2.8-4.9, the controller's writing slowed to
7-9 ms by the worker's prefill on the same cores. On a GPU the copy engine runs beside
the kernels: not measured yet.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from timeshare.errors import ConfigError, GenerationError

ALIGN = 256  # each stack starts at a multiple of this many bytes
STACKED_SLOTS = 16  # up to this many slots, corrections are products over whole stacks (NOTE [Adapters in slots])
# A correction of fewer multiply-adds than this (some 0.2 ms on one core) by one adapter's
# factors, or with graphs by every slot's, runs on the calling thread on the CPU: each of a team's operators waits for
# its slowest thread, woken from sleep in a server's process (a 64-token prefill's 84
# corrections took 31 ms on two threads and 14 ms on one, 2-core VM, in-process) or
# descheduled in a worker whose cores another process also wants (NOTE [Adapters in slots]).
ONE_THREAD_MACS = 1 << 22
# Without graphs, a step's rows are multiplied by the factors of the stacks' columns from
# its first slot's to its last one's, a view, unless they span more than this many times
# the columns its rows use: those are then gathered, a copy of each (read, written and
# read again) costing about three times its reading in place (NOTE [Adapters in slots]).
SPAN_PER_USED = 3
SLOT_WRITE_S = 60.0  # the longest a correction (or the step's end) waits for its cold adapter's targets


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """An adaptable projection: its module's name in the model and its dimensions."""

    name: str
    fan_in: int
    fan_out: int


@dataclass(frozen=True, slots=True)
class LoraUse:
    """What a step's adapters use: the largest rank of its rows' adapters, and the targets
    any of them adapts (bit ``i``: target ``i``). A step without graphs computes just these
    (NOTE [Adapters in slots])."""

    rank: int
    targets: int


@dataclass(frozen=True, slots=True)
class RowGroups:
    """A step's rows grouped by their slots (NOTE [Adapters in slots]), for a batched
    product over the stacks' columns: the ``lo:hi`` of ``span`` (a view), or those in
    ``columns`` (gathered); ``per`` product rows for each, the input row of each in
    ``entries`` (row 0 where a column has fewer: those products are dropped), those
    kept in ``keep`` (None: all), each added to the row in ``into``."""

    span: tuple[int, int] | None
    columns: torch.Tensor | None
    per: int
    entries: torch.Tensor
    keep: torch.Tensor | None
    into: torch.Tensor


def group_rows(slots: Sequence[int], device: torch.device) -> RowGroups | None:
    """The rows of ``slots`` (each row's slot, 0 the base's) grouped by column; None when
    every row is the base's."""
    by: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot:
            by.setdefault(slot - 1, []).append(row)
    if not by:
        return None
    used = sorted(by)
    lo, hi = used[0], used[-1] + 1
    spanned = hi - lo <= SPAN_PER_USED * len(used)
    columns = list(range(lo, hi)) if spanned else used
    per = max(len(rows) for rows in by.values())
    entries: list[int] = []
    keep: list[int] = []
    into: list[int] = []
    for column in columns:
        rows = by.get(column, [])
        for k in range(per):
            if k < len(rows):
                keep.append(len(entries))
                into.append(rows[k])
            entries.append(rows[k] if k < len(rows) else 0)
    every = len(keep) == len(entries)  # then each product is kept, added to the row it was of
    # One tensor (on CUDA one copy to the device), cut into the views the products read.
    parts = [entries, [] if spanned else columns, [] if every else keep, [] if every else into]
    whole = torch.tensor([i for part in parts for i in part], dtype=torch.int64, device=device)
    cut = whole.split([len(part) for part in parts])
    return RowGroups((lo, hi) if spanned else None, None if spanned else cut[1], per, cut[0],
                     None if every else cut[2], cut[0] if every else cut[3])


@dataclass(frozen=True, slots=True)
class StackAt:
    """Where a projection's stacks are in the region: byte offsets of ``A`` and ``B``."""

    a: int
    b: int


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A model's adapter slots (NOTE [Adapters in slots]): the region of ``nbytes`` at
    ``offset`` in the arena, ``slots`` of them (slot 0 the base's, which takes no room),
    each of ``rank`` columns at most, for ``targets``, in ``dtype``."""

    offset: int
    nbytes: int
    slots: int
    rank: int
    dtype: torch.dtype
    # The targets as plain tuples (name, fan_in, fan_out): the spec crosses to a worker with
    # every step, and tuples pickle some 15x faster than records (about 20 us against 290
    # for a 12-layer model's 84).
    projections: tuple[tuple[str, int, int], ...]

    @property
    def targets(self) -> tuple[LoraTarget, ...]:
        return tuple(LoraTarget(*p) for p in self.projections)

    @property
    def count(self) -> int:
        """How many targets."""
        return len(self.projections)

    @classmethod
    def of(cls, module: nn.Module, slots: int, rank: int, dtype: torch.dtype) -> LoraSpec:
        """The spec of ``module``'s adaptable projections, its region not yet placed (``at``)."""
        targets = adaptable(module)
        if not targets:
            raise ConfigError(f"{type(module).__name__} has no nn.Linear projections in its layers to adapt")
        if slots < 2 or rank < 1:
            raise ConfigError(f"adapter slots need at least one adapter's slot and a rank of 1, got {slots - 1} "
                              f"and {rank}")
        spec = cls(0, 0, slots, rank, dtype, tuple((t.name, t.fan_in, t.fan_out) for t in targets))
        return spec.at(0, spec.layout()[1])

    def at(self, offset: int, nbytes: int) -> LoraSpec:
        return LoraSpec(offset, nbytes, self.slots, self.rank, self.dtype, self.projections)

    def layout(self) -> tuple[tuple[StackAt, ...], int]:
        """Each target's stacks' offsets in the region (columns for slots 1 on), and the
        region's bytes."""
        size, at, out, n = self.dtype.itemsize, 0, [], self.slots - 1
        for t in self.targets:
            a = _aligned(at)
            b = _aligned(a + n * t.fan_in * self.rank * size)
            at = b + n * self.rank * t.fan_out * size
            out.append(StackAt(a, b))
        return tuple(out), _aligned(at)

    @property
    def slot_bytes(self) -> int:
        """What one slot holds, every projection's factors at full rank."""
        return sum((t.fan_in + t.fan_out) * self.rank for t in self.targets) * self.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(down: torch.Tensor, up: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's factors as PEFT stores them (``A`` ``[rank, fan_in]``, ``B``
    ``[fan_out, rank]``) and its scale, as a slot holds them: ``A``, and ``scale * B``
    transposed (``[rank, fan_out]``), contiguous in ``dtype`` (NOTE [Adapters in slots])."""
    wide = torch.promote_types(dtype, torch.float32)  # the product rounded once, to ``dtype``
    return down.to(dtype).contiguous(), (up.t().to(wide) * scale).to(dtype).contiguous()


def adaptable(module: nn.Module) -> tuple[LoraTarget, ...]:
    """The projections of ``module``'s decoder layers an adapter may adapt: each
    ``nn.Linear`` under a ``layers`` list (not the embeddings or the output layer)."""
    found = []
    for name, child in module.named_modules():
        if type(child) is nn.Linear and ".layers." in f".{name}":
            found.append(LoraTarget(name, child.in_features, child.out_features))
    return tuple(found)


class LoraStacks:
    """The slots' tensors in ``memory`` (the region's bytes): per target ``A`` and ``B``,
    views that never move while the region lives; column ``s - 1`` is slot ``s``'s."""

    def __init__(self, spec: LoraSpec, memory: torch.Tensor):
        places, nbytes = spec.layout()
        if memory.dtype != torch.uint8 or memory.numel() < nbytes:
            raise ConfigError(f"adapter slots need {nbytes} bytes, got {memory.numel()}")
        self.spec, self.device = spec, memory.device
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        size, n, r = spec.dtype.itemsize, spec.slots - 1, spec.rank
        for t, place in zip(spec.targets, places):
            self.a.append(memory[place.a:place.a + n * t.fan_in * r * size].view(spec.dtype).view(r, n, t.fan_in))
            self.b.append(memory[place.b:place.b + n * r * t.fan_out * size].view(spec.dtype).view(r, n, t.fan_out))
        # On the CPU the stacks as numpy's words too, made at the first write (a runner's
        # stacks are only read): a slot's write is numpy's slices and copies alone (``_bytes``).
        self._words: list[tuple[Any, Any]] | None = None
        # Per slot and target, how many leading ranks may hold other than zeros: a write
        # zeroes past its own rank only up to there (a rank-8 adapter in slots of rank 64
        # copies its 8 ranks, not 8 and 56 of zeros). Unknown until written: all of them.
        self._extent = [[r] * len(self.a) for _ in range(spec.slots)]

    def clear(self, slot: int) -> None:
        if not 0 < slot < self.spec.slots:
            raise ConfigError(f"adapter slot {slot} is not one of 1..{self.spec.slots - 1}")
        for i in range(len(self.a)):
            self.write_target(slot, i, None)

    def check(self, slot: int, image: Sequence[object]) -> None:
        """That ``image`` (an adapter's, per target) may be written to slot ``slot``."""
        if not 0 < slot < self.spec.slots:
            raise ConfigError(f"adapter slot {slot} is not one of 1..{self.spec.slots - 1}")
        if len(image) != len(self.a):
            raise ConfigError(f"an adapter of {len(image)} projections for slots of {len(self.a)}")

    def write_target(self, slot: int, i: int, got: tuple[torch.Tensor, torch.Tensor] | None,
                     non_blocking: bool = False) -> None:
        """Target ``i`` of slot ``slot`` holds an adapter's image of it (``pack``: ``A``
        ``[rank, fan_in]`` and ``scale * B`` transposed ``[rank, fan_out]``), the columns
        past its rank zero; None: zeros (a target it does not adapt)."""
        rank = 0 if got is None else got[0].shape[0]
        was = self._extent[slot][i]
        self._extent[slot][i] = max(was, rank)  # what a copy cut short may leave
        if self.device.type == "cpu" and (got is None or all(t.device.type == "cpu" and t.dtype == self.spec.dtype
                                                             for t in got)):
            if self._words is None:
                self._words = [(_bytes(a), _bytes(b)) for a, b in zip(self.a, self.b)]
            wa, wb = self._words[i]
            for words, source in zip((wa[:, slot - 1], wb[:, slot - 1]), got or (None, None)):
                if source is not None and rank:
                    numpy.copyto(words[:rank], _bytes(source))
                if rank < was:
                    words[rank:was].fill(0)
        else:
            for stack, source in zip((self.a[i][:, slot - 1], self.b[i][:, slot - 1]), got or (None, None)):
                if source is not None:  # CUDA, or a conversion
                    stack[:rank].copy_(source, non_blocking=non_blocking)
                if rank < was:
                    stack[rank:was].zero_()
        self._extent[slot][i] = rank  # written whole: its rank is all it reaches now


# On the CPU a slot is written by numpy, as words of the item's size (numpy has no
# bfloat16), through views of the stacks made once: torch's copy of a large tensor runs an
# OpenMP parallel region, and a write on a thread of its own would start a second team
# beside the prefill's (NOTE [A core for the front end]); torch's slicing per copy cost
# more than the copying (9 MiB in 3.4 ms against 2.2, 2-core VM).
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(t: torch.Tensor) -> Any:
    return t.view(_WORDS[t.element_size()]).numpy()


def layer_ends(spec: LoraSpec) -> tuple[int, ...]:
    """Where each decoder layer's targets end in ``spec``'s order (a cold adapter is
    written layer by layer: NOTE [Adapters streamed in])."""
    layers = [re.search(r"\.layers\.(\d+)\.", f".{name}.") for name, _, _ in spec.projections]
    keys = [m.group(1) if m else name for m, (name, _, _) in zip(layers, spec.projections)]
    return tuple(i + 1 for i in range(len(keys)) if i + 1 == len(keys) or keys[i + 1] != keys[i])


def layers_holding(ends: Sequence[int], written: int) -> int:
    """How many of the layers that end at ``ends`` (``layer_ends``) hold the first
    ``written`` targets."""
    return bisect.bisect_left(ends, written) + 1 if written > 0 else 0


class SlotWrite:
    """A cold adapter's image going into slot ``slot`` of ``stacks``, layer by layer, while
    the prefill that needs it runs (NOTE [Adapters streamed in]); made by the controller,
    which owns the slots. ``written``: how many targets are in place. One writer at a
    time; a write cut short (its writer's ``told`` raised: the worker it told died) is
    taken up where it stopped by the next ``run``."""

    def __init__(self, stacks: LoraStacks, slot: int, image: Sequence[tuple[torch.Tensor, torch.Tensor] | None]):
        stacks.check(slot, image)
        self.stacks, self.slot, self.image = stacks, slot, tuple(image)
        self.count = len(self.image)
        self.ends = layer_ends(stacks.spec)
        self.written = 0
        self.seconds = 0.0  # the copies' own time
        self.error: BaseException | None = None  # a copy that failed: the slot holds no adapter
        self._started = False
        self._cv = threading.Condition()
        self._writer = threading.Lock()
        device = stacks.device
        # On CUDA the copies run on a stream of their own, each layer's followed by an
        # event that a correction's stream waits on: the host never waits for a copy.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._stream is not None:  # after what was queued before it: a clear of the slot
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._events: list[Any] = []

    @property
    def done(self) -> bool:
        return self.written == self.count and self.error is None

    @property
    def ended(self) -> bool:
        """No writer is at it, and it is written whole or failed."""
        return not self._writer.locked() and (self.done or self.error is not None)

    def start(self) -> None:
        """Begin writing on a thread of its own (in the process that runs the step)."""
        with self._cv:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run_quietly, name=f"adapter-slot-{self.slot}", daemon=True).start()

    def _run_quietly(self) -> None:
        with contextlib.suppress(Exception):  # kept in ``error``: the step's waits raise it
            self.run()

    def run(self, told: Callable[[int], None] | None = None, timeout_s: float = SLOT_WRITE_S) -> None:
        """Write what is not written yet, on this thread, calling ``told(written)`` first
        with what is already written and then after each layer; with ``told`` each
        layer's copy is synchronised before it is told (another process reads it)."""
        if not self._writer.acquire(timeout=timeout_s):
            raise GenerationError(f"adapter slot {self.slot}: another write held it for {timeout_s:g} s")
        try:
            if self.error is not None:
                raise GenerationError(f"adapter slot {self.slot} could not be written: {self.error}")
            if told is not None and self.written:
                told(self.written)
            for end in self.ends:
                if end > self.written:
                    self._layer_to(end, sync=told is not None)
                    if told is not None:
                        told(end)
            if self._stream is not None:
                try:
                    self._stream.synchronize()  # done means on the device
                except BaseException as exc:
                    self._failed(exc)
                    raise
        finally:
            self._writer.release()

    def _failed(self, exc: BaseException) -> None:
        """A copy failed: the waits raise it, and the slot holds no adapter."""
        with self._cv:
            self.error = exc
            self._cv.notify_all()

    def _layer_to(self, end: int, sync: bool) -> None:
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                for i in range(self.written, end):
                    self.stacks.write_target(self.slot, i, self.image[i], non_blocking=self._stream is not None)
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    if sync:
                        event.synchronize()
                    self._events.append(event)
        except BaseException as exc:
            if self._stream is not None:  # the copies queued before it end first: the slot's extents count them
                with contextlib.suppress(Exception):
                    self._stream.synchronize()
            self._failed(exc)
            raise
        finally:
            self.seconds += time.perf_counter() - t0
        with self._cv:
            self.written = end
            self._cv.notify_all()

    def wait(self, written: int, timeout_s: float = SLOT_WRITE_S) -> bool:
        """Until the first ``written`` targets are in place (on CUDA: for the current
        stream, which waits on their layer's copy); whether it had to wait."""
        with self._cv:
            waited = self.written < written and self.error is None
            if not self._cv.wait_for(lambda: self.written >= written or self.error is not None, timeout_s):
                raise GenerationError(f"adapter slot {self.slot}: its targets to {written} were not written "
                                      f"within {timeout_s:g} s")
            if self.written < written:
                raise GenerationError(f"adapter slot {self.slot} could not be written: {self.error}")
            events = self._events[:layers_holding(self.ends, written)]
        if events:
            torch.cuda.current_stream().wait_event(events[-1])
        return waited

    def finish(self, timeout_s: float = SLOT_WRITE_S) -> None:
        """Written whole and on the device, whatever became of the step (``GenerationError``:
        a copy failed, and the slot holds no adapter)."""
        try:
            self.run(timeout_s=timeout_s)
        except GenerationError:
            raise
        except Exception as exc:
            raise GenerationError(f"adapter slot {self.slot} could not be written: {exc}") from exc


class LoraLayers:
    """A model's projections corrected by the adapters of its rows' slots (NOTE [Adapters
    in slots]): ``use`` sets the rows' slots before a forward; the hooks it puts on the
    projections of the module it is ``attach``-ed to, or the lean step's calls of
    ``apply``, add each row's correction. ``always``: the correction runs even when every
    row is the base's (a graph is captured with it)."""

    def __init__(self, stacks: LoraStacks, rows: int, device: torch.device, always: bool = False):
        self.stacks, self.always = stacks, always
        spec = stacks.spec
        self.index = torch.zeros(rows, dtype=torch.int64, device=device)  # each input row's slot
        self._slot_ids = torch.arange(1, spec.slots, device=device)  # the stacks' columns' slots
        # Made from the index by ``use``, before the forwards that read them (a graph's too):
        # each row's one of the columns (none for the base's), each row's column, whether
        # a row has an adapter.
        self._mine = torch.zeros(rows, 1, 1, spec.slots - 1, dtype=torch.bool, device=device)
        self._column = torch.zeros(rows, dtype=torch.int64, device=device)
        self._adapted = torch.zeros(rows, 1, 1, dtype=torch.bool, device=device)
        self._rank, self._targets = spec.rank, (1 << spec.count) - 1  # what ``use`` says is used
        self._one: int | None = None  # the one slot of every row, when they share it (no graphs)
        self._groups: RowGroups | None = None  # the rows by slot, without graphs (NOTE [Adapters in slots])
        self.active = always
        self._of: dict[int, int] = {}  # id(projection) -> its target's index
        self._hooks: list[Any] = []
        self._module: nn.Module | None = None
        self._stacked = spec.slots - 1 < STACKED_SLOTS  # which buffers ``use`` makes: NOTE [Adapters in slots]
        self._cpu = device.type == "cpu"  # small products may leave the team
        self._ready: Callable[[int], bool] | None = None  # NOTE [Adapters streamed in]
        self.waits = 0  # corrections that waited for their cold slot's targets

    def attach(self, module: nn.Module) -> None:
        """Hook ``module``'s projections (once per module object)."""
        if module is self._module:
            return
        self.detach()
        named = dict(module.named_modules())
        for i, target in enumerate(self.stacks.spec.targets):
            proj = named.get(target.name)
            if type(proj) is not nn.Linear or (proj.in_features, proj.out_features) != (target.fan_in,
                                                                                         target.fan_out):
                raise ConfigError(f"the model's {target.name} is not the projection its adapter slots were made for")
            self._of[id(proj)] = i
            self._hooks.append(proj.register_forward_hook(self._hook(i)))
        self._module = module

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._of, self._module = [], {}, None

    def use(self, slots: Sequence[int], used: LoraUse | None = None,
            ready: Callable[[int], bool] | None = None) -> None:
        """The slots of the rows of the next forwards (the input rows past them: the
        base's), and what their adapters use (None: every target at full rank; with
        graphs always so); ``ready(n)``: waits until a cold slot's first ``n`` targets
        are written, and says whether it waited (NOTE [Adapters streamed in])."""
        self._ready, self._groups = ready, None
        self.active = self.always or any(slots)
        if not self.active:
            return
        spec = self.stacks.spec
        if used is None or self.always:
            self._rank, self._targets = spec.rank, (1 << spec.count) - 1
        else:
            self._rank, self._targets = min(max(used.rank, 1), spec.rank), used.targets
        # Every row of one adapter (a prefill, a batch of one fine-tune): its own factors alone.
        self._one = slots[0] if not self.always and slots and all(s == slots[0] for s in slots) else None
        if self._one is not None:
            return  # its factors alone: no row's column is read
        if not self.always:  # no graph reads the index: the rows grouped by slot instead
            self._groups = group_rows(slots, self.index.device)
            return
        values = torch.zeros(self.index.shape[0], dtype=torch.int64)
        values[:len(slots)] = torch.tensor(list(slots), dtype=torch.int64)
        if self.index.device.type == "cuda":
            values = values.pin_memory()
        self.index.copy_(values, non_blocking=True)
        if self._stacked:
            self._mine.copy_((self._slot_ids[None, :] == self.index[:, None])[:, None, None, :])
        else:
            self._column.copy_((self.index - 1).clamp(min=0))
            self._adapted.copy_((self.index > 0)[:, None, None])

    def _hook(self, i: int) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor | None]:
        """Target ``i``'s forward hook (its index bound here: a compiled step traces no
        lookup)."""
        bit = 1 << i

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            return self._corrected(i, args[0], output) if self.active and self._targets & bit else None

        return hook

    def apply(self, proj: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``proj``'s output for ``x``, ``[rows, positions, fan_out]``) with each
        row's correction (the lean step's call: NOTE [Lean decode steps])."""
        i = self._of[id(proj)]
        return self._corrected(i, x, out) if self._targets >> i & 1 else out

    def _corrected(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` with each row's correction added in place (a contiguous copy of it if it
        is not contiguous)."""
        if self._ready is not None and self._ready(i + 1):  # NOTE [Adapters streamed in]
            self.waits += 1
        a = self.stacks.a[i]
        rank, fan_in, n = self._rank, a.shape[2], a.shape[1]  # the ranks past ``rank`` are every slot's zeros
        if not out.is_contiguous():
            out = out.contiguous()
        # Sizes are looked at only outside a compiled step: a comparison there would guard
        # its trace on the rows (NOTE [Compiled decode steps]: one trace for every bucket).
        # Grouped products keep the team: it splits them by column (NOTE [Adapters in slots]).
        if self._groups is not None or not self._cpu or torch.compiler.is_compiling() \
                or torch.get_num_threads() == 1 \
                or x.numel() // fan_in * rank * (fan_in + out.shape[-1]) * (n if self._one is None else 1) \
                >= ONE_THREAD_MACS:
            self._add(i, x, out)
            return out
        threads = torch.get_num_threads()  # NOTE [Adapters in slots]: small products on this thread
        torch.set_num_threads(1)
        try:
            self._add(i, x, out)
        finally:
            torch.set_num_threads(threads)
        return out

    def _add(self, i: int, x: torch.Tensor, out: torch.Tensor) -> None:
        a, b = self.stacks.a[i], self.stacks.b[i]
        rank, n, fan_in, fan_out = self._rank, a.shape[1], a.shape[2], out.shape[-1]
        rows = x.shape[0]
        flat = out.view(-1, fan_out)
        if self._one is not None:  # one adapter for every row (padding rows too: their outputs go nowhere)
            column = self._one - 1
            flat.addmm_(F.linear(x.reshape(-1, fan_in), a[:rank, column]), b[:rank, column])
        elif self._groups is not None:  # NOTE [Adapters in slots]: each column's rows by its factors, in place
            g = self._groups
            if g.span is not None:
                a, b = a[:rank, g.span[0]:g.span[1]], b[:rank, g.span[0]:g.span[1]]
            else:
                assert g.columns is not None
                a, b = a[:rank].index_select(1, g.columns), b[:rank].index_select(1, g.columns)
            positions = x.numel() // (rows * fan_in)
            grouped = x.reshape(rows, positions, fan_in).index_select(0, g.entries)
            low = torch.bmm(grouped.view(a.shape[1], -1, fan_in), a.permute(1, 2, 0))
            got = torch.bmm(low, b.permute(1, 0, 2)).view(-1, positions, fan_out)
            if g.keep is not None:
                got = got.index_select(0, g.keep)
            out.view(rows, positions, fan_out).index_add_(0, g.into, got)
        elif self._stacked:  # NOTE [Adapters in slots]: over whole stacks, each row its own slot's columns
            # Selected, not multiplied by 0/1: another slot's overflow (inf) stays out of this row.
            low = F.linear(x.reshape(rows, -1, fan_in), a[:rank].view(rank * n, fan_in)).view(rows, -1, rank, n)
            low = torch.where(self._mine[:rows], low, 0.0)
            flat.addmm_(low.view(-1, rank * n), b[:rank].view(rank * n, fan_out))
        else:
            columns = self._column[:rows]
            low = torch.bmm(x.reshape(rows, -1, fan_in), a[:rank, columns].permute(1, 2, 0))
            low = torch.where(self._adapted[:rows], low, 0.0)
            out.view(rows, -1, fan_out).baddbmm_(low, b[:rank, columns].permute(1, 0, 2))
