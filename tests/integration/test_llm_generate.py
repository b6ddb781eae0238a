"""Generation (issue 18): greedy tokens identical to ``transformers``' own ``generate`` on
the same weights when the model is warm, after a pipelined load from poisoned blocks,
after another model took the device between two tokens, and inside a continuous batch;
sampling, stop strings, streaming, cancellation and bad input."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.llm_reference import greedy_tokens, with_pools
from timeshare.errors import ConfigError, LaneExceededError, Unavailable, WeightsError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.kv_budget import KVBudget
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import ContextLengthError, Delta, Finish, TokenTiming
from timeshare.runtime.events import CallRecord
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu", "load weights layer token fast slow memory host device"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("gen") / "llama", "llama", seed=3, hidden=128, layers=4)


@pytest.fixture(scope="module")
def reference(llama):
    generate = greedy_tokens(llama)
    return lambda prompt, n=GREEDY.max_tokens: generate(prompt, n)


def started(seq, tokens: int = 3) -> None:
    """Wait (30 s at most) until ``seq`` has generated ``tokens`` tokens."""
    deadline = time.monotonic() + 30
    while len(seq.tokens) < tokens and time.monotonic() < deadline:
        time.sleep(0.002)


def records(rt) -> list[CallRecord]:
    seen: list[CallRecord] = []
    rt.subscribe(lambda r: seen.append(r) if isinstance(r, CallRecord) else None)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_greedy_tokens_are_those_of_transformers_for_each_architecture(tmp_path, arch):
    """Eager steps on the CPU: by the lean step for the Llama family, once it matched
    transformers' forward (NOTE [Lean decode steps]), by transformers' forward for GPT-2."""
    path = hfdir.write_model_dir(tmp_path / arch, arch, seed=2, hidden=96, layers=3)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tok(PROMPTS[2], add_special_tokens=False)["input_ids"]])
    want = ref.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, arch, path)
        got = m.generate(ids[0].tolist(), SamplingParams(max_tokens=16, temperature=0)).result(60)
        assert got.tokens == want
        snap = m.engine.snapshot()
        assert snap.eager_steps == 15 and snap.lean_steps == (0 if arch == "gpt2" else 14)  # the first: both
        m.close()
        assert rt.models() == []


def test_a_lean_step_that_differs_from_transformers_is_never_used(llama, reference, monkeypatch, caplog):
    """NOTE [Lean decode steps]: the first eager step runs both; a lean step whose logits
    are off by more than rounding (here a thousandth of their largest, as a projection's
    bias left out would do) is dropped, and every token is transformers' own."""
    from timeshare.decode.lean import LeanStep

    real = LeanStep.logits

    def off_a_little(self, *args, **kwargs):
        logits = real(self, *args, **kwargs)
        return logits + 1e-3 * logits.abs().max()

    monkeypatch.setattr(LeanStep, "logits", off_a_little)
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, "llama", llama)
        assert m.generate(m.encode(PROMPTS[0]), GREEDY).result(60).tokens == reference(PROMPTS[0])
        snap = m.engine.snapshot()
        assert snap.eager_steps == GREEDY.max_tokens - 1 and snap.lean_steps == 0
        assert "differs from transformers' forward" in caplog.text
        m.close()


def test_greedy_warm_and_after_a_pipelined_load_from_poisoned_blocks(llama, reference):
    with Runtime("cpu", "64MiB", poison_evicted=True, copy_delay_s=0.001) as rt:
        seen = records(rt)
        m = lm.load(rt, "llama", llama)
        for prompt in PROMPTS:  # the first call loads (and profiles) it; the rest are warm
            got = m.generate(m.encode(prompt), GREEDY).result(60)
            assert got.tokens == reference(prompt)
            assert got.text == m.decode(got.tokens) and got.finish_reason == "length"
            assert (got.prompt_tokens, got.completion_tokens) == (len(m.encode(prompt)), GREEDY.max_tokens)
        for prompt in PROMPTS:  # cold: every load is pipelined into a poisoned block
            rt.evict("llama")
            before = sum(r.loaded for r in seen)
            assert m.generate(m.encode(prompt), GREEDY).result(60).tokens == reference(prompt)
            assert sum(r.loaded for r in seen) == before + 1
        m.close()


