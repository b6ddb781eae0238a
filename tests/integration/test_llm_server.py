"""The OpenAI-compatible API (issue 18), through the official ``openai`` client against a
running server: two language models in room for one beside an Open Inference Protocol
model, greedy text identical to ``transformers``' ``generate``, streaming, usage,
errors in OpenAI's shape, a client that leaves mid-stream, metrics; a seeded request's
text the same in-process and with workers, alone and in a batch (issue 45)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import torch

from tests.serving import openai_client, running_server
from timeshare.llm import hfdir
from timeshare.llm import model as lm

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {"llama": hfdir.write_model_dir(root / "llama", "llama", seed=3, hidden=128, layers=4),
            "qwen": hfdir.write_model_dir(root / "qwen", "qwen2", seed=4, hidden=128, layers=4)}


@pytest.fixture(scope="module")
def server(dirs):
    # About 2.8 MB each: room for one language model at a time, so requests switch them,
    # and for the pool of pages they share (the larger of their own pools' sizes).
    pool = max(lm.own_pool_bytes(dirs["llama"], None, 4), lm.own_pool_bytes(dirs["qwen"], None, 8, 128))
    cfg = {
        "runtime": {"device": "cpu", "memory": (4 << 20) + pool, "kv_memory": "16KiB"},
        "server": {"host": "127.0.0.1", "metrics_port": None, "request_timeout_s": 60},
        "models": [{"name": "mlp", "zoo": "tiny_mlp"}],
        "llms": [{"name": "llama", "path": str(dirs["llama"]), "max_sequences": 4},
                 {"name": "qwen", "path": str(dirs["qwen"]), "max_context": 128}],
    }
    with running_server(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def reference(path, prompt_ids: list[int], n: int) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def decode(path, tokens: list[int]) -> str:
    return transformers.AutoTokenizer.from_pretrained(path).decode(tokens, skip_special_tokens=True)


def test_models_are_listed(client):
    models = client.models.list()
    assert sorted(m.id for m in models.data) == ["llama", "qwen"]
    assert client.models.retrieve("qwen").id == "qwen"


def test_completions_and_chats_of_two_models_are_those_of_transformers(client, dirs):
    for name in ["llama", "qwen", "llama"]:  # each request switches the model in
        path = dirs[name]
        tok = transformers.AutoTokenizer.from_pretrained(path)
        prompt = "the model switch fast"
        out = client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0)
        want = reference(path, tok(prompt, add_special_tokens=False)["input_ids"], 20)
        assert out.choices[0].text == decode(path, want)
        assert out.model == name and out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert out.usage.completion_tokens == 20
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "load the weights"}]
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        assert chat.choices[0].message.content == decode(path, reference(path, ids, 12))
        assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(ids)


def test_streams_deliver_the_same_text_with_usage_at_the_end(client):
    messages = [{"role": "user", "content": "a gpu"}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="llama", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    comp = list(client.completions.create(model="qwen", prompt=["a", "the"], max_tokens=8, temperature=0,
                                          stream=True))
    for index, prompt in enumerate(["a", "the"]):
        streamed = "".join(c.choices[0].text for c in comp if c.choices[0].index == index)
        alone = client.completions.create(model="qwen", prompt=prompt, max_tokens=8, temperature=0)
        assert streamed == alone.choices[0].text


def test_seeded_sampling_repeats_and_stop_strings_cut(client):
    kw = dict(model="llama", prompt="memory host", max_tokens=24, temperature=0.9, seed=5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    full = client.completions.create(model="llama", prompt="memory host", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = next(text[i:i + 2] for i in range(6, len(text))
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])
    cut = client.completions.create(model="llama", prompt="memory host", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="a", max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qwen", prompt="the " * 200, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and "128" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qwen", prompt="a", max_tokens=0)
    assert err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=[{"role": "wizard", "content": "hi"}])
    assert "messages" in err.value.param
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llama", messages=[])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="a", best_of=2)
    assert err.value.param == "best_of" and err.value.body["message"] == "best_of=2 is not supported by this " \
                                                                        "server (only best_of=1, or null)"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                       functions=[{"name": "f", "parameters": {}}])
    assert err.value.param == "functions"  # the deprecated form of tools
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="a", stop=["a", "b", "c", "d", "e"])
    assert err.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="a", seed=2 ** 70)
    assert err.value.param == "seed"
    nulls = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": "llama", "prompt": "a", "max_tokens": 2, "temperature": None, "top_p": None, "n": None})
    assert nulls.status_code == 200 and nulls.json()["usage"]["completion_tokens"] == 2
    raw = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    # the Open Inference Protocol beside it keeps its own error shape
    oip = httpx.get(f"{server.url}/v2/models/nope", timeout=30)
    assert oip.status_code == 404 and isinstance(oip.json()["error"], str)


def test_unsupported_fields_are_refused_as_unsupported_and_their_neutral_values_pass(client):
    """Issue 34, item 5: a field this server does not implement is refused saying so, with
    the field as ``param`` (not told that its value "must be <= 0"); a value that asks for
    nothing is answered as usual."""
    chat = dict(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    refused = [
        (dict(tool_choice="auto"), "tool_choice", "tool_choice needs tools"),
        (dict(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    ]
    for extra, param, words in refused:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**chat, **extra)
        assert err.value.param == param and words in err.value.message, (extra, err.value.message)
        assert "must be" not in err.value.message and "less than" not in err.value.message
    for extra in (dict(best_of=2), dict(suffix="end")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="llama", prompt="a", max_tokens=2, **extra)
        name = next(iter(extra))
        assert err.value.param == name and "is not supported by this server" in err.value.message, extra
    whole = client.chat.completions.create(**chat)
    neutral = client.chat.completions.create(**chat, n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
                                             tool_choice="none", response_format={"type": "text"}, logit_bias={})
    assert neutral.choices[0].message.content == whole.choices[0].message.content
    done = client.completions.create(model="llama", prompt="a", max_tokens=2, temperature=0, echo=False, best_of=1)
    assert done.usage.completion_tokens == 2


def _events(server, path: str, body: dict) -> list:
    """A streamed answer's server-sent events as the wire has them: JSON objects, then "[DONE]"."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]] + ["[DONE]"]


