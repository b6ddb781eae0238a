"""Tensors held once across models (NOTE [Shared tensors]): fine-tuned variants of one
base share its tensors in host memory and in the arena, a switch between them copies only
what differs, outputs stay exact, and memory is given back."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch

import timeshare.transfer.copy as copy_mod
from tests.models import VariantNet, variant_net
from timeshare.errors import ConfigError, MemoryBudgetError, ModelTooLargeError, PipelineError, WeightsError
from timeshare.executor.inprocess import InProcessExecutor
from timeshare.executor.testing import in_process_worker
from timeshare.runtime import sharing
from timeshare.runtime.facade import Runtime

IDS = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))
BASE_BYTES = sum(p.numel() * 4 for name, p in VariantNet().named_parameters()
                 if not name.startswith(("head", "out")) and p.numel() * 4 >= sharing.MIN_SHARED_BYTES)


def want(v: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    net = variant_net(v)
    if dtype is not None:
        net = net.to(dtype)
    with torch.no_grad():
        return net(IDS)


def register(rt: Runtime, v: int, name: str | None = None, **kw) -> str:
    name = name or f"v{v}"
    rt.register(name, functools.partial(variant_net, v), example_inputs=(IDS,), **kw)
    return name


def loads_of(rt: Runtime, name: str):
    call = rt.call(name, (IDS,))
    assert call.record.loaded
    return call


def test_variants_share_their_base_and_a_switch_copies_only_what_differs():
    # Evicted blocks poisoned and every copy held back: a tensor read from a set that was
    # not copied, or before its copy, gives other outputs.
    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True, copy_delay_s=0.002) as rt:
        for v in range(3):
            register(rt, v)
        shared = rt.snapshot().shared
        assert shared.sets == 1 and shared.shared_bytes >= BASE_BYTES
        assert shared.own_bytes + shared.shared_bytes < shared.logical_bytes / 2
        own = {n: m.nbytes for n, m in rt.diagnostics().models.items()}
        assert all(n < BASE_BYTES / 2 for n in own.values())

        first = loads_of(rt, "v0")  # copies the set too
        assert torch.equal(first.output, want(0))
        assert first.record.moved_bytes == own["v0"] + shared.shared_bytes
        for rep in range(2):
            for v in (1, 2, 0):
                rt.evict(f"v{(v - 1) % 3}")
                call = loads_of(rt, f"v{v}")
                assert torch.equal(call.output, want(v)), (rep, v)
                # The set stayed in the arena: only the variant's own bytes moved (the
                # second load of a model is pipelined, the first copies it whole).
                assert call.record.moved_bytes <= own[f"v{v}"], (rep, v, call.record.moved_bytes)
                assert torch.equal(rt.infer(f"v{v}", IDS), want(v))  # resident
        assert rt.diagnostics().shared.resident_shared_bytes == shared.shared_bytes


def test_a_resident_model_whose_tensors_become_shared_is_laid_out_again_and_stays_exact():
    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True) as rt:
        register(rt, 0)
        assert torch.equal(rt.infer("v0", IDS), want(0))
        before = rt.diagnostics().models["v0"].nbytes
        register(rt, 1)  # v0's base moves into a shared set: v0 leaves the arena first
        assert rt.resident() == []
        assert rt.diagnostics().models["v0"].nbytes < before / 2
        for v in (0, 1, 0):
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v))


def test_a_pinned_model_whose_tensors_become_shared_is_resident_again_after_the_registration():
    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True) as rt:
        register(rt, 0, pin=True)
        assert torch.equal(rt.infer("v0", IDS), want(0))
        register(rt, 1)  # v0 is laid out again: it leaves the arena, and comes back
        assert rt.is_resident("v0") and rt.snapshot().shared.sets == 1
        call = rt.call("v0", (IDS,))
        assert not call.record.loaded and torch.equal(call.output, want(0))
        assert torch.equal(rt.infer("v1", IDS), want(1))


def test_unregistering_gives_every_byte_back():
    with Runtime("cpu", "64MiB", dedup=True) as rt:
        for v in range(3):
            register(rt, v)
            rt.infer(f"v{v}", IDS)
        worker = in_process_worker(rt)
        assert len(worker.shared) == 1
        rt.unregister("v0")
        rt.unregister("v1")
        assert torch.equal(rt.infer("v2", IDS), want(2))  # its set stays while it uses it
        assert len(worker.shared) == 1
        rt.unregister("v2")
        assert worker.shared == {} and worker.models == {}
        assert rt.stats()["used_bytes"] == 0
        shared = rt.snapshot().shared
        assert (shared.sets, shared.own_bytes, shared.shared_bytes, shared.resident_shared_bytes) == \
            (0, 0, 0, 0)
        register(rt, 1)  # registering anew starts from nothing
        assert torch.equal(rt.infer("v1", IDS), want(1))


def test_a_spare_set_is_freed_when_room_is_needed_and_copied_again_later():
    big = functools.partial(variant_net, 7, base_seed=9)  # another base and head: nothing shared
    own_v0 = None
    with Runtime("cpu", 2_621_440, dedup=True, poison_evicted=True) as rt:
        register(rt, 0)
        register(rt, 1)
        rt.register("other", big, example_inputs=(IDS,))
        own_v0 = rt.diagnostics().models["v0"].nbytes
        assert torch.equal(rt.infer("v0", IDS), want(0))
        with torch.no_grad():
            assert torch.equal(rt.infer("other", IDS), big()(IDS))  # evicts v0, then frees its set
        sets = rt.diagnostics().shared_sets
        assert len(sets) == 1 and all(s.offset is None and not s.loaded for s in sets.values())
        call = loads_of(rt, "v1")
        assert torch.equal(call.output, want(1))
        assert call.record.moved_bytes > own_v0  # the set came back with it


def test_a_load_copies_the_whole_set_also_what_its_model_does_not_use():
    # v2 tunes its norm too: the set (made from v0 and v1) holds a norm v2 never reads.
    # When v2's load brings the set back, the norm must come with it, or v0 reads poison.
    v2 = functools.partial(variant_net, 2, tuned=("head", "out", "norm"))
    big = functools.partial(variant_net, 7, base_seed=9)
    with Runtime("cpu", 2_621_440, dedup=True, poison_evicted=True) as rt:
        register(rt, 0)
        register(rt, 1)
        rt.register("v2", v2, example_inputs=(IDS,))
        rt.register("other", big, example_inputs=(IDS,))
        assert rt.snapshot().shared.sets == 1
        with torch.no_grad():
            want2 = v2()(IDS)
            for _ in range(2):  # the second time v2's load is pipelined
                assert torch.equal(rt.infer("v2", IDS), want2)
                rt.evict("v2")
                rt.infer("other", IDS)  # evicts the set: poisoned
                assert rt.diagnostics().shared_sets["shared-1"].offset is None
            assert torch.equal(rt.infer("v2", IDS), want2)
        assert torch.equal(rt.infer("v0", IDS), want(0))


def test_a_failed_relayout_changes_nothing(monkeypatch):
    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True) as rt:
        register(rt, 0)
        assert torch.equal(rt.infer("v0", IDS), want(0))
        original = InProcessExecutor.pack_shared

        def refuse(self, spec, *args):
            if spec.name == "v0":
                raise OSError("no room in /dev/shm")
            return original(self, spec, *args)

        monkeypatch.setattr(InProcessExecutor, "pack_shared", refuse)
        with pytest.raises(OSError, match="no room"):
            register(rt, 1)
        monkeypatch.undo()
        assert rt.models() == ["v0"] and rt.snapshot().shared.sets == 0
        assert torch.equal(rt.infer("v0", IDS), want(0))
        # The executor lets go of v0's old copy, then refuses the new one: v0 gets its
        # old layout back and still answers.
        original_add = InProcessExecutor.add

        def refuse_add(self, packed):
            if packed.name == "v0" and packed.shared:
                raise OSError("worker refused")
            return original_add(self, packed)

        monkeypatch.setattr(InProcessExecutor, "add", refuse_add)
        with pytest.raises(OSError, match="worker refused"):
            register(rt, 1)
        monkeypatch.undo()
        assert rt.models() == ["v0"] and rt.snapshot().shared.sets == 0
        assert in_process_worker(rt).shared == {}
        assert torch.equal(rt.infer("v0", IDS), want(0))
        register(rt, 1)  # and it works once the cause is gone
        assert rt.snapshot().shared.sets == 1
        assert torch.equal(rt.infer("v1", IDS), want(1)) and torch.equal(rt.infer("v0", IDS), want(0))
        rt.unregister("v0")
        rt.unregister("v1")
        assert in_process_worker(rt).shared == {}


def test_a_failed_load_leaves_no_set_behind(monkeypatch):
    original = copy_mod.CpuLoad.copy_group

    def broken(self, k):
        raise OSError("link down")

    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True) as rt:
        register(rt, 0)
        register(rt, 1)
        monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", broken)
        with pytest.raises(PipelineError, match="link down"):
            rt.infer("v0", IDS)
        assert rt.stats()["used_bytes"] == 0
        sets = rt.diagnostics().shared_sets
        assert len(sets) == 1 and all(s.offset is None for s in sets.values())
        monkeypatch.setattr(copy_mod.CpuLoad, "copy_group", original)
        assert torch.equal(rt.infer("v1", IDS), want(1))
        assert torch.equal(rt.infer("v0", IDS), want(0))


def test_equal_digests_with_different_bytes_are_not_shared(monkeypatch):
    # Every tensor gets the same digest: only the comparison of bytes tells them apart.
    monkeypatch.setattr(sharing, "digest", lambda t: "collision")
    with Runtime("cpu", "64MiB", dedup=True, poison_evicted=True) as rt:
        rt.register("a", functools.partial(variant_net, 0, base_seed=1), example_inputs=(IDS,))
        rt.register("b", functools.partial(variant_net, 0, base_seed=2), example_inputs=(IDS,))
        assert rt.snapshot().shared.sets == 0
        with torch.no_grad():
            assert torch.equal(rt.infer("b", IDS), variant_net(0, base_seed=2)(IDS))
            assert torch.equal(rt.infer("a", IDS), variant_net(0, base_seed=1)(IDS))


def test_other_dtypes_share_nothing_and_the_same_dtype_shares():
    with Runtime("cpu", "64MiB", dedup=True) as rt:
        register(rt, 0)
        register(rt, 1, dtype="bfloat16")
        assert rt.snapshot().shared.sets == 0  # converted bytes differ
        register(rt, 2, dtype="bfloat16")
        assert rt.snapshot().shared.sets == 1
        assert torch.equal(rt.infer("v0", IDS), want(0))
        for v in (1, 2):
            assert torch.equal(rt.infer(f"v{v}", IDS.clone()), want(v, torch.bfloat16))


def test_a_model_and_its_sets_larger_than_the_arena_is_refused_clearly():
    with Runtime("cpu", "1MiB", dedup=True) as rt:
        register(rt, 0)
        register(rt, 1)
        with pytest.raises(ModelTooLargeError, match="'v0' needs"):
            rt.infer("v0", IDS)
        assert rt.stats()["used_bytes"] == 0


def test_with_workers_variants_share_their_base_and_answer_exactly():
    # Two workers: the set is taught to each, before the models; a relaid-out model is
    # taught again; a switch copies only the variant's own bytes in whichever worker runs it.
    with Runtime("cpu", "64MiB", dedup=True, workers=2, poison_evicted=True) as rt:
        for v in range(3):
            register(rt, v)
        shared = rt.snapshot().shared
        assert shared.sets == 1
        own = {n: m.nbytes for n, m in rt.diagnostics().models.items()}
        assert torch.equal(rt.infer("v0", IDS), want(0))
        for v in (1, 2, 0, 1):
            rt.evict(f"v{(v - 1) % 3}")
            call = loads_of(rt, f"v{v}")
            assert torch.equal(call.output, want(v)), v
            assert call.record.moved_bytes <= own[f"v{v}"]
        # Workers that die are replaced, and the replacements are taught the set first.
        for pid in rt.worker_pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while rt.snapshot().workers.replacements < 2 or rt.snapshot().workers.ready < 2:
            assert time.monotonic() < deadline, rt.snapshot().workers
            time.sleep(0.05)
        for v in (0, 1, 2):
            rt.evict(f"v{v}")
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v)), v
        rt.unregister("v0")
        rt.unregister("v1")
        assert torch.equal(rt.infer("v2", IDS), want(2))
        rt.unregister("v2")
        assert rt.snapshot().shared.sets == 0 and rt.stats()["used_bytes"] == 0


OWN_BYTES = sum(p.numel() * 4 for name, p in VariantNet().named_parameters() if name.startswith(("head", "out")))


@pytest.mark.parametrize("workers", [0, 2])
def test_under_a_host_budget_the_sets_stay_and_the_variants_stores_come_back_from_disk(tmp_path, workers):
    # NOTE [Shared tensors under a host budget]: room for the set and about two variants'
    # own bytes; six variants, each evicted from both tiers in turn (blocks poisoned).
    budget = BASE_BYTES + OWN_BYTES * 5 // 2
    with Runtime("cpu", "64MiB", dedup=True, host_memory=budget, spill_dir=str(tmp_path), workers=workers,
                 poison_evicted=True) as rt:
        for v in range(6):
            register(rt, v)
            assert rt.snapshot().host_tier.used <= budget
        shared = rt.snapshot().shared
        tier = rt.snapshot().host_tier
        assert shared.sets == 1 and tier.shared_bytes == shared.shared_bytes >= BASE_BYTES
        assert tier.drops >= 3  # six own stores do not fit beside the set
        for v in (0, 3, 1, 5, 2, 4, 0):
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v)), v
            rt.evict(f"v{v}", host=True)
            assert rt.snapshot().host_tier.used <= budget
        tier = rt.snapshot().host_tier
        assert tier.fills >= 6 and tier.bytes_read >= 6 * OWN_BYTES
        for v in range(6):
            rt.unregister(f"v{v}")
        assert rt.snapshot().host_tier.used == 0 and rt.snapshot().shared.sets == 0
        assert list(tmp_path.iterdir()) == []  # every spill file removed


def test_under_a_host_budget_a_load_read_from_disk_copies_the_set_it_misses_beside():
    # A pipelined load whose own store streams from disk while its set, freed from the
    # arena for "other" (poisoned), is copied in the same groups.
    other = functools.partial(variant_net, 7, base_seed=9)
    with Runtime("cpu", 2_621_440, dedup=True, host_memory=2 * BASE_BYTES + 2 * OWN_BYTES, poison_evicted=True,
                 copy_delay_s=0.002) as rt:
        register(rt, 0)
        register(rt, 1)
        rt.register("other", other, example_inputs=(IDS,))
        assert torch.equal(rt.infer("v0", IDS), want(0))  # the first load: whole, profiled
        for _ in range(2):
            rt.evict("v0", host=True)
            with torch.no_grad():
                assert torch.equal(rt.infer("other", IDS), other()(IDS))
            assert all(s.offset is None for s in rt.diagnostics().shared_sets.values())
            before = rt.snapshot().host_tier.streamed_fills
            assert torch.equal(rt.infer("v0", IDS), want(0))
            assert rt.snapshot().host_tier.streamed_fills == before + 1


def test_under_a_host_budget_a_dropped_store_is_read_back_to_be_matched():
    # v0's store goes to disk for another model; registering v1 must still find v0's base.
    other = functools.partial(variant_net, 7, base_seed=9)
    with Runtime("cpu", "64MiB", dedup=True, host_memory=2 * BASE_BYTES + OWN_BYTES * 3 // 2,
                 poison_evicted=True) as rt:
        register(rt, 0)
        rt.register("other", other, example_inputs=(IDS,))
        assert rt.diagnostics().host_stores["v0"].filled is False  # dropped for "other"
        register(rt, 1)
        assert rt.snapshot().shared.sets == 1
        with torch.no_grad():
            assert torch.equal(rt.infer("other", IDS), other()(IDS))
        for v in (1, 0, 1):
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v)), v
            rt.evict(f"v{v}", host=True)


def test_under_a_host_budget_a_store_that_cannot_come_back_is_not_matched_and_fails_its_model_alone(tmp_path):
    # v0's store was dropped to its spill file, which is then cut short: registering v1
    # cannot compare with v0, so it holds its own copy; v0's calls fail, v1 answers.
    other = functools.partial(variant_net, 7, base_seed=9)
    with Runtime("cpu", "64MiB", dedup=True, host_memory=2 * BASE_BYTES + OWN_BYTES * 3 // 2,
                 spill_dir=str(tmp_path)) as rt:
        register(rt, 0)
        rt.register("other", other, example_inputs=(IDS,))
        (spill,) = [p for p in tmp_path.iterdir() if p.name.startswith("v0-")]
        os.truncate(spill, spill.stat().st_size - 100)
        register(rt, 1)
        assert rt.snapshot().shared.sets == 0
        assert torch.equal(rt.infer("v1", IDS), want(1))
        with pytest.raises(WeightsError, match="damaged"):
            rt.infer("v0", IDS)
        assert torch.equal(rt.infer("v1", IDS), want(1))
        register(rt, 2)  # matched against v1's copy now, not v0's lost one
        assert rt.snapshot().shared.sets == 1
        for v in (2, 1):
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v)), v


def test_under_a_host_budget_a_registration_whose_sets_would_crowd_out_another_model_is_refused():
    # "other" fits the budget alone; sharing v0's base with v1 would hold a set beside it
    # that leaves no room for "other" ever again: the registration of v1 is refused.
    other = functools.partial(variant_net, 7, base_seed=9)
    with Runtime("cpu", "64MiB", dedup=True, host_memory=BASE_BYTES + OWN_BYTES * 3 // 2) as rt:
        rt.register("other", other, example_inputs=(IDS,))
        register(rt, 0)
        with pytest.raises(MemoryBudgetError, match="model 'other' needs .* beside the .* shared tensors held"):
            register(rt, 1)
        assert rt.models() == ["other", "v0"] and rt.snapshot().shared.sets == 0
        with torch.no_grad():
            assert torch.equal(rt.infer("other", IDS), other()(IDS))
        assert torch.equal(rt.infer("v0", IDS), want(0))


def test_under_a_host_budget_a_variant_that_does_not_fit_beside_the_sets_is_refused_and_loses_nothing():
    with Runtime("cpu", "64MiB", dedup=True, host_memory=BASE_BYTES + OWN_BYTES * 3 // 2) as rt:
        register(rt, 0)
        register(rt, 1)
        big_head = functools.partial(variant_net, 2, tuned=("head", "out", "base"))
        with pytest.raises(MemoryBudgetError, match="shared tensors held"):
            rt.register("v2", big_head, example_inputs=(IDS,))
        assert rt.models() == ["v0", "v1"] and rt.snapshot().shared.sets == 1
        for v in (0, 1):
            assert torch.equal(rt.infer(f"v{v}", IDS), want(v)), v


class SlowVariant(VariantNet):
    """A variant whose forward first sleeps ``delay`` seconds (set by the test)."""

    delay = 0.0

    def forward(self, ids):
        time.sleep(SlowVariant.delay)
        return super().forward(ids)


def slow_variant(v: int) -> SlowVariant:
    net = SlowVariant().eval()
    net.load_state_dict(variant_net(v).state_dict())
    return net


def test_with_lanes_a_model_laid_out_again_is_laid_out_once_its_running_call_ends():
    """A registration under pack that shares a running model's tensors waits for its call:
    the running forward reads its own weights to the end (evicted blocks are poisoned)."""
    with Runtime("cpu", "64MiB", dedup=True, scheduling="pack", lane_memory="16MiB", poison_evicted=True) as rt:
        rt.register("s0", functools.partial(slow_variant, 0), example_inputs=(IDS,))
        for _ in range(2):  # measured: it asks for its own lane
            assert torch.equal(rt.infer("s0", IDS), want(0))
        SlowVariant.delay = 0.5
        try:
            done: dict = {}

            def slow_call():
                done["out"] = rt.infer("s0", IDS)
                done["at"] = time.monotonic()

            caller = threading.Thread(target=slow_call)
            caller.start()
            time.sleep(0.15)  # in its forward, outside the runtime's lock
            register(rt, 1)  # shares s0's base: s0 is laid out again
            registered = time.monotonic()
            caller.join(10)
        finally:
            SlowVariant.delay = 0.0
        assert torch.equal(done["out"], want(0)) and registered >= done["at"]
        assert rt.snapshot().shared.sets == 1
        assert torch.equal(rt.infer("v1", IDS), want(1)) and torch.equal(rt.infer("s0", IDS), want(0))


def test_dedup_needs_example_inputs():
    with Runtime("cpu", "16MiB", dedup=True) as rt:
        with pytest.raises(ConfigError, match="example_inputs"):
            rt.register("v0", functools.partial(variant_net, 0))
        assert rt.models() == []


def test_with_lanes_a_registration_runs_alone_beside_a_training_job_that_holds_persistent_memory():
    """NOTE [Asks that shrink]: a job's state is admitted for its whole life; a registration
    asking for every lane's bytes must not wait for more than the rest, forever."""
    from tests.models import adam, endless_batches, train_net, train_step

    with Runtime("cpu", "64MiB", dedup=True, scheduling="pack", lane_memory="16MiB") as rt:
        job = rt.train("bg", train_net, adam, endless_batches, train_step)
        deadline = time.monotonic() + 30
        while job.stats.iterations < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.stats.persistent_bytes  # measured: re-admitted with its state
        done = threading.Event()

        def registrations():
            register(rt, 0)
            register(rt, 1)
            done.set()

        t = threading.Thread(target=registrations, daemon=True)
        t.start()
        assert done.wait(30), "the registration never got its turn"
        assert torch.equal(rt.infer("v0", IDS), want(0)) and torch.equal(rt.infer("v1", IDS), want(1))
        assert job.status == "running" and job.error is None
        job.cancel()
        assert job.wait(30)