@pytest.mark.parametrize("offload", [False, True], ids=["caches-stay", "caches-to-host"])
def test_a_latency_critical_model_takes_the_device_between_two_tokens(llama, reference, offload):
    """With ``offload_kv`` the preempted generation's caches go to host memory while the
    other model runs (NOTE [Key/value caches off the device]) and come back unchanged."""
    other = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
    x = torch.randn(2, 1024)
    with torch.no_grad():
        want_other = other(x)
    # Room for one of the two (and the language model's pages): it is evicted while it generates.
    with Runtime("cpu", with_pools("6MiB", [llama]), poison_evicted=True, copy_delay_s=0.001) as rt:
        seen = records(rt)
        m = lm.load(rt, "llama", llama, priority="best_effort", offload_kv=offload)
        rt.register("other", lambda: other, other.state_dict(), (x,))
        prompt = PROMPTS[0]
        seq = m.generate(m.encode(prompt), SamplingParams(max_tokens=60, temperature=0))
        started(seq, 5)
        outputs = [rt.infer("other", x) for _ in range(3)]
        at_other = time.monotonic()
        got = seq.result(60)
        assert all(torch.equal(o, want_other) for o in outputs)
        assert got.tokens == reference(prompt, 60)
        assert seq.last_token_at > at_other  # the generation went on after the other model ran
        llama_loads = [r for r in seen if r.model == "llama" and r.loaded]
        assert len(llama_loads) >= 2  # its first load, and again after "other" evicted it
        assert m.engine.turns >= 2
        assert (m.engine.kv_offloads >= 1) == offload and m.engine.kv_host_bytes == 0
        m.close()


def test_a_request_waiting_for_its_first_token_comes_before_another_models_decoding(tmp_path, llama, reference):
    qwen = hfdir.write_model_dir(tmp_path / "qwen", "qwen2", seed=6, hidden=96, layers=2)
    with Runtime("cpu", "64MiB") as rt:
        # Same priority, and a quantum longer than the whole generation: only the rule
        # "prefills first" can put the other model's first token before its end.
        a = lm.load(rt, "llama", llama, quantum_s=60.0)
        b = lm.load(rt, "qwen", qwen, quantum_s=60.0)
        long = a.generate(a.encode(PROMPTS[0]), SamplingParams(max_tokens=150, temperature=0))
        started(long)
        short = b.generate(b.encode(PROMPTS[1]), SamplingParams(max_tokens=2, temperature=0))
        short.result(60)
        got = long.result(60)
        assert short.first_token_at is not None and long.last_token_at is not None
        assert short.first_token_at < long.last_token_at
        assert got.tokens == reference(PROMPTS[0], 150)  # and the long one resumed where it stopped
        a.close()
        b.close()


def test_a_model_queued_only_to_decode_becomes_due_when_a_request_arrives_for_it(tmp_path, llama, reference):
    qwen = hfdir.write_model_dir(tmp_path / "qwen", "qwen2", seed=6, hidden=96, layers=2)
    with Runtime("cpu", "64MiB") as rt:
        a = lm.load(rt, "llama", llama, quantum_s=60.0)
        b = lm.load(rt, "qwen", qwen, quantum_s=60.0)
        first = a.generate(a.encode(PROMPTS[0]), SamplingParams(max_tokens=150, temperature=0))
        started(first)
        other = b.generate(b.encode(PROMPTS[1]), SamplingParams(max_tokens=150, temperature=0))
        started(other)  # qwen holds the device now; llama's next turn waits, only to decode
        second = a.generate(a.encode(PROMPTS[2]), SamplingParams(max_tokens=2, temperature=0))
        assert second.result(60).tokens == reference(PROMPTS[2], 2)
        other.result(60)
        assert second.first_token_at < other.last_token_at  # its waiting turn was made due
        assert first.result(60).tokens == reference(PROMPTS[0], 150)
        a.close()
        b.close()


