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
writing a slot is ``rank`` contiguous runs. A step carries each row's slot and what its
rows' adapters use (``LoraUse``: their largest rank and the projections any adapts);
every such projection adds ``(x @ A[s]) @ (scale * B[s])`` to its output, in place, for
each row's ``s`` (PEFT computes ``lora_B(lora_A(x)) * scaling``: the same terms, the
scale rounded into ``B`` once), through a forward hook on the projection, or called by
the lean step (NOTE [Lean decode steps]), which calls no module. With up to
``STACKED_SLOTS`` slots the two products run over the used ranks of every slot at once,
each row's other slots zeroed between them: two plain matrix products, where gathering
each row's factors copies them; with more slots each row's factors are gathered and
multiplied in batches; when every row has the same adapter (a prefill, a batch of one
fine-tune) and no graph is captured, its own factors alone. On the CPU, in a process whose
teams sleep between parallel regions (a server's own: NOTE [A core for the front end]),
products this small run on the calling thread alone (``ONE_THREAD_MACS``): a team's
wake-up costs more than it saves; a worker's team spins, and keeps them. The slots are
read by the index in the runner's input buffer, so a captured graph replays with new
contents in a slot and needs no new capture; with graphs the correction always runs at
full rank on every projection (a base row's selected out), without them a step whose
rows are all the base's skips it. The base's weights are never copied or changed.

What it costs on the 2-core VM (``bench llm --adapters 1,8,64``: a 64M Llama in float32,
rank 16 on all seven projections of every layer, 8 rows, 8 slots, steps as a server runs
them; ``bench/results/llm-cpu-epyc-2core-adapters.json``): one adapter for every row
decodes at 0.82-0.92x the base's rate, 8 adapters mixed at 0.74x in-process and 0.64-0.68x
with workers, 64 through the 8 slots at 0.67-0.79x (PEFT's own mixed batch: 77 tokens/s
where ours are 119-169). The products read every used slot's factors and are bound by
memory here: 75 MB a step for 8 adapters against the base projections' 255 MB (so 0.78x
at best, at the base's bandwidth), 13 ms against 31 on one core (0.70x); fewer slots are
cheaper. A
prefill of an adapter pays its products too (6.5 ms of a 64-token prompt's 67 ms of
projections), and a cold adapter its copy (2.5 ms for 9 MiB). On a GPU the products are
launches in a graph: not measured yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from timeshare.device import teams_sleep
from timeshare.errors import ConfigError

ALIGN = 256  # each stack starts at a multiple of this many bytes
STACKED_SLOTS = 16  # up to this many slots, corrections are products over whole stacks (NOTE [Adapters in slots])
# A correction of fewer multiply-adds than this (some 0.2 ms on one core) runs on one
# thread on the CPU where teams sleep (``device.teams_sleep``): with a team, each of its
# operators paid a wake-up, and a 64-token prefill's 84 corrections took 31 ms on two
# threads and 14 ms on one (2-core VM, in-process).
ONE_THREAD_MACS = 1 << 22


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
        self.spec = spec
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        size, n, r = spec.dtype.itemsize, spec.slots - 1, spec.rank
        for t, place in zip(spec.targets, places):
            self.a.append(memory[place.a:place.a + n * t.fan_in * r * size].view(spec.dtype).view(r, n, t.fan_in))
            self.b.append(memory[place.b:place.b + n * r * t.fan_out * size].view(spec.dtype).view(r, n, t.fan_out))

    def clear(self, slot: int) -> None:
        if not 0 < slot < self.spec.slots:
            raise ConfigError(f"adapter slot {slot} is not one of 1..{self.spec.slots - 1}")
        for a, b in zip(self.a, self.b):
            a[:, slot - 1].zero_()
            b[:, slot - 1].zero_()

    def write(self, slot: int, image: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` holds an adapter whose image (``pack``) is, per target (None: not
        adapted), ``A`` (``[rank, fan_in]``) and ``scale * B`` transposed (``[rank,
        fan_out]``); the columns past its rank zero."""
        if not 0 < slot < self.spec.slots:
            raise ConfigError(f"adapter slot {slot} is not one of 1..{self.spec.slots - 1}")
        if len(image) != len(self.a):
            raise ConfigError(f"an adapter of {len(image)} projections for slots of {len(self.a)}")
        for i, got in enumerate(image):
            a, b = self.a[i][:, slot - 1], self.b[i][:, slot - 1]
            if got is None:
                a.zero_()
                b.zero_()
                continue
            down, up = got
            rank = down.shape[0]
            a[:rank].copy_(down)
            a[rank:].zero_()
            b[:rank].copy_(up)
            b[rank:].zero_()


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
        self.active = always
        self._of: dict[int, int] = {}  # id(projection) -> its target's index
        self._hooks: list[Any] = []
        self._module: nn.Module | None = None
        self._stacked = spec.slots - 1 < STACKED_SLOTS  # which buffers ``use`` makes: NOTE [Adapters in slots]
        self._teams_sleep = device.type == "cpu" and teams_sleep()  # small products may leave the team

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

    def use(self, slots: Sequence[int], used: LoraUse | None = None) -> None:
        """The slots of the rows of the next forwards (the input rows past them: the
        base's), and what their adapters use (None: every target at full rank; with
        graphs always so)."""
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
        a = self.stacks.a[i]
        rank, fan_in, n = self._rank, a.shape[2], a.shape[1]  # the ranks past ``rank`` are every slot's zeros
        if not out.is_contiguous():
            out = out.contiguous()
        # Sizes are looked at only outside a compiled step: a comparison there would guard
        # its trace on the rows (NOTE [Compiled decode steps]: one trace for every bucket).
        if not self._teams_sleep or torch.compiler.is_compiling() or torch.get_num_threads() == 1 \
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
