"""Generation with worker processes (NOTE [One step, two places]): the steps run in the
model's home worker on pages in the arena; greedy tokens are those of ``transformers``
alone, in a batch, after a pipelined load into a poisoned block and after another model
took the device; a home killed mid-generation loses nothing (NOTE [A step outlives its
worker]): the rows go on in a new home, exactly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.llm_reference import greedy_tokens
from tests.models import sleepy_linear
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
    return rt.snapshot().workers.step_homes


def test_generation_in_a_worker_equals_transformers_alone_batched_cold_and_preempted(llama, reference):
    x = torch.randn(2, 4)
    with torch.no_grad():
        want_other = sleepy_linear()(x)
    with Runtime("cpu", "64MiB", workers=2, poison_evicted=True, copy_delay_s=0.001) as rt:
        m = lm.load(rt, "llama", llama)
        rt.register("other", "tests.models:sleepy_linear", None, (x,))
        assert m.generate(m.encode(PROMPTS[0]), greedy(24)).result(60).tokens == reference(PROMPTS[0], 24)
        # The worker's eager steps by the lean step, as in-process (NOTE [Lean decode steps]).
        snap = m.engine.snapshot()
        assert snap.eager_steps == 23 and snap.lean_steps == 22
        [home] = homes(rt).values()
        assert home != rt.snapshot().workers.workers[0].id  # not the first worker: inference goes there
        rt.evict("llama")  # the next one loads, pipelined, into a poisoned block, in the home
        lengths = (40, 8, 25)  # rows leave the batch at different steps
        with rt.turn(m.name):  # queued together: one batch, rows joining one by one
            seqs = [m.generate(m.encode(p), greedy(n)) for p, n in zip(PROMPTS, lengths)]
        while not all(s.done for s in seqs):
            assert torch.equal(rt.infer("other", x), want_other)  # takes the device between two steps
            time.sleep(0.01)
        for prompt, seq, n in zip(PROMPTS, seqs, lengths):
            assert seq.result(60).tokens == reference(prompt, n)
        assert homes(rt) == {"llama": home}  # its steps stayed in one worker
        assert m.engine.snapshot().kv_bytes == 0 and m.engine.turns >= 2
        m.close()
        assert homes(rt) == {}


def test_a_killed_home_loses_nothing_the_rows_go_on_in_a_new_home(llama, reference):
    # The home dies while the device is held, a new request queued meanwhile: the engine's
    # next turn prefills it in a new home, and the running row's next step runs there too,
    # from its pages in the arena. Every token is transformers' own.
    with Runtime("cpu", "64MiB", workers=2) as rt:
        m = lm.load(rt, "llama", llama)
        seq = m.generate(m.encode(PROMPTS[2]), greedy(120))
        deadline = time.monotonic() + 30
        while len(seq.tokens) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        [home] = homes(rt).values()
        pid = next(w.pid for w in rt.snapshot().workers.workers if w.id == home)
        with rt.turn(m.name):
            os.kill(pid, signal.SIGKILL)
            again = m.generate(m.encode(PROMPTS[1]), greedy(16))
        assert again.result(60).tokens == reference(PROMPTS[1], 16)
        assert seq.result(60).tokens == reference(PROMPTS[2], 120)
        workers = rt.snapshot().workers.workers
        assert home not in [w.id for w in workers] and len(workers) == 2
        assert list(homes(rt).values()) != [home]
        m.close()


def test_in_a_worker_caches_wait_in_host_memory_under_offload_kv_and_a_kv_budget(tmp_path, llama, reference):
    """NOTE [Key/value caches off the device] and [... under pressure] with workers: a
    preempted batch's pages go to the controller's host memory and back before its next
    step, bit for bit."""
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
        assert a.engine.kv_host_bytes == b.engine.kv_host_bytes == 0
        a.close()
        b.close()
