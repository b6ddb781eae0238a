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
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from timeshare.errors import BadRequest, ConfigError, Timeout, TimeshareError
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import ContextLengthError, Delta, Finish
from timeshare.server.auth import ApiKey, key_dependencies
from timeshare.server.llms import Generation, ServedLLM
from timeshare.server.parsing import load_json
from timeshare.server.status import served_error, status_of

DISCONNECT_POLL_S = 0.25  # how often a whole (not streamed) answer checks that its client is still there


# ---------------------------------------------------------------------- requests
# Fields of OpenAI's API that this server does not implement, with the values that ask
# for nothing (null always does): a request that asks for more is refused, 400 with the
# field as ``param`` and a message that says it is not supported, rather than answered as
# if it had not asked, or told that its value is out of some range.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False,),
    "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "logit_bias": ({},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields of their own (user, metadata...)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """An extension (as vLLM's): the most likely k tokens only; 0 or -1: all."""
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)  # what a torch generator takes
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logprobs: bool | int | None = None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The request's sampling parameters; a refused value is 400 naming its field."""
        self._refuse_unsupported()
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                                  seed=self.seed, stop=stop)
        except ConfigError as exc:  # the message begins with the field's name
            raise InvalidRequest(str(exc), str(exc).split(" ", 1)[0]) from None

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


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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

    @app.get("/v1/models", dependencies=keyed, summary="The language models (OpenAI)")
    def list_models():
        return {"object": "list", "data": [_model_card(m) for m in llms.loaded.values()]}

    @app.get("/v1/models/{name}", dependencies=keyed, summary="One language model (OpenAI)")
    def model_card(name: str):
        return _model_card(llms.get(name))

    @app.post("/v1/completions", dependencies=keyed, summary="Complete prompts (OpenAI)")
    async def completions(request: Request):
        try:
            req: CompletionRequest = parse_request(CompletionRequest, await read_body(request))
            model = llms.get(req.model)
            prompts = _prompts(req.prompt, model)
            params = req.sampling(req.max_tokens or 16)
        except InvalidRequest as exc:
            return openai_error(400, str(exc), param=exc.param, code=exc.code)
        return await _answer(request, model, prompts, params, req, chat=False, timeout_s=timeout_s)

    @app.post("/v1/chat/completions", dependencies=keyed, summary="Answer a chat (OpenAI)")
    async def chat_completions(request: Request):
        try:
            req: ChatRequest = parse_request(ChatRequest, await read_body(request))
            model = llms.get(req.model)
            try:
                prompt = model.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])
            except ConfigError as exc:
                raise InvalidRequest(str(exc), "messages") from None
            limit = req.max_completion_tokens or req.max_tokens or max(1, model.max_context - len(prompt))
            params = req.sampling(limit)
        except InvalidRequest as exc:
            return openai_error(400, str(exc), param=exc.param, code=exc.code)
        return await _answer(request, model, [prompt], params, req, chat=True, timeout_s=timeout_s)


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
            "max_model_len": model.max_context}


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
            out[-1] = (index, Delta(out[-1][1].text + event.text, event.tokens))
        else:
            out.append((index, event))
    return out


async def _answer(request: Request, model: ServedLLM, prompts: list[list[int]], params: SamplingParams,
                  req: _Sampling, *, chat: bool, timeout_s: float):
    stream = _Stream(timeout_s)
    try:
        for i, prompt in enumerate(prompts):
            stream.seqs.append(model.generate(prompt, params, stream.listener(i)))
    except ContextLengthError as exc:
        stream.cancel()
        return openai_error(400, str(exc), param="prompt" if not chat else "messages", code="context_length_exceeded")
    except ConfigError as exc:
        stream.cancel()
        return openai_error(400, str(exc), param="prompt")
    except BaseException:  # the model closing meanwhile: no sequence may be left without a reader
        stream.cancel()
        raise
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_sse(stream, model.name, rid, created, chat, req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    finishes: dict[int, Finish] = {}

    async def collect() -> None:
        async for index, event in stream.events():
            if isinstance(event, Delta):
                texts[index].append(event.text)
            else:
                finishes[index] = event

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
    failed = next((f.error for f in finishes.values() if f.error is not None), None)
    if failed is not None:
        raise served_error(model.name, failed)
    choices = []
    for i in range(len(prompts)):
        text, reason = "".join(texts[i]), finishes[i].reason
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                            "logprobs": None})
        else:
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model.name, "choices": choices, "usage": _usage(finishes.values())}


def _usage(finishes) -> dict:
    prompt = sum(f.prompt_tokens for f in finishes)
    completion = sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(stream: _Stream, model: str, rid: str, created: int, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    # As OpenAI documents stream_options.include_usage: when asked, every chunk has
    # "usage": null and one more chunk, with no choices, carries the usage before [DONE];
    # when not asked, no chunk has a "usage" field at all.
    usage: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(choices: list, **extra) -> str:
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **usage, **extra}
        return f"data: {json.dumps(body, ensure_ascii=True)}\n\n"

    finishes: list[Finish] = []
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
                finishes.append(event)
                end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
                yield chunk([{"index": index, **end, "finish_reason": event.reason, "logprobs": None}])
            else:
                part: dict[str, Any] = {"delta": {"content": event.text}} if chat else {"text": event.text}
                yield chunk([{"index": index, **part, "finish_reason": None, "logprobs": None}])
        else:
            if include_usage:
                yield chunk([], usage=_usage(finishes))
        yield "data: [DONE]\n\n"
    except Timeout as exc:
        body = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "504"}}
        yield f"data: {json.dumps(body)}\n\n"
    finally:  # the client went away (the response is cancelled), or the stream ended
        stream.cancel()


def _error_of(exc: BaseException) -> tuple[int, str]:
    served = served_error("", exc)
    return status_of(served), str(served) if isinstance(served, TimeshareError) else repr(exc)
