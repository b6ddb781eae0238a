"""The costs of moving weights, on the CPU: the link probe (device-timed through a fake
engine that implements the real interface, host-timed through the CPU copy engine),
the host's queueing cost reaching the planner, per-layer timing marks, the one
definition of a bench's floor, and the per-plan events a worker hands its copy engine."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from tests import models
from timeshare.bench import link as link_bench
from timeshare.errors import PipelineError
from timeshare.memory.arena import Arena
from timeshare.models.binding import collect, unbind
from timeshare.transfer.copy import CopyEngine, CpuCopyEngine, LoadEvents, LoadHandle
from timeshare.transfer.host_store import HostStore
from timeshare.transfer.profiler import LinkCosts, ModelProfile, measure_link, time_layers
from timeshare.worker.worker import Worker

CPU = torch.device("cpu")


class _Arrived(LoadHandle):
    """A load that has arrived, with a device timing of its own choosing."""

    def __init__(self, n_groups: int, seconds: float):
        self.n_groups, self.where, self.seconds = n_groups, "fake", seconds

    def wait(self, k: int) -> None:
        pass

    def done(self) -> bool:
        return True

    def copy_seconds(self) -> float | None:
        return self.seconds


class DeviceTimedEngine(CopyEngine):
    """A copy engine whose loads take, on its (fake) device, a fixed cost per load, a
    cost per group and the bytes over a bandwidth: what measure_link must recover."""

    host_waits = False
    device_timed = True

    def __init__(self, fixed_s: float, per_group_s: float, bandwidth_Bps: float):
        self.fixed_s, self.per_group_s, self.bandwidth_Bps = fixed_s, per_group_s, bandwidth_Bps
        self.held: list[float] = []
        self.events: dict[tuple, set[int]] = {}  # ranges -> ids of the LoadEvents given with them

    def hold(self, seconds: float) -> None:
        self.held.append(seconds)

    def start(self, src, dst, ranges, where, fences=(), events=None, ready=None, shared=None, deadline_s=None):
        assert isinstance(events, LoadEvents)
        self.events.setdefault(tuple(ranges), set()).add(id(events))
        nbytes = sum(b - a for a, b in ranges)
        return _Arrived(len(ranges), self.fixed_s + len(ranges) * self.per_group_s + nbytes / self.bandwidth_Bps)


def test_the_link_probe_reads_device_timings_and_takes_the_fixed_cost_apart():
    engine = DeviceTimedEngine(fixed_s=20e-6, per_group_s=3e-6, bandwidth_Bps=25e9)
    nbytes = 1 << 20
    link = measure_link(engine, torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8), CPU)
    assert link.bandwidth_Bps == pytest.approx(25e9, rel=1e-9)
    assert link.overhead_s == pytest.approx(20e-6 + 3e-6, rel=1e-9)  # a one-group load's fixed part
    assert link.alpha_s == pytest.approx(3e-6, rel=1e-9)
    assert link.latency_s == 0.0 and link.probe_bytes == nbytes
    assert 0 <= link.queue_s < 1e-3
    # every load held until queued; each kind of load (whole buffer, one tiny group, 64
    # tiny groups) reused its events, as a plan's loads do
    assert engine.held and all(h > 0 for h in engine.held)
    assert sorted(len(r) for r in engine.events) == [1, 1, 64]
    assert all(len(ids) == 1 for ids in engine.events.values())
    assert len(set().union(*engine.events.values())) == 3


def test_the_link_probe_on_the_cpu_copy_engine_uses_the_host_clock():
    engine = CpuCopyEngine(deadline_s=10)
    try:
        nbytes = 4 << 20
        link = measure_link(engine, torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8),
                            CPU, repeats=3)
    finally:
        engine.close()
    assert link.bandwidth_Bps > 1e8
    # host-timed: a load's fixed cost holds the hand-off to the copy thread and back
    assert link.overhead_s > 0 and link.latency_s == pytest.approx(max(0.0, link.overhead_s - link.alpha_s))
    assert 0 < link.queue_s < 1e-3  # one put on a queue, and an Event per group


def test_the_link_probe_is_not_held_to_the_users_load_timeout(monkeypatch):
    # A runtime made with a tight load_timeout_s (a test of a stuck copy) still measures
    # its link on a loaded host, where the probe's 64 MiB took longer than that once.
    from timeshare.transfer import copy as copy_mod

    real, slow = copy_mod.CpuLoad.copy_group, {"left": 1}

    def first_slow(self, k):
        if slow["left"]:
            slow["left"] -= 1
            time.sleep(0.2)
        real(self, k)

    monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", first_slow)
    engine = CpuCopyEngine(deadline_s=0.05)
    try:
        nbytes = 1 << 20
        link = measure_link(engine, torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8),
                            CPU, repeats=1)
        assert link.bandwidth_Bps > 0 and slow["left"] == 0
        # ... while a model's load still is
        slow["left"] = 1
        h = engine.start(torch.zeros(8), torch.zeros(8), [(0, 8)], "loading m")
        with pytest.raises(PipelineError, match="did not arrive within 0.05 s"):
            h.wait_all()
    finally:
        engine.close()


def test_link_costs_from_before_the_queue_and_overhead_fields_still_load():
    costs = LinkCosts(10e9, 1e-6, 2e-6, 0.0, 64)
    state = dict(costs.__dict__)
    del state["queue_s"], state["overhead_s"]
    old = LinkCosts.__new__(LinkCosts)
    old.__dict__.update(state)  # what a pickle made before the fields existed holds
    back = pickle.loads(pickle.dumps(old))
    assert back.queue_s == 0.0 and back.overhead_s == 0.0 and back.bandwidth_Bps == 10e9


def _profile(link: LinkCosts) -> ModelProfile:
    return ModelProfile("m", "cpu", "k", ["a", "b"], [1000, 3000], [1e-3, 2e-3], link, 3e-3, 0, {})


def test_the_planner_is_charged_the_hosts_queueing():
    link = LinkCosts(1e9, 1e-6, 1e-6, 0.0, 64, queue_s=50e-6, overhead_s=7e-6)
    cost = _profile(link).cost_model()
    assert cost.queue == 50e-6 and cost.alpha == 1e-6
    summary = _profile(link).summary()
    assert summary["queue_us"] == pytest.approx(50.0) and summary["overhead_us"] == pytest.approx(7.0)
    from timeshare.transfer import planner

    # two groups are queued before the forward starts: it cannot start before 2 q
    assert planner.first_inference_time(cost, (1, 2)) >= 2 * 50e-6 + sum(cost.compute)


def test_one_floor_for_every_bench():
    link = LinkCosts(2e9, 1e-6, 1e-6, 0.0, 64, overhead_s=30e-6)
    nbytes = 10_000_000
    fit = {"fit": {"h2d": {"bandwidth_GBps": 2.0, "overhead_us": 30.0}}}
    # max(overhead + bytes / bandwidth, ready): 0.03 + 5 ms against a 1 ms ready model
    assert link_bench.load_floor_ms(nbytes, link.bandwidth_Bps, link.overhead_s, 1.0) == pytest.approx(5.03)
    assert link_bench.floor_ms(nbytes, fit, 1.0) == pytest.approx(5.03)
    assert link_bench.floor_ms(nbytes, fit, 9.0) == 9.0


class _Skips(torch.nn.Module):
    """Three layers; the middle one runs only when asked."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        if self.use_b:
            x = self.b(x)
        return self.c(x)


