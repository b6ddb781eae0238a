"""A language model's steps queue their work on the device without waiting for it (NOTE
[No waiting on the device] in ``decode/pages.py``): a prefill, eager and replayed decode
steps that take new pages, sampled choices and the pages' zeroing all run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any wait for the device;
the one wait, the read of the tokens, is outside. The tokens are transformers' own.
Marked ``cuda``; skipped on machines without a GPU."""

import contextlib

import pytest
import torch

from tests.llm_reference import greedy_tokens
from timeshare.decode.pages import PagedLayout, pool_footprint
from timeshare.decode.runner import DecodeRunner
from timeshare.decode.sampler import choose
from timeshare.decode.step import DecoderSpec, Draw, KVShape, Step, StepKind
from timeshare.llm import hfdir

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
    page_bytes = 4 * shape.position_bytes
    nbytes = pool_footprint(64 * page_bytes, page_bytes)
    memory = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    spec = DecoderSpec(0, nbytes, page_bytes, shape, max_sequences=4, max_context=64, graphs="cuda")
    runner = DecodeRunner(spec, memory)
    assert runner.layout.block == 4
    greedy = Draw((0.0,), (0,), (1.0,), (0,), (0,))
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    pages = list(range(1, -(-len(prompt) // 4) + 1))
    torch.cuda.synchronize()

    def step(kind: StepKind, tokens: tuple[int, ...], start: int, zero: tuple[int, ...] = ()) -> Step:
        return Step(kind, spec, (tokens,), (start,), (tuple(pages),), greedy, zero)

    def decode(tokens: list[int]) -> int:
        position = len(prompt) + len(tokens) - 1
        zero = ()
        if position >= 4 * len(pages):  # a new page, zeroed by the step itself
            pages.append(len(pages) + 1)
            zero = (pages[-1],)
        s = step(StepKind.DECODE, (tokens[-1],), position, zero)
        with no_waits():
            chosen = runner.launch(model, s)
        return int(chosen[0])  # the read of its token: the step's one wait, after its kernels

    with no_waits():
        first = runner.launch(model, step(StepKind.PREFILL, tuple(prompt), 0))
    tokens = [int(first[0])]
    for _ in range(7):  # eager: no graphs yet
        tokens.append(decode(tokens))
    assert runner.counts.eager == 7 and runner.counts.replays == 0
    assert runner.run(model, Step(StepKind.CAPTURE, spec)).counts.captures > 0  # a capture may wait
    for _ in range(8):
        tokens.append(decode(tokens))
    assert runner.counts.replays == 8
    assert tokens == want


def test_sampling_and_zeroing_pages_queue_without_waiting():
    logits = torch.randn(3, 1000, device="cuda")
    sampled = Draw((0.8, 0.0, 1.2), (30, 0, 0), (0.9, 1.0, 0.5), (5, 6, 7), (3, 4, 5))
    with no_waits():
        chosen = choose(logits, sampled)
    assert chosen.tolist() == choose(logits, sampled).tolist()  # a function of seed and index
    assert chosen[1].item() == logits[1].argmax().item()  # greedy
    assert chosen[0].item() in logits[0].topk(30).indices.tolist()
    memory = torch.full((8 * 1024,), 0xFF, dtype=torch.uint8, device="cuda")
    layout = PagedLayout(memory, 1024, KVShape(1, 1, 4, torch.float32))
    with no_waits():
        layout.zero([2, 5])
    assert not memory.view(8, 1024)[[2, 5]].any() and memory.view(8, 1024)[3].all()
