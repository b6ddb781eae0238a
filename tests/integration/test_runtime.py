"""The in-process runtime on the CPU backend: exact outputs, eviction, errors. (The zoo's
outputs under every load strategy, in-process and with workers: test_workers.py.)"""

import os

import pytest
import torch

import timeshare
from tests import models
from tests.exact import nan_free, plain_outputs, same
from timeshare.errors import (
    ConfigError,
    DuplicateModelError,
    MemoryBudgetError,
    ModelError,
    ModelTooLargeError,
    TimeshareError,
    UnknownModelError,
    WeightsError,
)
from timeshare.models.zoo import ZOO, weights_path
from timeshare.transfer.planner import STRATEGIES


@pytest.fixture
def rt():
    with timeshare.Runtime(device="cpu", memory="64MiB", profile_repeats=1,
                           poison_evicted=True) as r:  # NOTE [Poisoned reloads]
        yield r


@pytest.mark.parametrize("case", sorted(models.CASES))
def test_weight_sharing_and_odd_modules(rt, case):
    build = models.CASES[case]
    x = (torch.randn(4, 8),)
    rt.register(case, build, None, x)
    ref = plain_outputs(build, None, *x)
    assert same(rt.infer(case, *x), ref)  # profiling load
    for strategy in STRATEGIES:
        rt.evict(case)
        assert same(rt.call(case, x, strategy=strategy).output, ref), strategy
        assert same(rt.infer(case, *x), ref)


def test_tail_tensors_used_by_another_call_arrive_in_time(rt):
    # The traced call never touches the head; a later first call does.
    x = torch.randn(4, 8)
    rt.register("m", models.optional_head, None, (x,))
    rt.infer("m", x)
    prof = rt.profile("m")
    assert prof.tail_bytes > 0
    ref = plain_outputs(models.optional_head, None, x, use_head=True)
    for strategy in STRATEGIES:
        rt.evict("m")
        out = rt.call("m", (x,), {"use_head": True}, strategy=strategy).output
        assert same(out, ref), strategy


def test_kwargs_and_dataclass_outputs_of_bert(rt):
    zoo = ZOO["tiny_bert"]
    ids, mask = zoo.example_inputs(2)
    rt.register("bert", zoo.builder, weights_path("tiny_bert"), (ids,), example_kwargs={"attention_mask": mask})
    out = rt.infer("bert", ids, attention_mask=mask)
    assert type(out).__name__ == "BertOutput" and out.last_hidden_state.shape == (2, 16, 64)
    rt.evict("bert")
    assert same(rt.infer("bert", ids, attention_mask=mask), out) and nan_free(out)
    unmasked = rt.infer("bert", ids)
    assert not torch.equal(unmasked.pooler_output, out.pooler_output)  # the mask reached the model


