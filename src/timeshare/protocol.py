"""Every message that crosses a process boundary between the controller and a worker.
Imported by both sides.

Messages are small frozen dataclasses, pickled by value (never through shared-memory
tensor reductions, so a crash cannot leak a segment) and sent as bytes over a
``multiprocessing`` pipe. Shared memory is named once, when a worker starts
(``Start``) or learns a model (``AddModel``), or when its tensor channel grows
(``RunModel.channel``); nothing on the switch path exchanges handles.

A call's tensors do not travel in the pickle: inputs (``RunModel``, ``Profile``) and
outputs (``Result``) are written into the worker's tensor channel, a shared-memory
buffer per worker, and the message carries a ``TensorRef`` (offset, shape, dtype,
strides) in each tensor's place; ``refs`` counts them (NOTE [Tensor channel] in
``worker/channel.py``). A tensor the channel cannot carry (too large, a subclass, a
sparse or quantized layout, inside an object the walk of ``tree.py`` does not open)
is pickled in place, and logged once.

    controller -> worker            worker -> controller
    ----------------------------    ---------------------------------------
    (spawn args: Start)             Hello(worker, pid)       after start-up
    AddModel(model, ...)            Ack(seq)                 model ready
    RemoveModel(model)              Ack(seq)
    UnpinStore(seq, model)          Ack(seq)  (its store unlocked: the host tier drops its pages)
    RunModel(seq, model, ...)       Result(seq, output, ...) or Failure(seq, error)
      args as TensorRefs, channel:    output as TensorRefs in the channel (refs, out_nbytes)
      a grown channel to map first
      with step: a language model's step (decode/step.py), answered with its StepOutcome
    SlotReady(seq, written)           a prefill whose cold adapter slot is written while it
                                      runs: after each layer, read by the corrections
    StepMasks(seq, masks)             a step whose masks follow it: sent once it is posted
                                      (after its SlotReady), read by the step after
                                      queueing its forward
    Profile(seq, model, ...)        Result(seq, profile)     or Failure(seq, error)
      args as TensorRefs, channel
    Train(seq, job, spec, lane)     Progress(seq, ...) after every iteration, then
                                    SegmentStopped(seq, ...) or Failure(seq, error)
    PreemptSegment(seq)             (the Train with that seq stops at its next
                                    preemption point; ignored if it already ended)
    GetJobState(seq, job, full)     Result(seq, state dict, or with full the job's checkpoint)
    DropJob(seq, job)               Ack(seq)
    Shutdown()                      (exits)

A worker answers one request at a time, except that a Train segment reads the pipe
at every preemption point, where only PreemptSegment and Shutdown can arrive, and a
step reads what follows it: its SlotReady (NOTE [Adapters streamed in]), then its
StepMasks (NOTE [Masks while the device runs]).
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

from timeshare import errors
from timeshare.decode.step import Step
from timeshare.memory.ephemeral import LaneBound
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.host_store import TensorEntry
from timeshare.transfer.profiler import ExecutionOrder

PROTOCOL = 5


@dataclass(frozen=True)
class Start:
    """What a worker process is started with."""

    worker: int
    parent_pid: int
    device: str
    arena: Any  # Arena.share(): the shared-memory name (CPU) or the CUDA IPC handle
    arena_capacity: int
    profile_repeats: int
    fixed_group_bytes: int
    load_timeout_s: float
    copy_delay_s: float = 0.0  # diagnostic: NOTE [Poisoned reloads]
    backend_flags: Any = None  # device.BackendFlags of the process that created the runtime
    direct_host_access: bool | None = None  # NOTE [Direct host access]; None: the device's default
    leave_a_core: bool = False  # the controller serves: NOTE [A core for the front end]
    # The controller's environment when it started this worker: a process forked from the
    # fork server would otherwise see the server's, as it was when it started (NOTE [Fork server]).
    environ: tuple[tuple[str, str], ...] = ()
    channel: ChannelSpec | None = None  # NOTE [Tensor channel]: the worker's buffer for call tensors


@dataclass(frozen=True)
class ChannelSpec:
    """A worker's tensor channel (NOTE [Tensor channel]): the shared-memory segment's name
    and size, mapped by the worker when it starts or when the controller grows it."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a worker's tensor channel, in the message in its place (NOTE [Tensor
    channel]): its bytes start at ``offset``; ``stride`` None is contiguous."""

    offset: int
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype (pickled by name)
    stride: tuple[int, ...] | None = None
    requires_grad: bool = False


@dataclass(frozen=True)
class Hello:
    worker: int
    pid: int


@dataclass(frozen=True)
class AddModel:
    seq: int
    model: str
    builder: Any  # "module:function" or a picklable callable
    entries: tuple[TensorEntry, ...]  # the host store's layout (execution order)
    store_name: str
    store_nbytes: int
    order: ExecutionOrder
    # Under a host budget the store's pages come and go (NOTE [Host tier]): it is page-locked
    # (on CUDA) by this worker's loads and until an UnpinStore, not when added (NOTE [Locked host tier]).
    droppable: bool = False
    # NOTE [Shared tensors]: the keys held in shared sets, as (key, set, the tensor's entry in the set)
    shared: tuple[tuple[str, str, TensorEntry], ...] = ()


@dataclass(frozen=True)
class AddShared:
    """A shared set's host store (NOTE [Shared tensors]), taught before the models using it."""

    seq: int
    sid: str
    entries: tuple[TensorEntry, ...]
    store_name: str
    store_nbytes: int


