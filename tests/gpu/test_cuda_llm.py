"""Language models on CUDA (issue 18): greedy tokens identical to transformers' own
``generate`` on the same device, warm, after a pipelined load into poisoned blocks with the
copies held back, and in a continuous batch; the key/value caches stay on the device and
are given back. Marked ``cuda``; skipped on machines without a GPU."""

import pytest
import torch

import timeshare
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu share time", "load weights layer token fast slow memory host"]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_generation_on_cuda_equals_transformers_warm_cold_and_batched(tmp_path, workers):
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).to("cuda").eval()

    def want(prompt: str, n: int) -> list[int]:
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device="cuda")
        out = ref.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                           pad_token_id=tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1, poison_evicted=True,
                           copy_delay_s=0.002, workers=workers) as rt:
        m = lm.load(rt, "llama", path)
        greedy = SamplingParams(max_tokens=24, temperature=0)
        for prompt in PROMPTS:
            assert m.generate(m.encode(prompt), greedy).result(120).tokens == want(prompt, 24)
            rt.evict("llama")  # the next one loads pipelined into a poisoned block
        with rt.turn(m.name):  # queued together: one batch
            seqs = [m.generate(m.encode(p), SamplingParams(max_tokens=40, temperature=0)) for p in PROMPTS]
        for prompt, seq in zip(PROMPTS, seqs):
            assert seq.result(120).tokens == want(prompt, 40)
        assert m.engine.snapshot().kv_bytes == 0
        m.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_caches_moved_to_pinned_host_memory_while_preempted_come_back_unchanged(tmp_path, workers):
    """NOTE [Key/value caches off the device] on CUDA: a generation preempted by another
    model (its caches in page-locked host memory meanwhile) gives the tokens of one never
    preempted; with workers, the controller moves the pages its home wrote."""
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)
    x = torch.randn(2, 512)
    with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1, workers=workers) as rt:
        m = lm.load(rt, "llama", path, priority="best_effort", offload_kv=True, quantum_s=0.001)
        rt.register("other", "tests.models:wide_relu", None, (x,))
        prompt = m.encode(PROMPTS[2])
        alone = m.generate(prompt, SamplingParams(max_tokens=48, temperature=0)).result(120).tokens
        seq = m.generate(prompt, SamplingParams(max_tokens=48, temperature=0))
        for _ in range(20):
            rt.infer("other", x)
        assert seq.result(120).tokens == alone
        assert m.engine.kv_offloads >= 1 and m.engine.kv_host_bytes == 0
        m.close()


def test_under_a_tight_kv_budget_caches_wait_in_host_memory_and_come_back_unchanged(tmp_path):
    """NOTE [Key/value caches under pressure] on CUDA: two models taking turns, with room
    for the caches of neither between turns: what waits is on the host, and comes back."""
    from timeshare.llm.kv_budget import KVBudget

    paths = [hfdir.write_model_dir(tmp_path / f"m{i}", "llama", seed=3 + i, hidden=128, layers=4) for i in range(2)]
    budget = KVBudget(1)
    with timeshare.Runtime(device="cuda", memory="64MiB", profile_repeats=1) as rt:
        ms = [lm.load(rt, f"m{i}", p, quantum_s=0.002, kv_budget=budget) for i, p in enumerate(paths)]
        params = SamplingParams(max_tokens=96, temperature=0)
        alone = [m.generate(m.encode(PROMPTS[i]), params).result(120).tokens for i, m in enumerate(ms)]
        seqs = [m.generate(m.encode(PROMPTS[i]), params) for i, m in enumerate(ms)]
        between: list[tuple[int, int]] = []  # (on the device, in host memory) while no model has a turn
        while not all(s.done for s in seqs):
            with rt.turn(ms[0].name):
                between.append((budget.on_device(), sum(m.engine.kv_host_bytes for m in ms)))
        assert [s.result(120).tokens for s in seqs] == alone
        assert all(dev == 0 for dev, _ in between) and any(host > 0 for _, host in between), between
        assert budget.snapshot().moves >= 2 and all(m.engine.kv_offloads >= 1 for m in ms)
        assert budget.on_device() == 0 and all(m.engine.kv_host_bytes == 0 for m in ms)
        for m in ms:
            m.close()
