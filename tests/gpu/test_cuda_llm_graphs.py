"""Decode as CUDA graphs on paged caches (issues 35, 45), of the step compiled by inductor,
in-process and in the worker process a model's steps run in (NOTE [One step, two
places]): captured at registration, replayed warm, after pipelined reloads into the same
offsets (poisoned in between) and in a batch, with greedy tokens identical to
transformers' own ``generate`` on the device for the four architectures; a model laid out
elsewhere runs eagerly, never replaying a stale graph, and captures again when idle; a
seeded request samples the same tokens alone, in a batch and in either mode. Marked
``cuda``; skipped on machines without a GPU."""

import pytest
import torch

import timeshare
from tests.llm_reference import greedy_tokens
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu share time", "load weights layer token fast slow memory host"]


def reference(path):
    return greedy_tokens(path, "cuda")


MODES = pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])


@MODES
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_replayed_graphs_give_the_tokens_of_transformers_warm_cold_and_batched(tmp_path, arch, workers):
    path = hfdir.write_model_dir(tmp_path / arch, arch, seed=3, hidden=128, layers=4)
    want = reference(path)
    with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1, poison_evicted=True,
                           copy_delay_s=0.002, workers=workers) as rt:
        m = lm.load(rt, "m", path, max_context=256)
        captured = m.engine.snapshot().graph_captures
        # NOTE [Compiled decode steps]: on CUDA every graph is of the inductor-compiled step.
        assert captured > 0 and m.engine.snapshot().graphs_compiled == captured
        greedy = SamplingParams(max_tokens=24, temperature=0)
        for prompt in PROMPTS:
            assert m.generate(m.encode(prompt), greedy).result(120).tokens == want(prompt, 24)
            rt.evict("m")  # the next one loads pipelined into a poisoned block
        with rt.turn(m.name):  # queued together: one batch
            seqs = [m.generate(m.encode(p), SamplingParams(max_tokens=40, temperature=0)) for p in PROMPTS]
        for prompt, seq in zip(PROMPTS, seqs):
            assert seq.result(120).tokens == want(prompt, 40)
        snap = m.engine.snapshot()
        assert snap.graph_captures == captured and snap.graph_invalidations == 0 and snap.eager_steps == 0
        assert snap.graph_replays >= 3 * 23 + 39
        assert snap.kv_bytes == 0
        m.close()


@MODES
def test_a_model_laid_out_elsewhere_runs_eagerly_then_captures_again(tmp_path, workers):
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=128, layers=4)
    want = reference(path)
    x = torch.randn(2, 512, device="cuda")
    greedy = SamplingParams(max_tokens=16, temperature=0)
    with timeshare.Runtime(device="cuda", memory="16MiB", profile_repeats=1, poison_evicted=True,
                           workers=workers) as rt:
        m = lm.load(rt, "llama", path, max_context=128)
        assert m.generate(m.encode(PROMPTS[0]), greedy).result(120).tokens == want(PROMPTS[0], 16)
        at = rt.diagnostics().models["llama"].offset
        rt.evict("llama")
        rt.register("other", "tests.models:wide_relu", None, (x,))
        rt.infer("other", x)
        before = m.engine.snapshot()
        assert m.generate(m.encode(PROMPTS[2]), greedy).result(120).tokens == want(PROMPTS[2], 16)
        assert rt.diagnostics().models["llama"].offset not in (at, None)
        after = m.engine.snapshot()
        assert after.graph_invalidations == before.graph_invalidations + 1
        assert after.eager_steps > before.eager_steps and after.graph_captures > before.graph_captures
        assert m.generate(m.encode(PROMPTS[1]), greedy).result(120).tokens == want(PROMPTS[1], 16)
        assert m.engine.snapshot().graph_replays > after.graph_replays
        m.close()


def test_seeded_sampling_on_the_device_is_the_same_alone_in_a_batch_and_in_either_mode(tmp_path):
    """In bf16 too: what holds on CUDA is that a seeded request's tokens are a function of
    its logits, its seed and each token's index (NOTE [One sampler]); the two modes run the
    same kernels on the same bytes, so their tokens are equal; a batch computes its rows
    with kernels of another shape, so alone and batched agree while no two logits of a
    row fall within the rounding of each other, which the test's small model keeps."""
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=128, layers=4)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=30, seed=5)
    got = {}
    for workers in (0, 2):
        for dtype in (None, "bf16"):
            with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1, workers=workers) as rt:
                m = lm.load(rt, "llama", path, max_context=128, dtype=dtype)
                alone = m.generate(m.encode(PROMPTS[0]), params).result(120).tokens
                with rt.turn(m.name):
                    others = [m.generate(m.encode(p), SamplingParams(max_tokens=16, temperature=1.0, seed=i))
                              for i, p in enumerate(PROMPTS)]
                    mine = m.generate(m.encode(PROMPTS[0]), params)
                assert mine.result(120).tokens == alone
                got[workers, dtype] = (alone, [s.result(120).tokens for s in others])
                m.close()
    for dtype in (None, "bf16"):
        assert got[0, dtype] == got[2, dtype]
