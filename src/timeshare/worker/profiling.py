"""Measuring, the worker's side (runs in the process that computes): a resident model's
profile for one input shape, with a plan for every grouping strategy, and the link's
costs, measured once per worker. Also who owns each tensor, which tracing the execution
order needs (NOTE [Layers are wait points], ``transfer/profiler.py``).

Never on the switch path: a model is profiled at its first load of a shape, and the
link at a worker's first profile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from timeshare.memory.ephemeral import EphemeralMeter, unmetered
from timeshare.models.binding import TensorLayout
from timeshare.transfer.copy import CopyEngine
from timeshare.transfer.planner import STRATEGIES, make_plan
from timeshare.transfer.profiler import LinkCosts, ModelProfile, measure_link, time_layers
from timeshare.tree import shape_key
from timeshare.worker.loading import WorkerModel

log = logging.getLogger(__name__)

LINK_PROBE_BYTES = 64 << 20  # large enough to reach the link's full bandwidth


def profile_resident(wm: WorkerModel, args: tuple, kwargs: dict, link: LinkCosts, device: torch.device, *,
                     repeats: int, fixed_group_bytes: int) -> ModelProfile:
    """Profile ``wm``, resident and bound, for these inputs: each layer's compute time,
    and a plan for every strategy over ``link``. The caller keeps the profile."""
    assert wm.order is not None

    def run():
        with torch.no_grad():
            wm.module(*args, **kwargs)

    ephemeral = measure_ephemeral(run, device)  # also the warm-up
    times = time_layers(wm.module, run, wm.layer_modules, device, repeats)
    layer_bytes = [b - a for a, b in wm.layer_spans]
    key = shape_key(args, kwargs)
    profile = ModelProfile(
        model=wm.name,
        device=str(device),
        shape_key=key,
        layer_names=[layer.module or "<root>" for layer in wm.order.layers],
        layer_bytes=layer_bytes,
        compute_s=times.compute_s,
        link=link,
        ready_s=times.ready_s,
        tail_bytes=wm.tail_span[1] - wm.tail_span[0],
        plans={},
        ephemeral_bytes=ephemeral,
    )
    cost = profile.cost_model()
    profile.plans = {s: make_plan(s, cost, layer_bytes, fixed_group_bytes) for s in STRATEGIES}
    best = profile.plans["optimal"]
    log.info("profiled %s for %s: %d layers, optimal %d groups, predicted %.2f ms (ready %.2f ms)",
             wm.name, key, len(layer_bytes), len(best), best.predicted_s * 1e3, times.ready_s * 1e3)
    return profile


def with_direct_layers(profile: ModelProfile, direct_compute_s: list[float], fixed_group_bytes: int,
                       spared: list[int] | None = None) -> ModelProfile:
    """NOTE [Direct host access]: the longest prefix of the candidate layers whose compute
    from the host store (``direct_compute_s``, measured) costs less extra than copying
    them would take (``spared``: each layer's bytes, its shared tensors' too; default its
    own); the plans are made again with those layers direct."""
    sizes = profile.layer_bytes if spared is None else spared
    k = 0
    for i, direct in enumerate(direct_compute_s):
        if direct - profile.compute_s[i] >= sizes[i] / profile.link.bandwidth_Bps:
            break
        k = i + 1
    if k == 0:
        return profile
    profile.direct_layers, profile.direct_compute_s = k, list(direct_compute_s[:k])
    cost = profile.cost_model()
    profile.plans = {s: make_plan(s, cost, profile.layer_bytes, fixed_group_bytes) for s in STRATEGIES}
    log.info("%s: %d leading layers computed from host memory, optimal now %d groups, predicted %.2f ms",
             profile.model, k, len(profile.plans["optimal"]), profile.plans["optimal"].predicted_s * 1e3)
    return profile


def measure_ephemeral(run: Callable[[], object], device: torch.device) -> int:
    """The peak bytes ``run`` holds beyond what exists before it: counted through the
    dispatcher (NOTE [Counting ephemeral bytes]) and, on CUDA, also read from the
    caching allocator's peak; the larger of the two."""
    counted = EphemeralMeter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with counted:
        run()
    if device.type != "cuda":
        return counted.peak
    torch.cuda.synchronize(device)
    return max(counted.peak, torch.cuda.max_memory_allocated(device) - base)


def probe_link(engine: CopyEngine, device: torch.device, *, pin_host: bool) -> LinkCosts:
    """The link's costs, by copying a scratch host buffer to a scratch device buffer
    through ``engine``; the scratch memory is given back before this returns, and counts
    in no lane (``unmetered``: the probe may run inside a call in a lane)."""
    with unmetered():
        src = torch.full((LINK_PROBE_BYTES,), 7, dtype=torch.uint8, pin_memory=pin_host)
        dst = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
        link = measure_link(engine, src, dst, device)
        del src, dst
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    release_host_cache(device)
    log.info("link: %.2f GB/s + %.1f us per load, alpha %.1f us, beta %.1f us, latency %.1f us, "
             "queue %.1f us per group", link.bandwidth_Bps / 1e9, link.overhead_s * 1e6, link.alpha_s * 1e6,
             link.beta_s * 1e6, link.latency_s * 1e6, link.queue_s * 1e6)
    return link


def owners_of(layout: TensorLayout) -> dict[str, list[nn.Module]]:
    """Per tensor key, the distinct modules holding it, in store-entry order."""
    owners: dict[str, list[nn.Module]] = {e.key: [] for e in layout.entries}
    for slot in layout.slots:
        if all(slot.module is not o for o in owners[slot.key]):
            owners[slot.key].append(slot.module)
    return owners


def release_host_cache(device: torch.device) -> None:
    """Give cached pinned host blocks back to the OS (CUDA builds that expose it)."""
    if device.type == "cuda":
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
