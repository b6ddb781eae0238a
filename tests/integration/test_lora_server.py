"""LoRA adapters through the server (NOTE [Adapter residency]): each adapter answered by
name through the official ``openai`` client with PEFT's tokens, listed by ``/v1/models``
with its parent, loaded and unloaded by vLLM's routes, found by the resolver."""

from __future__ import annotations

import httpx
import pytest

from tests.llm_reference import peft_greedy, write_adapter
from tests.serving import openai_client, running_server
from timeshare.llm import hfdir

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENS = 10
PROMPT = "the model switch fast"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("loraserve") / "llama", "llama", seed=13, hidden=64, layers=2)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = {"alpha": (8, ["q_proj", "v_proj"]), "beta": (4, ["gate_proj", "down_proj", "o_proj"]),
            "gamma": (2, ["k_proj", "up_proj"])}
    # gamma alone in the resolver's directory
    return {name: write_adapter(base, root / ("resolved" if name == "gamma" else "given") / name, rank=r, targets=t,
                                seed=i, std=0.3)
            for i, (name, (r, t)) in enumerate(made.items())}


@pytest.fixture(scope="module")
def expected(base, adapters):
    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    return {name: tok.decode(peft_greedy(base, path)(ids, TOKENS), skip_special_tokens=True)
            for name, path in [("llama", None), *adapters.items()]}


@pytest.fixture(scope="module")
def server(base, adapters):
    cfg = {"runtime": {"device": "cpu", "memory": "64MiB"},
           "server": {"host": "127.0.0.1", "metrics_port": None, "request_timeout_s": 60},
           "llms": [{"name": "llama", "path": str(base), "max_sequences": 4, "max_context": 256, "max_loras": 2,
                     "max_lora_rank": 8, "lora_dir": str(adapters["gamma"].parent),
                     "adapters": [{"name": "alpha", "path": str(adapters["alpha"])}]}]}
    with running_server(cfg) as s:
        yield s


def test_each_adapter_answered_by_name_with_pefts_tokens_listed_with_its_parent_and_in_ps(server, adapters, expected):
    with openai_client(server) as client:
        ids = {m.id for m in client.models.list().data}
        assert ids == {"llama", "alpha"}
        # The admin plane's guard: a cross-site page cannot load an adapter.
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", headers={"Origin": "http://evil.example"}, timeout=30,
                       json={"lora_name": "beta", "lora_path": str(adapters["beta"])})
        assert r.status_code == 403 and "beta" not in {m.id for m in client.models.list().data}
        # vLLM's route and body: beta from now on.
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "beta",
                                                                  "lora_path": str(adapters["beta"])}, timeout=30)
        assert r.status_code == 200 and "beta" in r.text
        for name in ["llama", "alpha", "beta", "gamma"]:  # gamma: the resolver's, on its first request
            done = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
            assert done.model == name
            assert done.choices[0].text == expected[name], name
        cards = {m.id: m.model_dump() for m in client.models.list().data}
        assert set(cards) == {"llama", "alpha", "beta", "gamma"}
        assert cards["llama"]["parent"] is None
        assert all(cards[n]["parent"] == "llama" and cards[n]["root"] == str(adapters[n]) for n in
                   ("alpha", "beta", "gamma"))
        # Streamed chat by an adapter name too.
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True)
            if c.choices]
        assert "".join(parts)
        # Unloaded: its requests are 404s; loading a name twice is refused.
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, timeout=30)
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "alpha",
                                                                  "lora_path": str(adapters["alpha"])}, timeout=30)
        assert r.status_code == 409, r.text
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "alpha", "load_inplace": True,
                                                                  "lora_path": str(adapters["alpha"])}, timeout=30)
        assert r.status_code == 200, r.text  # vLLM's load_inplace: the same name, read again
        assert client.completions.create(model="alpha", prompt=PROMPT, max_tokens=TOKENS,
                                         temperature=0).choices[0].text == expected["alpha"]
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
        assert r.status_code == 404, r.text
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere"},
                       timeout=30)
        assert r.status_code == 400 and "adapter_config.json" in r.text, r.text
    # timeshare ps's view: which adapters are on the device.
    r = httpx.get(f"{server.url}/admin/ps", timeout=30)
    assert r.status_code == 200
    shown = {a["name"]: a for a in r.json()["adapters"]}
    assert set(shown) == {"alpha", "gamma"} and all(a["parent"] == "llama" for a in shown.values())
    assert shown["gamma"]["slot"] in (1, 2)  # the last one used is on the device (two slots)


def test_metrics_show_the_adapter_slots_and_the_copies_into_them(server, adapters):
    """NOTE [Adapter residency] in Prometheus's text: the slots, those holding an adapter
    (as ``timeshare ps`` shows them), and the copies into them."""
    with openai_client(server) as client:
        client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2, temperature=0)
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines()
              if line.startswith("timeshare_llm_adapter") and " " in line}
    on = [a for a in httpx.get(f"{server.url}/admin/ps", timeout=30).json()["adapters"] if a["slot"] is not None]
    assert values['timeshare_llm_adapter_slots{model="llama"}'] == 2
    assert values['timeshare_llm_adapters_on_device{model="llama"}'] == len(on) >= 1
    assert values['timeshare_llm_adapter_loads_total{model="llama"}'] >= 1  # alpha's, now or before
    assert values['timeshare_llm_adapter_load_seconds_total{model="llama"}'] > 0