@pytest.mark.parametrize("kv_memory", [1 << 14, 1 << 30], ids=["tight", "roomy"])
def test_under_a_kv_budget_the_least_recent_caches_wait_in_host_memory(tmp_path, llama, reference, kv_memory):
    """NOTE [Key/value caches under pressure]: two models taking turns, with room on the
    device for the caches of at most one (tight) or of both (roomy)."""
    qwen = hfdir.write_model_dir(tmp_path / "qwen", "qwen2", seed=6, hidden=96, layers=2)
    want_qwen = greedy_tokens(qwen)(PROMPTS[1], 80)
    budget = KVBudget(kv_memory)
    with Runtime("cpu", "64MiB") as rt:
        a = lm.load(rt, "llama", llama, quantum_s=0.01, kv_budget=budget)
        b = lm.load(rt, "qwen", qwen, quantum_s=0.01, kv_budget=budget)
        first = a.generate(a.encode(PROMPTS[0]), SamplingParams(max_tokens=80, temperature=0))
        started(first)
        other = b.generate(b.encode(PROMPTS[1]), SamplingParams(max_tokens=80, temperature=0))
        assert first.result(60).tokens == reference(PROMPTS[0], 80)
        assert other.result(60).tokens == want_qwen
        assert a.engine.turns >= 2 and b.engine.turns >= 2  # they took turns
        moves = budget.snapshot().moves
        if kv_memory < 1 << 20:
            assert moves >= 2 and a.engine.kv_offloads >= 1 and b.engine.kv_offloads >= 1
        else:
            assert moves == 0 and a.engine.kv_offloads == b.engine.kv_offloads == 0
        assert a.engine.kv_host_bytes == b.engine.kv_host_bytes == 0 and budget.on_device() == 0
        a.close()
        b.close()


