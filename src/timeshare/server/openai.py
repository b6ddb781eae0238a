"""The OpenAI-compatible API of the language models: ``GET /v1/models``, ``POST
/v1/completions`` and ``POST /v1/chat/completions``, whole or streamed as server-sent
events, with ``usage``, and errors in OpenAI's shape (``{"error": {"message", "type",
"param", "code"}}``, made by ``openai_error`` for every ``/v1`` path). Runs in the
server's event loop; generation runs in each model's engine thread, whose events reach
the loop through ``call_soon_threadsafe``.

A request is checked whole before anything is queued: an unknown model is 404, a bad
field 400 naming it, a prompt over the context 400 with code
``context_length_exceeded``. A client that goes away mid-stream cancels its sequences
(freed at the engine's next step)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from timeshare.errors import BadRequest, ConfigError, Timeout, TimeshareError, UnknownModelError
from timeshare.llm.adapters import Adapter, AdapterInfo
from timeshare.llm.constrained import GrammarError, OutputFormat
from timeshare.llm.sampling import MAX_LOGPROBS, SamplingParams
from timeshare.llm.sequence import ContextLengthError, Delta, Finish
from timeshare.server.auth import ApiKey, key_dependencies
from timeshare.server.llms import Generation, LanguageModels, ServedLLM
from timeshare.server.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from timeshare.server.parsing import load_json
from timeshare.server.status import served_error, status_of
from timeshare.server.tools import ToolDelta, ToolError, ToolPlan, ToolStream, plan, read_calls, rendered

DISCONNECT_POLL_S = 0.25  # how often a whole (not streamed) answer checks that its client is still there
MAX_CHOICES = 128  # ``n``: choices per prompt


# ---------------------------------------------------------------------- requests
# Fields of OpenAI's API that this server does not implement, with the values that ask
# for nothing (null always does): a request that asks for more is refused, 400 with the
# field as ``param`` and a message that says it is not supported, rather than answered as
# if it had not asked, or told that its value is out of some range.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none",),
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields of their own (user, metadata...)

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: a completion's prompt scored (echo with logprobs)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """An extension (as vLLM's): the most likely k tokens only; 0 or -1: all."""
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)  # what a torch generator takes
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    """An extension (as vLLM's): transformers' repetition penalty over the prompt and output; 1: none."""
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    """An extension (as vLLM's): no end token and no stop string before that many tokens."""
    response_format: dict[str, Any] | None = None

    def sampling(self, max_tokens: int, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 output: OutputFormat | None = None) -> SamplingParams:
        """The request's sampling parameters; a refused value is 400 naming its field."""
        self._refuse_unsupported()
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                                  seed=self.seed, stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  presence_penalty=self.presence_penalty or 0.0,
                                  frequency_penalty=self.frequency_penalty or 0.0,
                                  repetition_penalty=self.repetition_penalty or 1.0,
                                  logit_bias=self._bias(), min_tokens=self.min_tokens or 0,
                                  output=output or self._output())
        except ConfigError as exc:  # the message begins with the field's name
            raise InvalidRequest(str(exc), str(exc).split(" ", 1)[0]) from None

    def _output(self) -> OutputFormat | None:
        """``response_format`` (NOTE [Constrained decoding]): text, any JSON object, or a
        JSON schema (``json_schema.schema``)."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return OutputFormat.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema") if fmt is not None else None
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema (an object)",
                                     "response_format")
            return OutputFormat.json_schema(schema)
        raise InvalidRequest(f"response_format type {json.dumps(kind)} is not supported (text, json_object or "
                             "json_schema)", "response_format")

    def _bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs: its keys are token ids, as strings."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if token in pairs:
                raise InvalidRequest(f"logit_bias names token {token} twice", "logit_bias")
            pairs[token] = float(bias)
        return tuple(sorted(pairs.items()))

    def _refuse_unsupported(self) -> None:
        """400 for the first field of ``UNSUPPORTED`` that asks for something."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            # true is not 1, nor false 0: the type of a neutral value counts, except int for float
            if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
                continue
            shown = isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 40)
            asked = f"{name}={json.dumps(value)}" if shown else name
            only = " or ".join(f"{name}={json.dumps(v)}" for v in neutral)
            raise InvalidRequest(f"{asked} is not supported by this server (only {only}, or null)", name)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """The log-probabilities of each token's most likely alternatives, and its own."""

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        return None if value is False else value  # as clients of the chat API send it

    def params(self, max_tokens: int) -> SamplingParams:
        return self.sampling(max_tokens, logprobs=self.logprobs,
                             prompt_logprobs=self.logprobs if self.echo else None)


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (NOTE [Tool calls])
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(BaseModel):
    type: Literal["function"]
    function: _Function


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan:
        """What ``tools`` and ``tool_choice`` make of the answer (NOTE [Tool calls])."""
        try:
            return plan(self.tool_list(), self.tool_choice, parallel=self.parallel_tool_calls is not False)
        except ToolError as exc:
            raise InvalidRequest(str(exc), exc.param) from None

    def tool_list(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def params(self, max_tokens: int, tools: ToolPlan | None = None) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        held = tools.output if tools is not None else None
        if held is not None and self.response_format not in (None, {"type": "text"}):
            raise InvalidRequest("response_format cannot be asked with a tool_choice that requires a call",
                                 "response_format")
        return self.sampling(max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None, output=held)


# ---------------------------------------------------------------------- errors
def openai_error(status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(json.loads(json.dumps(body, ensure_ascii=True)), status_code=status, headers=headers)


class InvalidRequest(Exception):
    """A request that fails validation: its message and the field at fault."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def parse_request(cls: type[BaseModel], body: Any) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")  # pydantic's prefix of a validator's own message
        raise InvalidRequest(f"{param}: {msg}" if param else msg, param) from None


# ---------------------------------------------------------------------- the routes
def add_openai_api(app: FastAPI, service, key: ApiKey | None = None) -> None:
    """The ``/v1`` routes on ``app``; with ``key``, each needs it (NOTE [The data plane's key])."""
    llms = service.llms
    timeout_s = service.config.server.request_timeout_s
    keyed = key_dependencies(key)

    @app.get("/v1/models", dependencies=keyed, summary="The language models and their adapters (OpenAI)")
    def list_models():
        bases = [_model_card(m) for m in llms.loaded.values()]
        return {"object": "list", "data": bases + [_adapter_card(a, llms.get(a.parent)) for a in llms.adapters()]}

    @app.get("/v1/models/{name:path}", dependencies=keyed, summary="One language model or adapter (OpenAI)")
    def model_card(name: str):
        model, adapter = llms.find(name)
        if adapter is None:
            return _model_card(model)
        found = [a for a in llms.adapters() if a.name == adapter]
        if not found:
            raise UnknownModelError(f"adapter {adapter!r} is not loaded (its first request loads it)")
        return _adapter_card(found[0], model)

    @app.post("/v1/completions", dependencies=keyed, summary="Complete prompts (OpenAI)")
    async def completions(request: Request):
        try:
            req: CompletionRequest = parse_request(CompletionRequest, await read_body(request))
            model, adapter = await _target(llms, req.model)
            prompts = _prompts(req.prompt, model)
            params = req.params(16 if req.max_tokens is None else req.max_tokens)
        except InvalidRequest as exc:
            return openai_error(400, str(exc), param=exc.param, code=exc.code)
        echoed = partial(_echoed, req.prompt, prompts, model) if req.echo else None
        return await _answer(request, model, prompts, params, req, chat=False, timeout_s=timeout_s, echoed=echoed,
                             adapter=adapter)

    @app.post("/v1/chat/completions", dependencies=keyed, summary="Answer a chat (OpenAI)")
    async def chat_completions(request: Request):
        try:
            req: ChatRequest = parse_request(ChatRequest, await read_body(request))
            model, adapter = await _target(llms, req.model)
            tools = req.tool_plan()
            try:
                prompt = model.encode_chat([rendered(m) for m in req.messages], tools=req.tool_list())
            except ConfigError as exc:
                raise InvalidRequest(str(exc), "messages") from None
            asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            limit = max(1, model.max_context - len(prompt)) if asked is None else asked
            params = req.params(limit, tools)
        except InvalidRequest as exc:
            return openai_error(400, str(exc), param=exc.param, code=exc.code)
        return await _answer(request, model, [prompt], params, req, chat=True, timeout_s=timeout_s, tools=tools,
                             adapter=adapter)


def _served_as(model: ServedLLM, adapter: Adapter | str | None) -> str:
    """The ``model`` an answer names: the adapter's, else the base's."""
    return model.name if adapter is None else adapter if isinstance(adapter, str) else adapter.name


async def _target(llms: LanguageModels, name: str) -> tuple[ServedLLM, Adapter | str | None]:
    """The model and adapter a request names (NOTE [Adapter residency]); an adapter the
    resolver finds, or one whose host copy was let go, is read here, off the event loop
    (a bad one: 400 naming why), and the request keeps that copy."""
    model, named = llms.find(name)
    if named is None or model.adapters is None:  # ``find`` names an adapter only of a model that serves them
        return model, None
    try:
        return model, await asyncio.to_thread(model.adapters.get, named)
    except ConfigError as exc:
        raise InvalidRequest(str(exc), "model") from None


async def read_body(request: Request) -> Any:
    """A ``/v1`` request's JSON document; a body the parser refuses (not JSON, not UTF-8,
    nested too deeply) is an ``InvalidRequest``, answered 400."""
    raw = await request.body()
    try:
        return load_json(raw)
    except BadRequest as exc:
        raise InvalidRequest(str(exc), None) from None


def _model_card(model: ServedLLM) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "timeshare",
            "root": model.name, "parent": None, "max_model_len": model.max_context}


def _adapter_card(adapter: AdapterInfo, model: ServedLLM) -> dict:
    """An adapter as vLLM lists one: its directory as ``root``, its base as ``parent``."""
    return {"id": adapter.name, "object": "model", "created": model.created, "owned_by": "timeshare",
            "root": adapter.path, "parent": adapter.parent, "max_model_len": model.max_context}


def _prompts(prompt, model: ServedLLM) -> list[list[int]]:
    """A completion request's prompts as token ids: a string, strings, token ids, or
    lists of token ids."""
    if isinstance(prompt, str):
        return [model.encode(prompt)]
    if not prompt:
        raise InvalidRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [model.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _echoed(prompt, prompts: list[list[int]], model: ServedLLM) -> list[str]:
    """Each prompt's text as ``echo`` returns it: as given, or its tokens' text."""
    given = [prompt] if isinstance(prompt, str) else [p if isinstance(p, str) else None for p in prompt] \
        if prompt and not all(isinstance(p, int) for p in prompt) else [None]
    return [g if g is not None else model.decode(ids) for g, ids in zip(given, prompts)]


class _Stream:
    """The events of several sequences, on the event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # the longest wait for any sequence's next event
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Delta | Finish]] = asyncio.Queue()
        self.seqs: list[Generation] = []

    def listener(self, index: int):
        def put(event: Delta | Finish) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
        return put

    async def events(self) -> AsyncIterator[tuple[int, Delta | Finish]]:
        """The sequences' events as they come; the text of a sequence's events already
        waiting together (a burst of decode steps: NOTE [Multi-step decode]) in one."""
        left = len(self.seqs)
        while left:
            try:
                first = await asyncio.wait_for(self.queue.get(), self.timeout_s)
            except TimeoutError:
                raise Timeout(f"no token in {self.timeout_s:g} s (server.request_timeout_s)") from None
            for index, event in join_deltas([first, *self._waiting()]):
                if isinstance(event, Finish):
                    left -= 1
                yield index, event

    def _waiting(self) -> list[tuple[int, Delta | Finish]]:
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out

    def cancel(self) -> None:
        for seq in self.seqs:
            seq.cancel()


def join_deltas(events: list[tuple[int, Delta | Finish]]) -> list[tuple[int, Delta | Finish]]:
    """``events`` in order, each run of one sequence's consecutive deltas as one delta."""
    out: list[tuple[int, Delta | Finish]] = []
    for index, event in events:
        if out and isinstance(event, Delta) and out[-1][0] == index and isinstance(out[-1][1], Delta):
            before = out[-1][1]
            assert isinstance(before, Delta)
            out[-1] = (index, Delta(before.text + event.text, event.tokens, before.ids + event.ids,
                                    before.logprobs + event.logprobs, before.prompt_logprobs or event.prompt_logprobs))
        else:
            out.append((index, event))
    return out


class _Choice:
    """One choice's answer as it grows: its text, and its log-probabilities in the shape
    of its API when asked (a chat's ``content``; a completion's, from its echoed prompt
    on)."""

    def __init__(self, index: int, texts: TokenTexts, *, chat: bool, logprobs: bool, echo: str | None,
                 prompt: list[int], first: bool = True, tools: ToolPlan | None = None):
        self.index, self.chat, self.asked, self.echo, self.prompt = index, chat, logprobs, echo, prompt
        self.tools = tools if tools is not None and tools.reads else None  # NOTE [Tool calls]
        self.streamed = ToolStream(held=self.tools.output is not None) if self.tools is not None else None
        self.first = first  # the first choice of its prompt: its prompt's tokens count in the usage
        self.texts = texts
        self.parts: list[str] = []
        self.content: list[dict] = []
        # The tokens before the next one: the prompt's, unless it is echoed (it comes first then).
        self.completion = CompletionLogprobs(texts, context=[] if echo is not None else prompt[-TokenTexts.WINDOW:])
        self.context = prompt[-TokenTexts.WINDOW:]  # a chat's, for its tokens' texts
        self.finish: Finish | None = None
        self.started = False

    def opening(self, delta: Delta) -> tuple[str, dict | None] | None:
        """Before a completion's first delta, with ``echo``: its prompt's text and, when
        asked, the prompt's log-probabilities (its first token has none)."""
        self.started, first = True, not self.started
        if not first or self.echo is None:
            return None
        self.parts.append(self.echo)
        if not self.asked:
            return self.echo, None
        return self.echo, self.completion.add(self.prompt, delta.prompt_logprobs or (), first_unknown=True)

    def add(self, delta: Delta) -> dict | None:
        """A delta's text; its part of the log-probabilities, when asked."""
        self.parts.append(delta.text)
        if not self.asked:
            return None
        if self.chat:
            part = chat_logprobs(self.texts, delta.ids, delta.logprobs, self.context)
            self.content.extend(part)
            return {"content": part}
        return self.completion.add(delta.ids, delta.logprobs)

    def message(self) -> tuple[dict, str]:
        """A chat choice's message once its answer is complete, and its finish reason: its
        tool calls read from it, when it may call one (NOTE [Tool calls])."""
        assert self.finish is not None
        text = "".join(self.parts)
        if self.tools is not None and self.finish.error is None:
            content, calls = read_calls(text, held=self.tools.output is not None)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, self.finish.reason

    def whole(self) -> dict:
        assert self.finish is not None
        text = "".join(self.parts)
        logprobs = None if not self.asked else {"content": self.content} if self.chat else self.completion.since()
        if self.chat:
            message, reason = self.message()
            return {"index": self.index, "message": message, "finish_reason": reason, "logprobs": logprobs}
        return {"index": self.index, "text": text, "finish_reason": self.finish.reason, "logprobs": logprobs}


def _choices(model: ServedLLM, prompts: list[list[int]], params: SamplingParams, chat: bool,
             echoed: list[str] | None, n: int, tools: ToolPlan | None) -> list[_Choice]:
    """``n`` choices of each prompt, in OpenAI's order (by prompt, then by choice)."""
    texts = TokenTexts(model.decode)
    asked = params.logprobs is not None
    return [_Choice(i * n + j, texts, chat=chat, logprobs=asked, echo=None if echoed is None else echoed[i], prompt=p,
                    first=j == 0, tools=tools)
            for i, p in enumerate(prompts) for j in range(n)]


async def _answer(request: Request, model: ServedLLM, prompts: list[list[int]], params: SamplingParams,
                  req: _Sampling, *, chat: bool, timeout_s: float,
                  echoed: Callable[[], list[str]] | None = None, tools: ToolPlan | None = None,
                  adapter: Adapter | str | None = None):
    """The answer to ``prompts``, by ``adapter`` of ``model`` if named; ``echoed``: their
    texts for ``echo``, made once the prompts passed the model's checks."""
    n = req.n or 1
    stream = _Stream(timeout_s)
    try:
        # ``n`` choices of each prompt, one after another: the first's prefill publishes the
        # prompt's full pages and the others find them cached (NOTE [Prefix caching]); each
        # its own sampling stream (a seeded request: seed + j for its j-th choice, as vLLM).
        for i, prompt in enumerate(prompts):
            for j in range(n):
                choice = params if j == 0 or params.seed is None else replace(params, seed=params.seed + j)
                stream.seqs.append(model.generate(prompt, choice, stream.listener(i * n + j), adapter))
    except ContextLengthError as exc:
        stream.cancel()
        return openai_error(400, str(exc), param="prompt" if not chat else "messages", code="context_length_exceeded")
    except GrammarError as exc:  # NOTE [Constrained decoding]: a schema the library cannot compile
        stream.cancel()
        return openai_error(400, str(exc), param="response_format")
    except ConfigError as exc:
        stream.cancel()
        return openai_error(400, str(exc), param="logit_bias" if str(exc).startswith("logit_bias") else "prompt")
    except BaseException:  # the model closing meanwhile: no sequence may be left without a reader
        stream.cancel()
        raise
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    choices = _choices(model, prompts, params, chat, None if echoed is None else echoed(), n, tools)
    if req.stream:
        served = _served_as(model, adapter)
        return StreamingResponse(_sse(stream, choices, served, rid, created, chat, req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect() -> None:
        async for index, event in stream.events():
            if isinstance(event, Delta):
                choices[index].opening(event)
                choices[index].add(event)
            else:
                choices[index].finish = event

    collecting = asyncio.ensure_future(collect())
    try:
        # The server does not cancel a handler whose client left: watch for it, so that
        # an abandoned request stops generating at the next step.
        while not collecting.done():
            await asyncio.wait([collecting], timeout=DISCONNECT_POLL_S)
            if not collecting.done() and await request.is_disconnected():
                collecting.cancel()
                return openai_error(499, "the client disconnected")
        collecting.result()
    finally:
        collecting.cancel()
        stream.cancel()  # a no-op for finished sequences
    failed = next((c.finish.error for c in choices if c.finish is not None and c.finish.error is not None), None)
    if failed is not None:
        raise served_error(model.name, failed)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": _served_as(model, adapter), "choices": [c.whole() for c in choices],
            "usage": _usage(choices)}


def _usage(choices: list[_Choice]) -> dict:
    """Tokens of the prompts (each once, however many choices it has) and of every choice."""
    done = [(c.first, c.finish) for c in choices if c.finish is not None]
    prompt = sum(f.prompt_tokens for first, f in done if first)
    completion = sum(f.completion_tokens for _, f in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(stream: _Stream, choices: list[_Choice], model: str, rid: str, created: int, chat: bool,
               include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    # As OpenAI documents stream_options.include_usage: when asked, every chunk has
    # "usage": null and one more chunk, with no choices, carries the usage before [DONE];
    # when not asked, no chunk has a "usage" field at all.
    usage: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(choices: list, **extra) -> str:
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **usage, **extra}
        return f"data: {json.dumps(body, ensure_ascii=True)}\n\n"

    try:
        if chat:
            for i in range(len(stream.seqs)):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        async for index, event in stream.events():
            if isinstance(event, Finish):
                if event.error is not None:
                    status, message = _error_of(event.error)
                    body = {"error": {"message": message, "type": "server_error" if status >= 500
                                      else "invalid_request_error", "param": None, "code": str(status)}}
                    yield f"data: {json.dumps(body, ensure_ascii=True)}\n\n"
                    break
                choice = choices[index]
                choice.finish = event
                end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
                reason = event.reason
                if choice.streamed is not None:  # NOTE [Tool calls]: what it held back, and how it ended
                    pieces, reason = choice.streamed.close(reason)
                    for piece in pieces:
                        yield chunk([{"index": index, "delta": _tool_delta(piece), "finish_reason": None,
                                      "logprobs": None}])
                yield chunk([{"index": index, **end, "finish_reason": reason, "logprobs": None}])
            else:
                opening = choices[index].opening(event)
                if opening is not None:  # a completion's echoed prompt
                    yield chunk([{"index": index, "text": opening[0], "finish_reason": None, "logprobs": opening[1]}])
                logprobs = choices[index].add(event)
                streamed = choices[index].streamed
                if streamed is not None:  # NOTE [Tool calls]: its content and calls as they are read
                    for piece in streamed.feed(event.text):
                        yield chunk([{"index": index, "delta": _tool_delta(piece), "finish_reason": None,
                                      "logprobs": None}])
                    continue
                part: dict[str, Any] = {"delta": {"content": event.text}} if chat else {"text": event.text}
                yield chunk([{"index": index, **part, "finish_reason": None, "logprobs": logprobs}])
        else:
            if include_usage:
                yield chunk([], usage=_usage(choices))
        yield "data: [DONE]\n\n"
    except Timeout as exc:
        body = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "504"}}
        yield f"data: {json.dumps(body)}\n\n"
    finally:  # the client went away (the response is cancelled), or the stream ended
        stream.cancel()


def _tool_delta(piece: ToolDelta) -> dict:
    """A streamed piece of an answer that may call tools as OpenAI's chunk delta: content,
    a call's opening (its id, type and name) or more of its arguments."""
    if piece.index < 0:
        return {"content": piece.content}
    function: dict[str, Any] = {"arguments": piece.arguments}
    call: dict[str, Any] = {"index": piece.index}
    if piece.id is not None:
        call.update(id=piece.id, type="function")
        function = {"name": piece.name, "arguments": piece.arguments}
    call["function"] = function
    return {"tool_calls": [call]}


def _error_of(exc: BaseException) -> tuple[int, str]:
    served = served_error("", exc)
    return status_of(served), str(served) if isinstance(served, TimeshareError) else repr(exc)
