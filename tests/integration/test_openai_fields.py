"""The OpenAI API's fields beyond sampling, through the official ``openai`` client (issue
48): log-probabilities, echo, penalties and logit bias in OpenAI's shapes, whole and
streamed, each number against ``transformers``' own log-softmax on the same weights;
several choices (``n``) with the prompt computed once; refused values are 400s naming
their field. Every test that asks a server asks one with no workers and one with two:
the fields are the one engine's, answered alike in both modes."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from tests.serving import openai_client, running_server
from timeshare.llm import hfdir

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("lp") / "llama", "llama", seed=7, hidden=96, layers=3,
                                 max_positions=1024)  # room for a prompt that lists tools


@pytest.fixture(scope="module")
def hf(path):
    return (transformers.AutoTokenizer.from_pretrained(path),
            transformers.AutoModelForCausalLM.from_pretrained(path).eval())


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "workers"])
def server(path, request):
    cfg = {"runtime": {"device": "cpu", "memory": "64MiB", "workers": request.param},
           "server": {"host": "127.0.0.1", "metrics_port": None, "request_timeout_s": 60},
           "llms": [{"name": "llama", "path": str(path), "max_sequences": 4, "max_context": 1024}]}
    with running_server(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def _prefilled(server) -> int:
    """The positions the model's prefills computed so far, as ``/metrics`` says."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return int(float(re.search(r'^timeshare_llm_prefill_tokens_total\{model="llama"\} (\S+)$', text, re.M)[1]))


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_completions_logprobs_are_transformers_with_the_chosen_among_the_top(client, hf):
    tok, model = hf
    prompt = "the model switch fast"
    done = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    ids = _ids(tok, prompt)
    tokens = _greedy(model, ids, 8)  # greedy: the tokens the server chose too
    ref = _log_softmax(model, ids + tokens[:-1])[len(ids) - 1:]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for i, token in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i, token]), abs=TOLERANCE)
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 3 <= len(top) <= 4  # the top 3, and the chosen one always
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(ref[i].topk(3).values.tolist(), abs=TOLERANCE)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_echo_gives_the_prompts_log_likelihood_as_evaluation_harnesses_read_it(client, hf):
    tok, model = hf
    prompt = "layer token fast slow memory host device"
    ids = _ids(tok, prompt)
    done = client.completions.create(model="llama", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = done.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_softmax(model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOLERANCE)
    total = sum(lp.token_logprobs[1:len(ids)])
    assert total == pytest.approx(float(sum(ref[i - 1, ids[i]] for i in range(1, len(ids)))), abs=1e-4)


def test_a_prompt_scored_without_an_answer(client, hf):
    """``max_tokens: 0`` with ``echo`` and ``logprobs``: the prompt's log-likelihood, nothing
    generated (how evaluation harnesses score a continuation)."""
    tok, model = hf
    prompt = "the model switch fast on a gpu"
    ids = _ids(tok, prompt)
    done = client.completions.create(model="llama", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = done.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and done.usage.completion_tokens == 0
    ref = _log_softmax(model, ids)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                               abs=TOLERANCE)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt=prompt, max_tokens=0)  # nothing asked of it
    assert err.value.param == "max_tokens"


def test_a_chats_logprobs_whole_and_streamed_are_the_same_in_openais_shape(client, hf):
    chat = dict(model="llama", messages=[{"role": "user", "content": "a gpu load"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**chat)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 or whole.choices[0].finish_reason == "stop"
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8")) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=TOLERANCE)  # greedy: the best
    streamed = []
    for chunk in client.chat.completions.create(**chat, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**chat, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_penalties_and_bias_change_the_answer_as_asked(client, hf):
    tok, model = hf
    prompt = "the model switch fast"
    plain = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0)
    first = _greedy(model, _ids(tok, prompt), 1)[0]
    biased = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100}, logprobs=1)
    lp = biased.choices[0].logprobs
    assert lp.tokens[0] != tok.decode([first])
    # Raw log-probabilities: the best is still the banned one; the chosen is reported beside it.
    assert set(lp.top_logprobs[0]) == {tok.decode([first]), lp.tokens[0]}
    assert lp.top_logprobs[0][tok.decode([first])] > lp.token_logprobs[0]
    repeated = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"repetition_penalty": 1.0, "min_tokens": 2},
                                         presence_penalty=0.0, frequency_penalty=0.0)
    assert repeated.choices[0].text == plain.choices[0].text  # neutral values change nothing


@pytest.mark.parametrize("extra, param", [
    (dict(logprobs=21), "logprobs"),
    (dict(logit_bias={"100000": 1}), "logit_bias"),
    (dict(logit_bias={"5": 1, "05": 2}), "logit_bias"),
    (dict(prompt=[-1], echo=True), "prompt"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"1": 101}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens"),
])
def test_refused_values_are_400s_naming_their_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{"model": "llama", "prompt": "a", "max_tokens": 8, **extra})
    assert err.value.param == param, err.value.message


def test_logprobs_false_asks_for_none(client):
    done = client.completions.create(model="llama", prompt="a", max_tokens=2, temperature=0,
                                     extra_body={"logprobs": False})
    assert done.choices[0].logprobs is None


def test_top_logprobs_needs_logprobs_in_a_chat(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)
    assert err.value.param == "top_logprobs"


