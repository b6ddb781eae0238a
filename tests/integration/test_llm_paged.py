"""Paged caches and decode graphs (issue 35) on the CPU, with graphs emulated (NOTE
[Decode graphs]: a stand-in that keeps the module's tensors as they were at capture, as a
CUDA graph keeps their addresses): greedy tokens equal ``transformers``' ``generate``
for Llama, Qwen2, Mistral and GPT-2, warm, cold from poisoned blocks, batched and
preempted between tokens; a replay after a reload into the same offsets reads the
reloaded weights; a model laid out elsewhere never replays a stale capture."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from torch import nn

from tests.llm_reference import greedy_tokens, with_pools
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu", "load weights layer token fast slow memory host device"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


MODES = pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "gpt2"])
def arch(request, tmp_path_factory):
    path = hfdir.write_model_dir(tmp_path_factory.mktemp("paged") / request.param, request.param, seed=7,
                                 hidden=96, layers=3)
    return request.param, path, greedy_tokens(path)


# As on CUDA, a load copies every layer (on the CPU, by default, a load may leave the first
# layers computing from host memory: a layout of its own, which would invalidate the captures).
POISONED = {"poison_evicted": True, "copy_delay_s": 0.001, "direct_host_access": False}


@pytest.fixture(scope="module")
def workers_runtime():
    """One runtime with two workers for the four architectures' runs (each closes its model)."""
    with Runtime("cpu", "64MiB", workers=2, **POISONED) as rt:
        yield rt


@MODES
def test_replayed_steps_give_the_tokens_of_transformers_warm_cold_and_batched(arch, workers, request):
    name, path, reference = arch
    runtime = contextlib.nullcontext(request.getfixturevalue("workers_runtime")) if workers else \
        Runtime("cpu", "64MiB", **POISONED)
    with runtime as rt:
        m = lm.load(rt, name, path, graphs="emulate", max_context=256)
        captured = m.engine.snapshot().graph_captures
        assert captured > 0  # at registration: resident and idle
        for prompt in PROMPTS:  # warm
            assert m.generate(m.encode(prompt), greedy(20)).result(60).tokens == reference(prompt, 20)
        warm = m.engine.snapshot()
        assert warm.graph_replays >= 3 * 19 and warm.eager_steps == 0
        for prompt in PROMPTS:  # cold: each wake is a pipelined load into a poisoned block
            rt.evict(name)
            assert m.generate(m.encode(prompt), greedy(20)).result(60).tokens == reference(prompt, 20)
        cold = m.engine.snapshot()
        # Reloaded into the same offsets: the captures are replayed, never taken again.
        assert cold.graph_captures == captured and cold.graph_invalidations == 0
        assert cold.graph_replays >= warm.graph_replays + 3 * 19
        with rt.turn(m.name):  # queued together: one batch of three
            seqs = [m.generate(m.encode(p), greedy(24)) for p in PROMPTS]
        for prompt, seq in zip(PROMPTS, seqs):
            assert seq.result(60).tokens == reference(prompt, 24)
        assert m.engine.snapshot().eager_steps == 0 and m.engine.snapshot().kv_bytes == 0
        m.close()


@MODES
def test_two_models_taking_turns_between_tokens_each_give_their_own_tokens(tmp_path, workers):
    """Room for one of the two: each wake between their tokens reloads one into the block
    the other left, and their graphs replay with the caches of their preempted rows."""
    paths = [hfdir.write_model_dir(tmp_path / a, a, seed=s, hidden=96, layers=3) for a, s in
             (("llama", 1), ("qwen2", 2))]
    refs = [greedy_tokens(p) for p in paths]
    memory = with_pools("3MiB", paths, max_context=128)  # and their pages
    with Runtime("cpu", memory, workers=workers, **POISONED) as rt:
        models = [lm.load(rt, f"m{i}", p, graphs="emulate", max_context=128, quantum_s=0.0)
                  for i, p in enumerate(paths)]
        with rt.turn(models[0].name):
            seqs = [m.generate(m.encode(PROMPTS[i]), greedy(30)) for i, m in enumerate(models)]
        for i, seq in enumerate(seqs):
            assert seq.result(60).tokens == refs[i](PROMPTS[i], 30)
        for m in models:
            snap = m.engine.snapshot()
            assert snap.turns >= 3  # preempted between tokens
            assert snap.graph_replays > 0
            m.close()


