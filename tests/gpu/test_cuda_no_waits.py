"""A language model's steps queue their work on the device without waiting for it (NOTE
[No waiting on the device] in ``worker/paged.py``): a prefill, eager and replayed decode
steps that take new pages, sampled choices and the pool's page moves all run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any wait for the device;
the one wait, the read of the tokens, is outside. The tokens are transformers' own.
Marked ``cuda``; skipped on machines without a GPU."""

import contextlib

import pytest
import torch

from tests.llm_reference import greedy_tokens
from timeshare.llm import hfdir
from timeshare.worker.decoding import DecodeRunner, Draw, choose
from timeshare.worker.paged import KVShape, PagedLayout, PagePool

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

PROMPT = "load weights layer token fast slow memory host"


@contextlib.contextmanager
def no_waits():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_check_itself_fails_on_a_wait():
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), no_waits():
        torch.tensor([1, 2, 3], device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), no_waits():
        x[x > 0]  # a boolean index reads its count back


def test_prefill_and_decode_steps_queue_without_waiting_and_give_the_tokens_of_transformers(tmp_path):
    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=4, hidden=128, layers=4)
    want = greedy_tokens(path, "cuda")(PROMPT, 16)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    shape = KVShape.of(model.config, torch.float32)
    # Pages of 4 positions: the decode steps take a new page every fourth token.
    pool = PagePool("cuda", 64 * 4 * shape.position_bytes, page_bytes=4 * shape.position_bytes)
    runner = DecodeRunner(PagedLayout(pool, shape), max_sequences=4, max_context=64, graphs="cuda", compile="off")
    assert runner.layout.block == 4
    greedy = Draw((0.0,), (0,), (1.0,), (0,), (0,))
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        with no_waits():
            first = runner.prefill(prompt, greedy)(model)
        tokens = [int(first)]
        for _ in range(7):  # eager: no graphs yet
            with no_waits():
                next_token = runner.decode([tokens[-1]], greedy)(model)
            tokens.append(int(next_token))
        assert runner.counts.eager == 7 and runner.counts.replays == 0
        assert runner.capture()(model) > 0  # a capture may wait; it is never on a request's path
        for _ in range(8):
            with no_waits():
                next_token = runner.decode([tokens[-1]], greedy)(model)
            tokens.append(int(next_token))
        assert runner.counts.replays == 8
    assert tokens == want


def test_sampling_and_moving_pages_queue_without_waiting():
    logits = torch.randn(3, 1000, device="cuda")
    sampled = Draw((0.8, 0.0, 1.2), (30, 0, 0), (0.9, 1.0, 0.5), (5, 6, 7), (3, 4, 5))
    with no_waits():
        chosen = choose(logits, sampled)
    assert chosen.tolist() == choose(logits, sampled).tolist()  # a function of seed and index
    assert chosen[1].item() == logits[1].argmax().item()  # greedy
    assert chosen[0].item() in logits[0].topk(30).indices.tolist()
    pool = PagePool("cuda", 8 * 1024, page_bytes=1024)
    data = torch.arange(2 * 1024, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, 1024).pin_memory()
    with no_waits():
        pages = pool.take(2)
        pool.write(pages, data)
        back = pool.read(pages)
    assert torch.equal(back.cpu(), data)
