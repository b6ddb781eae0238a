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


# Every architecture in-process, and Llama in a worker process too, which rebuilds the
# model from the directory.
MODES = [pytest.param(arch, 0, id=f"{arch}-in-process") for arch in hfdir.ARCHITECTURES] \
    + [pytest.param("llama", 1, id="llama-workers")]


@pytest.mark.parametrize("arch, workers", MODES)
def test_a_written_directory_is_served_with_the_logits_of_transformers(dirs, arch, workers):
    path = dirs[arch]
    assert len(hfdir.shard_files(path)) > 1  # sharded, with an index, as large models are
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s>user: hi</s><s>assistant:"
    ids = tokens(path)
    want = reference(path, ids)
    with Runtime("cpu", "64MiB", poison_evicted=True, copy_delay_s=0.001, workers=workers) as rt:
        register(rt, arch, path, ids)
        for _ in range(3):  # the first load, then pipelined ones from poisoned blocks
            out = rt.infer(arch, ids, use_cache=False)
            assert torch.equal(out["logits"], want)
            rt.evict(arch)


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
