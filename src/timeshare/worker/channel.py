"""A worker's tensor channel (NOTE [Tensor channel]): the shared-memory buffer through which
a call's tensors go to a worker process and come back, and the encoding of a nested
structure of tensors as ``TensorRef`` descriptors into it. Runs in both processes: the
controller's :class:`~timeshare.executor.handle.WorkerHandle` creates and grows a worker's
channel, writes the inputs and copies the outputs out; the worker
(:mod:`timeshare.worker.proc`) maps it, computes from the inputs where they lie (on CUDA
it page-locks the channel and uploads from it) and writes its outputs after them.
"""

from __future__ import annotations

import copyreg
import io
import logging
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from timeshare import protocol as P
from timeshare.device import HostRegistrar
from timeshare.memory.allocator import align_up
from timeshare.memory.arena import reserve_shared_memory
from timeshare.transfer.host_store import HostPin
from timeshare.tree import map_instances, map_tensors

log = logging.getLogger(__name__)

# NOTE [Tensor channel]
# A call's tensors never go through pickle to a worker. Each worker has one shared-memory
# buffer, its channel: the controller writes a call's input tensors into it, each at an
# aligned offset, and the message carries a ``TensorRef`` (offset, shape, dtype, strides)
# in each tensor's place; the worker computes from views of the buffer (on the CPU no copy
# at all; on CUDA the buffer is page-locked through the worker's host registrar, NOTE
# [Exact host pinning], and each input is uploaded from it with a non-blocking copy, no
# staging copy); it writes the outputs after the inputs (from the device straight into the
# pinned buffer on CUDA) and answers with their TensorRefs; the controller copies them out
# before it answers the caller, so that no output ever changes under the caller when the
# next call writes the buffer. The nesting (tuples, lists, dicts, named tuples,
# dataclasses: ``tree.py``'s walk) travels in the pickle around the descriptors.
#
# Ownership. The controller creates each worker's channel (``WorkerHandle``), pre-faulted,
# and names it in ``Start``; a replacement worker gets a fresh one. The name is unlinked as
# soon as the worker has confirmed its mapping (its first Result), and at the latest when
# the handle releases the worker: a crashed worker leaks nothing, and the memory goes
# with the last mapping. Only the thread holding the worker's lease writes the inputs or
# reads the outputs (NOTE [One owner per pipe]), and the worker answers only once nothing
# of its own reads or writes the channel any more (on CUDA the device is synchronized
# before every answer, a Failure included), so a write never meets a copy in flight.
#
# Growth. The channel starts at ``DEFAULT_BYTES``; a call whose tensors (its inputs, and
# the outputs the worker last answered) need more is given a larger channel first, up to
# a maximum (``MAX_BYTES``), between calls: the controller creates it, writes the inputs
# there and names it in the message (``RunModel.channel``) until the worker's Result
# confirms it mapped it; the old one is unmapped. A tensor that still does not fit, or that
# the descriptor cannot carry (a tensor subclass, a sparse or quantized layout, a dtype not
# in ``DTYPES``, or one inside an object the walk does not open), is pickled in place, the
# old way, and logged once per reason at INFO: slower, never wrong.
ALIGNMENT = 256  # every tensor's offset: enough for any dtype's view and for vectorized copies
PAGE = mmap.PAGESIZE
DEFAULT_BYTES = 8 << 20
MAX_BYTES = 256 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14

DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_said: set[str] = set()  # reasons already logged (once each per process)


def _once(kind: str, detail: str = "") -> None:
    """Log the first tensor pickled for ``kind`` of reason (with ``detail``), and no other."""
    if kind not in _said:
        _said.add(kind)
        log.info("a tensor crosses the process boundary pickled (slower; logged once): %s", detail or kind)


