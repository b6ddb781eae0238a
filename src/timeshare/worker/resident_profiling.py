"""Profiling a resident model for an input shape in a :class:`~timeshare.worker.worker.Worker`
(runs in the process that computes, as ``Worker`` does): each layer's compute time, the
layers cheaper to compute from host memory (NOTE [Direct host access]), and the link's
costs, measured once per worker. The measurements themselves are ``worker/profiling.py``.
"""

from __future__ import annotations

import torch

from timeshare.transfer.profiler import LinkCosts, time_layers
from timeshare.worker.loading import WorkerModel
from timeshare.worker.placement import Placement
from timeshare.worker.profiling import probe_link, profile_resident, with_direct_layers


class ResidentProfiling(Placement):
    """The profiling side of a ``Worker``. State is set by ``Worker.__init__``."""

    profile_repeats: int
    fixed_group_bytes: int
    _link: LinkCosts | None

    def _profile_resident(self, wm: WorkerModel, args: tuple, kwargs: dict) -> None:
        profile = profile_resident(wm, args, kwargs, self._link_costs(), self.device,
                                   repeats=self.profile_repeats, fixed_group_bytes=self.fixed_group_bytes)
        if wm.direct_candidates:
            # A candidate's shared tensors count as bytes its direct access spares: a load
            # that copies their set copies them last (NOTE [Direct host access]).
            spared = [b + sum(e - a for _, a, e in runs) for b, runs in zip(profile.layer_bytes, wm.layer_shared)]
            profile = with_direct_layers(profile, self._time_direct(wm, args, kwargs), self.fixed_group_bytes,
                                         spared)
        wm.profiles[profile.shape_key] = profile
        wm.last_profile = profile.shape_key

    def _time_direct(self, wm: WorkerModel, args: tuple, kwargs: dict) -> list[float]:
        """The candidate layers' compute seconds with their tensors on the host store
        (NOTE [Direct host access]); the binding is put back after."""
        assert wm.order is not None and wm.bound_at is not None
        keys = tuple(k for layer in wm.order.layers[:wm.direct_candidates] for k in layer.keys)
        before = wm.host_bound
        self._bind_direct(wm, keys)

        def run():
            with torch.no_grad():
                wm.module(*args, **kwargs)

        try:
            times = time_layers(wm.module, run, wm.layer_modules, self.device, self.profile_repeats)
        finally:
            self._bind_direct(wm, before)
        return times.compute_s[:wm.direct_candidates]

    def _link_costs(self) -> LinkCosts:
        """Measured once per worker, at the first profile (never on a switch), by copying
        a scratch host buffer to a scratch device buffer through the copy engine."""
        if self._link is None:
            self._link = probe_link(self.engine, self.device, pin_host=self.pin_host)
        return self._link
