"""A module's tensors as data: which unique tensors it has, under which names, and
how to point every slot at new storage. Runs where the module lives.

Tied weights are one tensor object held in several slots; they get one entry (one
copy in memory) with all their names, and binding puts the same new tensor object in
every slot, so the tie survives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from timeshare.transfer.host_store import TensorEntry


@dataclass(frozen=True)
class Slot:
    """One place a tensor is held: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: nn.Module
    attr: str
    kind: str  # "parameter" | "buffer"
    key: str


@dataclass
class TensorLayout:
    """The unique tensors of a module (registration order) and every slot holding them."""

    entries: list[TensorEntry]
    slots: list[Slot]
    persistent: dict[str, bool]  # key -> appears in the state dict

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the slots hold right now, by key."""
        out: dict[str, torch.Tensor] = {}
        for s in self.slots:
            if s.key not in out:
                holder = s.module._parameters if s.kind == "parameter" else s.module._buffers
                t = holder[s.attr]
                assert t is not None, f"slot {s.key} is empty: collect skips empty slots and bind fills them"
                out[s.key] = t
        return out


def collect(module: nn.Module) -> TensorLayout:
    """Find every parameter and buffer of ``module``, merging tied ones."""
    key_of: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    first: dict[str, tuple[torch.Tensor, str, bool]] = {}
    slots: list[Slot] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        non_persistent: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for kind, holder in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for attr, t in holder.items():
                if t is None:
                    continue
                full = prefix + attr
                key = key_of.get(id(t))
                if key is None:
                    key = full
                    key_of[id(t)] = key
                    names[key] = []
                    persistent = kind == "parameter" or attr not in non_persistent
                    first[key] = (t, kind, persistent)
                if full not in names[key]:
                    names[key].append(full)
                slots.append(Slot(mod, attr, kind, key))
    entries = []
    persistent_of = {}
    for key, (t, kind, persistent) in first.items():
        entries.append(
            TensorEntry(
                key=key,
                names=tuple(names[key]),
                kind=kind,
                shape=tuple(t.shape),
                dtype=t.dtype,
                requires_grad=bool(getattr(t, "requires_grad", False)) and kind == "parameter",
            )
        )
        persistent_of[key] = persistent
    return TensorLayout(entries, slots, persistent_of)


def bind(layout: TensorLayout, tensors: dict[str, torch.Tensor]) -> dict[int, str]:
    """Point every slot at ``tensors[key]``; parameters are wrapped as ``nn.Parameter``.

    Returns ``id(bound object) -> key`` for tracing.
    """
    by_key = {e.key: e for e in layout.entries}
    made: dict[str, torch.Tensor] = {}
    for s in layout.slots:
        obj = made.get(s.key)
        if obj is None:
            t = tensors[s.key]
            if s.kind == "parameter":
                obj = nn.Parameter(t, requires_grad=by_key[s.key].requires_grad)
            else:
                obj = t
            made[s.key] = obj
        # Parameters (obj is the nn.Parameter made above) or buffers: two dict types under one name.
        holder: dict[str, Any] = s.module._parameters if s.kind == "parameter" else s.module._buffers
        holder[s.attr] = obj
    return {id(obj): key for key, obj in made.items()}


def bind_some(layout: TensorLayout, tensors: dict[str, torch.Tensor]) -> None:
    """Point the slots of the keys in ``tensors`` at them; the other slots stay as they are."""
    bind(TensorLayout([e for e in layout.entries if e.key in tensors],
                      [s for s in layout.slots if s.key in tensors], layout.persistent), tensors)


def unbind(layout: TensorLayout) -> None:
    """Point every slot at a meta tensor, so that a module that is no longer managed
    holds no memory and any use of it fails loudly (done on unregister and close;
    eviction keeps stale views, see NOTE [Sticky placement])."""
    bind(layout, {e.key: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in layout.entries})
