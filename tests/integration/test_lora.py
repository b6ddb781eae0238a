"""LoRA adapters (NOTE [Adapters in slots], NOTE [Adapter residency]): greedy tokens of
four adapters of different ranks, targets and scalings equal PEFT's ``generate``, alone and
mixed in one batch with the base, in-process and with workers; bad adapters refused with
the reason; slots reused least recently used first."""

from __future__ import annotations

import json
import time

import pytest

from tests.llm_reference import peft_greedy, with_pools, write_adapter
from timeshare.errors import ConfigError, GenerationError, UnknownModelError
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

pytest.importorskip("peft")

TOKENS = 12
PROMPTS = ["the model switch fast", "a gpu load weights", "layer token fast slow memory host device",
           "switch", "memory of the host and the device", "fast fast slow", "token layer", "load the weights now"]
# name -> (rank, targets, alpha, rslora)
ADAPTERS = {"attn8": (8, ["q_proj", "v_proj"], 16, False),
            "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, False),
            "mlp16": (16, ["gate_proj", "down_proj"], 32, True),
            "o2": (2, ["o_proj", "up_proj"], 4, False)}


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


def test_the_engines_snapshot_counts_the_adapter_slots_and_the_copies_into_them(served, expected, adapters):
    """NOTE [Adapter residency]: what the metrics show of a model's adapter slots (the
    controller's, in both modes)."""
    assert _greedy(served, 0, "o2").result(60).tokens == expected["o2"][0]  # on the device now
    before = served.engine.snapshot()
    assert before.adapter_slots == 4
    assert before.adapters_on_device == sum(i.slot is not None for i in served.adapters.infos()) >= 1
    assert _greedy(served, 1, "o2").result(60).tokens == expected["o2"][1]
    warm = served.engine.snapshot()
    assert (warm.adapter_loads, warm.adapter_load_s) == (before.adapter_loads, before.adapter_load_s)  # no copy
    served.adapters.remove("o2")
    assert served.engine.snapshot().adapters_on_device == before.adapters_on_device - 1
    served.adapters.add("o2", adapters["o2"])
    assert _greedy(served, 2, "o2").result(60).tokens == expected["o2"][2]
    after = served.engine.snapshot()
    assert after.adapter_loads == before.adapter_loads + 1 and after.adapter_load_s > before.adapter_load_s
    assert after.adapters_on_device == before.adapters_on_device


def test_a_prompt_cached_by_the_base_is_not_read_by_an_adapter(served, expected, base, adapters):
    """NOTE [Prefix caching]: the base's published pages of a prompt are keyed apart from
    the same prompt's under an adapter."""
    long = " ".join(PROMPTS * 4)
    ids = served.encode(long)
    assert len(ids) > 64  # full pages to publish
    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    assert served.generate(ids, params).result(60).tokens == peft_greedy(base, None)(ids, TOKENS)
    hits = served.engine.snapshot().prefix_hits
    assert served.generate(ids, params, adapter="all4").result(60).tokens == \
        peft_greedy(base, adapters["all4"])(ids, TOKENS)
    assert served.engine.snapshot().prefix_hits == hits  # nothing of the base's was read
    assert served.generate(ids, params, adapter="all4").result(60).tokens == \
        peft_greedy(base, adapters["all4"])(ids, TOKENS)
    assert served.engine.snapshot().prefix_hits > hits  # its own pages are


def test_more_adapters_than_slots_take_turns_in_them_least_recently_used_first(base, adapters, expected):
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, max_sequences=8, adapters=adapters, max_loras=2,
                    max_lora_rank=16)
        slots = m.adapters.slots
        names = ["attn8", "all4", "mlp16", "o2", "attn8", "o2", None, "mlp16"]
        seqs = [_greedy(m, i, name) for i, name in enumerate(names)]
        assert [s.result(60).tokens for s in seqs] == [expected[name][i] for i, name in enumerate(names)]
        loads = slots.loads
        assert loads >= 4  # four adapters through two slots
        on = {i.name: i.slot for i in m.adapters.infos()}
        assert sorted(s for s in on.values() if s is not None) == [1, 2]
        # Pinned, an adapter stays through the others' turns.
        m.adapters.slots.pin("o2")
        for name in ["attn8", "all4", "mlp16", "attn8"]:
            assert _greedy(m, 0, name).result(60).tokens == expected[name][0]
        assert {i.name: i.slot for i in m.adapters.infos()}["o2"] is not None
        assert slots.loads > loads


