"""``timeshare bench llm`` end to end on tiny models: every part runs in both modes
(in-process and with workers), the cold greedy tokens equal the warm ones, the decode
part's greedy tokens equal those of ``transformers`` at each count of sequences, a
request whose system prompt is cached gives the tokens of the same request computed whole
(finding the system prompt's pages), and in the fleet both servers (timeshare's and the
reload-on-switch baseline) answer every request with the same greedy text. The 8b size is
checked from its config on the meta device, and its writer and path on a small shape given
in full (8B parameters are a GPU machine's to write). Speed is the bench's to report, not
this test's."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from timeshare.cli import main

pytest.importorskip("transformers")

from timeshare.bench import llm_models as models  # noqa: E402
from timeshare.bench.llm import LLMBenchConfig  # noqa: E402

SMALL_IN_FULL = models.Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=400)
# Wide enough a vocabulary for near ties: converted to bf16, its rotary buffers part our
# greedy tokens from transformers' at the 21st (NOTE [Conversions the weights do not need]).
WIDE_IN_FULL = models.Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=32000)


def test_bench_llm_runs_every_part_and_the_two_servers_agree(tmp_path):
    out = tmp_path / "llm.json"
    plot = tmp_path / "llm.png"
    code = main(["bench", "llm", "--size", "tiny", "--repeats", "2", "--prompt-tokens", "12", "--new-tokens", "6",
                 "--concurrent", "1,2", "--fleet-models", "3", "--fleet-requests", "6", "--fleet-rate", "6",
                 "--fleet-max-tokens", "4", "--system-tokens", "100", "--turn-tokens", "8", "--device", "cpu",
                 "--workdir", str(tmp_path / "models"), "--json", str(out), "--plot", str(plot)])
    assert code == 0
    r = json.loads(out.read_text())
    assert list(r["modes"]) == ["in-process", "workers"] and r["modes"]["workers"]["workers"] == 2
    for mode in r["modes"].values():
        wake = mode["wake"]
        assert wake["cold_tokens_exact"] == wake["cold_runs"] == 2
        assert wake["bytes"] > 0 and wake["cold_ttft_s"] > 0 and math.isfinite(wake["cold_over_warm_plus_copy"])
        assert wake["load_then_generate_s"] > 0 and wake["baseline_skipped"] is None
        # On the CPU no decode graph is captured, so nothing is compiled (NOTE [Compiled decode steps]).
        assert mode["graphs"]["captures"] == mode["graphs"]["compiled"] == 0 and r["config"]["compile"] == "auto"
        assert mode["graphs"]["registration_reserved_bytes"] is None  # the CUDA allocator's, measured on CUDA only
        rows = mode["decode"]["rows"]
        assert [row["sequences"] for row in rows] == [1, 2]
        assert mode["decode"]["ours_tokens_per_s"] == rows[0]["ours_tokens_per_s"]  # as runs of one count said it
        for row in rows:  # every sequence of every repeat: transformers' greedy tokens at the same batch
            assert row["tokens_exact"] == row["sequences_compared"] == 2 * row["sequences"]
            assert row["agreeing_prefix_mean"] == row["plain_self_prefix_mean"] == 6
            assert row["ours_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
            assert math.isfinite(row["ours_over_plain_paired"])  # a tiny model's rates are noise, maybe < 0
        prefix = mode["prefix"]
        assert prefix["tokens_equal"] == prefix["requests_compared"] == 2
        assert prefix["hits"] == 2 * (100 // 32) and prefix["misses"] == 0  # the system prompt's full pages
        assert prefix["ttft_cached_s"] > 0 and prefix["miss_decode_cached_tokens_per_s"] > 0
        structured = mode["structured"]  # NOTE [Constrained decoding]: every constrained token had its mask
        assert structured["sequences"] == 2 and structured["masks"] == structured["constrained_tokens"] > 0
        assert structured["mask_us_per_token"] > 0 and structured["constrained_tokens_per_s"] > 0
    assert [row["sequences"] for row in r["decode_modes"]] == [1, 2]
    assert all(row["workers_over_in_process"] > 0 for row in r["decode_modes"])
    fleet = r["fleet"]
    for server in ("timeshare", "reload_on_switch"):
        assert fleet[server]["ok"] == 6 and fleet[server]["failed"] == 0, fleet[server]["errors"]
        assert fleet[server]["completion_tokens"] > 0 and fleet[server]["loads"] >= 1
    assert fleet["texts_agree"] == 6
    assert plot.stat().st_size > 0
    assert len(r["models"]) == 3 and all(m["parameters"] > 0 and m["bytes"] == 4 * m["parameters"]
                                         for m in r["models"])


def test_bench_llm_adapters_runs_in_both_modes_against_peft_and_a_merged_fine_tune(tmp_path):
    """``--adapters`` alone runs the adapters part (NOTE [Adapters in slots])."""
    pytest.importorskip("peft")
    out = tmp_path / "adapters.json"
    code = main(["bench", "llm", "--size", "tiny", "--adapters", "1,3", "--lora-rank", "4", "--repeats", "2",
                 "--prompt-tokens", "12", "--new-tokens", "6", "--concurrent", "3", "--device", "cpu",
                 "--workdir", str(tmp_path / "models"), "--json", str(out), "--plot", str(tmp_path / "a.png")])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["config"]["parts"] == ["adapters"] and list(r["modes"]) == ["in-process", "workers"]
    for mode in r["modes"].values():
        a = mode["adapters"]
        assert (a["rows"], a["slots"], a["rank"]) == (3, 3, 4) and set(mode) == {"adapters"}
        assert [row["adapters"] for row in a["decode"]] == [1, 3]
        assert a["decode"][1]["slot_loads"] >= 2 and all(row["adapters_tokens_per_s"] > 0 for row in a["decode"])
        first = a["first_token"]
        assert first["adapter_bytes"] > 0 and first["floor_s"] > first["base_warm_s"] > 0
        assert all(len(v) == 2 for v in first["samples"].values())
    assert [row["adapters"] for row in r["adapters_peft"]] == [1, 3, 0]
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.parametrize("args, words", [(["--workers", "1"], "workers must be at least 2"),
                                         (["--modes", "in-process,gpu"], "modes must be one or both"),
                                         (["--system-tokens", "0"], "system_tokens and turn_tokens"),
                                         (["--fleet-models", "2"], "at least 3 models"),
                                         (["--new-tokens", "1"], "new_tokens at least 2"),
                                         (["--concurrent", "1,0"], "each at least 1"),
                                         (["--concurrent", "1,x"], "comma-separated whole numbers"),
                                         (["--size", "8b"], "written in bf16"),
                                         (["--size", "8b", "--dtype", "bf16"], "wake, decode and prefix parts only"),
                                         (["--size", "8b", "--dtype", "bf16", "--arch", "gpt2", "--parts", "wake"],
                                          "Llama-shaped")])
def test_bench_llm_refuses_a_bad_option_before_it_builds_anything(tmp_path, capsys, args, words):
    code = main(["bench", "llm", "--size", "tiny", "--device", "cpu", "--workdir", str(tmp_path / "models"), *args])
    assert code != 0 and words in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "models").exists()


def test_the_8b_size_is_llama_3_8b_shaped_with_8_billion_parameters_in_16_gb():
    shape = models.SIZES["8b"].shapes[0]
    config = models.shape_config("llama", shape, max_positions=512)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert not config.tie_word_embeddings and config.dtype == torch.bfloat16
    tensors = models.meta_tensors(config)  # names and shapes, no memory
    assert all(t.is_meta for t in tensors.values())
    parameters = sum(t.numel() for t in tensors.values())
    assert parameters == 8_030_261_248  # Llama-3-8B's count
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 2 * parameters  # 16.06 GB
    assert LLMBenchConfig(size="8b", dtype="bf16", parts=("wake",)).baseline_skipped
    assert LLMBenchConfig(size="1b", parts=("wake",)).baseline_skipped is None


def test_a_shape_given_in_full_is_drawn_seeded_sharded_and_loads_in_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cpu = torch.device("cpu")
    path = models.write_drawn(tmp_path / "a", "llama", SMALL_IN_FULL, seed=1, max_positions=128, device=cpu,
                              shard_bytes=64 << 10)
    again = models.write_drawn(tmp_path / "b", "llama", SMALL_IN_FULL, seed=1, max_positions=128, device=cpu,
                               shard_bytes=256 << 10)  # other shards, the same tensors
    other = models.write_drawn(tmp_path / "c", "llama", SMALL_IN_FULL, seed=2, max_positions=128, device=cpu)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 2 and len(shards) > len(list(again.glob("*.safetensors")))
    weights = {k: v for f in shards for k, v in load_file(str(f)).items()}
    config = models.shape_config("llama", SMALL_IN_FULL, 128)
    meta = models.meta_tensors(config)
    assert {k: (tuple(v.shape), v.dtype) for k, v in weights.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}
    assert models.describe(path)["parameters"] == sum(t.numel() for t in meta.values())
    same = {k: v for f in again.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert all(torch.equal(weights[k], same[k]) for k in weights)
    others = {k: v for f in other.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert others.keys() == weights.keys() and not torch.equal(weights["lm_head.weight"], others["lm_head.weight"])
    up = [weights[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(2)]
    assert not torch.equal(*up)  # each tensor its own generator
    assert torch.equal(weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    std = weights["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.015 < std < 0.025  # transformers' initializer_range
    module, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert module.config.vocab_size == 400 and module.config.num_key_value_heads == 2
    assert torch.equal(module.state_dict()["lm_head.weight"], weights["lm_head.weight"])


def test_the_8b_path_on_a_small_shape_given_in_full(tmp_path, monkeypatch):
    """The 8b size as the GPU runs it (drawn weights in bf16, registered as they are, the
    wake without its baseline, decode at two counts with transformers' tokens), on a shape
    small enough for the CPU; run twice, the second run reuses the directory."""
    monkeypatch.setitem(models.SIZES, "8b", dataclasses.replace(models.SIZES["8b"], shapes=(WIDE_IN_FULL,)))
    out = tmp_path / "8b.json"
    args = ["bench", "llm", "--size", "8b", "--dtype", "bf16", "--parts", "wake", "decode", "--concurrent", "1,2",
            "--repeats", "1", "--prompt-tokens", "64", "--new-tokens", "32", "--device", "cpu", "--modes", "in-process",
            "--workdir", str(tmp_path / "models"), "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    m = r["models"][0]
    assert m["parameters"] == sum(t.numel() for t in models.meta_tensors(
        models.shape_config("llama", WIDE_IN_FULL, 512)).values()) and m["bytes"] == 2 * m["parameters"]
    assert list(r["modes"]) == ["in-process"] and "decode_modes" not in r
    r = r["modes"]["in-process"]
    assert r["converted_to"] is None
    wake = r["wake"]
    assert wake["load_then_generate_s"] is None and "minutes" in wake["baseline_skipped"]
    assert wake["cold_tokens_exact"] == wake["cold_runs"] == 1 and wake["bytes"] > 0
    rows = r["decode"]["rows"]
    assert [row["sequences"] for row in rows] == [1, 2]
    assert [(row["tokens_exact"], row["agreeing_prefix_mean"]) for row in rows] == [(1, 32), (2, 32)]
    assert r["memory"]["weights_bytes"] == m["bytes"] and r["memory"]["arena"] == "auto"
    written = [p.stat().st_mtime_ns for p in sorted((tmp_path / "models").rglob("*"))]
    assert main([*args, "--parts", "wake"]) == 0
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "models").rglob("*"))] == written
