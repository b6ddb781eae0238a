"""An encoder from a Hugging Face directory (issue 34): served through the Open Inference
Protocol with its token ids and mask, and through OpenAI's ``/v1/embeddings`` with the
official client; every output compared with ``transformers``' own model of the directory."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serving import running_server
from timeshare.llm import hfdir

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TEXTS = ["the model switch fast", "serve what you have on the gpu"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("enc") / "bert", "bert", seed=7, hidden=64, layers=2)


@pytest.fixture(scope="module")
def server(encoder):
    cfg = {"runtime": {"device": "cpu", "memory": "16MiB"}, "server": {"metrics_port": None},
           "models": [{"name": "enc", "path": str(encoder)}]}
    with running_server(cfg) as s:
        yield s


def _reference(encoder, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(encoder).eval()
    t = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=t, attention_mask=torch.ones_like(t)).last_hidden_state[0]


def test_embeddings_are_the_mean_of_transformers_hidden_states_at_unit_length(server, encoder):
    tok = transformers.AutoTokenizer.from_pretrained(encoder)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out = client.embeddings.create(model="enc", input=TEXTS)
        one = client.embeddings.create(model="enc", input=TEXTS[0])
    assert [d.index for d in out.data] == [0, 1] and out.model == "enc"
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(i) for i in ids)
    for d, i in zip(out.data, ids, strict=True):
        want = torch.nn.functional.normalize(_reference(encoder, i).mean(dim=0), dim=0)
        got = torch.tensor(d.embedding)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert one.data[0].embedding == out.data[0].embedding  # alone or in a list: the same vector
    # As floats in JSON (the client above asked for base64, its default, and decoded it).
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "enc", "input": TEXTS[0],
                                                         "encoding_format": "float"}, timeout=60)
    assert r.status_code == 200 and torch.allclose(torch.tensor(r.json()["data"][0]["embedding"]),
                                                   torch.tensor(one.data[0].embedding), atol=1e-6)


def test_the_encoder_answers_the_open_inference_protocol_too(server, encoder):
    ids = [5, 9, 17, 33]
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 4], "data": ids},
                       {"name": "attention_mask", "datatype": "INT64", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
    r = httpx.post(f"{server.url}/v2/models/enc/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    hidden = outputs["last_hidden_state"]
    got = torch.tensor(hidden["data"]).reshape(hidden["shape"])[0]
    assert torch.allclose(got, _reference(encoder, ids), atol=1e-5)


def test_what_is_not_an_encoder_is_refused_in_openais_shape(server):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "absent", "input": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "enc", "input": "x", "encoding_format": "int8"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "enc", "input": [[]]}, timeout=60)
    assert r.status_code == 400