def test_bad_adapters_are_refused_whole_with_the_reason(base, adapters, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, max_lora_rank=8, max_loras=2)

        def broken(name: str, edit_config=None, edit_tensors=None):
            path = tmp_path / name
            shutil.copytree(adapters["mlp16" if name == "rank" else "attn8"], path)
            if edit_config is not None:
                config = json.loads((path / "adapter_config.json").read_text())
                edit_config(config)
                (path / "adapter_config.json").write_text(json.dumps(config))
            if edit_tensors is not None:
                tensors = load_file(path / "adapter_model.safetensors")
                edit_tensors(tensors)
                save_file(tensors, path / "adapter_model.safetensors")
            return path

        cases = {
            "rank": (broken("rank"), "exceeds max_lora_rank 8"),
            "dora": (broken("dora", lambda c: c.update(use_dora=True)), "use_dora=True"),
            "saved": (broken("saved", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
            "shape": (broken("shape", edit_tensors=lambda t: t.update({k: v[:, :-1].contiguous() for k, v in t.items()
                                                                        if "lora_A" in k})), "another base"),
            "stray": (broken("stray", edit_tensors=lambda t: t.update({"base_model.model.lm_head.lora_A.weight":
                                                                       next(iter(t.values())).clone()})),
                      "not one of the base's adaptable projections"),
            "half": (broken("half", edit_tensors=lambda t: [t.pop(k) for k in list(t) if "q_proj.lora_B" in k]),
                     "without its other factor"),
            "missing": (tmp_path / "nowhere", "no adapter_config.json"),
        }
        cases["nan"] = (broken("nan", edit_tensors=lambda t: t.update({k: v.fill_(float("nan")) for k, v in t.items()
                                                                       if "q_proj.lora_B" in k})), "inf or NaN")
        cases["big"] = (broken("big", lambda c: c.update(lora_alpha=1e30), lambda t: t.update(
            {k: v.fill_(1e20) for k, v in t.items() if "q_proj.lora_B" in k})), "overflow torch.float32 once scaled")
        cases["alpha"] = (broken("alpha", lambda c: c.update(lora_alpha="x")), "cannot be read")
        corrupt = broken("corrupt")
        (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
        cases["corrupt"] = (corrupt, "cannot be read")
        for name, (path, words) in cases.items():
            with pytest.raises(ConfigError, match=words):
                m.adapters.add(name, path)
        assert [i.name for i in m.adapters.infos()] == []
        with pytest.raises(UnknownModelError):
            m.generate(m.encode("hi"), SamplingParams(max_tokens=2), adapter="rank")


def test_the_resolver_loads_an_adapter_on_its_first_request_and_a_removed_one_is_unknown(base, adapters, expected):
    resolve = adapters["attn8"].parent
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, lora_dir=resolve, max_lora_rank=16)
        assert [i.name for i in m.adapters.infos()] == []
        assert _greedy(m, 1, "mlp16").result(60).tokens == expected["mlp16"][1]
        assert [i.name for i in m.adapters.infos()] == ["mlp16"]
        with pytest.raises(UnknownModelError):
            _greedy(m, 1, "../attn8")  # a name, never a path
        m.adapters.remove("mlp16")
        assert m.adapters.slots.slot_of("mlp16") is None
        m.adapters.resolve_dir = None
        with pytest.raises(UnknownModelError):
            _greedy(m, 1, "mlp16")


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_at_most_max_cpu_loras_adapters_stay_in_host_memory_and_one_let_go_is_read_again(base, adapters, expected,
                                                                                        workers):
    """vLLM's ``--max-cpu-loras``: added or resolved, an adapter's host copy goes when the
    bound is passed (the least recently requested one not on the device), its name stays
    served, and its next request reads it again and answers as PEFT does."""
    resolve = adapters["attn8"].parent
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=workers) as rt:
        with pytest.raises(ConfigError, match="must be at least max_loras"):
            lm.load(rt, "bad", base, max_context=256, max_loras=2, max_cpu_loras=1)
        m = lm.load(rt, "llama", base, max_context=256, adapters={"o2": adapters["o2"]}, lora_dir=resolve,
                    max_loras=1, max_cpu_loras=2, max_lora_rank=16)
        table = m.adapters
        for name in ["attn8", "all4", "mlp16"]:  # resolved; one slot: each takes it from the one before
            assert _greedy(m, 2, name).result(60).tokens == expected[name][2], name
        held = {i.name: i.in_host for i in table.infos()}
        assert sorted(i.name for i in table.infos()) == ["all4", "attn8", "mlp16", "o2"]
        assert sum(held.values()) == 2 and held["mlp16"] and held["all4"]  # the bound, most recent first
        assert not held["o2"] and not held["attn8"]  # added or resolved, alike
        reads = table.reads
        for name in ["o2", "attn8"]:  # read again from their directories
            assert _greedy(m, 3, name).result(60).tokens == expected[name][3], name
        assert table.reads == reads + 2
        assert sum(i.in_host for i in table.infos()) == 2
        kept = table.get("o2")  # what a request holds while it waits
        for name in ["all4", "mlp16"]:
            assert _greedy(m, 4, name).result(60).tokens == expected[name][4], name
        assert not {i.name: i.in_host for i in table.infos()}["o2"]
        reads = table.reads
        assert table.get("o2") is kept and table.reads == reads  # taken back: one copy, no second read
        pinned = lm.load(rt, "pinned", base, max_context=256, adapters={"o2": adapters["o2"]},
                         pinned_adapters=["o2"], lora_dir=resolve, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
        for name in ["attn8", "mlp16"]:
            assert _greedy(pinned, 1, name).result(60).tokens == expected[name][1], name
        assert {i.name: (i.in_host, i.pinned) for i in pinned.adapters.infos()}["o2"] == (True, True)  # never let go
        pinned.close()
        table.remove("o2")  # removed, its copy let go or not: unknown (with no resolver to find it again)
        assert not table.serves("o2")
        table.resolve_dir = None
        with pytest.raises(UnknownModelError):
            _greedy(m, 3, "o2")
        m.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_a_cold_adapter_streams_in_layer_by_layer_while_its_prefill_runs(base, adapters, expected, workers,
                                                                         monkeypatch):
    """NOTE [Adapters streamed in]: streamed (CUDA's default, asked for here), a cold
    adapter's slot is written after its prefill began (in-process on a thread of its own,
    with workers by the controller once the step is sent), each correction waiting for its
    layer: with each copy slowed, corrections wait and the tokens are still PEFT's. A
    write that fails, streamed or made before the step (the CPU's default), fails its
    request with the reason, and the slot holds no adapter: the next request writes it
    again, whole."""
    from timeshare.decode.lora import LoraStacks

    write = LoraStacks.write_target

    def slow(self, slot, i, got, non_blocking=False):
        time.sleep(0.02)  # 14 targets: 280 ms, against a prefill of milliseconds
        write(self, slot, i, got, non_blocking)

    def broken(self, slot, i, got, non_blocking=False):
        if i >= 7:  # the second layer's
            raise RuntimeError("copy engine fault")
        write(self, slot, i, got, non_blocking)

    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=workers) as rt:
        m = lm.load(rt, "llama", base, max_context=256, adapters=adapters, max_loras=1, max_lora_rank=16)
        slots, counts = m.adapters.slots, m.engine.counts
        assert not slots.stream  # the CPU's default: written before the step
        assert _greedy(m, 5, "o2").result(60).tokens == expected["o2"][5]
        assert counts.slot_waits == 0 and slots.loads == 1
        slots.stream = True
        monkeypatch.setattr(LoraStacks, "write_target", slow)
        assert _greedy(m, 0, "all4").result(60).tokens == expected["all4"][0]
        waited = counts.slot_waits
        assert waited >= 1 and slots.loads == 2 and slots.load_s >= 14 * 0.02
        assert _greedy(m, 1, "all4").result(60).tokens == expected["all4"][1]  # on the device now: no write
        assert counts.slot_waits == waited and slots.loads == 2
        monkeypatch.setattr(LoraStacks, "write_target", broken)
        for stream in (True, False):
            slots.stream = stream
            with pytest.raises(GenerationError, match="could not be written.*copy engine fault"):
                _greedy(m, 2, "mlp16").result(60)
            assert {i.name: i.slot for i in m.adapters.infos()}["mlp16"] is None, stream
        slots.stream = True
        monkeypatch.setattr(LoraStacks, "write_target", slow)
        for i, name in [(2, "mlp16"), (3, "all4"), (4, "mlp16")]:
            assert _greedy(m, i, name).result(60).tokens == expected[name][i], name
        assert counts.slot_waits > waited and slots.loads == 7
        m.close()


@pytest.mark.parametrize("compiled", ["off", "aot_eager"])
def test_captured_steps_read_the_slots_so_a_new_adapter_in_a_slot_needs_no_new_capture(base, adapters, expected,
                                                                                        compiled):
    """NOTE [Adapters in slots] under NOTE [Decode graphs]: the CPU's stand-in for a CUDA
    graph (and a compiled step) keeps the tensors it captured; the slots are read by
    index at each replay, so two adapters taking turns in one slot each give PEFT's
    tokens from the same captures."""
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, max_sequences=4, adapters=adapters, max_loras=1,
                    max_lora_rank=16, graphs="emulate", compile=compiled)
        captures = m.engine.snapshot().graph_captures
        assert captures > 0
        for name in ["attn8", None, "mlp16", "attn8", "o2"]:
            assert _greedy(m, 2, name).result(60).tokens == expected[name][2], name
        snap = m.engine.snapshot()
        assert snap.graph_captures == captures and snap.graph_replays > 0
        assert m.adapters.slots.loads >= 4


