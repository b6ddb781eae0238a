"""LoRA adapters of a language model, the controller's side: adapters read from PEFT's
format into host memory, which adapter is in which slot of the model's adapter region
(NOTE [Adapters in slots] in ``decode/lora.py``), and the names a request may give. Runs
in the controller; the engine thread takes slots, the server's threads add and remove
adapters.

# NOTE [Adapter residency]
An adapter is a resident of the runtime as a model is, on a smaller scale. Added (at
start, by ``POST /v1/load_lora_adapter``, or by the resolver on its first request), it
is read once from its directory into host memory (page-locked on CUDA), checked against
the base (every tensor names one of the base's adaptable projections; shapes, rank at
most ``max_lora_rank``; PEFT's ``lora_alpha``, ``use_rslora``, ``rank_pattern`` and
``alpha_pattern``): a bad one is refused then, whole, with the reason. A sequence of an
adapter takes a slot at its prefill (``AdapterSlots.take``): its adapter's slot if it is
on the device, else a free one, else the least recently used slot that no running row
holds and no pin keeps; the adapter's factors are copied there before the step that
needs them (the base's weights untouched). Its rows hold the slot until they end. When
every slot is held by running rows, a sequence of another adapter waits at the head of
the queue while the sequences behind it that need no new slot are admitted. Removing an
adapter refuses its new requests at once; its slot goes when its last row ends. A
prefix cache entry is keyed by the adapter too (the same prompt under two adapters has
two caches). An adapter whose factors hold inf or NaN is refused: the slots' products
select each row's own slot, so another slot's numbers never reach a row, but its own
would. With ``max_cpu_loras`` (vLLM's), at most that many adapters keep their factors in
host memory: past it, the least recently requested one that is neither on the device nor
pinned lets its copy go; its name stays served. Its next request takes the copy back if
something still holds it (a request that took it, a slot), so that an adapter is never
two copies, else reads it from its directory again, off the event loop as the resolver
does (the server's request keeps the copy it got there), a new copy whose prefix cache
pages are its own. ``timeshare ps`` shows which adapter is in which slot; the metrics
count the slots, those holding an adapter, and the copies into them and their seconds
(``SlotsSnapshot``, in the engine's snapshot; on a cluster summed over the replicas).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from timeshare.decode.lora import LoraSpec, LoraStacks, LoraUse, SlotWrite, pack
from timeshare.errors import ConfigError, GenerationError, Unavailable, UnknownModelError
from timeshare.options import DEFAULT_MAX_LORAS

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
DEFAULT_MAX_RANK = 64
DEFAULT_SLOTS = DEFAULT_MAX_LORAS  # adapters on the device at once, unless max_loras says

_loads = itertools.count(1)

# A target's factors as a slot holds them (``decode.lora.pack``): A ([rank, fan_in]) and
# scale * B transposed ([rank, fan_out]).
Factors = tuple[torch.Tensor, torch.Tensor]


class AdapterSlotsFull(GenerationError):
    """Every adapter slot is held by a running row (or pinned): the sequence waits until a
    row lets one go, while others are admitted."""


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter as ``/v1/models`` and ``timeshare ps`` show it."""

    name: str
    parent: str
    path: str
    rank: int
    nbytes: int
    slot: int | None  # on the device in this slot; None: not on the device
    pinned: bool
    in_host: bool = True  # its factors in host memory; else read from ``path`` on its next request


