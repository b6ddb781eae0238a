"""``timeshare bench variants``: fine-tuned variants of BERT-base held once (NOTE [Shared
tensors]). Runs in the CLI's process.

``variants`` variants (``models/zoo/variants.py``: one seeded base, each variant's own
pooler and classifier, and optionally its own last ``tuned_layers`` encoder layers) are
registered with ``dedup=True``. Reported:
- bytes: host memory (the models' own stores and the shared sets) and device memory with
  every variant resident, against what separate copies take (each model's bytes, summed);
- the switch: variant B requested while variant A ran, B not resident (evicted before,
  its shared base left in the arena): the first inference's latency, the bytes it copied
  and its overhead over B's resident call made right after, ``repeats`` times over
  successive pairs (paired, so that the machine's drift between runs cancels);
- against a full load of the same model by timeshare without deduplication (pipelined,
  after its profile), plain PyTorch (``load_state_dict`` from a host copy, ``.to(device)``,
  the inference; the module built beforehand), and the floor: the ready inference, and
  ``max(ready, bytes / measured link bandwidth)`` for each load.
With ``host_memory`` (NOTE [Shared tensors under a host budget]) the variants run under
that host budget, and a third switch is timed: B's own bytes dropped from host memory
too, so that its first inference reads them from disk while it copies them (the base
stays in host memory and in the arena); its latency and the bytes read from disk.
Every output is compared bitwise with the variant's plain-PyTorch output, with evicted
blocks poisoned (NaN) so that a tensor read before its copy could not go unnoticed.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from timeshare.bench.common import native_call, outputs_equal
from timeshare.bench.environment import describe
from timeshare.device import resolve_device, synchronize
from timeshare.errors import ConfigError, TimeshareError
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo.variants import SIZES, bert_variant
from timeshare.runtime.facade import Runtime
from timeshare.runtime.host_tier import HostTierSnapshot
from timeshare.runtime.observe import RuntimeSnapshot
from timeshare.runtime.sharing import SharingSnapshot
from timeshare.units import parse_bytes


@dataclass
class VariantsBenchConfig:
    variants: int = 10
    tuned_layers: int = 0
    batch: int = 1
    repeats: int = 10
    device: str = "auto"
    memory: str = "auto"
    size: str = "base"  # "tiny": the zoo's 2-layer BERT, for quick checks
    host_memory: str | None = None  # a host budget: switches from disk are timed too


@dataclass
class _Tally:
    """Outputs compared bitwise with plain PyTorch's, and how many were equal."""
    exact: int = 0
    total: int = 0

    def check(self, output, reference) -> None:
        self.exact += outputs_equal(output, reference)
        self.total += 1


@dataclass
class _DedupRun:
    """What the runtime with dedup measured: registering, bytes, the switches."""
    register_s: float
    shared: SharingSnapshot
    device_all: int
    link_Bps: float
    own: dict[str, int]
    switches: list[tuple[float, int, float]]
    from_disk: list[tuple[float, int, int]]
    host_tier: HostTierSnapshot | None
    after: SharingSnapshot


