"""Page-locked host memory for the copies to the device. Runs in the process that owns
the copies: the in-process runtime's, or a worker process.

- ``HostStore``: one model's tensors packed once into one contiguous host buffer, in
  execution order, page-locked when the device is CUDA. Each tensor sits at an aligned
  offset; the arena copy of the model uses the *same* relative offsets, so any run of
  consecutive layers is one contiguous byte range and a layer group is moved with a
  single copy.
- ``HostPin``: one page-locked range, registered at its exact size and unregistered
  before its memory can go (NOTE [Exact host pinning] in timeshare/device.py).
- ``InputStaging``: a worker's page-locked buffer for its inputs (NOTE [Input staging]).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from timeshare.device import HostRegistrar
from timeshare.memory.allocator import DEFAULT_ALIGNMENT, align_up


def aligned_offsets(sizes: Sequence[int], alignment: int) -> tuple[list[int], int]:
    """Where consecutive blocks of ``sizes`` bytes go, each at an ``alignment``
    boundary, and the bytes they span (at least one ``alignment``: never an empty buffer)."""
    offsets: list[int] = []
    pos = 0
    for n in sizes:
        offsets.append(pos)
        pos = align_up(pos + n, alignment)
    return offsets, max(pos, alignment)


class HostPin:
    """``buffer``'s bytes, exactly, page-locked through ``registrar`` until ``release()``
    (NOTE [Exact host pinning]). It holds the buffer, so the memory cannot be freed while
    registered, and unregisters at the latest when it is collected (before the buffer
    it holds can go)."""

    def __init__(self, buffer: torch.Tensor, registrar: HostRegistrar):
        ptr = buffer.data_ptr()
        nbytes = buffer.numel() * buffer.element_size()
        registrar.register(ptr, nbytes)
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = buffer
        self._unregister = weakref.finalize(self, registrar.unregister, ptr)
        self._unregister.atexit = False  # at exit the memory goes with the process (and CUDA may be gone)

    def release(self) -> None:
        """Unregister (idempotent). The caller makes sure no copy still reads the range."""
        self._unregister()  # a finalizer runs once
        self._buffer = None
        self.nbytes = 0


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
        self._pin: HostPin | None = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @property
    def pinned_nbytes(self) -> int:
        """Bytes this store page-locked: exactly ``nbytes`` once pinned, 0 before and after."""
        return self._pin.nbytes if self._pin is not None else 0

    @property
    def pinned(self) -> bool:
        return self.pinned_nbytes > 0

    def pin(self, registrar: HostRegistrar) -> None:
        """Page-lock the buffer, exactly its bytes, until ``release()`` (a no-op if pinned)."""
        if self._pin is None:
            self._pin = HostPin(self.buffer, registrar)

    def release(self) -> None:
        """Unpin (idempotent); the store stays readable, in pageable memory. The caller
        makes sure no copy from it is still in flight (NOTE [Exact host pinning])."""
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.release()

    @classmethod
    def pack(
        cls,
        entries: Sequence[TensorEntry],
        tensors: dict[str, torch.Tensor],
        *,
        pin: bool = False,
        registrar: HostRegistrar | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        buffer: torch.Tensor | None = None,
    ) -> HostStore:
        """Lay ``tensors`` (by entry key) out in the order of ``entries`` and copy them in,
        into ``buffer`` when given (shared memory, say), else a new one of exactly the
        store's size. With ``pin``, the store's bytes are page-locked through ``registrar``."""
        if pin and registrar is None:
            raise ValueError("pin=True needs a registrar (timeshare.device.host_registrar)")
        store = cls.laid_out(entries, buffer, alignment)
        for e in store.entries:
            store.view(store.buffer, e).copy_(tensors[e.key].detach().to("cpu"))
        if pin:
            assert registrar is not None
            store.pin(registrar)
        return store

    @classmethod
    def laid_out(cls, entries: Sequence[TensorEntry], buffer: torch.Tensor | None = None,
                 alignment: int = DEFAULT_ALIGNMENT) -> HostStore:
        """A store of ``entries`` in that order, each at an aligned offset, over ``buffer``
        (a new one of exactly the store's size when None); nothing written."""
        offsets, total = aligned_offsets([e.nbytes for e in entries], alignment)
        placed = [replace(e, offset=offset) for e, offset in zip(entries, offsets)]
        if buffer is None:
            buffer = torch.empty(total, dtype=torch.uint8)  # NOTE [Exact host pinning]: not pin_memory=True
        elif buffer.numel() < total:
            raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than the store ({total})")
        else:
            buffer = buffer[:total]
        return cls(placed, buffer, alignment)

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


# NOTE [Input staging]
# With workers, inputs reach the worker as pickled host tensors in pageable memory, and
# leave the controller's device untouched (Runtime._to_device keeps them on the host).
# On CUDA the worker copies them, packed at aligned offsets, into one page-locked buffer
# of its own, and uploads each with a non-blocking copy on the current stream: the
# forward queued behind them waits on the device, not the host. The buffer is exact-sized
# (NOTE [Exact host pinning]), replaced by a larger one when an input set does not fit,
# and reused across calls. It must not be rewritten while a copy may still read it:
# after the uploads an event is recorded, and the next ``stage`` (or a growth, or the
# release) waits for it first. The worker also synchronizes the device at the end of
# every Run before it answers (worker/proc.py), so that wait normally returns at once;
# the event covers the paths that answer without it (a forward that raised, a profile
# answered from cache). A task's args and kwargs are staged in one call: a second call
# would overwrite the first one's bytes.
class Fence(Protocol):
    """Completes when the copies queued before it have finished (a CUDA event)."""

    def synchronize(self) -> None: ...


class InputStaging:
    """A worker's page-locked buffer for its inputs (NOTE [Input staging]); without a
    registrar (tests) the same logic runs on pageable memory."""

    def __init__(self, registrar: HostRegistrar | None, alignment: int = DEFAULT_ALIGNMENT):
        self.registrar = registrar
        self.alignment = alignment
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.staged_nbytes = 0  # bytes of the latest ``stage``
        self._pin: HostPin | None = None
        self._in_flight: Fence | None = None

    @property
    def pinned_nbytes(self) -> int:
        return self._pin.nbytes if self._pin is not None else 0

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` (strided, on the host) in the buffer, each at an aligned
        offset, with the strides ``t.to(device)`` would give them: views of the buffer,
        equal to the inputs, valid until the next call."""
        self.wait()
        self.staged_nbytes = sum(t.nbytes for t in tensors)
        if not tensors:
            return []
        offsets, total = aligned_offsets([t.nbytes for t in tensors], self.alignment)
        self._reserve(total)
        staged = []
        with torch.no_grad():  # the buffer must not join an input's autograd graph
            for t, offset in zip(tensors, offsets):
                region = self.buffer[offset : offset + t.nbytes].view(t.dtype)
                view = region.as_strided(t.shape, t.to("meta").stride())  # .to()'s own layout rule
                view.copy_(t)
                staged.append(view)
        return staged

    def upload(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``tensors`` on ``device``. On CUDA, staged and copied without blocking on the
        current stream; on the CPU, where the inputs already are, the tensors themselves."""
        if device.type != "cuda":
            return [t.to(device) for t in tensors]
        plain = [i for i, t in enumerate(tensors) if stageable(t)]
        out = list(tensors)
        for i, view in zip(plain, self.stage([tensors[i] for i in plain])):
            out[i] = view.to(device, non_blocking=True).requires_grad_(tensors[i].requires_grad)
        for i, t in enumerate(tensors):
            if out[i] is t:  # sparse, quantized...: PyTorch's own (blocking) upload
                out[i] = t.to(device)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self.mark_in_flight(done)
        return out

    def mark_in_flight(self, fence: Fence) -> None:
        """Copies read the buffer until ``fence`` completes: the next write waits for it."""
        self._in_flight = fence

    def wait(self) -> None:
        """Until no copy reads the buffer."""
        fence, self._in_flight = self._in_flight, None
        if fence is not None:
            fence.synchronize()

    def release(self) -> None:
        """Unpin and drop the buffer, once no copy reads it (idempotent)."""
        self.wait()
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.release()
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def _reserve(self, nbytes: int) -> None:
        """Keep the buffer if ``nbytes`` fit; else one of exactly ``nbytes`` replaces it."""
        if self.buffer.numel() >= nbytes:
            return
        self.release()
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.registrar is not None:
            self._pin = HostPin(self.buffer, self.registrar)


def stageable(t: torch.Tensor) -> bool:
    """A dense host tensor whose bytes can be copied as they are."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