class Sleeper(nn.Module):
    """A linear layer whose forward sleeps 0.4 s when its first input is positive, and
    records when each forward ran."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.windows: list[tuple[float, float]] = []

    def forward(self, x):
        t0 = time.monotonic()
        if float(x[0, 0]) > 0:
            time.sleep(0.4)
        self.windows.append((t0, time.monotonic()))
        return self.lin(x)


def test_under_pack_a_language_model_decodes_in_its_lane_beside_another_model(llama, reference):
    """NOTE [Turns in lanes]: tokens come while another model's forward runs in its own
    lane, and they are the tokens of the model alone."""
    sleeper = Sleeper()
    x = torch.full((1, 4), 1.0)
    with torch.no_grad():
        want = sleeper.lin(x)
    with Runtime("cpu", "64MiB", scheduling="pack", lane_memory="64MiB") as rt:
        m = lm.load(rt, "llama", llama)
        assert 0 < m.engine.lane_bytes <= 64 << 20
        rt.register("sleeper", lambda: sleeper, sleeper.state_dict(), (torch.zeros(1, 4),))
        for _ in range(2):  # measured: it asks for its own lane, not every free byte
            rt.infer("sleeper", torch.zeros(1, 4))
        times: list[float] = []
        m.engine.subscribe(lambda e: times.append(time.monotonic()) if isinstance(e, TokenTiming) else None)
        seq = m.generate(m.encode(PROMPTS[0]), SamplingParams(max_tokens=200, temperature=0))
        started(seq, 3)
        out = rt.infer("sleeper", x)
        got = seq.result(60)
        assert got.tokens == reference(PROMPTS[0], 200)
        assert torch.equal(out, want)
        start, end = sleeper.windows[-1]
        assert end - start >= 0.4
        assert sum(start < t < end for t in times) >= 3  # tokens while the other forward ran
        m.close()


def test_under_pack_a_prefill_that_outgrows_its_lane_fails_alone(llama):
    with Runtime("cpu", "64MiB", scheduling="pack", lane_memory="16KiB") as rt:
        m = lm.load(rt, "llama", llama)
        rt.register("other", lambda: nn.Linear(4, 4), None, (torch.zeros(1, 4),))
        want = rt.infer("other", torch.ones(1, 4))
        with pytest.raises(LaneExceededError) as info:
            m.generate(m.encode(PROMPTS[2]), GREEDY).result(60)
        assert info.value.task == "llama" and info.value.asked > info.value.lane_bytes
        assert torch.equal(rt.infer("other", torch.ones(1, 4)), want)  # the rest goes on
        m.close()


def test_sequences_that_join_a_running_batch_get_the_tokens_they_would_alone(llama, reference):
    with Runtime("cpu", "64MiB", copy_delay_s=0.001) as rt:
        m = lm.load(rt, "llama", llama)
        m.generate(m.encode("a"), SamplingParams(max_tokens=2, temperature=0)).result(60)  # loaded, profiled
        seqs = []
        for prompt in PROMPTS:  # each joins when the previous one is decoding
            seqs.append(m.generate(m.encode(prompt), SamplingParams(max_tokens=40, temperature=0)))
            started(seqs[-1])
        steps0 = m.engine.steps
        results = [s.result(60) for s in seqs]
        for prompt, got in zip(PROMPTS, results):
            assert got.tokens == reference(prompt, 40)
        alone = sum(len(r.tokens) - 1 for r in results)  # decode steps had each run alone
        assert m.engine.steps - steps0 < alone - 20
        assert m.engine.snapshot().kv_bytes == 0 and m.engine.snapshot().running == 0
        m.close()


def test_sampling_is_seeded_per_request_and_top_k_one_is_greedy(llama, reference):
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, "llama", llama)
        ids = m.encode(PROMPTS[0])
        sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
        a = m.generate(ids, sampled).result(60)
        b = m.generate(ids, sampled).result(60)
        c = m.generate(ids, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=12)).result(60)
        assert a.tokens == b.tokens and a.tokens != c.tokens
        assert a.tokens != reference(PROMPTS[0])
        k1 = m.generate(ids, SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=3)).result(60)
        assert k1.tokens == reference(PROMPTS[0])
        m.close()


def test_stop_strings_end_the_text_before_them_and_are_never_streamed(llama):
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, "llama", llama)
        ids = m.encode(PROMPTS[1])
        full = m.generate(ids, SamplingParams(max_tokens=40, temperature=0)).result(60).text
        # Random weights make byte-level text; the stop is two plain characters of it.
        stop = next(full[i:i + 2] for i in range(8, len(full)) if full[i:i + 2].isprintable()
                    and "\ufffd" not in full[i:i + 2])
        cut = full.find(stop)
        seq = m.generate(ids, SamplingParams(max_tokens=40, temperature=0, stop=("never there", stop)))
        events = list(seq.events(60))
        streamed = "".join(e.text for e in events if isinstance(e, Delta))
        finish = events[-1]
        assert isinstance(finish, Finish) and finish.reason == "stop"
        assert streamed == full[:cut] and stop not in streamed
        assert finish.completion_tokens < 40
        m.close()


def test_a_cancelled_sequence_is_freed_and_the_others_carry_on(llama, reference):
    with Runtime("cpu", "64MiB", copy_delay_s=0.001) as rt:
        m = lm.load(rt, "llama", llama)
        long = m.generate(m.encode(PROMPTS[0]), SamplingParams(max_tokens=200, temperature=0))
        other = m.generate(m.encode(PROMPTS[2]), SamplingParams(max_tokens=60, temperature=0))
        next(iter(long.events(30)))  # it is generating
        long.cancel()
        assert other.result(60).tokens == reference(PROMPTS[2], 60)
        finish = list(long.events(30))[-1]
        assert isinstance(finish, Finish) and finish.reason == "cancelled"
        assert len(long.tokens) < 200
        deadline = time.monotonic() + 10
        while m.engine.snapshot().kv_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        # Their full pages stay cached (NOTE [Prefix caching]), free for any allocation.
        assert m.engine.snapshot().cached_pages > 0
        counted = {"steps": 0, "turns": 0, "eager_steps": 0, "lean_steps": 0, "cached_pages": 0, "decode_calls": 0,
                   "prefill_tokens": 0, "masks": 0, "mask_s": 0.0}
        assert replace(m.engine.snapshot(), **counted) == EngineSnapshot(
            running=0, waiting=0, kv_bytes=0, kv_host_bytes=0, kv_offloads=0, steps=0, turns=0,
            max_sequences=8, max_context=256)
        m.close()


def test_bad_requests_are_refused_and_queued_work_fails_on_close(llama):
    with Runtime("cpu", "64MiB") as rt:
        m = lm.load(rt, "llama", llama, max_context=64)
        with pytest.raises(ContextLengthError, match="context of 64 tokens"):
            m.generate([5] * 60, SamplingParams(max_tokens=10))
        with pytest.raises(ConfigError, match="empty"):
            m.generate([], SamplingParams())
        with pytest.raises(ConfigError, match="token ids"):
            m.generate([10**6], SamplingParams())
        with pytest.raises(ConfigError, match="exceeds its 256 positions"):
            lm.load(rt, "big", llama, max_context=1000)
        gate = threading.Event()
        with rt.turn(m.name):  # nothing runs: the sequence stays queued until close
            seq = m.generate(m.encode("a"), SamplingParams(max_tokens=5))
            closer = threading.Thread(target=lambda: (m.engine.close(), gate.set()))
            closer.start()
            time.sleep(0.2)
        closer.join(30)
        finish = list(seq.events(30))[-1]
        assert isinstance(finish, Finish) and finish.reason == "error" and "closed" in str(finish.error)
        assert seq.tokens == []  # closed before its turn came: never prefilled
        assert gate.is_set() and m.engine.snapshot().kv_bytes == 0
        with pytest.raises(Unavailable, match="closed"):
            m.generate(m.encode("a"), SamplingParams(max_tokens=5))


def test_broken_directories_are_refused_clearly(tmp_path, llama):
    with Runtime("cpu", "64MiB") as rt:
        with pytest.raises(ConfigError, match="not a model directory"):
            lm.load(rt, "x", tmp_path)
        bad_tok = tmp_path / "badtok"
        shutil.copytree(llama, bad_tok)
        (bad_tok / "tokenizer.json").write_text("{not json")
        with pytest.raises(ConfigError, match="tokenizer cannot be read"):
            lm.load(rt, "x", bad_tok)
        bad_shard = tmp_path / "badshard"
        shutil.copytree(llama, bad_shard)
        shard = hfdir.shard_files(bad_shard)[0]
        shard.write_bytes(shard.read_bytes()[:100])
        with pytest.raises(WeightsError, match="corrupt or unreadable"):
            lm.load(rt, "x", bad_shard)
        assert rt.models() == []


def test_under_a_host_budget_the_shards_are_read_only_when_needed_and_again_after_a_drop(tmp_path, llama,
                                                                                          reference):
    qwen = hfdir.write_model_dir(tmp_path / "qwen", "qwen2", seed=5, hidden=128, layers=4)
    assert len(hfdir.shard_files(llama)) > 1 and len(hfdir.shard_files(qwen)) > 1
    tok = transformers.AutoTokenizer.from_pretrained(qwen)
    ref_qwen = transformers.AutoModelForCausalLM.from_pretrained(qwen).eval()
    ids = torch.tensor([tok(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    want_qwen = ref_qwen.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids),
                                  pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    # Host memory for one model's store, device memory for one model: every switch reads the shards.
    with Runtime("cpu", with_pools("4MiB", [llama, qwen]), host_memory="3MiB", poison_evicted=True) as rt:
        a = lm.load(rt, "llama", llama, profile=False)
        b = lm.load(rt, "qwen", qwen, profile=False)
        host = rt.snapshot().host_tier
        assert host.filled == 0 and host.bytes_read == 0  # registered from the headers alone
        for _ in range(2):
            assert a.generate(a.encode(PROMPTS[0]), GREEDY).result(60).tokens == reference(PROMPTS[0])
            assert b.generate(ids[0].tolist(), GREEDY).result(60).tokens == want_qwen
        host = rt.snapshot().host_tier
        assert host.drops >= 2 and host.fills >= 3 and host.bytes_read > 0
        # A shard rewritten after registration fails that model's generation alone.
        rt.evict("qwen", host=True)
        shard = hfdir.shard_files(qwen)[-1]
        shard.write_bytes(shard.read_bytes()[:-8])
        finish = list(b.generate(ids[0].tolist(), GREEDY).events(60))[-1]
        assert isinstance(finish, Finish) and isinstance(finish.error, WeightsError)
        assert str(shard) in str(finish.error)
        assert a.generate(a.encode(PROMPTS[1]), GREEDY).result(60).tokens == reference(PROMPTS[1])
        a.close()
        b.close()


def test_a_reader_that_fails_cancels_its_own_sequence_alone(llama, reference):
    """A caller's ``on_event`` that raises: its sequence is cancelled at the next step, and
    the other sequence of the batch (in a worker process) goes on, exactly."""
    seen: list[object] = []

    def broken(event):
        seen.append(event)
        if len(seen) == 3:
            raise RuntimeError("reader broke")

    with Runtime("cpu", "64MiB", workers=2) as rt:
        m = lm.load(rt, "llama", llama)
        with rt.turn(m.name):  # both queued first, so that they decode in one batch
            bad = m.generate(m.encode(PROMPTS[1]), SamplingParams(max_tokens=30, temperature=0.7, seed=666), broken)
            good = m.generate(m.encode(PROMPTS[0]), SamplingParams(max_tokens=30, temperature=0))
        assert good.result(60).tokens == reference(PROMPTS[0], 30)
        deadline = time.monotonic() + 30
        while not bad.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bad.finish is not None and bad.finish.reason == "cancelled" and len(bad.tokens) < 30
        assert m.engine.snapshot().running == 0 and m.engine.snapshot().kv_bytes == 0
        m.close()
