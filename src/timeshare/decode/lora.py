"""LoRA adapters as the model that computes sees them: slots of a region of the arena,
each holding one adapter's low-rank factors for every projection it may adapt, and the
projections' outputs corrected per row by the adapter of that row's slot. Tensors only;
runs where the model's weights are (``decode/runner.py``). Which adapter is in which slot
is the controller's (``llm/adapters.py``).

# NOTE [Adapters in slots]
A language model served with adapters gets a region of the arena (NOTE [Regions of the
arena]) cut into ``slots``: for each of its adaptable projections (every ``nn.Linear`` of
its decoder layers: attention and MLP), a stack ``A`` of ``[slots, fan_in, rank]``, a
stack ``B`` of ``[slots, rank, fan_out]`` and a float32 ``scale`` per slot
(``LoraSpec.layout`` places them). Slot 0 is the base's: zeros, never written. An
adapter of a smaller rank fills the first columns of its slot and leaves the rest zero
(it adds nothing); a projection it does not adapt stays zero. A step carries each row's
slot; every adapted projection adds ``scale[s] * (x @ A[s]) @ B[s]`` to its output for
each row's ``s``, gathered per row and computed as two batched products (PEFT computes
``lora_B(lora_A(x)) * scaling``: the same terms), through a forward hook on the
projection, or called by the lean step (NOTE [Lean decode steps]), which calls no
module. A captured graph gathers by the slots in its input buffer, so a slot's new
contents need no new capture; with graphs the correction always runs (a base row reads
slot 0's zeros), without them a step whose rows are all the base's skips it. The base's
weights are never copied or changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from timeshare.errors import ConfigError

SCALE_DTYPE = torch.float32
ALIGN = 256  # each stack starts at a multiple of this many bytes


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """An adaptable projection: its module's name in the model and its dimensions."""

    name: str
    fan_in: int
    fan_out: int