class Adapter:
    """One adapter of a base, read (``read``): its factors per target of the base's
    adapter slots (None where it adapts nothing), in host memory."""

    def __init__(self, name: str, path: Path, rank: int, factors: list[Factors | None]):
        self.name, self.path, self.rank, self.factors = name, path, rank, factors
        self.targets = sum(1 << i for i, f in enumerate(factors) if f is not None)  # the projections it adapts
        self.key = f"{name}#{next(_loads)}".encode()  # NOTE [Prefix caching]: its pages apart from others'
        self.nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                          for a, b in (f for f in factors if f is not None))

    @classmethod
    def read(cls, name: str, path: str | Path, spec: LoraSpec, pin: bool = False) -> Adapter:
        """The PEFT LoRA adapter in directory ``path`` for slots ``spec`` (NOTE [Adapter
        residency]); ``ConfigError`` saying what is wrong with it."""
        where = f"adapter {name!r} ({path})"
        try:
            return cls._read(name, Path(path), spec, pin, where)
        except ConfigError:
            raise
        except (ValueError, TypeError, ArithmeticError, IndexError, re.error) as exc:  # a config or tensor of no sense
            raise ConfigError(f"{where} cannot be read: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _read(cls, name: str, path: Path, spec: LoraSpec, pin: bool, where: str) -> Adapter:
        config = _config(path, where)
        tensors = _tensors(path, where)
        targets = spec.targets  # made from the spec's tuples on each access: once here
        by_target = {t.name: i for i, t in enumerate(targets)}
        found: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            parsed = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight", key)
            if parsed is None:
                raise ConfigError(f"{where}: {key!r} is not a LoRA factor (only LoRA's A and B weights are served)")
            target = by_target.get(parsed.group(1))
            if target is None:
                raise ConfigError(f"{where}: {parsed.group(1)!r} is not one of the base's adaptable projections "
                                  "(the attention and MLP projections of its layers)")
            found.setdefault(target, {})[parsed.group(2)] = tensor
        if not found:
            raise ConfigError(f"{where}: {WEIGHTS} holds no LoRA factors")
        factors: list[Factors | None] = [None] * spec.count
        rank = 0
        for i, pair in found.items():
            t = targets[i]
            if set(pair) != {"A", "B"}:
                raise ConfigError(f"{where}: {t.name} has lora_{''.join(pair)} without its other factor")
            a, b = pair["A"], pair["B"]
            r = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != t.fan_in or b.shape != (t.fan_out, r):
                raise ConfigError(f"{where}: {t.name}'s factors are {tuple(a.shape)} and {tuple(b.shape)}, not "
                                  f"[rank, {t.fan_in}] and [{t.fan_out}, rank]: an adapter of another base?")
            if r > spec.rank:
                raise ConfigError(f"{where}: rank {r} of {t.name} exceeds max_lora_rank {spec.rank}")
            if not r or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ConfigError(f"{where}: {t.name}'s factors are empty or hold inf or NaN")
            alpha = _pattern(config.get("alpha_pattern") or {}, t.name, config.get("lora_alpha", 8))
            scale = float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)
            a, b = pack(a, b, scale, spec.dtype)  # NOTE [Adapters in slots]: the slot's image, once
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ConfigError(f"{where}: {t.name}'s factors overflow {spec.dtype} once scaled by {scale:g}")
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            factors[i] = (a, b)
            rank = max(rank, r)
        return cls(name, path, rank, factors)


def _config(path: Path, where: str) -> dict[str, Any]:
    file = path / CONFIG
    if not file.is_file():
        raise ConfigError(f"{where}: no {CONFIG} (an adapter directory in PEFT's format is needed)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {CONFIG} cannot be read ({exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{where}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    refused = [(k, config.get(k)) for k, fine in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"))
               if config.get(k, fine) not in (fine, None)]
    if config.get("modules_to_save"):
        refused.append(("modules_to_save", config["modules_to_save"]))
    if refused:
        raise ConfigError(f"{where}: {', '.join(f'{k}={v!r}' for k, v in refused)} is not served (plain LoRA only)")
    return config


def _tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS
    if not file.is_file():
        raise ConfigError(f"{where}: no {WEIGHTS}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {WEIGHTS} cannot be read ({exc})") from None