@pytest.mark.parametrize("graphs", ["off", "emulate"])
def test_factors_gathered_give_the_same_tokens(base, adapters, expected, monkeypatch, graphs):
    """NOTE [Adapters in slots]: the used columns gathered where they are few in a wide span
    (here always), and with graphs past ``STACKED_SLOTS`` slots each row's factors
    gathered instead of whole stacks multiplied; the same tokens."""
    from timeshare.decode import lora

    monkeypatch.setattr(lora, "SPAN_PER_USED", 0)
    monkeypatch.setattr(lora, "STACKED_SLOTS", 2)
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, max_sequences=8, adapters=adapters, max_loras=4,
                    max_lora_rank=16, graphs=graphs)
        names = [None, "attn8", "all4", "mlp16", "o2", None, "mlp16", "attn8"]
        seqs = [_greedy(m, i, name) for i, name in enumerate(names)]
        assert [s.result(60).tokens for s in seqs] == [expected[name][i] for i, name in enumerate(names)]


def test_a_sequence_waiting_for_a_slot_lets_those_behind_it_that_need_none_go_first(base, adapters, expected):
    """NOTE [Adapter residency]: one slot, held by a long generation of one adapter; a
    request of another adapter waits for it, and a request of the base behind it does not."""
    with Runtime("cpu", with_pools("16MiB", [base], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", base, max_context=256, max_sequences=4, adapters=adapters, max_loras=1,
                    max_lora_rank=16)
        long = m.generate(m.encode(PROMPTS[0]), SamplingParams(max_tokens=120, temperature=0, min_tokens=120),
                          adapter="attn8")
        while long.first_token_at is None:
            time.sleep(0.001)
        other = _greedy(m, 1, "mlp16")
        plain = _greedy(m, 2, None)
        assert plain.result(60).tokens == expected[None][2]
        assert other.result(60).tokens == expected["mlp16"][1]
        long.result(60)
        assert plain.first_token_at is not None and long.last_token_at is not None
        assert plain.first_token_at < long.last_token_at  # admitted beside the long one
        assert other.first_token_at is not None and other.first_token_at > long.last_token_at  # its slot came then

