"""LoRA adapters on CUDA (NOTE [Adapters in slots]), in-process and in the worker a
model's steps run in: greedy tokens of adapters of different ranks and targets equal
PEFT's ``generate`` on the device, alone and mixed with the base in one batch, from
decode graphs captured once (of the compiled step) while adapters take turns in the
slots; the factors reach the slots from page-locked host memory. Marked ``cuda``;
skipped on machines without a GPU."""

import pytest

import timeshare
from tests.llm_reference import peft_greedy, write_adapter
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams

pytestmark = pytest.mark.cuda
pytest.importorskip("peft")

PROMPTS = ["the model switch fast", "a gpu share time", "load weights layer token fast slow memory host"]
ADAPTERS = {"attn8": (8, ["q_proj", "v_proj"]), "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]),
            "mlp16": (16, ["gate_proj", "down_proj"])}


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_adapters_from_captured_graphs_give_pefts_tokens_mixed_and_taking_turns(tmp_path, workers):
    base = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)
    paths = {n: write_adapter(base, tmp_path / n, rank=r, targets=t, seed=i, std=0.2)
             for i, (n, (r, t)) in enumerate(ADAPTERS.items())}
    with timeshare.Runtime(device="cuda", memory="96MiB", profile_repeats=1, workers=workers) as rt:
        m = lm.load(rt, "m", base, max_context=256, adapters=paths, max_loras=2, max_lora_rank=16)
        ids = [m.encode(p) for p in PROMPTS]
        want = {n: [peft_greedy(base, paths.get(n), "cuda")(i, 16) for i in ids] for n in [None, *ADAPTERS]}
        captured = m.engine.snapshot().graph_captures
        assert captured > 0
        greedy = SamplingParams(max_tokens=16, temperature=0)
        names = [None, "attn8", "all4", "mlp16", "attn8", None]
        for j, name in enumerate(names):  # alone, three adapters through two slots
            assert m.generate(ids[j % 3], greedy, adapter=name).result(120).tokens == want[name][j % 3], name
        with rt.turn(m.name):  # queued together: one batch of the base and two adapters
            seqs = [(n, i, m.generate(ids[i], greedy, adapter=n)) for i, n in enumerate([None, "attn8", "all4"])]
        for n, i, seq in seqs:
            assert seq.result(120).tokens == want[n][i], n
        snap = m.engine.snapshot()
        assert snap.graph_captures == captured and snap.eager_steps == 0 and snap.graph_replays > 0
        assert all(a.pinned_memory() for f in m.adapters.get("attn8").factors if f is not None for a in f)
        m.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_eager_steps_group_rows_by_slot_on_the_device_and_give_pefts_tokens(tmp_path, workers):
    """NOTE [Adapters in slots] without graphs: a step's rows grouped by slot, their
    index tensors on the device; a batch of the base, two rows of one adapter and one of
    another gives PEFT's tokens."""
    base = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)
    paths = {n: write_adapter(base, tmp_path / n, rank=r, targets=t, seed=i, std=0.2)
             for i, (n, (r, t)) in enumerate(ADAPTERS.items())}
    with timeshare.Runtime(device="cuda", memory="96MiB", profile_repeats=1, workers=workers) as rt:
        m = lm.load(rt, "m", base, max_context=256, adapters=paths, max_loras=3, max_lora_rank=16, graphs="off")
        ids = [m.encode(p) for p in PROMPTS]
        names = [None, "attn8", "mlp16", "attn8"]
        want = [peft_greedy(base, paths.get(n), "cuda")(ids[i % 3], 16) for i, n in enumerate(names)]
        greedy = SamplingParams(max_tokens=16, temperature=0)
        with rt.turn(m.name):  # queued together: one batch
            seqs = [m.generate(ids[i % 3], greedy, adapter=n) for i, n in enumerate(names)]
        assert [s.result(120).tokens for s in seqs] == want
        snap = m.engine.snapshot()
        assert snap.graph_captures == 0 and snap.eager_steps > 0
        m.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_a_cold_adapter_streamed_in_on_its_own_stream_gives_pefts_tokens(tmp_path, workers, monkeypatch):
    """NOTE [Adapters streamed in] on CUDA: each target's copy queued behind a spin of the
    copy stream (``torch.cuda._sleep``), so the prefill's corrections are queued before
    their factors have arrived: in-process only their stream's wait on the layer's event
    keeps them correct (the host does not wait), with workers the controller
    synchronises each layer before it tells the worker, whose corrections wait. The
    tokens are PEFT's, and later steps replay the captured graphs."""
    import torch

    from timeshare.decode.lora import LoraStacks

    base = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)
    paths = {n: write_adapter(base, tmp_path / n, rank=r, targets=t, seed=i, std=0.2)
             for i, (n, (r, t)) in enumerate(ADAPTERS.items())}
    write = LoraStacks.write_target

    def slow(self, slot, i, got, non_blocking=False):
        torch.cuda._sleep(5_000_000)  # some ms of the copy stream (the current one here), not of the host
        write(self, slot, i, got, non_blocking)

    monkeypatch.setattr(LoraStacks, "write_target", slow)
    with timeshare.Runtime(device="cuda", memory="96MiB", profile_repeats=1, workers=workers) as rt:
        m = lm.load(rt, "m", base, max_context=256, adapters=paths, max_loras=1, max_lora_rank=16)
        ids = [m.encode(p) for p in PROMPTS]
        greedy = SamplingParams(max_tokens=16, temperature=0)
        for j, name in enumerate(["all4", "mlp16", "attn8", "all4"]):  # one slot: each one cold
            want = peft_greedy(base, paths[name], "cuda")(ids[j % 3], 16)
            assert m.generate(ids[j % 3], greedy, adapter=name).result(120).tokens == want, name
        assert m.adapters.slots.stream and m.adapters.slots.loads == 4
        if workers:  # told only once each layer is on the device: the worker's corrections waited
            assert m.engine.counts.slot_waits >= 4
        assert m.engine.snapshot().graph_replays > 0
        m.close()