def test_layer_times_give_a_layer_that_did_not_run_zero():
    module = _Skips().eval()
    x = torch.randn(256, 64)

    def run():
        with torch.no_grad():
            module(x)

    times = time_layers(module, run, [module.a, module.b, module.c], CPU, repeats=3)
    assert all(c > 0 for c in times.compute_s) and times.samples == 3
    assert sum(times.compute_s) <= times.ready_s * (1 + 1e-9)  # scaled to the plain forward at most
    module.use_b = False
    skipped = time_layers(module, run, [module.a, module.b, module.c], CPU, repeats=3)
    assert skipped.compute_s[1] == 0.0 and skipped.compute_s[0] > 0 and skipped.compute_s[2] > 0


class SpyEngine(CpuCopyEngine):
    """The CPU copy engine, recording the events handed with each model load."""

    def __init__(self):
        super().__init__(deadline_s=10)
        self.given: list[tuple[str, int, object]] = []

    def start(self, src, dst, ranges, where, fences=(), events=None, ready=None, shared=None, deadline_s=None):
        self.given.append((where, len(ranges), events))
        return super().start(src, dst, ranges, where, fences, events, ready, shared, deadline_s)


def test_a_worker_hands_the_engine_the_same_events_on_every_load_of_a_plan():
    engine = SpyEngine()
    arena = Arena(CPU, 1 << 20)
    try:
        worker = Worker(CPU, arena, engine, profile_repeats=1)
        module = models.out_of_order().eval()
        x = torch.randn(2, 8)
        layout = collect(module)
        store = HostStore.pack(layout.entries, layout.tensors())
        unbind(layout)
        worker.add("m", module, layout, store)
        block = arena.allocate(store.nbytes, "m")
        assert block is not None
        expected = worker.to_host(worker.run("m", block.offset, False, (x,), {}, "optimal"))  # first load
        for strategy in ("per_layer", "optimal", "per_layer", "optimal"):
            worker.release("m")
            out = worker.to_host(worker.run("m", block.offset, False, (x,), {}, strategy))
            assert torch.equal(out["y"], expected["y"])
        loads = [(n, ev) for where, n, ev in engine.given if where == "loading m"]
        assert len(loads) == 4 and all(isinstance(ev, LoadEvents) for _, ev in loads)
        per_layer, optimal = loads[0::2], loads[1::2]
        assert per_layer[0][1] is per_layer[1][1] and optimal[0][1] is optimal[1][1]
        assert per_layer[0][1] is not optimal[0][1]
        worker.release("m")
        worker.remove("m")
    finally:
        engine.close()
        arena.close()