def test_streamed_chunks_carry_usage_as_openai_documents(client, server):
    """With stream_options.include_usage every chunk has "usage": null, and one more chunk,
    with empty choices, carries the whole request's usage just before [DONE]; without it,
    no chunk has a "usage" field (OpenAI's documentation of include_usage)."""
    chat = {"model": "llama", "messages": [{"role": "user", "content": "a gpu"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    whole = client.chat.completions.create(model="llama", messages=chat["messages"], max_tokens=6, temperature=0)
    completion = {"model": "qwen", "prompt": ["a", "the"], "max_tokens": 5, "temperature": 0, "stream": True}
    both = client.completions.create(model="qwen", prompt=["a", "the"], max_tokens=5, temperature=0)
    cases = [("/v1/chat/completions", chat, "chat.completion.chunk", whole.usage),
             ("/v1/completions", completion, "text_completion", both.usage)]
    for path, body, kind, usage in cases:
        asked = _events(server, path, {**body, "stream_options": {"include_usage": True}})
        *chunks, last, done = asked
        assert chunks and all(c["usage"] is None and c["choices"] and c["object"] == kind for c in chunks), chunks
        assert last["choices"] == [] and last["object"] == kind and last["id"] == chunks[0]["id"]
        assert last["usage"] == {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                                 "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        for plain in (body, {**body, "stream_options": {"include_usage": False}}, {**body, "stream_options": None}):
            *chunks, done = _events(server, path, plain)
            assert chunks and all("usage" not in c and c["choices"] for c in chunks), chunks
    # the official client reads the same: the last chunk's usage, None before it
    streamed = list(client.chat.completions.create(model="llama", messages=chat["messages"], max_tokens=6,
                                                   temperature=0, stream=True, stream_options={"include_usage": True}))
    assert [c.usage for c in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert streamed[-1].choices == [] and streamed[-1].usage.total_tokens == whole.usage.total_tokens
    first = _events(server, "/v1/chat/completions", chat)[0]["choices"][0]
    assert first == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}


def test_a_client_that_leaves_mid_stream_frees_its_sequence(client, server):
    body = {"model": "llama", "prompt": "the model", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["index"] == 0
    # the others carry on meanwhile, and the engine lets the sequence go at its next step
    assert client.completions.create(model="llama", prompt="a", max_tokens=4, temperature=0).choices
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        llm = httpx.get(f"{server.url}/admin/status", timeout=30).json()["llms"]["llama"]
        if llm["running"] == 0 and llm["kv_bytes"] == 0:
            break
        time.sleep(0.05)
    assert llm["running"] == 0 and llm["kv_bytes"] == 0
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'timeshare_llm_generations_total{finish_reason="cancelled",model="llama"}' in metrics


def test_a_client_that_leaves_a_whole_answer_frees_its_sequence_too(server):
    def cancelled() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        line = 'timeshare_llm_generations_total{finish_reason="cancelled",model="llama"}'
        return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)

    before = cancelled()
    # The abandoned request must still be generating, or waiting, when the server next looks
    # for its client (every DISCONNECT_POLL_S): alone, a tiny model's whole answer came
    # sooner on a quiet machine. So it queues behind four long ones filling llama's rows.
    busy = {"model": "llama", "prompt": "the", "max_tokens": 200, "temperature": 0}
    fillers = [threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/completions", json=busy, timeout=60))
               for _ in range(4)]
    for t in fillers:
        t.start()
    time.sleep(0.2)
    body = {"model": "llama", "prompt": "the", "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 200 tokens
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    deadline = time.monotonic() + 20
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1
    for t in fillers:
        t.join(60)


def test_metrics_count_tokens_and_time_the_first_and_next_tokens(client, server, dirs):
    client.completions.create(model="qwen", prompt="a", max_tokens=5, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith(("timeshare_llm", "timeshare_arena_reserved")) and " " in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    assert values['timeshare_llm_time_to_first_token_seconds_count{model="qwen"}'] >= 1
    assert values['timeshare_llm_inter_token_seconds_count{model="qwen"}'] >= 4
    assert values['timeshare_llm_tokens_total{kind="completion",model="qwen"}'] >= 5
    assert values['timeshare_llm_kv_cache_bytes{model="qwen"}'] == 0
    assert values["timeshare_llm_kv_memory_bytes"] == 16 << 10 and values["timeshare_llm_kv_device_bytes"] == 0
    # NOTE [Prefix caching]: a prompt of three full pages, twice: the second finds them.
    long = "the model switch fast load weights layer token " * 12
    before = values.get('timeshare_llm_prefix_cache_hits_total{model="qwen"}', 0)
    for _ in range(2):
        client.completions.create(model="qwen", prompt=long, max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("timeshare_llm", "timeshare_arena_reserved")) and " " in line}
    assert values['timeshare_llm_prefix_cache_hits_total{model="qwen"}'] >= before + 2
    assert values['timeshare_llm_prefix_cache_misses_total{model="qwen"}'] >= 2
    assert values['timeshare_llm_prefix_cache_pages{model="qwen"}'] >= 2
    assert values['timeshare_llm_preemptions_total{model="qwen"}'] == 0
    # One pool of pages for both models, a region of the arena (NOTE [Regions of the arena]).
    pool = max(lm.own_pool_bytes(dirs["llama"], None, 4), lm.own_pool_bytes(dirs["qwen"], None, 8, 128))
    assert [k for k in values if k.startswith("timeshare_arena_reserved")] == [
        'timeshare_arena_reserved_bytes{owner="kv-pages"}']
    assert values['timeshare_arena_reserved_bytes{owner="kv-pages"}'] == pool
    # the Open Inference Protocol model shares the runtime
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", timeout=30, json={
        "inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [0.0] * 32}]})
    assert r.status_code == 200, r.text


def test_the_llms_section_is_checked(dirs, tmp_path):
    from timeshare.config import parse_config
    from timeshare.errors import ConfigError

    ok = {"runtime": {"device": "cpu"}, "llms": [{"name": "llama", "path": str(dirs["llama"])}]}
    assert parse_config(ok).llms[0].max_sequences == 8
    bad = [
        ({"llms": [{"name": "x", "path": str(tmp_path)}]}, "not a model directory"),
        ({"models": [{"name": "llama", "zoo": "tiny_mlp"}], "llms": ok["llms"]}, "repeated: ['llama']"),
        ({"llms": [{"name": "llama", "path": str(dirs["llama"]), "max_sequences": 0}]}, "max_sequences"),
        ({"runtime": {"kv_memory": "auto"}, "llms": ok["llms"]}, "kv_memory"),
        ({"runtime": {"kv_memory": "lots"}, "llms": ok["llms"]}, "kv_memory"),
    ]
    for cfg, words in bad:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_config(cfg)


@contextlib.contextmanager
def serve(path, workers: int):
    """``timeshare serve DIR --workers N`` as a user starts it, in a process of its own,
    ready; its URL."""
    from timeshare.harness.client import Client
    from timeshare.harness.process import free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIMESHARE_PARENT_PID": str(os.getpid())}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "timeshare", "serve", str(path), "--device", "cpu",
                             "--workers", str(workers), "--port", str(port), "--metrics-port", "none"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        with Client(url, timeout_s=5) as c:
            while not c.ready():
                log.seek(0)
                assert proc.poll() is None and time.monotonic() < deadline, log.read().decode()[-3000:]
                time.sleep(0.25)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


def test_a_seeded_request_gives_the_same_text_in_process_and_with_workers_alone_and_in_a_batch(dirs):
    """NOTE [One sampler], as a user tries it: ``timeshare serve DIR`` with ``--workers 0``
    and ``--workers 2``, a sampled completion (temperature 1) for each of three seeds,
    alone and among eight requests at once; the greedy text is transformers' in both."""
    path = dirs["llama"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = "load weights layer token"
    want = decode(path, reference(path, tok(prompt, add_special_tokens=False)["input_ids"], 16))
    seeds = (1, 2, 3)
    got: dict[tuple[int, str], str] = {}
    for workers in (0, 2):
        with serve(path, workers) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
                def complete(seed: int | None, text: str = prompt) -> str:
                    out = c.completions.create(model="llama", prompt=text, max_tokens=24, temperature=1.0,
                                               seed=seed) if seed is not None else \
                        c.completions.create(model="llama", prompt=text, max_tokens=16, temperature=0)
                    return out.choices[0].text

                assert complete(None) == want
                streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
                    model="llama", prompt=prompt, max_tokens=16, temperature=0, stream=True) if chunk.choices)
                assert streamed == want
                for seed in seeds:
                    got[workers, f"alone {seed}"] = complete(seed)
                # Eight at once: the three seeded ones among five others of other prompts.
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    mine = [pool.submit(complete, seed) for seed in seeds]
                    others = [pool.submit(complete, 100 + i, f"a gpu {i}") for i in range(5)]
                    for seed, f in zip(seeds, mine):
                        got[workers, f"batch {seed}"] = f.result(60)
                    assert all(f.result(60) for f in others)
    for seed in seeds:
        assert got[0, f"alone {seed}"] == got[0, f"batch {seed}"] == got[2, f"alone {seed}"] == \
            got[2, f"batch {seed}"]
    assert len({got[0, f"alone {seed}"] for seed in seeds}) == 3  # the seeds matter
