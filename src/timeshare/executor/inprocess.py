"""Models run in this process: one :class:`~timeshare.worker.worker.Worker` and its copy
engine (the ``Executor`` of ``executor/interface.py`` for ``workers=0``). Runs in the controller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from timeshare.decode.step import Step
from timeshare.errors import ConfigError
from timeshare.executor.interface import Packed, PoolHealth, Ran, Shared
from timeshare.executor.packing import Tiered
from timeshare.memory import Arena
from timeshare.memory.ephemeral import LaneBound, in_lane, plain_on_cpu, use_cores
from timeshare.models.binding import TensorLayout
from timeshare.models.spec import ModelSpec
from timeshare.transfer.copy import CopyEngine, LoadHandle
from timeshare.transfer.disk import FillSpec
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder, ModelProfile
from timeshare.tree import map_tensors
from timeshare.worker.trainer import TrainingTask, TrainSpec
from timeshare.worker.worker import Worker


class InProcessExecutor:
    """Models run in this process: one worker and its copy engine."""

    def __init__(self, device: torch.device, arena: Arena, engine: CopyEngine, *, profile_repeats: int,
                 fixed_group_bytes: int, direct_host_access: bool | None = None):
        self.device = device
        self._engine = engine
        self._worker = Worker(device, arena, engine, profile_repeats=profile_repeats,
                              fixed_group_bytes=fixed_group_bytes, direct_host_access=direct_host_access)

    def check_registrable(self, spec: ModelSpec) -> None:
        return None

    def pack(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore) -> Packed:
        self._pin(store)
        return Packed(spec.name, spec, module, layout, store, store.nbytes)

    def pack_shared(self, spec: ModelSpec, module: nn.Module, layout: TensorLayout, store: HostStore,
                    order: ExecutionOrder, shared: dict[str, tuple[str, TensorEntry]]) -> Packed:
        self._pin(store)
        return Packed(spec.name, spec, module, layout, store, store.nbytes, order=order, view=store, shared=shared)

    def add_shared(self, sid: str, store: HostStore) -> HostStore:
        self._worker.add_shared(sid, store)
        return store

    def release_shared(self, sid: str) -> LoadHandle | None:
        return self._worker.release_shared(sid)

    def remove_shared(self, sid: str) -> None:
        self._worker.remove_shared(sid)

    def pack_tiered(self, spec: ModelSpec, tiered: Tiered,
                    shared: dict[str, tuple[str, TensorEntry]] | None = None) -> Packed:
        if tiered.filled:  # NOTE [Locked host tier]: locked while its pages hold bytes
            self._pin(tiered.store)
        return Packed(spec.name, spec, tiered.module, tiered.layout, tiered.store, tiered.store.nbytes,
                      order=tiered.order, pages=tiered.pages, view=tiered.store, shared=shared)

    def host_dropping(self, name: str) -> None:
        # The copies reading the store are waited for on the host too (NOTE [Exact host
        # pinning]): unlocked before its pages go (NOTE [Locked host tier]).
        self._worker.unpin_store(name)

    def host_filling(self, name: str) -> None:
        if name in self._worker.models:
            self._worker.pin_store(name)  # before the reads: they land in locked memory

    def reads_host(self, name: str) -> bool:
        return self._worker.reads_host(name)

    def _pin(self, store: HostStore) -> None:
        """Page-lock ``store`` with the worker's registrar (on CUDA; NOTE [Exact host pinning])."""
        registrar = self._worker.host_registrar
        if registrar is not None:
            store.pin(registrar)

    def add(self, packed: Packed) -> None:
        assert packed.store is not None
        self._worker.add(packed.name, packed.module, packed.layout, packed.store, order=packed.order,
                         shared=packed.shared, droppable=packed.pages is not None)

    def discard(self, packed: Packed) -> None:
        if packed.store is not None:
            packed.store.release()

    def run(self, name: str, offset: int, resident: bool, args: tuple, kwargs: dict, strategy: str,
            lane: LaneBound | None = None, fill: FillSpec | None = None, shared: Shared = None,
            step: Step | None = None) -> Ran:
        if resident and (lane is None or plain_on_cpu(lane, self.device)):
            # The resident call's path: nothing to meter or report. An unmetered lane on
            # the CPU is its cores alone (a few microseconds of Python per call saved, in
            # lanes that share the interpreter lock).
            if lane is not None:
                use_cores(lane.threads)
            return Ran(self._worker.to_host(self._worker.run(name, offset, True, args, kwargs, strategy, None,
                                                             shared, step=step)))
        with in_lane(lane, self.device) as meter:  # NOTE [Counting ephemeral bytes]: this thread only
            out = self._worker.run(name, offset, resident, args, kwargs, strategy, fill, shared, step=step)
        # A resident run may overlap another model's load (lanes): only a load reads the latest load.
        stream = self._worker.last_fill if fill is not None else None
        return Ran(self._worker.to_host(out), load_s=None if resident else self._worker.load_seconds(),
                   ephemeral_peak=None if meter is None else meter.peak,
                   read_s=stream.read_s if stream is not None else None,
                   moved_bytes=None if resident else self._worker.moved_bytes)

    def profile(self, name: str, offset: int, args: tuple, kwargs: dict, shared: Shared = None) -> ModelProfile:
        return self._worker.profile(name, offset, args, kwargs, shared)

    def release(self, name: str) -> LoadHandle | None:
        return self._worker.release(name)

    def remove(self, name: str) -> None:
        self._worker.remove(name)

    def inputs(self, obj: Any) -> Any:
        return on_device(obj, self.device)

    def check_trainable(self, spec: TrainSpec) -> None:
        return None

    def start_job(self, spec: TrainSpec) -> TrainingTask:
        return TrainingTask.build(spec, self.device)

    def drop_job(self, name: str) -> None:
        return None

    def pids(self) -> list[int]:
        return []

    def health(self) -> PoolHealth | None:
        return None

    def pinned_host_bytes(self) -> int:
        return self._worker.pinned_host_bytes()

    def run_in_new_process(self, name: str, offset: int, args: tuple, kwargs: dict, strategy: str,
                           shared: Shared = None) -> Any:
        raise ConfigError("a new-process inference needs workers")

    @property
    def worker(self) -> Worker:
        """The worker that runs this process's models."""
        return self._worker

    def close(self) -> None:
        for name in list(self._worker.models):
            self._worker.remove(name)
        for sid in list(self._worker.shared):
            self._worker.remove_shared(sid)
        self._engine.close()


def on_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors on ``device``: the object itself when they all are there
    already (a call's inputs usually are: no container is rebuilt), else a copy moved."""
    if type(obj) is tuple or type(obj) is list:
        if all(type(x) is torch.Tensor and x.device == device for x in obj):
            return obj
    elif type(obj) is dict:
        if not obj or all(type(x) is torch.Tensor and x.device == device for x in obj.values()):
            return obj
    elif type(obj) is torch.Tensor and obj.device == device:
        return obj
    return map_tensors(obj, lambda t: t.to(device))