def test_a_model_laid_out_elsewhere_never_replays_a_stale_capture(tmp_path):
    """Evicted, its block taken by another model, it comes back at another offset: the
    placement epoch moved, so its steps run eagerly (a stale replay would read the other
    model's bytes) until the graphs are captured again, when it is idle."""
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=96, layers=3)
    reference = greedy_tokens(path)
    other = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
    x = torch.randn(2, 256)
    with Runtime("cpu", "8MiB", poison_evicted=True, direct_host_access=False) as rt:
        m = lm.load(rt, "llama", path, graphs="emulate", max_context=128)
        assert m.generate(m.encode(PROMPTS[0]), greedy(12)).result(60).tokens == reference(PROMPTS[0], 12)
        at = rt.diagnostics().models["llama"].offset
        rt.evict("llama")
        rt.register("other", lambda: other, other.state_dict(), (x,))
        rt.infer("other", x)  # in the block the language model left
        before = m.engine.snapshot()
        assert m.generate(m.encode(PROMPTS[2]), greedy(12)).result(60).tokens == reference(PROMPTS[2], 12)
        assert rt.diagnostics().models["llama"].offset not in (at, None)
        after = m.engine.snapshot()
        assert after.graph_invalidations == before.graph_invalidations + 1
        assert after.eager_steps > before.eager_steps
        assert after.graph_captures > before.graph_captures  # captured again once idle
        assert m.generate(m.encode(PROMPTS[1]), greedy(12)).result(60).tokens == reference(PROMPTS[1], 12)
        assert m.engine.snapshot().graph_replays > after.graph_replays
        m.close()


def test_sampled_tokens_are_seeded_per_request_whatever_the_batch(tmp_path):
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=96, layers=3)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=11)
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, "llama", path, graphs="emulate", max_context=128)
        alone = m.generate(m.encode(PROMPTS[0]), params).result(60).tokens
        with rt.turn(m.name):
            seqs = [m.generate(m.encode(p), SamplingParams(max_tokens=16, temperature=1.0, seed=i))
                    for i, p in enumerate(PROMPTS)]
            mine = m.generate(m.encode(PROMPTS[0]), params)
        assert mine.result(60).tokens == alone
        assert len({tuple(s.result(60).tokens) for s in seqs}) == 3
        other = m.generate(m.encode(PROMPTS[0]), SamplingParams(max_tokens=16, temperature=0.9, seed=12))
        assert other.result(60).tokens != alone
        m.close()


def test_a_models_own_pool_is_a_region_of_the_arena_given_back_when_it_closes(tmp_path):
    """NOTE [Regions of the arena]: the pages are planned with the weights, in the arena:
    the keys and values a generation writes land in the arena's own bytes (its shared
    memory segment, read here through a mapping of its own), and closing the model gives
    the region back. A pool that does not fit fails the load clearly and leaves nothing."""
    from timeshare.errors import MemoryBudgetError
    from timeshare.memory.arena import map_shared_memory

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=96, layers=3)
    reference = greedy_tokens(path)
    pool = lm.own_pool_bytes(path, None, 8, 128)
    with Runtime("cpu", with_pools("4MiB", [path], max_context=128)) as rt:
        m = lm.load(rt, "llama", path, max_context=128, graphs="emulate")
        assert rt.snapshot().reserved == {"kv-pages:llama": pool}
        diag = rt.diagnostics()
        at = diag.regions["kv-pages:llama"].offset
        assert diag.arena.name is not None
        arena = map_shared_memory(diag.arena.name, diag.arena.capacity_bytes)
        pages = arena[at + lm.pool_need(path, None, 8, 128)[0]:at + pool]  # the scratch page aside
        assert not pages.any()  # no sequence yet: untouched
        assert m.generate(m.encode(PROMPTS[0]), greedy(12)).result(60).tokens == reference(PROMPTS[0], 12)
        assert pages.any()  # its keys and values were written there
        m.close()
        assert rt.snapshot().reserved == {} and rt.models() == []
    # A pinned model leaves room for the weights but not the pages: the load fails, naming
    # them, and takes nothing.
    with Runtime("cpu", pool + (512 << 10)) as rt:
        rt.register("mlp", lambda: nn.Linear(512, 512), None, (torch.randn(1, 512),), pin=True)
        rt.infer("mlp", torch.randn(1, 512))
        with pytest.raises(MemoryBudgetError, match=r"key/value pages \(kv-pages:llama\).*pinned"):
            lm.load(rt, "llama", path, max_context=128, profile=False)
        assert rt.models() == ["mlp"] and rt.snapshot().reserved == {}


