"""Hugging Face model directories (issue 18, its first piece): written from code with
seeded weights and a trained tokenizer, read back by ``transformers`` itself, and served
by the runtime from their safetensors shards with logits bit for bit those of
``transformers``' own model, through pipelined reloads with evicted blocks poisoned."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from timeshare.errors import ConfigError, WeightsError
from timeshare.llm import hfdir
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: hfdir.write_model_dir(root / arch, arch, seed=1) for arch in hfdir.ARCHITECTURES}


def reference(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def tokens(path, text="the model switch fast"):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return torch.tensor([tokenizer(text)["input_ids"]])


def register(rt, name, path, ids):
    rt.register(name, functools.partial(hfdir.build_causal_lm, str(path)), hfdir.read_weights(path), (ids,),
                example_kwargs={"use_cache": False})


@pytest.mark.parametrize("arch", hfdir.ARCHITECTURES)
def test_a_written_directory_is_served_with_the_logits_of_transformers(dirs, arch):
    path = dirs[arch]
    assert len(hfdir.shard_files(path)) > 1  # sharded, with an index, as large models are
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s>user: hi</s><s>assistant:"
    ids = tokens(path)
    want = reference(path, ids)
    with Runtime("cpu", "64MiB", poison_evicted=True, copy_delay_s=0.001) as rt:
        register(rt, arch, path, ids)
        for _ in range(3):  # the first load, then pipelined ones from poisoned blocks
            out = rt.infer(arch, ids, use_cache=False)
            assert torch.equal(out["logits"], want)
            rt.evict(arch)


def test_with_workers_the_directory_model_is_rebuilt_there_and_exact(dirs):
    path = dirs["llama"]
    ids = tokens(path)
    with Runtime("cpu", "64MiB", workers=2, poison_evicted=True) as rt:
        register(rt, "llama", path, ids)
        for _ in range(2):
            assert torch.equal(rt.infer("llama", ids, use_cache=False)["logits"], reference(path, ids))
            rt.evict("llama")


def test_broken_directories_are_refused_clearly(tmp_path, dirs):
    with pytest.raises(ConfigError, match="unknown architecture"):
        hfdir.write_model_dir(tmp_path / "x", "gpt9")
    with pytest.raises(WeightsError, match="no safetensors weights"):
        hfdir.shard_files(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((dirs["llama"] / "model.safetensors.index.json").read_text())
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="missing"):
        hfdir.read_weights(broken)
    (broken / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError, match="not a safetensors index"):
        hfdir.read_weights(broken)
