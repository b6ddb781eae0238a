"""LoRA adapters (NOTE [Adapters in slots], NOTE [Adapter residency]): greedy tokens of
four adapters of different ranks, targets and scalings equal PEFT's ``generate``, alone and
mixed in one batch with the base, in-process and with workers; bad adapters refused with
the reason; slots reused least recently used first."""

from __future__ import annotations

import json

import pytest

from tests.llm_reference import peft_greedy, with_pools, write_adapter
from timeshare.errors import ConfigError, UnknownModelError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

pytest.importorskip("peft")

TOKENS = 12
PROMPTS = ["the model switch fast", "a gpu load weights", "layer token fast slow memory host device",
           "switch", "memory of the host and the device", "fast fast slow", "token layer", "load the weights now"]
# name -> (rank, targets, alpha, rslora)
ADAPTERS = {"attn8": (8, ["q_proj", "v_proj"], 16.0, False),
            "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8.0, False),
            "mlp16": (16, ["gate_proj", "down_proj"], 32.0, True),
            "o2": (2, ["o_proj", "up_proj"], 4.0, False)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("lora") / "llama", "llama", seed=11, hidden=64, layers=2)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(base, root / name, rank=r, targets=t, alpha=a, rslora=rs, seed=i, std=0.3)
            for i, (name, (r, t, a, rs)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def expected(base, adapters):
    """PEFT's greedy tokens for every prompt, with each adapter and with none."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    out = {}
    for name, path in [(None, None), *adapters.items()]:
        generate = peft_greedy(base, path)
        out[name] = [generate(i, TOKENS) for i in ids]
    return out


def test_the_adapters_change_the_answers(expected):
    """The premise: each adapter's tokens differ from the base's (else equality proves nothing)."""
    for name in ADAPTERS:
        assert expected[name] != expected[None], name


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "workers"])
def served(request, base, adapters):
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=request.param) as rt:
        yield lm.load(rt, "llama", base, max_context=256, max_sequences=8, adapters=adapters, max_loras=4,
                      max_lora_rank=16)


def _greedy(model, i: int, adapter: str | None):
    return model.generate(model.encode(PROMPTS[i]), SamplingParams(max_tokens=TOKENS, temperature=0),
                          adapter=adapter)


def test_each_adapter_alone_gives_pefts_tokens(served, expected):
    for name in [None, *ADAPTERS]:
        for i in range(3):
            assert _greedy(served, i, name).result(60).tokens == expected[name][i], (name, i)


def test_a_batch_of_eight_rows_mixing_four_adapters_and_the_base_gives_each_its_tokens(served, expected):
    names = [None, "attn8", "all4", "mlp16", "o2", None, "mlp16", "attn8"]
    seqs = [_greedy(served, i, name) for i, name in enumerate(names)]
    got = [s.result(60).tokens for s in seqs]
    assert got == [expected[name][i] for i, name in enumerate(names)]