def test_state_dict_weights_and_bf16(rt):
    src = models.out_of_order()
    rt.register("bf", models.out_of_order, dict(src.state_dict()), (torch.randn(2, 8),), dtype="bf16")
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    a = rt.infer("bf", x)
    assert a["y"].dtype == torch.bfloat16 and a["n"] == 3
    rt.evict("bf")
    assert same(rt.infer("bf", x), a)
    ref = models.out_of_order().to(torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(ref(x)["y"], a["y"])


def test_plans_are_cached_per_input_shape(rt):
    zoo = ZOO["tiny_cnn"]
    rt.register("cnn", zoo.builder, weights_path("tiny_cnn"), zoo.example_inputs(1))
    p1 = rt.profile("cnn")
    p4 = rt.profile("cnn", *zoo.example_inputs(4))
    assert p1.shape_key != p4.shape_key
    assert rt.profile("cnn") is p1
    assert p1.layer_names == p4.layer_names == ["conv1", "bn1", "conv2", "bn2", "head"]
    assert sum(p1.layer_bytes) == sum(p4.layer_bytes)
    assert p1.plans["optimal"].predicted_s <= min(p.predicted_s for p in p1.plans.values()) * (1 + 1e-9)


def test_lru_eviction_pinning_and_memory_given_back():
    sizes = {}
    with timeshare.Runtime(device="cpu", memory="1MiB", profile_repeats=1) as rt:
        x = (torch.randn(2, 32),)
        for name in "abc":
            rt.register(name, lambda: torch.nn.Sequential(torch.nn.Linear(32, 2048), torch.nn.Linear(2048, 10)),
                        None, x)
            sizes[name] = rt.diagnostics().models[name].nbytes
        assert 2 * sizes["a"] < rt.stats()["capacity_bytes"] < 3 * sizes["a"]  # room for two
        rt.infer("a", *x)
        rt.infer("b", *x)
        rt.infer("a", *x)  # b is now the least recently used
        rt.infer("c", *x)
        assert rt.resident() == ["a", "c"]
        rt.pin("a")
        rt.infer("b", *x)  # must evict c, not the pinned a
        assert sorted(rt.resident()) == ["a", "b"]
        rt.pin("b")
        with pytest.raises(MemoryBudgetError, match="every resident model is pinned"):
            rt.infer("c", *x)
        assert sorted(rt.resident()) == ["a", "b"]  # nothing lost
        rt.pin("b", False)
        rt.infer("c", *x)
        stats = rt.stats()
        assert stats["used_bytes"] == sizes["a"] + sizes["c"] and stats["blocks"] == 2
        for name in "abc":
            rt.evict(name)
        assert rt.stats()["used_bytes"] == 0
        arena = rt.diagnostics().arena
        assert arena.free_ranges == [(0, arena.capacity_bytes)]


def test_models_return_to_their_offset_or_are_rebound_elsewhere():
    def build(width):
        def make():
            torch.manual_seed(width)
            return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Linear(width, 10))

        return make

    x = torch.randn(2, 32)
    with timeshare.Runtime(device="cpu", memory="1MiB", profile_repeats=1) as rt:
        for name, width in (("a", 2048), ("b", 2048), ("c", 3000)):
            rt.register(name, build(width), None, (x,))
        ref = {n: rt.infer(n, x) for n in "abc"}  # a, b fit; c evicts both (it needs more than one slot)
        offsets = {n: rt.diagnostics().models[n].last_offset for n in "abc"}
        rt.evict("c")
        rt.infer("a", x)
        assert rt.diagnostics().models["a"].offset == offsets["a"]  # back where it was: no rebinding
        rt.infer("c", x)  # c's old range overlaps a, so a is evicted again
        rt.infer("b", x)  # b's old range is taken by c: b is placed and bound elsewhere
        assert rt.diagnostics().models["b"].offset != offsets["b"]
        for n in "abc":
            assert torch.equal(rt.infer(n, x), ref[n]), n
            rt.evict(n)
            assert torch.equal(rt.infer(n, x), ref[n]), n


def test_a_model_larger_than_the_budget_is_refused_with_both_sizes():
    with timeshare.Runtime(device="cpu", memory="64KiB") as rt:
        rt.register("big", lambda: torch.nn.Linear(256, 256), None, (torch.randn(1, 256),))
        with pytest.raises(ModelTooLargeError) as err:
            rt.infer("big", torch.randn(1, 256))
        need = rt.diagnostics().models["big"].nbytes
        assert f"{need:,} bytes" in str(err.value) and f"{64 * 1024:,} bytes" in str(err.value)
        assert rt.resident() == [] and rt.stats()["used_bytes"] == 0


def test_close_unlinks_the_arena_and_refuses_further_use():
    rt = timeshare.Runtime(device="cpu", memory="1MiB")
    name = rt.diagnostics().arena.name
    assert os.path.exists(f"/dev/shm/{name}")
    rt.register("m", models.out_of_order, None, (torch.randn(2, 8),))
    rt.infer("m", torch.randn(2, 8))
    rt.close()
    rt.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(TimeshareError, match="closed"):
        rt.infer("m", torch.randn(2, 8))