def _pattern(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern that ends ``name`` (a regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


@dataclass(frozen=True, slots=True)
class SlotsSnapshot:
    """A model's adapter slots for metrics: how many, how many hold an adapter, and the
    adapters copied into them so far and the seconds those copies took."""

    slots: int = 0
    on_device: int = 0
    loads: int = 0
    load_s: float = 0.0


class AdapterSlots:
    """Which adapter is in which slot of a model's adapter region (NOTE [Adapter
    residency]), the region's tensors seen from the controller (``stacks``)."""

    def __init__(self, stacks: LoraStacks, stream: bool | None = None):
        self.stacks = stacks
        # NOTE [Adapters streamed in]: a cold adapter written while its prefill runs (on
        # CUDA by default), or before the step (on the CPU by default).
        self.stream = stacks.device.type == "cuda" if stream is None else stream
        self.slots = stacks.spec.slots - 1  # slot 0 is the base's
        self._in: dict[int, Adapter] = {}  # slot -> the adapter there
        self._held: dict[int, int] = {}  # slot -> rows holding it
        self._recent: OrderedDict[int, None] = OrderedDict()  # slots, least recently taken first
        self._pinned: set[str] = set()
        self.loads = 0  # adapters copied to the device
        self.load_s = 0.0
        self._writes: dict[int, SlotWrite] = {}  # slots being written (NOTE [Adapters streamed in])
        self._removed: set[Adapter] = set()  # adapters removed while rows held their slots
        self._closed = False  # the region was given back: nothing is written any more
        self._lock = threading.Lock()

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return next((s for s, a in self._in.items() if a.name == name and a not in self._removed), None)

    def kept(self) -> set[str]:
        """The names of the adapters on the device or pinned: their host copies stay."""
        with self._lock:
            return {a.name for a in self._in.values() if a not in self._removed} | self._pinned

    def take(self, adapter: Adapter) -> int:
        """A slot holding ``adapter`` for a new row, loading it there if it is not on the
        device (``AdapterSlotsFull``: every slot is held or pinned)."""
        with self._lock:
            if self._closed:
                raise Unavailable("the model's adapter slots are closed")
            slot = next((s for s, a in self._in.items() if a is adapter), None)
            loading = slot is None
            if slot is None:
                slot = self._free()
                self._writes[slot] = SlotWrite(self.stacks, slot, adapter.factors)
                self.loads += 1
                self._in[slot] = adapter
            self._held[slot] = self._held.get(slot, 0) + 1
            self._recent.pop(slot, None)
            self._recent[slot] = None
        # NOTE [Adapters streamed in]: written while the prefill that takes it runs, or now,
        # before its step, on this thread (the table's readers do not wait for the copy).
        if loading and not self.stream:
            try:
                self.settle(slot)
            except BaseException:
                self.release(slot)
                raise
        return slot

    def writing(self, slot: int) -> SlotWrite | None:
        """The write of ``slot`` a prefill that took it is to wait for, if it is being written."""
        with self._lock:
            return self._writes.get(slot)

    def settle(self, slot: int) -> None:
        """The step that took ``slot`` ended: its write is finished whatever the step did
        (``GenerationError``: it could not be, and the slot holds no adapter now)."""
        with self._lock:
            write = self._writes.get(slot)
        if write is None:
            return
        try:
            write.finish()
        except GenerationError:
            if write.error is None:  # still being written (a writer stuck past the deadline):
                raise  # it stays registered, and the next row of its adapter waits for it
            self._written(slot, write, failed=True)
            raise
        self._written(slot, write, failed=False)

    def _written(self, slot: int, write: SlotWrite, failed: bool) -> None:
        """``slot``'s ``write`` ended (``failed``: the slot holds no adapter)."""
        with self._lock:
            if self._writes.get(slot) is write:
                del self._writes[slot]
                self.load_s += write.seconds
                if failed:
                    there = self._in.pop(slot, None)
                    self._recent.pop(slot, None)
                    if there is not None:  # removed while its rows held the slot: nothing is left to vacate, nor kept
                        self._removed.discard(there)

    def snapshot(self) -> SlotsSnapshot:
        with self._lock:
            held = sum(a not in self._removed for a in self._in.values())  # as slot_of sees them
            return SlotsSnapshot(self.slots, held, self.loads, self.load_s)

    def _free(self) -> int:
        for slot, write in list(self._writes.items()):  # a vacated slot's stuck write that has since ended
            if slot not in self._in and write.ended:
                del self._writes[slot]
                if not self._closed:
                    self.stacks.clear(slot)
        empty = next((s for s in range(1, self.slots + 1) if s not in self._in and s not in self._writes), None)
        if empty is not None:
            return empty
        for slot in self._recent:
            if not self._held.get(slot) and self._in[slot].name not in self._pinned and slot not in self._writes:
                del self._in[slot]
                self._recent.pop(slot)
                return slot
        raise AdapterSlotsFull(f"all {self.slots} adapter slots are held by running sequences or pinned")

    def use_of(self, slots: Sequence[int]) -> LoraUse | None:
        """What the adapters in ``slots`` use: their largest rank and the projections any
        adapts (None: no slot but the base's)."""
        with self._lock:
            held = [self._in[s] for s in set(slots) if s in self._in]
        if not held:
            return None
        targets = 0
        for adapter in held:
            targets |= adapter.targets
        return LoraUse(max(a.rank for a in held), targets)

    def release(self, slot: int) -> None:
        """A row holding ``slot`` ended."""
        if not slot:
            return
        with self._lock:
            left = self._held.get(slot, 0) - 1
            if left > 0:
                self._held[slot] = left
                return
            self._held.pop(slot, None)
            adapter = self._in.get(slot)
            if adapter is not None and adapter in self._removed:  # its adapter was removed meanwhile
                self._removed.discard(adapter)
                self._vacate(slot)

    def drop(self, name: str, keep: Adapter | None = None) -> None:
        """Adapter ``name`` was removed (or replaced by ``keep``): the slot of any other
        copy of it goes now, or when its last row lets it go."""
        with self._lock:
            for slot, there in list(self._in.items()):
                if there.name == name and there is not keep:
                    if self._held.get(slot):
                        self._removed.add(there)
                    else:
                        self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        del self._in[slot]
        self._recent.pop(slot, None)
        # A write still under way (stuck past its deadline) keeps the slot out of use: it is
        # neither cleared nor handed out (``_free``) until that write is settled.
        if not self._closed and slot not in self._writes:
            self.stacks.clear(slot)

    def close(self) -> None:
        """The region is about to be given back: no slot is written after this (a write
        under way ends first)."""
        with self._lock:
            self._closed = True
            writes = list(self._writes.values())
        for write in writes:
            with contextlib.suppress(GenerationError):
                write.finish()

    def pin(self, name: str, pinned: bool = True) -> None:
        with self._lock:
            (self._pinned.add if pinned else self._pinned.discard)(name)

    def pinned(self, name: str) -> bool:
        with self._lock:
            return name in self._pinned


@dataclass(frozen=True)
class KnownAdapter:
    """An adapter served, whether or not its factors are in host memory: where it is read
    from, and what it is (on a cluster, as the front end read it once to check it)."""

    path: Path
    rank: int
    nbytes: int

    @classmethod
    def of(cls, adapter: Adapter) -> KnownAdapter:
        return cls(adapter.path, adapter.rank, adapter.nbytes)


class Adapters:
    """The adapters of one base model ``parent`` (NOTE [Adapter residency]): by name,
    their slots, a directory ``resolve_dir`` where a name not added yet is looked for on
    its first request (None: no resolver), and at most ``max_host`` of them in host memory
    (None: no bound)."""

    def __init__(self, parent: str, spec: LoraSpec, slots: AdapterSlots, pin_host: bool = False,
                 resolve_dir: str | Path | None = None, max_host: int | None = None):
        if max_host is not None and max_host < spec.slots - 1:
            raise ConfigError(f"max_cpu_loras ({max_host}) must be at least max_loras ({spec.slots - 1}): an "
                              "adapter on the device keeps its host copy")
        self.parent, self.spec, self.slots = parent, spec, slots
        self.resolve_dir = Path(resolve_dir) if resolve_dir is not None else None
        self.max_host = max_host
        self.reads = 0  # adapters read from their directories (added, resolved, or read again)
        self._pin_host = pin_host
        self._known: dict[str, KnownAdapter] = {}  # every adapter served, by name
        self._held: dict[str, Adapter] = {}  # those in host memory, least recently requested first
        # Copies let go that something still holds (a slot, a request that took one): taken
        # back by the next request rather than read again, so one adapter is one copy.
        self._gone: weakref.WeakValueDictionary[str, Adapter] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def add(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False) -> Adapter:
        """Read and add adapter ``name`` (``ConfigError``: it cannot be served; a name taken
        by another adapter, unless ``replace``: the new one then serves the requests that
        come after, the old one's rows finish with it)."""
        check_name(self.parent, name)
        adapter = Adapter.read(name, path, self.spec, pin=self._pin_host)
        with self._lock:
            if name in self._known and not replace:
                raise ConfigError(f"adapter {name!r} is already loaded")
            replaced = name in self._known
            self._keep(adapter)
        if replaced:
            self.slots.drop(name, keep=adapter)
        if pinned:
            self.slots.pin(name)
        self._trim()
        return adapter

    def remove(self, name: str) -> None:
        with self._lock:
            known = self._known.pop(name, None)
            self._held.pop(name, None)
            self._gone.pop(name, None)
        if known is None:
            raise UnknownModelError(f"adapter {name!r} is not loaded")
        self.slots.pin(name, False)
        self.slots.drop(name)

    def get(self, name: str) -> Adapter:
        """Adapter ``name``: its host copy, read again from its directory if that copy was
        let go, or read from the resolver's directory on its first request
        (``UnknownModelError`` if there is none of that name)."""
        with self._lock:
            adapter = self._held.pop(name, None)
            revived = adapter is None and name in self._known
            if revived:
                adapter = self._gone.pop(name, None)  # let go, but still alive
            if adapter is not None:
                self._held[name] = adapter  # the most recently requested
            known = self._known.get(name)
        if adapter is not None:
            if revived:
                self._trim()
            return adapter
        if known is not None:  # its host copy was let go (NOTE [Adapter residency])
            adapter = Adapter.read(name, known.path, self.spec, pin=self._pin_host)
            with self._lock:
                raced = self._known.get(name) is not known  # removed, replaced or read again meanwhile
                if not raced:
                    self._keep(adapter)
            if raced:
                return self.get(name)
            self._trim()
            return adapter
        found = self.resolvable(name)
        if found is None:
            raise UnknownModelError(f"adapter {name!r} is not loaded")
        try:
            return self.add(name, found)
        except ConfigError:
            with self._lock:  # another request resolved it first
                resolved = name in self._known
            if not resolved:
                raise
            return self.get(name)

    def _keep(self, adapter: Adapter) -> None:
        """With the lock held: ``adapter`` served, in host memory, the most recently
        requested."""
        self._known[adapter.name] = KnownAdapter.of(adapter)
        self._held.pop(adapter.name, None)
        self._gone.pop(adapter.name, None)
        self._held[adapter.name] = adapter
        self.reads += 1

    def _trim(self) -> None:
        """At most ``max_host`` adapters in host memory: the least recently requested one
        not on the device and not pinned is let go, its name and directory kept (a request
        that took it already keeps its copy until it ends, and the next takes it back)."""
        if self.max_host is None:
            return
        kept = self.slots.kept()  # before this table's lock: the slots' lock is never taken inside it
        with self._lock:
            while len(self._held) > self.max_host:
                out = next((n for n in list(self._held)[:-1] if n not in kept), None)
                if out is None:
                    return  # the others are on the device or pinned: over the bound until the next add or read
                self._gone[out] = self._held.pop(out)

    def resolvable(self, name: str) -> Path | None:
        """The directory the resolver would read ``name`` from, if it has one."""
        return resolvable(self.resolve_dir, name)

    def serves(self, name: str) -> bool:
        """Whether adapter ``name`` is served (added, or read by the resolver)."""
        with self._lock:
            return name in self._known

    def infos(self) -> list[AdapterInfo]:
        with self._lock:
            known = [(name, k, name in self._held) for name, k in self._known.items()]
        return [AdapterInfo(name, self.parent, str(k.path), k.rank, k.nbytes, self.slots.slot_of(name),
                            self.slots.pinned(name), held) for name, k, held in known]


def check_name(parent: str, name: str) -> None:
    """That ``name`` may name an adapter of base ``parent`` (``ConfigError``: not)."""
    if not name or name == parent:
        raise ConfigError(f"an adapter's name must differ from its base's, got {name!r}")


def resolvable(resolve_dir: Path | None, name: str) -> Path | None:
    """The directory vLLM's resolver reads adapter ``name`` from in ``resolve_dir`` (a
    name, never a path), if there is an adapter there."""
    if resolve_dir is None or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        return None
    path = resolve_dir / name
    return path if (path / CONFIG).is_file() else None


def adapter_spec(config: Any, slots: int, rank: int, dtype: torch.dtype) -> LoraSpec:
    """The adapter slots of a model of ``config`` (its module made on the meta device: no
    memory), before its region is placed."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return LoraSpec.of(skeleton, slots + 1, rank, dtype)
