"""Where a :class:`~timeshare.worker.worker.Worker`'s models' tensors are bound (runs in the
process that computes, as ``Worker`` does): their slots on the arena at a model's offset and
at its shared sets' (NOTE [Sticky placement], NOTE [Shared tensors]), some on the host store
instead (NOTE [Direct host access]), and the execution order a store is laid out in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from timeshare.decode.runner import relaid_out
from timeshare.errors import TimeshareError
from timeshare.memory.arena import Arena
from timeshare.models.binding import bind, bind_some
from timeshare.transfer.host_store import HostStore, TensorEntry
from timeshare.transfer.profiler import ExecutionOrder
from timeshare.worker.host_stores import HostStores
from timeshare.worker.loading import WorkerModel, adopt_order


class Placement(HostStores):
    """The binding side of a ``Worker``. State is set by ``Worker.__init__``."""

    arena: Arena
    direct_host_access: bool
    # NOTE [Direct host access]: the models with keys bound to host memory now (kept by
    # ``_bind`` and ``_bind_direct``), so that ``to_host`` looks at those alone.
    _host_bound: set[str]

    # NOTE [Sticky placement]
    # Building and binding views for every tensor costs milliseconds of host time for a
    # large model, too much for the switch path. So a model goes back to the arena
    # offset it had before when that range is free, and eviction leaves its slots
    # pointing at the old offset (stale views, never read: the module is private to the
    # runtime and only called through a load). A model that lands where it was bound
    # needs no binding at all. Removing a model points the slots at meta tensors.
    #
    # NOTE [Poisoned reloads]
    # Sticky placement makes exactness checks weak: a model reloaded where it was finds
    # its old bytes still there, so a load that forgot to wait for a group would still
    # compute the right outputs. Checks therefore run with two diagnostics of the
    # Runtime: ``poison_evicted`` fills an evicted model's block with 0xFF bytes (NaN in
    # every floating type) before it is freed, and ``copy_delay_s`` starts each group's
    # copy later (a sleep on the CPU copy thread, a device-side spin on the CUDA copy
    # stream), so a compute that does not wait surely reads poison and the check fails.
    def _bind(self, wm: WorkerModel, offset: int, at: Mapping[str, int]) -> None:
        """The slots on the arena: the store's tensors at ``offset``, the shared ones where
        the model's sets are (``at``, NOTE [Shared tensors])."""
        if wm.bound_at != offset or wm.shared_bound != at:
            views = self.arena.views(offset, wm.store.entries)
            for sid, entries in _by_set(wm, wm.shared).items():
                views.update(self.arena.views(at[sid], entries))
            bind(wm.layout, views)
            relaid_out(wm.module)  # NOTE [Decode graphs]: graphs captured before are stale
            wm.bound_at = offset
            wm.shared_bound = dict(at)
            wm.host_bound = ()
            self._host_bound.discard(wm.name)

    def _bind_direct(self, wm: WorkerModel, keys: tuple[str, ...]) -> None:
        """After ``_bind``: the slots of ``keys`` on the host store, the others' on the
        arena (NOTE [Direct host access])."""
        if keys == wm.host_bound:
            return
        leaving = set(wm.host_bound) - set(keys)
        back = [e for e in wm.store.entries if e.key in leaving]
        if back:  # copied by this load's plan: the arena's bytes again
            assert wm.bound_at is not None
            bind_some(wm.layout, self.arena.views(wm.bound_at, back))
        for sid, entries in _by_set(wm, leaving).items():  # in their set's block again
            bind_some(wm.layout, self.arena.views(wm.shared_bound[sid], entries))
        if keys:
            bind_some(wm.layout, {k: self._host_tensor(wm, k) for k in keys})
        relaid_out(wm.module)
        wm.host_bound = keys
        if keys:
            self._host_bound.add(wm.name)
        else:
            self._host_bound.discard(wm.name)

    def _host_tensor(self, wm: WorkerModel, key: str) -> torch.Tensor:
        """``key``'s bytes in host memory: the model's store, or its shared set's."""
        if key in wm.shared:
            sid, e = wm.shared[key]
            return HostStore.view(self.shared[sid].buffer, e)
        return wm.store.tensor(key)

    def reads_host(self, name: str) -> bool:
        """Whether ``name`` computes from its host store (NOTE [Direct host access]): the
        store must stay in memory while the model may run."""
        return bool(self.host_keys(name))

    def host_keys(self, name: str) -> tuple[str, ...]:
        """The keys of ``name`` bound to its host store now (NOTE [Direct host access])."""
        wm = self.models.get(name)
        return wm.host_bound if wm is not None else ()

    def _adopt_order(self, wm: WorkerModel, order: ExecutionOrder, *, repack: bool) -> None:
        """Take ``order`` as the model's layers; with ``repack``, lay the host store out in
        that order (the store is then this worker's own)."""
        if repack:
            if wm.order_fixed:
                raise TimeshareError(f"model {wm.name!r}: its store's layout is fixed by its owner and cannot be "
                                     "repacked")
            by_key = {e.key: e for e in wm.store.entries}
            entries = [by_key[k] for k in order.key_order()]
            old = wm.store
            wm.store = HostStore.pack(entries, old.state(), pin=self.host_registrar is not None,
                                      registrar=self.host_registrar)
            wm.bound_at = None
            self._drop_store(old)  # the store in registration order
        elif [e.key for e in wm.store.entries] != [k for k in order.key_order() if k not in wm.shared]:
            raise TimeshareError(f"model {wm.name!r}: the host store is not laid out in the traced order")
        adopt_order(wm, order, direct=self.direct_host_access)

def _by_set(wm: WorkerModel, keys: Iterable[str]) -> dict[str, list[TensorEntry]]:
    """The shared ones among ``keys``, as entries of their sets named by the model's keys."""
    by_set: dict[str, list[TensorEntry]] = {}
    for key in keys:
        if key in wm.shared:
            sid, e = wm.shared[key]
            by_set.setdefault(sid, []).append(replace(e, key=key))
    return by_set