def _slot_writes_on(device: str) -> None:
    """The body of the test below, on any device: a slot's writes on CUDA's copy streams
    keep the extents' promise (NOTE [Adapters in slots]) and come after a clear queued
    before them."""
    import torch
    from torch import nn

    from timeshare.decode.lora import LoraSpec, LoraStacks, SlotWrite, pack

    torch.manual_seed(0)
    module = nn.Module()
    module.layers = nn.ModuleList(nn.Sequential(nn.Linear(256, 192), nn.Linear(192, 256)) for _ in range(2))
    spec = LoraSpec.of(module, 3, 8, torch.float32)
    stacks = LoraStacks(spec, torch.full((spec.nbytes,), 0xFF, dtype=torch.uint8, device=device))

    def image(rank, seed):
        gen = torch.Generator().manual_seed(seed)
        return [pack(torch.randn(rank, t.fan_in, generator=gen), torch.randn(t.fan_out, rank, generator=gen), 0.5,
                     torch.float32) for t in spec.targets]

    def holds(got, rank):
        for i, (a, b) in enumerate(zip(stacks.a, stacks.b)):
            for stack, want in ((a[:, 0], None if got is None else got[i][0]),
                                (b[:, 0], None if got is None else got[i][1])):
                if want is not None:
                    assert torch.equal(stack[:rank].cpu(), want), i
                assert not stack[rank:].any(), i

    stacks.clear(1)
    holds(None, 0)
    for rank, seed in ((6, 1), (2, 2)):  # ranks 2..5 zeroed by the second: the first reached them
        written = image(rank, seed)
        SlotWrite(stacks, 1, written).run()
        holds(written, rank)
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(20):  # the current stream busy, then a clear queued behind it: a write after must follow it
        busy = busy @ busy / 2048
    stacks.clear(1)
    written = image(4, 3)
    SlotWrite(stacks, 1, written).run()
    holds(written, 4)


def test_slot_writes_on_their_own_streams_zero_what_earlier_writes_left_and_follow_a_clear():
    _slot_writes_on("cuda")