class Channel:
    """One worker's tensor channel as mapped in this process (NOTE [Tensor channel])."""

    def __init__(self, spec: P.ChannelSpec, buffer: torch.Tensor, segment: SharedMemory | None = None):
        self.spec = spec
        self.buffer = buffer
        self._segment = segment  # the controller's, until unlinked
        self._pin: HostPin | None = None
        self._in_flight: Any = None  # a CUDA event: copies still reading the buffer (worker)
        self.page_locked = False  # CUDA said so, once pinned (worker)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def pinned(self) -> bool:
        return self._pin is not None

    @classmethod
    def create(cls, nbytes: int) -> Channel:
        """A new channel of at least ``nbytes`` (the controller's), backed and pre-faulted;
        MemoryBudgetError where /dev/shm lacks the room."""
        nbytes = align_up(max(int(nbytes), PAGE), PAGE)
        segment = SharedMemory(create=True, size=nbytes)
        reserve_shared_memory(segment, "a worker's tensor channel",
                              "free space in /dev/shm (or a smaller channel_max_bytes)")
        segment.close()  # mapped by name, on its own (NOTE [Mappings outlive close])
        try:
            buffer = _map(segment.name, nbytes)
        except BaseException:
            segment.unlink()
            raise
        return cls(P.ChannelSpec(segment.name, nbytes), buffer, segment)

    @classmethod
    def attach(cls, spec: P.ChannelSpec, registrar: HostRegistrar | None = None) -> Channel:
        """The worker's mapping of ``spec``, pre-faulted; page-locked through ``registrar`` (CUDA)."""
        channel = cls(spec, _map(spec.name, spec.nbytes))
        if registrar is not None:
            channel._pin = HostPin(channel.buffer, registrar)
            # As the device sees it (tests): page-locked memory is read by DMA, no staging.
            channel.page_locked = channel.buffer.is_pinned() if channel.buffer.is_cpu else False
        return channel

    def unlink(self) -> None:
        """Remove the segment's name (idempotent): its memory goes with the last mapping."""
        segment, self._segment = self._segment, None
        if segment is not None:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in this channel."""
        base = self.buffer.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.nbytes

    def mark_in_flight(self, fence: Any) -> None:
        """Copies read the buffer until ``fence`` (a CUDA event) completes."""
        self._in_flight = fence

    def settle(self) -> None:
        """Until no copy of this process reads the buffer."""
        fence, self._in_flight = self._in_flight, None
        if fence is not None:
            fence.synchronize()

    def release(self) -> None:
        """Unpin and unmap (once no copy reads it); the name too, if still ours. Idempotent."""
        try:
            self.settle()
        finally:
            pin, self._pin = self._pin, None
            if pin is not None:
                pin.release()
            self.unlink()
            self.buffer = torch.empty(0, dtype=torch.uint8)


def _map(name: str, nbytes: int) -> torch.Tensor:
    """The segment mapped on its own (NOTE [Mappings outlive close]), every page faulted in
    now: a call's copy then costs the copy alone."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)  # faults every page in, writable, without writing
    except (OSError, ValueError):
        int(buffer[::PAGE].sum())  # an older kernel: a read of each page (shared memory maps it writable)
    return buffer


# ---------------------------------------------------------------------- encoding
@dataclass
class Encoded:
    """A structure with its tensors written into a channel: ``value`` holds a TensorRef in
    each written tensor's place; ``refs`` counts them; ``end`` is the first byte after
    them; ``need`` the bytes every tensor the channel could carry would take from the
    start; ``left`` the tensors left in place (pickled), and why."""

    value: Any
    refs: int
    end: int
    need: int
    left: list[torch.Tensor]
    reasons: list[tuple[str, str]]  # (kind, detail) for each tensor left


def unsupported(t: torch.Tensor) -> str | None:
    """Why the channel cannot carry ``t`` (None: it can)."""
    if type(t) not in _PLAIN:
        return f"a tensor subclass ({type(t).__qualname__})"
    if t.layout is not torch.strided:
        return f"layout {t.layout}"
    if t.is_quantized:
        return "a quantized tensor"
    if t.dtype not in DTYPES:
        return f"dtype {t.dtype}"
    if t.device.type == "meta":
        return "a meta tensor"
    return None


def dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides ``t`` keeps in the channel: None when it is contiguous; its own when it is
    dense and non-overlapping in another order (channels-last, transposed: kernels may pick
    another path, so the layout is kept, as ``Tensor.to`` keeps it); None (written
    contiguous) when it has gaps or overlaps."""
    if t.is_contiguous():
        return None
    stride = t.stride()
    dims = sorted((s, n) for n, s in zip(t.shape, stride) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return None
        expected *= n
    return tuple(stride)


def _view(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
          stride: tuple[int, ...] | None) -> torch.Tensor:
    """The tensor at ``offset`` of ``buffer``: one ``as_strided`` of the buffer seen as
    ``dtype`` (kept on the buffer, one per dtype), instead of a slice and two views per
    tensor, three calls into torch on every input and output of every call."""
    size = dtype.itemsize
    if offset % size:
        n = 1
        for d in shape:
            n *= d
        flat = buffer[offset:offset + n * size].view(dtype)
        return flat.view(shape) if stride is None else flat.as_strided(shape, stride)
    bases = buffer.__dict__.get("_typed")
    if bases is None:
        bases = buffer.__dict__["_typed"] = {}
    base = bases.get(dtype)
    if base is None:
        whole = buffer.numel() // size * size
        base = bases[dtype] = buffer[:whole].view(dtype)
    if stride is None:
        stride = _contiguous(shape)
    return base.as_strided(shape, stride, offset // size)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) < 2:
        return (1,) * len(shape)
    out = [1] * len(shape)
    step = 1
    for i in range(len(shape) - 1, 0, -1):
        step *= max(shape[i], 1)  # as torch counts a dimension of 0
        out[i - 1] = step
    return tuple(out)


def encode(obj: Any, buffer: torch.Tensor, start: int = 0, *, non_blocking: bool = False,
           keep: Callable[[torch.Tensor], torch.Tensor] | None = None, say: bool = True) -> Encoded:
    """Write every tensor of ``obj`` that fits into ``buffer`` from ``start`` on (NOTE [Tensor
    channel]). ``non_blocking``: copies from a device are queued (the caller synchronizes
    before the buffer is read). ``keep``: applied to each tensor left in place. ``say``: log
    why any is left (``report``); a caller that may try again in a larger buffer reports
    its final encoding itself."""
    limit = buffer.numel()
    pos = start
    need = start
    refs = 0
    left: list[torch.Tensor] = []
    reasons: list[tuple[str, str]] = []

    def put(t: torch.Tensor) -> Any:
        nonlocal pos, need, refs
        why = unsupported(t)
        if why is None:
            nbytes = t.numel() * t.element_size()
            need = align_up(need, ALIGNMENT) + nbytes
            at = align_up(pos, ALIGNMENT)
            if at + nbytes <= limit:
                stride = dense_stride(t)
                shape = tuple(t.shape)
                if nbytes:
                    _view(buffer, at, shape, t.dtype, stride).copy_(t.detach() if t.requires_grad else t,
                                                                    non_blocking=non_blocking)
                pos = at + nbytes
                refs += 1
                return P.TensorRef(at, shape, t.dtype, stride, t.requires_grad)
            reasons.append(("too large", f"{nbytes:,} bytes do not fit in a channel of {limit:,} bytes (grown up "
                            "to its maximum, channel_max_bytes)"))
        else:
            reasons.append((why, why))
        t = keep(t) if keep is not None else t
        left.append(t)
        return t

    value = map_tensors(obj, put)
    enc = Encoded(value, refs, pos, need, left, reasons)
    if say:
        report(enc)
    return enc


def report(enc: Encoded) -> None:
    """Log why tensors of ``enc`` travel pickled, once per kind of reason and process."""
    for kind, detail in enc.reasons:
        _once(kind, detail)


def views(obj: Any, buffer: torch.Tensor) -> tuple[Any, int]:
    """``obj`` with each TensorRef replaced by a view of ``buffer`` (the worker's inputs,
    no copy), and the first byte after them."""
    end = 0

    def view(r: P.TensorRef) -> torch.Tensor:
        nonlocal end
        t = _view(buffer, r.offset, r.shape, r.dtype, r.stride)
        end = max(end, r.offset + t.numel() * t.element_size())
        return t.detach().requires_grad_() if r.requires_grad else t

    return map_instances(obj, P.TensorRef, view), end


def copies(obj: Any, buffer: torch.Tensor) -> Any:
    """``obj`` with each TensorRef replaced by a copy of its bytes in ``buffer``, in memory
    of its own (the controller's outputs: the next call may overwrite the channel)."""

    def copy(r: P.TensorRef) -> torch.Tensor:
        t = _view(buffer, r.offset, r.shape, r.dtype, r.stride).clone()
        return t.requires_grad_() if r.requires_grad else t

    return map_instances(obj, P.TensorRef, copy)


class _Pickling(threading.local):
    """One pickler per thread, kept: making one per message cost as much as the pickling.
    Tensors are found through its dispatch table, in C (a ``reducer_override`` in Python
    ran for every object pickled); ``left``: the ids of the tensors meant to travel pickled."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.pickler = pickle.Pickler(self.out, protocol=P.PROTOCOL)
        self.pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: self._reduce,
                                       torch.nn.Parameter: self._reduce}
        self.left: set[int] = set()

    def _reduce(self, t: torch.Tensor) -> Any:
        if id(t) not in self.left:
            _once("inside an object that tree.py's walk does not open (tuple, list, dict, named tuple, "
                  "dataclass)")
        return t.__reduce_ex__(P.PROTOCOL)

    def dumps(self, msg: object, left: Sequence[torch.Tensor]) -> bytes:
        out = self.out
        self.left = {id(t) for t in left} if left else set()
        try:
            self.pickler.dump(msg)
            return out.getvalue()
        finally:
            self.pickler.clear_memo()
            out.seek(0)
            out.truncate()
            self.left = set()


_pickling = _Pickling()


def dumps(msg: object, left: Sequence[torch.Tensor] = ()) -> bytes:
    """``msg`` pickled, as ``protocol.dumps``; tensors other than ``left`` in it are logged once."""
    return _pickling.dumps(msg, left)