def test_a_pool_too_small_for_a_prompt_fails_that_sequence_clearly_and_loses_nothing(tmp_path):
    from timeshare.llm.pages import KVMemoryError

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=96, layers=3)
    reference = greedy_tokens(path)
    with Runtime("cpu", "64MiB") as rt:
        pool = lm.arena_pool(rt, "tiny", 2 * 4096, page_bytes=4096)  # two pages besides the scratch one
        m = lm.load(rt, "llama", path, max_context=256, pages=pool)
        long = list(range(1, 200))
        with pytest.raises(KVMemoryError, match="kv_memory"):
            m.generate(long, greedy(4)).result(60)
        assert pool.free_pages == 2  # nothing kept by the failed prefill
        assert m.generate(m.encode(PROMPTS[1]), greedy(4)).result(60).tokens == reference(PROMPTS[1], 4)
        assert pool.free_pages == 2
        m.close()


def test_pages_are_shared_by_the_models_of_one_pool(tmp_path):
    paths = [hfdir.write_model_dir(tmp_path / a, a, seed=1, hidden=96, layers=3) for a in ("llama", "gpt2")]
    refs = [greedy_tokens(p) for p in paths]
    with Runtime("cpu", "64MiB") as rt:
        pool = lm.arena_pool(rt, "kv-pages", 1 << 20, page_bytes=8192)
        models = [lm.load(rt, f"m{i}", p, pages=pool, max_context=128) for i, p in enumerate(paths)]
        seqs = [m.generate(m.encode(PROMPTS[2]), greedy(20)) for m in models]
        for seq, ref in zip(seqs, refs):
            assert seq.result(60).tokens == ref(PROMPTS[2], 20)
        assert pool.free_pages == pool.pages - 1  # every page back
        for m in models:
            m.close()


def test_a_pool_shared_under_a_budget_moves_the_other_models_caches_out_when_full(tmp_path):
    """NOTE [Key/value caches under pressure] with one pool of ``kv_memory`` bytes (as the
    server makes it): room for the pages of one generation at a time; when a step finds
    no page, the other model's caches wait in host memory, and both finish exactly."""
    from timeshare.decode.pages import block_of
    from timeshare.decode.step import KVShape
    from timeshare.llm.kv_budget import KVBudget

    paths = [hfdir.write_model_dir(tmp_path / a, a, seed=s, hidden=96, layers=2) for a, s in
             (("llama", 1), ("qwen2", 2))]
    refs = [greedy_tokens(p) for p in paths]
    page = 8192
    need = []
    for p in paths:
        config = transformers.AutoConfig.from_pretrained(p)
        tokens = len(transformers.AutoTokenizer.from_pretrained(p)(PROMPTS[2], add_special_tokens=False).input_ids)
        need.append(-(-(tokens + 80) // block_of(page, KVShape.of(config, torch.float32))))
    capacity = max(need) * page  # never both at once
    budget = KVBudget(capacity)
    with Runtime("cpu", "64MiB") as rt:
        pool = lm.arena_pool(rt, "kv-pages", capacity, page)
        models = [lm.load(rt, f"m{i}", p, quantum_s=0.0, kv_budget=budget, pages=pool, max_context=256)
                  for i, p in enumerate(paths)]
        first = models[0].generate(models[0].encode(PROMPTS[2]), greedy(80))
        deadline = time.monotonic() + 30
        while len(first.tokens) < 40 and time.monotonic() < deadline:  # it holds most of its pages
            time.sleep(0.002)
        second = models[1].generate(models[1].encode(PROMPTS[2]), greedy(80))
        assert first.result(60).tokens == refs[0](PROMPTS[2], 80)
        assert second.result(60).tokens == refs[1](PROMPTS[2], 80)
        assert budget.snapshot().moves >= 1 and models[0].engine.kv_offloads >= 1
        assert pool.free_pages == pool.pages - 1  # every page back
        for m in models:
            m.close()


def test_nan_weights_fail_the_sequence_with_a_clear_error_and_keep_nothing(tmp_path):
    """A corrupt weights file whose numbers are NaN: no token is made up from NaN logits."""
    from safetensors.torch import load_file, save_file

    from timeshare.errors import GenerationError

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=96, layers=2)
    shard = next(f for f in hfdir.shard_files(path) if "model.norm.weight" in load_file(f))
    tensors = load_file(shard)
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, shard, metadata={"format": "pt"})
    with Runtime("cpu", "64MiB") as rt:
        pool = lm.arena_pool(rt, "kv-pages", 256 << 10, page_bytes=8192)
        m = lm.load(rt, "llama", path, max_context=128, pages=pool)
        for params in (greedy(4), SamplingParams(max_tokens=4, temperature=0.7, seed=1)):
            with pytest.raises(GenerationError, match="NaN"):
                m.generate(m.encode(PROMPTS[0]), params).result(60)
        assert pool.free_pages == pool.pages - 1 and m.engine.snapshot().kv_bytes == 0
        m.close()


