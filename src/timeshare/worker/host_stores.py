"""The host stores a :class:`~timeshare.worker.worker.Worker` copies from (runs in the
process that computes, as ``Worker`` does): shared sets' stores (NOTE [Shared tensors]),
page-locking a store for its loads and unlocking it once no copy reads it (NOTE [Exact
host pinning], NOTE [Locked host tier]).
"""

from __future__ import annotations

import logging

import torch

from timeshare.device import HostRegistrar, synchronize
from timeshare.errors import DeviceError, TimeshareError
from timeshare.transfer.copy import CopyEngine, LoadHandle
from timeshare.transfer.host_store import HostStore
from timeshare.worker.loading import WorkerModel

log = logging.getLogger(__name__)


class HostStores:
    """The host-store side of a ``Worker``: its models' stores and its shared sets', and
    which of them this process holds page-locked. State is set by ``Worker.__init__``."""

    device: torch.device
    engine: CopyEngine
    pin_host: bool
    host_registrar: HostRegistrar | None
    models: dict[str, WorkerModel]
    shared: dict[str, HostStore]  # NOTE [Shared tensors]: the host stores of shared sets
    _shared_loads: dict[str, LoadHandle]  # the latest load that copied each set
    _lock_refused: set[str]  # models whose stores could not be page-locked (warned once)
    last_load: LoadHandle | None  # the latest pipelined load, for its timing

    def add_shared(self, sid: str, store: HostStore) -> None:
        """A shared set's host store (NOTE [Shared tensors]): models added later refer to it."""
        if self.pin_host and self.host_registrar is not None:
            store.pin(self.host_registrar)
        self.shared[sid] = store

    def release_shared(self, sid: str) -> LoadHandle | None:
        """The set leaves the arena: waits for the latest load that copied it; returns
        that load if it may still be writing (its deadline passed). Never raises."""
        handle = self._shared_loads.pop(sid, None)
        if handle is None:
            return None
        try:
            handle.wait_all()
        except TimeshareError as exc:
            log.warning("releasing shared set %s after a failed load: %s", sid, exc)
        if self.engine.host_waits and not handle.done():
            return handle
        return None

    def remove_shared(self, sid: str) -> None:
        """Forget a set no model refers to any more; its store is unpinned."""
        self.release_shared(sid)
        self._drop_store(self.shared.pop(sid))

    def pin_store(self, name: str) -> bool:
        """Page-lock ``name``'s host store now, if this worker locks stores and it is not
        locked (NOTE [Locked host tier]); True if this call locked it."""
        wm = self.models[name]
        if self.host_registrar is None or wm.store.pinned:
            return False
        try:
            wm.store.pin(self.host_registrar)
        except DeviceError as exc:  # best effort: the load copies from pageable memory instead
            if name not in self._lock_refused:
                self._lock_refused.add(name)
                log.warning("cannot page-lock the host store of %s; its loads copy from pageable memory: %s",
                            name, exc)
            return False
        return True

    def unpin_store(self, name: str) -> None:
        """``name``'s host store is about to lose its pages (NOTE [Locked host tier]):
        unlocked once no copy reads it. Idempotent."""
        wm = self.models.get(name)
        if wm is None:
            return
        try:
            self.finish_pending(name)  # a tail still copying reads the store
        except Exception as exc:  # that load's failure is its own: unlocked all the same, once the device is idle
            log.warning("unlocking the host store of %s after a failed copy: %s", name, exc)
        self._drop_store(wm.store)

    def store_pinned(self, name: str) -> bool:
        """Whether ``name``'s host store is page-locked in this process now."""
        wm = self.models.get(name)
        return wm is not None and wm.store.pinned

    def pinned_host_bytes(self) -> int:
        """Host memory this worker's stores hold page-locked (safe to call from any thread)."""
        stores = [wm.store for wm in list(self.models.values())] + list(self.shared.values())
        return sum(store.pinned_nbytes for store in stores)

    def unlock_failed_load(self, name: str) -> None:
        """A load that locked ``name``'s droppable store failed: unlock it, so that only a
        successful call reports a lock (NOTE [Locked host tier]). Never raises: the
        failure being handled is the one to report."""
        try:
            self.unpin_store(name)
        except Exception:
            log.exception("unlocking the host store of %s after a failed load", name)
            self.models[name].store.release()  # the device is broken: nothing copies any more

    def finish_pending(self, name: str) -> None:
        wm = self.models[name]
        if wm.pending is not None:
            wm.pending.wait_all()
            wm.pending = None

    def _drop_store(self, store: HostStore) -> None:
        """Unpin ``store`` once no copy reads it. A device-side wait does not mean the
        copies ran, and unregistering memory a DMA still reads is undefined, so a pinned
        store waits for the device first (off the switch path: a first load, a removal).
        The latest load, kept for its timing, then lets go of the store and of the arena
        range it copied (``done()`` drops them once the copies are over), so that an
        unregister frees the host memory and a close the device memory."""
        if store.pinned:
            synchronize(self.device)
        if self.last_load is not None:
            self.last_load.done()
        store.release()