def test_bad_registrations_are_clear_errors_and_lose_nothing(rt, tmp_path):
    x = (torch.randn(2, 8),)
    rt.register("ok", models.out_of_order, None, x)
    good = rt.infer("ok", *x)
    with pytest.raises(DuplicateModelError):
        rt.register("ok", models.out_of_order, None, x)
    with pytest.raises(ConfigError, match="model name"):
        rt.register("", models.out_of_order)
    with pytest.raises(ConfigError, match="module:function"):
        rt.register("s", "no_colon_here")
    with pytest.raises(ConfigError, match="cannot import"):
        rt.register("s", "not_a_module_xyz:build")
    with pytest.raises(ModelError, match="not a torch.nn.Module"):
        rt.register("s", lambda: 42)
    with pytest.raises(ModelError, match="building model 's' failed"):
        rt.register("s", lambda: 1 / 0)
    corrupt = tmp_path / "c.safetensors"
    corrupt.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(WeightsError, match="corrupt"):
        rt.register("s", models.out_of_order, corrupt)
    with pytest.raises(UnknownModelError, match="no model named 'nope'"):
        rt.infer("nope")
    assert rt.models() == ["ok"]
    assert same(rt.infer("ok", *x), good) and nan_free(good)


def test_a_failing_forward_during_a_load_leaves_the_runtime_consistent(rt):
    x = torch.randn(2, 8)
    rt.register("m", models.out_of_order, None, (x,))
    good = rt.infer("m", x)
    rt.evict("m")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x9 and 8x8\)"):
        rt.infer("m", torch.randn(2, 9))  # wrong width: the forward raises mid-load
    assert rt.resident() == [] and rt.stats()["used_bytes"] == 0
    assert same(rt.infer("m", x), good) and nan_free(good)


def test_outputs_never_alias_the_arena(rt):
    class ReturnsWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.w

    rt.register("rw", ReturnsWeight, None, (torch.zeros(1),))
    rt.infer("rw", torch.zeros(1))
    rt.evict("rw")
    out = rt.infer("rw", torch.zeros(1))  # pipelined: the weight is the output
    assert torch.equal(out, torch.ones(4))
    rt.evict("rw")
    rt.register("other", lambda: torch.nn.Linear(64, 64), None, (torch.zeros(1, 64),))
    rt.infer("other", torch.zeros(1, 64))  # reuses the arena bytes
    assert torch.equal(out, torch.ones(4))


def test_runtime_argument_errors():
    with pytest.raises(ConfigError, match="strategy"):
        timeshare.Runtime(device="cpu", memory="1MiB", strategy="fastest")
    with pytest.raises(ConfigError, match="memory"):
        timeshare.Runtime(device="cpu", memory="lots")
    with pytest.raises(ConfigError, match="eviction"):
        timeshare.Runtime(device="cpu", memory="1MiB", eviction="random")


def test_listeners_see_every_call_and_eviction(rt):
    from timeshare.runtime.events import CallRecord, EvictionRecord

    seen = []
    rt.subscribe(seen.append)
    rt.subscribe(lambda record: 1 / 0)  # a failing listener is logged, never the caller's problem
    x = torch.randn(2, 8)
    rt.register("a", models.out_of_order, None, (x,))
    rt.register("b", models.out_of_order, None, (x,))
    rt.infer("a", x)
    rt.infer("a", x)
    rt.infer("b", x)
    rt.evict("b")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x9 and 8x8\)"):
        rt.infer("b", torch.randn(2, 9))
    calls = [r for r in seen if isinstance(r, CallRecord)]
    assert [(c.model, c.loaded, c.switched_from, c.error) for c in calls] == [
        ("a", True, None, None), ("a", False, None, None), ("b", True, "a", None), ("b", True, None, "RuntimeError")]
    assert all(c.seconds > 0 and c.waited_s >= 0 for c in calls)
    evictions = [r.model for r in seen if isinstance(r, EvictionRecord)]
    assert evictions == ["b", "b"]  # by request, then the failed load's block
    snap = rt.snapshot()
    a_bytes = rt.diagnostics().models["a"].nbytes
    assert snap.failures == 1 and snap.evictions == 2 and snap.resident == {"a": a_bytes}
    assert snap.loads == {"a": 1, "b": 1} and snap.host_pinned_bytes == 0


def test_priority_and_slo_are_checked_at_registration(rt):
    x = torch.randn(2, 8)
    with pytest.raises(ConfigError, match="unknown priority"):
        rt.register("m", models.out_of_order, None, (x,), priority="urgent")
    with pytest.raises(ConfigError, match="slo_s"):
        rt.register("m", models.out_of_order, None, (x,), slo_s=0)
    rt.register("m", models.out_of_order, None, (x,), priority="best_effort", slo_s=0.5)
    assert same(rt.infer("m", x), plain_outputs(models.out_of_order, None, x))
