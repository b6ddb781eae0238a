"""Generation in worker processes (NOTE [Generation in worker processes]): the decode
batch's caches stay in the model's home worker; greedy tokens are those of
``transformers`` alone, in a batch, after a pipelined load into a poisoned block and
after another model took the device; a home killed mid-generation fails the rows it
held, and the next generation starts in a new home."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.llm_reference import greedy_tokens
from tests.models import sleepy_linear
from timeshare.errors import WorkerError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu", "load weights layer token fast slow memory host device"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("wgen") / "llama", "llama", seed=3, hidden=128, layers=4)


@pytest.fixture(scope="module")
def reference(llama):
    return greedy_tokens(llama)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def homes(rt: Runtime) -> dict:
    return rt.snapshot().workers.kv_homes


def test_generation_in_a_worker_equals_transformers_alone_batched_cold_and_preempted(llama, reference):
    x = torch.randn(2, 4)
    with torch.no_grad():
        want_other = sleepy_linear()(x)
    with Runtime("cpu", "64MiB", workers=2, poison_evicted=True, copy_delay_s=0.001) as rt:
        m = lm.load(rt, "llama", llama)
        rt.register("other", "tests.models:sleepy_linear", None, (x,))
        assert m.generate(m.encode(PROMPTS[0]), greedy(24)).result(60).tokens == reference(PROMPTS[0], 24)
        assert homes(rt) == {}  # its rows ended: the home let its caches go
        rt.evict("llama")  # the next one loads, pipelined, into a poisoned block, in the home
        lengths = (40, 8, 25)  # rows leave the batch at different steps
        with rt.hold_device():  # queued together: one batch in the home, rows joining one by one
            seqs = [m.generate(m.encode(p), greedy(n)) for p, n in zip(PROMPTS, lengths)]
        seen = []
        while not all(s.done for s in seqs):
            seen.append(dict(homes(rt)))
            assert torch.equal(rt.infer("other", x), want_other)  # takes the device between two steps
            time.sleep(0.01)
        for prompt, seq, n in zip(PROMPTS, seqs, lengths):
            assert seq.result(60).tokens == reference(prompt, n)
        home = next(h for h in seen if h)
        first = rt.snapshot().workers.workers[0].id
        assert len(home) == 1 and first not in home.values()  # one home, not the first worker
        assert m.engine.snapshot().kv_bytes == 0
        m.close()


def decoding_in_its_home(rt: Runtime, llama):
    """The model loaded and a long generation decoding in its home: the model, the
    sequence, and its home's worker id and pid."""
    m = lm.load(rt, "llama", llama)
    seq = m.generate(m.encode(PROMPTS[2]), greedy(200))
    deadline = time.monotonic() + 30
    while len(seq.tokens) < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
    [home_id] = homes(rt).values()
    pid = next(w.pid for w in rt.snapshot().workers.workers if w.id == home_id)
    return m, seq, home_id, pid


def test_a_killed_home_fails_the_rows_it_held_and_the_next_generation_starts_anew(llama, reference):
    # The home dies while the device is held, a new request queued meanwhile: the engine's
    # next turn prefills it first, into a batch whose caches are gone. The rows of that
    # batch fail; the newcomer, which never had caches there, starts a batch in a new
    # home and answers exactly. The model itself was never lost.
    with Runtime("cpu", "64MiB", workers=2) as rt:
        m, seq, home_id, pid = decoding_in_its_home(rt, llama)
        with rt.hold_device():
            os.kill(pid, signal.SIGKILL)
            again = m.generate(m.encode(PROMPTS[1]), greedy(16))
        with pytest.raises(WorkerError, match="caches"):
            seq.result(60)
        assert 3 <= len(seq.tokens) < 200
        assert again.result(60).tokens == reference(PROMPTS[1], 16)
        workers = rt.snapshot().workers.workers
        assert home_id not in [w.id for w in workers] and len(workers) == 2
        m.close()


def test_in_a_worker_caches_wait_in_host_memory_under_offload_kv_and_a_kv_budget(tmp_path, llama, reference):
    """NOTE [Key/value caches off the device] and [... under pressure] with workers: the
    home moves a preempted batch's caches to its host memory and back before its next step."""
    from timeshare.llm.kv_budget import KVBudget

    qwen = hfdir.write_model_dir(tmp_path / "qwen", "qwen2", seed=6, hidden=96, layers=2)
    want_qwen = greedy_tokens(qwen)(PROMPTS[1], 60)
    budget = KVBudget(1 << 14)
    with Runtime("cpu", "64MiB", workers=2) as rt:
        a = lm.load(rt, "llama", llama, quantum_s=0.01, offload_kv=True)
        b = lm.load(rt, "qwen", qwen, quantum_s=0.01, kv_budget=budget)
        first = a.generate(a.encode(PROMPTS[0]), greedy(60))
        deadline = time.monotonic() + 30
        while len(first.tokens) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        other = b.generate(b.encode(PROMPTS[1]), greedy(60))
        assert first.result(60).tokens == reference(PROMPTS[0], 60)
        assert other.result(60).tokens == want_qwen
        assert a.engine.kv_offloads >= 1 and b.engine.kv_offloads >= 1 and budget.snapshot().moves >= 1
        assert a.engine.kv_host_bytes == b.engine.kv_host_bytes == 0 and homes(rt) == {}
        a.close()
        b.close()
