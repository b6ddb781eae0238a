"""Where models execute, behind one interface (``Executor``): this process
(``executor/inprocess.py``: one :class:`~timeshare.worker.worker.Worker` and a copy engine
here) or a pool of worker processes (``executor/pool_executor.py``: the
:class:`~timeshare.executor.pool.ProcessPool`), and what a registered model is made into
for them (``Packed``). The runtime's facade decides what runs and where it lives in the
arena; an executor carries it out and never asks the facade anything back. Runs in the
controller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from timeshare.decode.step import Step
from timeshare.executor.packing import Tiered
from timeshare.memory.ephemeral import LaneBound
from timeshare.models.binding import TensorLayout
from timeshare.models.spec import ModelSpec
from timeshare.protocol import CallTimings, Progress, SegmentStopped
from timeshare.transfer.backing import HostPages
from timeshare.transfer.copy import LoadHandle
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder, ModelProfile
from timeshare.worker.trainer import TrainingTask, TrainSpec

if TYPE_CHECKING:
    from timeshare.executor.segments import HomeBusy, Segment


Shared = Mapping[str, tuple[int, bool]] | None  # shared set -> (arena offset, its bytes are there)


@dataclass(frozen=True)
class Ran:
    """What one forward gave: its output on the host, and with workers where its time
    went (``round_trip_s``, ``worker_s`` and the worker's own parts; None in-process)."""

    output: Any
    timings: CallTimings | None = None
    load_s: float | None = None  # the copies of a load, first start to last arrival, when measured
    ephemeral_peak: int | None = None  # in a lane: the forward's peak ephemeral bytes
    read_s: float | None = None  # a load from disk: its reads, first to last (NOTE [Disk to device])
    moved_bytes: int | None = None  # a load: the bytes it copied to the device (shared sets included)



@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker of the pool as operators see it: its id, its process, its state
    (starting, idle, busy with a task, training, dead) and the profiles it holds."""

    id: int
    pid: int | None
    state: str
    profiles: int


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """The latest worker the pool replaced: which, what went wrong (starting, hung,
    crashed, protocol), the error, and when (seconds since the epoch)."""

    worker: int
    kind: str
    cause: str
    at: float


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """The worker pool as operators see it, read without waiting for any worker: its
    size, the workers started and ready, the replacements so far by what went wrong and
    the latest, the replacements in a row that died starting, the profiles measured,
    each training job's home worker and each language model's (where its steps run), and
    each worker."""

    size: int
    ready: int
    replacements: int
    failures: dict[str, int]
    last_failure: WorkerFailure | None
    failing_to_start: int
    profilings: int
    homes: dict[str, int]
    step_homes: dict[str, int]
    workers: list[WorkerRow]


@dataclass
class Packed:
    """A registered model's weights made ready for an executor, before it is added."""

    name: str
    spec: ModelSpec
    module: nn.Module
    layout: TensorLayout
    store: HostStore | None
    nbytes: int
    segment: SharedMemory | None = None  # with workers: the store's shared memory
    order: ExecutionOrder | None = None  # with workers: traced at registration
    entries: tuple = ()  # with workers: the store's entries, in the traced order
    pages: HostPages | None = None  # with a host budget: the store's droppable pages (NOTE [Host tier])
    view: HostStore | None = None  # with a host budget: the controller's view of the store
    shared: dict[str, tuple[str, TensorEntry]] | None = None  # keys held in shared sets (NOTE [Shared tensors])


class ModelPath(Protocol):
    """The data path: models made ready, placed, run (a forward or a language model's
    step), profiled and forgotten, as the runtime's model table asks."""

    device: torch.device

    def check_registrable(self, spec: ModelSpec) -> None:
        """Raise ConfigError if ``spec`` cannot run here (before anything is built)."""

    def pack(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore) -> Packed:
        """Make a checked, packed model ready to add (outside the runtime's lock)."""

    def pack_tiered(self, spec: ModelSpec, tiered: Tiered,
                    shared: dict[str, tuple[str, TensorEntry]] | None = None) -> Packed:
        """``pack`` for a registration under a host budget: its store, already in
        execution order, in pages this executor can share (NOTE [Host tier]);
        ``shared`` as for ``pack_shared`` (NOTE [Shared tensors under a host budget])."""

    def pack_shared(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore,
                    order: ExecutionOrder, shared: dict[str, tuple[str, TensorEntry]]) -> Packed:
        """``pack`` for a model with tensors in shared sets (NOTE [Shared tensors]): ``store``
        holds the others, in ``order``; ``shared`` maps each shared key to its set and entry.
        ``Packed.view`` is the store the controller keeps (the pages the executor reads)."""

    def add_shared(self, sid: str, store: HostStore) -> HostStore:
        """A shared set's host store, before the models that refer to it are added; returns
        the store the controller keeps (the same pages the executor reads)."""

    def release_shared(self, sid: str) -> LoadHandle | None:
        """The set leaves the arena: a load still copying into its block, if any."""

    def remove_shared(self, sid: str) -> None:
        """Forget a set no model refers to any more and give back its host memory."""

    def host_dropping(self, name: str) -> None:
        """``name``'s host store is about to lose its pages: no copy may read it after, and
        no process holds it page-locked (NOTE [Locked host tier]). Idempotent."""

    def host_filling(self, name: str) -> None:
        """``name``'s host store has its pages again and is about to be written: page-lock
        it where this process copies from it (NOTE [Locked host tier])."""

    def reads_host(self, name: str) -> bool:
        """Whether ``name`` computes from its host store when it runs (NOTE [Direct host
        access]): the host tier must keep that store while the model is resident."""

    def add(self, packed: Packed) -> None:
        """Make the model runnable; on failure the caller ``discard``s it."""

    def discard(self, packed: Packed) -> None:
        """Give back what ``pack`` took for a model that was never added."""

    def run(self, name: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            lane: LaneBound | None = None, fill: FillSpec | None = None, shared: Shared = None,
            step: Step | None = None) -> Ran:
        """Forward ``name``; its bytes are at ``offset`` if ``resident``, else load them there.
        ``lane``: count the forward's ephemeral bytes and bound them (NOTE [Lanes in the runtime]);
        ``fill``: the host store is read from disk during the load (NOTE [Disk to device]);
        ``shared``: its shared sets' offsets and whether they are loaded (NOTE [Shared tensors]);
        ``step``: a language model's step instead of a forward (``args`` and ``kwargs``
        empty), run where the model runs; its ``Ran.output`` is the ``StepOutcome`` (NOTE
        [One step, two places])."""

    def profile(self, name: str, offset: int, args: tuple, kwargs: dict, shared: Shared = None) -> ModelProfile:
        """Profile the resident model ``name`` for these inputs."""

    def release(self, name: str) -> LoadHandle | None:
        """``name`` leaves the arena: a load still copying into its block, if any."""

    def remove(self, name: str) -> None:
        """Forget ``name`` and give back its host memory."""

    def inputs(self, obj: Any) -> Any:
        """Inputs made ready for ``run``: on the device in-process, on the host for workers."""

    def run_in_new_process(self, name: str, offset: int, args: tuple, kwargs: dict, strategy: str,
                           shared: Shared = None) -> Any:
        """Benchmarks' "two processes" baseline: a new worker started for this call."""


class SegmentHost(Protocol):
    """Where a training job's segments run in another process (the pool, on the job's
    home worker): what the job's thread in the controller asks of it."""

    def begin_segment(self, job: str, spec: TrainSpec | None, lane: LaneBound | None) -> Segment | HomeBusy | None:
        """Start or resume the job's segment; why not, if it cannot start now."""

    def run_segment(self, seg: Segment, on_progress: Callable[[Progress], None]) -> SegmentStopped:
        """Follow the segment until it stops."""

    def stop_segment(self, job: str) -> None:
        """Stop the job's running segment at its next preemption point."""

    def job_state(self, job: str, *, full: bool = False) -> dict:
        """The job's state (``full``: its checkpoint), between segments."""


class JobHost(Protocol):
    """Where training jobs' iterations run."""

    def check_trainable(self, spec: TrainSpec) -> None:
        """Raise ConfigError if the training job cannot run here."""

    def start_job(self, spec: TrainSpec) -> TrainingTask | SegmentHost:
        """Where a new training job's iterations run: a ``TrainingTask`` built here (in
        this process), or the pool (its home worker builds it).
        ``runtime/training.py`` makes the job's handle around it."""

    def drop_job(self, name: str) -> None:
        """Forget a finished job's state."""


class Observed(Protocol):
    """What operators and the runtime's snapshots read of where models run, without
    waiting for it."""

    def pids(self) -> list[int]:
        """Operating-system ids of the worker processes (none in-process)."""

    def health(self) -> PoolHealth | None:
        """The workers' state for operators (None in-process)."""

    def pinned_host_bytes(self) -> int:
        """Host memory page-locked for the host stores."""



class Executor(ModelPath, JobHost, Observed, Protocol):
    """What the runtime's facade asks of where models run: the three concerns above, and
    stopping. Test hooks are not part of it (``executor/testing.py``)."""

    def close(self) -> None:
        """Stop everything; the arena is closed by its owner afterwards."""