@dataclass(frozen=True)
class RemoveShared:
    seq: int
    sid: str


@dataclass(frozen=True)
class RemoveModel:
    seq: int
    model: str


@dataclass(frozen=True)
class UnpinStore:
    """Unlock the model's host store once no copy reads it: the host tier is about to give
    its pages back (NOTE [Locked host tier])."""

    seq: int
    model: str


@dataclass(frozen=True)
class RunModel:
    seq: int
    model: str
    offset: int
    resident: bool
    args: tuple
    kwargs: dict
    strategy: str
    profiles: tuple = ()  # ModelProfiles other workers measured that this one lacks
    lane: LaneBound | None = None  # NOTE [Lanes in the runtime]: the forward is metered and bounded
    fill: FillSpec | None = None  # NOTE [Disk to device]: the store is read from disk during the load
    shared: dict[str, tuple[int, bool]] | None = None  # NOTE [Shared tensors]: set -> (offset, its bytes are there)
    # NOTE [Direct host access]: a resident model's keys that its load left on the host store
    # (the load may have run in another worker); None: this worker's own binding stands.
    host_keys: tuple[str, ...] | None = None
    step: Step | None = None  # NOTE [One step, two places]: a language model's step; args and kwargs are empty
    # NOTE [Tensor channel]: how many TensorRefs args and kwargs hold (0: none to decode), and
    # the channel to map before decoding them when the controller has just grown it.
    refs: int = 0
    channel: ChannelSpec | None = None


@dataclass(frozen=True)
class StepMasks:
    """The grammar masks of step ``seq``'s rows, sent after its RunModel (NOTE [Masks while
    the device runs]); empty: the controller could not compute them (the step fails)."""

    seq: int
    masks: tuple[bytes, ...]


@dataclass(frozen=True)
class SlotReady:
    """Step ``seq``'s cold adapter slot holds its first ``written`` targets, sent after its
    RunModel, layer by layer, before any StepMasks (NOTE [Adapters streamed in]); -1: the
    controller could not write it (the step fails)."""

    seq: int
    written: int


@dataclass(frozen=True)
class Profile:
    seq: int
    model: str
    offset: int
    args: tuple
    kwargs: dict
    shared: dict[str, tuple[int, bool]] | None = None
    host_keys: tuple[str, ...] | None = None
    refs: int = 0  # NOTE [Tensor channel], as for RunModel
    channel: ChannelSpec | None = None


@dataclass(frozen=True)
class Train:
    """Run a training job until it ends or is preempted. ``spec`` (a TrainSpec) builds
    the job the first time; None resumes the job this worker already holds. ``lane``:
    with lanes, every iteration of the segment runs metered and bounded by it (NOTE
    [Lanes in the runtime])."""

    seq: int
    job: str
    spec: Any = None
    lane: LaneBound | None = None


@dataclass(frozen=True)
class PreemptSegment:
    seq: int  # the Train segment to stop


@dataclass(frozen=True)
class Progress:
    seq: int
    iterations: int
    loss: float | None
    seconds: float
    # Salus's memory classes, once measured (the second iteration): the dispatcher resizes
    # the job's lane from them at its next preemption point.
    ephemeral_bytes: int | None = None
    persistent_bytes: int | None = None


@dataclass(frozen=True)
class SegmentStopped:
    """A Train segment ended: "finished" (iterations or data exhausted) or
    "preempted". Times are ``time.perf_counter()`` in the worker, which on Linux reads
    the same monotonic clock as the controller's."""

    seq: int
    reason: str
    stats: Any  # TrainingStats
    stopped_at: float
    cleaned_at: float


@dataclass(frozen=True)
class GetJobState:
    seq: int
    job: str
    full: bool = False  # the whole checkpoint (NOTE [Checkpoints]), not only parameters and buffers


@dataclass(frozen=True)
class DropJob:
    seq: int
    job: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ack:
    seq: int


