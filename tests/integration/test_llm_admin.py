"""The admin plane for language models as for any model (issue 34): pin (loaded now, never
evicted), unload (answers 503 without Retry-After naming the way back, readiness no longer
waits for it, its memory freed), load again (the same greedy text), all seen in /admin/ps;
and a language model named as a repository id ("org/model") in the routes."""

from __future__ import annotations

import httpx
import pytest

from tests.llm_reference import with_pools
from tests.serving import running_server
from timeshare.llm import hfdir

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-llm")
    paths = [hfdir.write_model_dir(root / "l", "llama", seed=3, hidden=128, layers=4),
             hfdir.write_model_dir(root / "q", "qwen2", seed=4, hidden=128, layers=4)]
    cfg = {
        "runtime": {"device": "cpu", "memory": with_pools("8MiB", paths)},
        "server": {"metrics_port": None, "request_timeout_s": 60},
        "llms": [{"name": "acme/llama", "path": str(paths[0])}, {"name": "qwen", "path": str(paths[1])}],
    }
    with running_server(cfg) as s:
        yield s


def _ps(server) -> dict:
    r = httpx.get(f"{server.url}/admin/ps", timeout=30)
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["models"]}


def _text(server, name: str) -> str:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        return client.completions.create(model=name, prompt="admin plane", max_tokens=8, temperature=0).choices[0].text


def test_pin_unload_and_load_a_language_model(server):
    first = _text(server, "acme/llama")
    r = httpx.post(f"{server.url}/admin/models/acme/llama/pin", timeout=120)
    assert r.status_code == 200 and r.json() == {"name": "acme/llama", "pinned": True}
    rows = _ps(server)
    assert rows["acme/llama"]["pinned"] and rows["acme/llama"]["device_bytes"] is not None
    assert httpx.post(f"{server.url}/admin/models/acme/llama/unpin", timeout=60).status_code == 200
    assert not _ps(server)["acme/llama"]["pinned"]

    r = httpx.post(f"{server.url}/v2/repository/models/acme/llama/unload", timeout=120)
    assert r.status_code == 200, r.text
    row = _ps(server)["acme/llama"]
    assert row["state"] == "UNAVAILABLE" and row["device_bytes"] is None
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "acme/llama", "prompt": "x", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 503 and "retry-after" not in r.headers and "load it again" in r.text
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=30).status_code == 200  # unloaded on purpose

    r = httpx.post(f"{server.url}/v2/repository/models/acme/llama/load", timeout=300)
    assert r.status_code == 200, r.text
    assert _ps(server)["acme/llama"]["state"] == "READY"
    assert _text(server, "acme/llama") == first  # the same model, the same greedy text


def test_admin_actions_on_an_unknown_language_model_are_404(server):
    assert httpx.post(f"{server.url}/admin/models/acme/nope/pin", timeout=30).status_code == 404
    assert httpx.post(f"{server.url}/v2/repository/models/acme/nope/unload", timeout=30).status_code == 404


def test_a_language_model_is_added_at_run_time_from_a_directory(server, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    path = hfdir.write_model_dir(tmp_path / "extra", "llama", seed=9, hidden=64, layers=2)
    r = httpx.post(f"{server.url}/admin/models", json={"model": str(path), "name": "acme/extra"}, timeout=300)
    assert r.status_code == 201, r.text
    assert r.json() == {"name": "acme/extra", "kind": "language model", "path": str(path.resolve())}
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tok("admin plane", add_special_tokens=False)["input_ids"]])
    want = model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids),
                          pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    assert _text(server, "acme/extra") == tok.decode(want, skip_special_tokens=True)
    assert _ps(server)["acme/extra"]["state"] == "READY"
    again = httpx.post(f"{server.url}/admin/models", json={"model": str(path), "name": "acme/extra"}, timeout=60)
    assert again.status_code == 409 and "served already" in again.text
    missing = httpx.post(f"{server.url}/admin/models", json={"model": str(tmp_path / "absent")}, timeout=60)
    assert missing.status_code == 400 and "neither a file, a directory nor a repository" in missing.text
    bad = httpx.post(f"{server.url}/admin/models", json={"path": str(path)}, timeout=60)
    assert bad.status_code == 400 and "unknown fields: ['path']" in bad.text