@dataclass(frozen=True, slots=True)
class StackAt:
    """Where a projection's stacks are in the region: byte offsets of ``A``, ``B`` and its
    scales."""

    a: int
    b: int
    scale: int


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A model's adapter slots (NOTE [Adapters in slots]): the region of ``nbytes`` at
    ``offset`` in the arena, ``slots`` of them (slot 0 the base's), each of ``rank``
    columns at most, for ``targets``, in ``dtype``."""

    offset: int
    nbytes: int
    slots: int
    rank: int
    dtype: torch.dtype
    targets: tuple[LoraTarget, ...]

    @classmethod
    def of(cls, module: nn.Module, slots: int, rank: int, dtype: torch.dtype) -> LoraSpec:
        """The spec of ``module``'s adaptable projections, its region not yet placed (``at``)."""
        targets = adaptable(module)
        if not targets:
            raise ConfigError(f"{type(module).__name__} has no nn.Linear projections in its layers to adapt")
        if slots < 2 or rank < 1:
            raise ConfigError(f"adapter slots need at least one adapter's slot and a rank of 1, got {slots - 1} "
                              f"and {rank}")
        spec = cls(0, 0, slots, rank, dtype, targets)
        return spec.at(0, spec.layout()[1])

    def at(self, offset: int, nbytes: int) -> LoraSpec:
        return LoraSpec(offset, nbytes, self.slots, self.rank, self.dtype, self.targets)

    def layout(self) -> tuple[tuple[StackAt, ...], int]:
        """Each target's stacks' offsets in the region, and the region's bytes."""
        size, at, out = self.dtype.itemsize, 0, []
        for t in self.targets:
            a = _aligned(at)
            b = _aligned(a + self.slots * t.fan_in * self.rank * size)
            scale = _aligned(b + self.slots * self.rank * t.fan_out * size)
            at = scale + self.slots * SCALE_DTYPE.itemsize
            out.append(StackAt(a, b, scale))
        return tuple(out), _aligned(at)

    @property
    def slot_bytes(self) -> int:
        """What one slot holds, every projection's factors at full rank."""
        return sum((t.fan_in + t.fan_out) * self.rank for t in self.targets) * self.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def adaptable(module: nn.Module) -> tuple[LoraTarget, ...]:
    """The projections of ``module``'s decoder layers an adapter may adapt: each
    ``nn.Linear`` under a ``layers`` list (not the embeddings or the output layer)."""
    found = []
    for name, child in module.named_modules():
        if type(child) is nn.Linear and ".layers." in f".{name}":
            found.append(LoraTarget(name, child.in_features, child.out_features))
    return tuple(found)


class LoraStacks:
    """The slots' tensors in ``memory`` (the region's bytes): per target ``A``, ``B`` and
    ``scale``, views that never move while the region lives."""

    def __init__(self, spec: LoraSpec, memory: torch.Tensor):
        places, nbytes = spec.layout()
        if memory.dtype != torch.uint8 or memory.numel() < nbytes:
            raise ConfigError(f"adapter slots need {nbytes} bytes, got {memory.numel()}")
        self.spec = spec
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        self.scale: list[torch.Tensor] = []
        size, n, r = spec.dtype.itemsize, spec.slots, spec.rank
        for t, place in zip(spec.targets, places):
            self.a.append(memory[place.a:place.a + n * t.fan_in * r * size].view(spec.dtype).view(n, t.fan_in, r))
            self.b.append(memory[place.b:place.b + n * r * t.fan_out * size].view(spec.dtype).view(n, r, t.fan_out))
            self.scale.append(memory[place.scale:place.scale + n * SCALE_DTYPE.itemsize].view(SCALE_DTYPE))

    def clear(self, slot: int) -> None:
        for a, b, scale in zip(self.a, self.b, self.scale):
            a[slot].zero_()
            b[slot].zero_()
            scale[slot] = 0.0

    def write(self, slot: int, factors: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """Slot ``slot`` holds an adapter whose factors are, per target (None: not adapted),
        ``A`` as PEFT stores it (``[rank, fan_in]``), ``B`` (``[fan_out, rank]``) and its
        scale; the columns past its rank zero."""
        if not 0 < slot < self.spec.slots:
            raise ConfigError(f"adapter slot {slot} is not one of 1..{self.spec.slots - 1}")
        if len(factors) != len(self.a):
            raise ConfigError(f"an adapter of {len(factors)} projections for slots of {len(self.a)}")
        for i, got in enumerate(factors):
            a, b, scale = self.a[i][slot], self.b[i][slot], self.scale[i]
            if got is None:
                a.zero_()
                b.zero_()
                scale[slot] = 0.0
                continue
            down, up, s = got
            rank = down.shape[0]
            a[:, :rank].copy_(down.t())
            a[:, rank:].zero_()
            b[:rank].copy_(up.t())
            b[rank:].zero_()
            scale[slot] = s


class LoraLayers:
    """A model's projections corrected by the adapters of its rows' slots (NOTE [Adapters
    in slots]): ``use`` sets the rows' slots before a forward; the hooks it puts on the
    projections of the module it is ``attach``-ed to, or the lean step's calls of
    ``apply``, add each row's correction. ``always``: the correction runs even when every
    row is the base's (a graph is captured with it)."""

    def __init__(self, stacks: LoraStacks, rows: int, device: torch.device, always: bool = False):
        self.stacks, self.always = stacks, always
        self.index = torch.zeros(rows, dtype=torch.int64, device=device)  # each input row's slot
        self.active = always
        self._of: dict[int, int] = {}  # id(projection) -> its target's index
        self._hooks: list[Any] = []
        self._module: nn.Module | None = None

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
            self._hooks.append(proj.register_forward_hook(self._hook))
        self._module = module

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._of, self._module = [], {}, None

    def use(self, slots: Sequence[int], host: torch.Tensor | None = None) -> None:
        """The slots of the rows of the next forwards (the input rows past them: the
        base's). ``host``: a staging copy for the device (NOTE [No waiting on the device])."""
        self.active = self.always or any(slots)
        if not self.active:
            return
        values = torch.zeros(self.index.shape[0], dtype=torch.int64)
        values[:len(slots)] = torch.tensor(list(slots), dtype=torch.int64)
        if self.index.device.type == "cuda":
            values = values.pin_memory()
        self.index.copy_(values, non_blocking=True)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.active:
            return None
        return self.apply(module, args[0], output)

    def apply(self, proj: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``proj``'s output for ``x``, ``[rows, positions, fan_out]``) with each
        row's correction."""
        i = self._of[id(proj)]
        rows = x.shape[0]
        slots = self.index[:rows]
        s = self.stacks
        low = torch.bmm(x.reshape(rows, -1, x.shape[-1]), s.a[i][slots])
        delta = torch.bmm(low, s.b[i][slots]) * s.scale[i][slots].to(out.dtype)[:, None, None]
        return out + delta.view(out.shape)