@dataclass(slots=True)
class CallTimings:
    """Where one call through a worker spent its time, as the worker measured it (seconds
    on its ``perf_counter``), what its tensors took, and what its load left behind; the
    controller adds the round trip and the worker's whole share. Typed, built once per
    call and read by attribute: the records, the switch's record and the benchmarks'
    breakdown all read this one object."""

    received_at: float  # the worker's clock when the message was read
    unpickle_s: float  # the message's unpickling
    upload_s: float  # inputs to where the model runs (views of the channel on the CPU)
    forward_s: float
    to_host_s: float  # outputs into the channel (or to the host, pickled)
    sync_s: float  # the device's last work (CUDA)
    worker: int  # the worker's id
    store_pinned: bool = False  # NOTE [Locked host tier]: the model's store is page-locked there now
    lock_s: float | None = None  # what this call's load spent page-locking the store
    load_s: float | None = None  # a load's copies, first start to last arrival (None: resident)
    read_s: float | None = None  # a load from disk: its reads (NOTE [Disk to device])
    moved_bytes: int | None = None  # a load: the bytes copied to the device
    host_keys: tuple[str, ...] = ()  # NOTE [Direct host access]: the keys the model reads from the host
    ephemeral_peak: int | None = None  # in a lane: the forward's peak ephemeral bytes
    # NOTE [Tensor channel]: the bytes the inputs and the outputs took there, and how the
    # outputs came back; inputs that came pickled and went through the staging buffer.
    input_channel_bytes: int = 0
    output_channel_bytes: int = 0
    outputs_in_channel: int = 0
    outputs_pickled: int = 0
    input_staged_bytes: int = 0
    input_pinned_bytes: int = 0
    channel_pinned_bytes: int = 0
    channel_page_locked: bool = False
    host_pinned_bytes: int | None = None  # a load: host memory this worker holds page-locked
    cuda_segments: int | None = None  # a load on CUDA: the allocator's segments in this process
    sent_at: float | None = None  # the controller's: when the message went out
    round_trip_s: float | None = None  # the controller's: the message sent -> its reply read
    worker_s: float | None = None  # the worker's whole share of the round trip


@dataclass(frozen=True)
class Result:
    seq: int
    value: Any
    seconds: float = 0.0
    timings: CallTimings | None = None  # a call's (RunModel's); None for other requests
    profiles: tuple = ()  # ModelProfiles measured while running this task, for the other workers
    # NOTE [Tensor channel]: how many TensorRefs ``value`` holds, and the channel bytes its
    # tensors needed (those pickled for want of room included: the controller grows the channel).
    refs: int = 0
    out_nbytes: int = 0


@dataclass(frozen=True)
class ErrorInfo:
    """An exception as data: its type, message, where it happened and its traceback."""

    type_name: str
    message: str
    where: str
    traceback: str = ""
    timeshare_type: str | None = None  # set when it is one of timeshare's own errors
    in_task: bool = False  # raised by the task's own code (a forward, a training step), not the worker's
    init_args: tuple | None = None  # for an error built from fields (``init_args``), not from a message

    @classmethod
    def capture(cls, exc: BaseException, where: str, *, in_task: bool = False) -> ErrorInfo:
        own = type(exc).__name__ if isinstance(exc, errors.TimeshareError) else None
        message = exc.message if isinstance(exc, errors.TimeshareError) else str(exc)
        inner = getattr(exc, "where", None)
        return cls(
            type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=message,
            where=f"{where}, {inner}" if inner else where,
            traceback="".join(traceback.format_exception(exc)),
            timeshare_type=own,
            in_task=in_task,
            init_args=getattr(exc, "init_args", None) if own else None,
        )

    def to_exception(self) -> errors.TimeshareError:
        """The error to raise in the caller: timeshare's own type when it was one, else
        a RemoteError carrying the remote type and traceback."""
        cls = getattr(errors, self.timeshare_type or "", None)
        if isinstance(cls, type) and issubclass(cls, errors.TimeshareError) and cls is not errors.ModelTooLargeError:
            try:
                exc = cls(*self.init_args) if self.init_args is not None else cls(self.message, where=self.where)
            except TypeError:
                pass
            else:
                exc.where = self.where
                return exc
        return errors.RemoteError(
            f"{self.type_name}: {self.message}", where=self.where, remote_type=self.type_name,
            remote_traceback=self.traceback, in_task=self.in_task,
        )


@dataclass(frozen=True)
class Failure:
    seq: int
    error: ErrorInfo
    extra: dict = field(default_factory=dict)


def dumps(msg: object) -> bytes:
    return pickle.dumps(msg, protocol=PROTOCOL)


def loads(data: bytes) -> object:
    return pickle.loads(data)