def run(config: VariantsBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    if config.variants < 2 or config.repeats < 1 or config.batch < 1 or config.size not in SIZES:
        raise ConfigError(f"variants must be at least 2, repeats and batch at least 1, size one of {list(SIZES)}")
    if config.host_memory not in (None, "auto"):
        parse_bytes(config.host_memory, what="host_memory")  # refused before anything is built
    device = resolve_device(config.device)
    inputs = zoo_get(SIZES[config.size][1]).example_inputs(config.batch, torch.float32)
    builders = [functools.partial(bert_variant, v, config.tuned_layers, size=config.size)
                for v in range(config.variants)]
    names = [f"variant{v}" for v in range(config.variants)]
    reference, ready_s, plain = _plain_pytorch(config, builders, names, inputs, device, progress)
    tally = _Tally()
    dedup = _with_dedup(config, builders, names, inputs, device, reference, tally, progress)
    full, full_bytes = _without_dedup(config, builders, names, inputs, device, reference, tally, progress)
    return _report(config, device, dedup, full, full_bytes, ready_s, plain, tally)


def _plain_pytorch(config: VariantsBenchConfig, builders: list, names: list[str], inputs: tuple,
                   device: torch.device, progress: Callable[[str], None]) -> tuple[dict, float, dict]:
    """Each variant in plain PyTorch: its reference output, the ready call's median and
    plain PyTorch's switch (``_plain_load``, on the second variant)."""
    reference, ready = {}, []
    for v, build in enumerate(builders):
        progress(f"plain PyTorch {v + 1}/{config.variants}")
        module = build().to(device)
        reference[names[v]] = native_call(module, inputs, device)
        for _ in range(3 if v == 0 else 1):
            t0 = time.perf_counter()
            native_call(module, inputs, device)
            ready.append(time.perf_counter() - t0)
        if v == 1:
            plain = _plain_load(module, build, inputs, device, config.repeats)
        del module
    return reference, statistics.median(ready), plain


def _with_dedup(config: VariantsBenchConfig, builders: list, names: list[str], inputs: tuple, device: torch.device,
                reference: dict, tally: _Tally, progress: Callable[[str], None]) -> _DedupRun:
    """The variants registered with dedup: their bytes, then the switches between them
    (and, under a host budget, the switches whose variant's own bytes come from disk)."""
    progress("timeshare with dedup: registering")
    from_disk: list[tuple[float, int, int]] = []
    host_tier = None
    with Runtime(device, config.memory, dedup=True, poison_evicted=True, host_memory=config.host_memory) as rt:
        t0 = time.perf_counter()
        for name, build in zip(names, builders):
            rt.register(name, build, example_inputs=inputs)
        register_s = time.perf_counter() - t0
        shared = _shared(rt.snapshot())
        for i, name in enumerate(names):  # first loads profile each variant (untimed), all end resident
            progress(f"timeshare: profiling {i + 1}/{len(names)}")
            tally.check(rt.infer(name, *inputs), reference[name])
            rt.profile(name, *inputs)
        device_all = rt.stats()["used_bytes"]
        link_Bps = rt.profile(names[0], *inputs).link.bandwidth_Bps
        own = {n: m.nbytes for n, m in rt.diagnostics().models.items()}
        switches = []
        for k in range(config.repeats):
            a, b = names[k % len(names)], names[(k + 1) % len(names)]
            progress(f"timeshare: switch {k + 1}/{config.repeats}")
            rt.infer(a, *inputs)  # A runs (loaded if needed), then B, not resident, is requested
            rt.evict(b)
            call = rt.call(b, inputs)
            if not call.record.loaded:
                raise TimeshareError(f"{b} was evicted but its call did not load it")
            warm = rt.call(b, inputs)  # the same call with B resident: the overhead's baseline
            tally.check(call.output, reference[b])
            tally.check(warm.output, reference[b])
            switches.append((call.record.seconds, call.record.moved_bytes or 0, warm.record.seconds))
        for k in range(config.repeats if config.host_memory is not None else 0):
            a, b = names[k % len(names)], names[(k + 1) % len(names)]
            progress(f"timeshare: switch from disk {k + 1}/{config.repeats}")
            rt.infer(a, *inputs)
            rt.evict(b, host=True)  # B's own bytes leave host memory too: read back from disk
            read = _tier(rt.snapshot()).bytes_read
            call = rt.call(b, inputs)
            tally.check(call.output, reference[b])
            from_disk.append((call.record.seconds, call.record.moved_bytes or 0,
                              _tier(rt.snapshot()).bytes_read - read))
        if config.host_memory is not None:
            host_tier = _tier(rt.snapshot())
        after = _shared(rt.snapshot())
    return _DedupRun(register_s=register_s, shared=shared, device_all=device_all, link_Bps=link_Bps, own=own,
                     switches=switches, from_disk=from_disk, host_tier=host_tier, after=after)


def _shared(snap: RuntimeSnapshot) -> SharingSnapshot:
    """The shared tensors' part of ``snap``: the runtime with dedup has one."""
    assert snap.shared is not None, "the runtime was opened with dedup"
    return snap.shared


def _tier(snap: RuntimeSnapshot) -> HostTierSnapshot:
    """The host tier's part of ``snap``, once the runtime has a host budget."""
    assert snap.host_tier is not None, "the runtime was opened with host_memory"
    return snap.host_tier


def _without_dedup(config: VariantsBenchConfig, builders: list, names: list[str], inputs: tuple,
                   device: torch.device, reference: dict, tally: _Tally,
                   progress: Callable[[str], None]) -> tuple[list[tuple[float, int, float]], int]:
    """Full loads of the second variant by timeshare without dedup, each paired with the
    resident call right after; and that model's bytes."""
    progress("timeshare without dedup: full loads")
    full = []
    with Runtime(device, config.memory, poison_evicted=True) as rt:
        rt.register(names[1], builders[1], example_inputs=inputs)
        rt.infer(names[1], *inputs)
        rt.profile(names[1], *inputs)
        full_bytes = rt.diagnostics().models[names[1]].nbytes
        for _ in range(config.repeats):
            rt.evict(names[1])
            call = rt.call(names[1], inputs)
            warm = rt.call(names[1], inputs)
            tally.check(call.output, reference[names[1]])
            tally.check(warm.output, reference[names[1]])
            full.append((call.record.seconds, call.record.moved_bytes or 0, warm.record.seconds))
    return full, full_bytes


def _report(config: VariantsBenchConfig, device: torch.device, dedup: _DedupRun,
            full: list[tuple[float, int, float]], full_bytes: int, ready_s: float, plain: dict,
            tally: _Tally) -> dict:
    """The result: bytes, the switch against the full load and plain PyTorch, the floors."""
    switches, from_disk, host_tier, shared, after = (dedup.switches, dedup.from_disk, dedup.host_tier, dedup.shared,
                                                     dedup.after)
    link_Bps, device_all = dedup.link_Bps, dedup.device_all
    switch_s, full_s = statistics.median(s for s, _, _ in switches), statistics.median(s for s, _, _ in full)
    moved = statistics.median(m for _, m, _ in switches)
    # Overheads are paired (each load against the resident call right after it): the
    # machine's speed drifts more between runs than a small switch costs.
    switch_over, switch_noise = _paired(switches)
    full_over, full_noise = _paired(full)
    logical = shared.logical_bytes
    disk = None
    if host_tier is not None:
        disk = {"budget": host_tier.budget, "used": host_tier.used, "shared_bytes": host_tier.shared_bytes,
                "drops": host_tier.drops, "fills": host_tier.fills,
                "switch_from_disk": {"first_inference_s": statistics.median(s for s, _, _ in from_disk),
                                     "moved_bytes": statistics.median(m for _, m, _ in from_disk),
                                     "read_bytes": statistics.median(r for _, _, r in from_disk),
                                     "samples_s": [s for s, _, _ in from_disk]}}
    return {
        "environment": describe(device),
        "config": {"variants": config.variants, "tuned_layers": config.tuned_layers, "batch": config.batch,
                   "size": config.size,
                   "repeats": config.repeats, "memory": config.memory, "host_memory": config.host_memory,
                   "tuned": "pooler and classifier" + (f", last {config.tuned_layers} encoder layers"
                                                      if config.tuned_layers else "")},
        "register_s": dedup.register_s,
        "bytes": {
            "one_model": full_bytes,
            "separate_copies": logical,
            "host": shared.own_bytes + shared.shared_bytes,
            "host_of_one": (shared.own_bytes + shared.shared_bytes) / full_bytes,
            "device_all_resident": device_all,
            "device_of_one": device_all / full_bytes,
            "shared_sets": shared.sets, "shared_bytes": shared.shared_bytes,
            "own_bytes_per_variant": statistics.median(dedup.own.values()),
            "host_after_switches": after.own_bytes + after.shared_bytes,
        },
        "link_GBps": link_Bps / 1e9,
        "ready_s": ready_s,
        "switch": {"first_inference_s": switch_s, "overhead_s": switch_over, "overhead_noise_s": switch_noise,
                   "moved_bytes": moved,
                   "floor_s": max(ready_s, moved / link_Bps), "copy_floor_s": moved / link_Bps,
                   "samples_s": [s for s, _, _ in switches], "resident_samples_s": [w for _, _, w in switches]},
        "full_load": {"first_inference_s": full_s, "overhead_s": full_over, "overhead_noise_s": full_noise,
                      "moved_bytes": statistics.median(m for _, m, _ in full),
                      "floor_s": max(ready_s, full_bytes / link_Bps), "copy_floor_s": full_bytes / link_Bps,
                      "samples_s": [s for s, _, _ in full], "resident_samples_s": [w for _, _, w in full]},
        "host_tier": disk,
        "plain_pytorch": plain,
        "switch_speedup_vs_full_load": full_s / switch_s,
        # The switch's overhead may be below what this machine can resolve: then the ratio
        # is a lower bound, the full load's overhead over the noise of the switch's.
        "switch_overhead_ratio_vs_full_load": full_over / max(switch_over, switch_noise),
        "switch_overhead_within_noise": switch_over <= switch_noise,
        "moved_ratio_vs_full_load": full_bytes / moved if moved else None,
        "outputs_exact": tally.exact, "outputs": tally.total,
    }


def _paired(samples: list[tuple[float, int, float]]) -> tuple[float, float]:
    """The median of (load - resident) over the pairs, and its noise: the median absolute
    deviation of those differences over the square root of their number."""
    diffs = [s - w for s, _, w in samples]
    mid = statistics.median(diffs)
    mad = statistics.median(abs(d - mid) for d in diffs)
    return mid, mad / len(diffs) ** 0.5


def _plain_load(module: torch.nn.Module, build, inputs: tuple, device: torch.device, repeats: int) -> dict:
    """Plain PyTorch's switch: the weights from a host copy into a module built beforehand
    (``load_state_dict``), moved to the device, then the inference."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in build().state_dict().items()}
    target = build()
    samples = []
    for _ in range(repeats):
        target = target.to("cpu")
        t0 = time.perf_counter()
        target.load_state_dict(state)
        target = target.to(device)
        native_call(target, inputs, device)
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    return {"first_inference_s": statistics.median(samples), "samples_s": samples}


def plot(result: dict, path) -> None:
    """Bytes held (host, device) against separate copies, and first-inference latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = result["bytes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["separate copies", "host (dedup)", "device (dedup)", "one model"]
    values = [b["separate_copies"], b["host"], b["device_all_resident"], b["one_model"]]
    left.bar(labels, [v / 1e6 for v in values], color=["#999", "#1f77b4", "#2ca02c", "#ccc"])
    left.set_ylabel("MB")
    left.set_title(f"{result['config']['variants']} variants ({result['config']['tuned']} tuned)")
    rows = [("ready (floor)", result["ready_s"]), ("variant switch", result["switch"]["first_inference_s"]),
            ("full load", result["full_load"]["first_inference_s"]),
            ("plain PyTorch", result["plain_pytorch"]["first_inference_s"])]
    colors = ["#ccc", "#1f77b4", "#ff7f0e", "#999"]
    if result.get("host_tier"):
        rows.insert(2, ("switch from disk", result["host_tier"]["switch_from_disk"]["first_inference_s"]))
        colors.insert(2, "#aec7e8")
    right.bar([r[0] for r in rows], [r[1] * 1e3 for r in rows], color=colors)
    right.tick_params(axis="x", labelrotation=15)
    right.set_ylabel("first inference after the switch, ms")
    right.set_title(f"{result['environment']['device']}, batch {result['config']['batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