def test_n_choices_each_their_own_stream_with_the_prompt_computed_once(client, server, hf):
    tok, model = hf
    prompt = " ".join(["the model switch fast on a gpu with layers"] * 12)
    ids = _ids(tok, prompt)
    before = _prefilled(server)
    done = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4)
    computed = _prefilled(server) - before
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert len({c.text for c in done.choices}) > 1  # each choice its own sampling stream
    again = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4)
    assert [c.text for c in again.choices] == [c.text for c in done.choices]  # seeded: the same four
    assert done.usage.prompt_tokens == len(ids)  # the prompt counted once
    assert done.usage.completion_tokens == 4 * 12 or any(c.finish_reason == "stop" for c in done.choices)
    # The first choice computed the whole prompt; the others only what its full pages do
    # not hold (its last partial page, and its last position).
    assert len(ids) <= computed < 2 * len(ids), (computed, len(ids))
    greedy = client.completions.create(model="llama", prompt=prompt, max_tokens=6, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1


def test_n_chat_choices_stream_each_to_its_end(client):
    chunks = list(client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0.8, seed=3, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    ended = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ended == {0, 1}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens <= 10


def test_n_over_the_limit_and_best_of_are_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="a", max_tokens=2, n=129)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt="a", max_tokens=2, best_of=2)
    assert err.value.param == "best_of"


def test_a_json_schema_answer_validates_whole_and_streamed(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "a thing"}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=120, temperature=0,
                                           response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="llama", messages=messages, max_tokens=120, temperature=0, response_format=fmt, stream=True)
        if c.choices)
    assert streamed == whole.choices[0].message.content
    anything = client.chat.completions.create(model="llama", messages=messages, max_tokens=200, temperature=0.7,
                                              seed=1, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON schema"),
    ({"type": "yaml"}, "not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
     "cannot be compiled"),
])
def test_a_format_that_cannot_be_used_is_a_400_naming_why(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=fmt)
    assert err.value.param == "response_format" and words in err.value.message, err.value.message


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_tool_call_comes_back_in_openais_shape_whole_and_streamed(client, choice):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "what is the weather"}]
    done = client.chat.completions.create(model="llama", messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                          max_tokens=80, temperature=0, parallel_tool_calls=False)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    streamed, pieces, reason = _streamed_calls(client, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                               max_tokens=80, temperature=0, parallel_tool_calls=False)
    assert reason == "tool_calls"
    assert streamed == {0: {"id": streamed[0]["id"], "name": call.function.name,
                            "arguments": call.function.arguments}}
    assert pieces > 3  # the arguments come as they are written, not at the end
    # The follow-up with the tool's result is answered.
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="llama", messages=follow, tools=[WEATHER, TIME], max_tokens=8,
                                            temperature=0, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None


def _streamed_calls(client, **body) -> tuple[dict[int, dict], int, str | None]:
    """A streamed answer's calls joined from their deltas (the id and name once, the
    arguments in pieces), how many pieces of arguments came, and its finish reason."""
    streamed: dict[int, dict] = {}
    pieces, reason = 0, None
    for chunk in client.chat.completions.create(model="llama", stream=True, **body):
        for part in chunk.choices[0].delta.tool_calls or []:
            got = streamed.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            if part.id is not None:
                assert got["id"] is None and part.type == "function"  # opened once
                got["id"] = part.id
            got["name"] += part.function.name or ""
            got["arguments"] += part.function.arguments or ""
            pieces += bool(part.function.arguments)
        reason = chunk.choices[0].finish_reason or reason
    return streamed, pieces, reason


def test_parallel_required_calls_each_validate_whole_and_streamed(client):
    """``parallel_tool_calls`` left on: one call or more, each one of the tools."""
    jsonschema = pytest.importorskip("jsonschema")
    body = dict(messages=[{"role": "user", "content": "weather and time"}], tools=[WEATHER, TIME],
                tool_choice="required", max_tokens=150, temperature=1.0, seed=5)
    tools = {"get_weather": WEATHER, "get_time": TIME}
    done = client.chat.completions.create(model="llama", **body)
    assert done.choices[0].finish_reason == "tool_calls"
    calls = done.choices[0].message.tool_calls
    assert len({c.id for c in calls}) == len(calls) >= 2  # this seed calls twice
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])
    streamed, _, reason = _streamed_calls(client, **body)
    assert reason == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_auto_reads_hermes_tool_call_blocks_and_leaves_other_text_alone():
    from timeshare.server.tools import read_calls

    text = 'let me look <tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>'
    content, calls = read_calls(text, held=False)
    assert content == "let me look" and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": 2}'}
    assert read_calls("no call <tool_call>not json</tool_call>", held=False) == (
        "no call <tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("extra, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
])
def test_tools_that_cannot_be_used_are_400s(client, extra, param):
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [WEATHER],
            **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.param == param, err.value.message


def test_langchains_bind_tools_gets_a_call_whose_arguments_validate_and_its_follow_up_answered(server):
    """What agent frameworks send: langchain-openai's ``bind_tools`` with a required call."""
    jsonschema = pytest.importorskip("jsonschema")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = langchain_openai.ChatOpenAI(model="llama", base_url=f"{server.url}/v1", api_key="unused", temperature=0,
                                       max_tokens=80, max_retries=0, timeout=60)
    bound = chat.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False)
    asked = [HumanMessage("what is the weather in paris")]
    reply = bound.invoke(asked)
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(reply.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    streamed = None
    for part in bound.stream(asked):
        streamed = part if streamed is None else streamed + part
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [reply.tool_calls[0]["args"]]
    answer = chat.bind_tools([WEATHER]).invoke(
        [*asked, reply, ToolMessage('{"temperature": 21}', tool_call_id=reply.tool_calls[0]["id"])])
    assert isinstance(answer.content, str)