# NOTE [Compiled decode steps]: on CUDA the step the graphs capture is compiled by inductor;
# here dynamo traces it and AOTAutograd functionalizes it (``aot_eager``), as inductor would
# be given it, and PyTorch's kernels run it.
class Traced:
    """A ``torch.compile`` backend that keeps each graph dynamo traced, then runs it as
    ``aot_eager`` does."""

    def __init__(self):
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def writes(self) -> list[str]:
        """The in-place operations in the traced graphs (a write into the pool would be one)."""
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes
                if n.op in ("call_function", "call_method")
                and ("setitem" in str(n.target) or (str(n.target).endswith("_") and not str(n.target).endswith("__")))]


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_a_compiled_step_is_traced_once_writes_nothing_and_gives_the_tokens_of_transformers(tmp_path, architecture):
    path = hfdir.write_model_dir(tmp_path / architecture, architecture, seed=5, hidden=64, layers=2)
    reference = greedy_tokens(path)
    backend = Traced()
    with Runtime("cpu", "64MiB", poison_evicted=True, copy_delay_s=0.001, direct_host_access=False) as rt:
        m = lm.load(rt, "m", path, graphs="emulate", max_context=128, compile=backend)
        snap = m.engine.snapshot()
        assert snap.graphs_compiled == snap.graph_captures > 0
        # One trace for every bucket of batch and context: shapes are dynamic, none is 1.
        assert len(backend.graphs) == 1
        # The pool is read, never written, inside: the step writes its keys and values after.
        assert backend.writes() == []
        assert m.generate(m.encode(PROMPTS[0]), greedy(16)).result(60).tokens == reference(PROMPTS[0], 16)
        rt.evict("m")  # cold: a pipelined load into a poisoned block, the stand-ins replayed
        assert m.generate(m.encode(PROMPTS[2]), greedy(16)).result(60).tokens == reference(PROMPTS[2], 16)
        with rt.turn(m.name):  # one batch of three: a bucket of four rows
            seqs = [m.generate(m.encode(p), greedy(20)) for p in PROMPTS]
        for prompt, seq in zip(PROMPTS, seqs):
            assert seq.result(60).tokens == reference(prompt, 20)
        snap = m.engine.snapshot()
        assert snap.eager_steps == 0 and snap.graph_replays >= 2 * 15 + 19
        assert len(backend.graphs) == 1
        m.close()


def test_same_shaped_models_share_one_compiled_step_and_each_reads_its_own_weights(tmp_path):
    paths = [hfdir.write_model_dir(tmp_path / f"m{seed}", "llama", seed=seed, hidden=64, layers=2) for seed in (1, 2)]
    backend = Traced()
    with Runtime("cpu", "64MiB", direct_host_access=False) as rt:
        models = [lm.load(rt, f"m{i}", p, graphs="emulate", max_context=128, compile=backend)
                  for i, p in enumerate(paths)]
        assert len(backend.graphs) == 1  # the second model's captures took the first one's trace
        assert all(m.engine.snapshot().graphs_compiled > 0 for m in models)
        for m, p in zip(models, paths):
            assert m.generate(m.encode(PROMPTS[1]), greedy(12)).result(60).tokens == greedy_tokens(p)(PROMPTS[1], 12)
            m.close()


def test_a_step_that_fails_to_compile_is_captured_uncompiled(tmp_path, caplog):
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=5, hidden=64, layers=2)
    reference = greedy_tokens(path)

    def broken(gm, example_inputs):
        raise RuntimeError("no code generator here")

    with Runtime("cpu", "64MiB", direct_host_access=False) as rt:
        m = lm.load(rt, "m", path, graphs="emulate", max_context=128, compile=broken)
        snap = m.engine.snapshot()
        assert snap.graph_captures > 0 and snap.graphs_compiled == 0
        assert "captured uncompiled" in caplog.text and "no code generator here" in caplog.text
        assert m.generate(m.encode(PROMPTS[1]), greedy(12)).result(60).tokens == reference(PROMPTS[1], 12)
        assert m.engine.snapshot().graph_replays >= 11
        m.close()
