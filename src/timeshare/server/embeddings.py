"""OpenAI's ``POST /v1/embeddings`` for the encoders a server holds (a ``models`` entry
given by a Hugging Face directory whose model answers ``last_hidden_state``, such as
``BertModel``): each input's token ids run through the model's own queue, as an Open
Inference Protocol request would, and its embedding is the mean of its tokens' last hidden
states, scaled to length 1 (NOTE [Embeddings]). Runs in the server's process.

# NOTE [Embeddings]
An input is a string (tokenized with the directory's tokenizer, without special tokens
added) or a list of token ids; a list of either gives one embedding each, in order. Each
input is its own request of one row, so inputs of different lengths need no padding and
every embedding is the one the model gives that input alone. Pooling is the mean over the
input's tokens, then an L2 normalization: what sentence-transformers' mean pooling gives,
and unit length as OpenAI's embeddings have.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from timeshare.errors import BadRequest, TimeshareError, UnknownModelError
from timeshare.server.openai import InvalidRequest, openai_error, parse_request, read_body
from timeshare.server.status import status_of

if TYPE_CHECKING:
    from timeshare.server.service import Service

_HIDDEN = "last_hidden_state"


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: str = "float"
    user: str | None = None


def add_embeddings(app: FastAPI, service: Service, keyed: list) -> None:
    """``/v1/embeddings`` on ``app``, behind the data plane's key dependencies ``keyed``."""

    @app.post("/v1/embeddings", dependencies=keyed, summary="Embed texts with an encoder (OpenAI)")
    async def embeddings(request: Request):
        try:
            req: EmbeddingRequest = parse_request(EmbeddingRequest, await read_body(request))
            if req.encoding_format not in ("float", "base64"):
                raise InvalidRequest(f"encoding_format {req.encoding_format!r} is not supported ('float' or "
                                     "'base64')", "encoding_format")
            ep = _encoder(service, req.model)
            inputs = await _token_ids(ep.cfg.path, req.input)
        except InvalidRequest as exc:
            return openai_error(400, str(exc), param=exc.param)
        except UnknownModelError as exc:
            return openai_error(404, str(exc), param="model", code="model_not_found")
        try:
            vectors = await asyncio.gather(*(_embed(service, req.model, ids) for ids in inputs))
        except TimeshareError as exc:
            return openai_error(status_of(exc), str(exc))
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in inputs)
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoder(service: Service, name: str) -> Any:
    """The endpoint of an encoder given by a directory; an unknown model is 404."""
    ep = service.endpoints.get(name)
    if ep is None or ep.cfg.path is None:
        encoders = sorted(n for n, e in service.endpoints.items() if e.cfg.path is not None)
        raise UnknownModelError(f"no encoder named {name!r} (an embedding model is a 'models' entry given by a "
                                f"Hugging Face directory); known: {encoders}")
    if [s.name for s in ep.inputs] != ["input_ids", "attention_mask"]:
        raise InvalidRequest(f"model {name!r} does not take token ids and a mask", "model")
    return ep


@functools.lru_cache(maxsize=16)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def _token_ids(path: str, given: Any) -> list[list[int]]:
    """Each input's token ids (NOTE [Embeddings]); text is tokenized off the event loop."""
    if isinstance(given, str):
        given = [given]
    if given and isinstance(given[0], int):
        given = [given]
    if any(isinstance(g, str) for g in given):
        tok = await asyncio.to_thread(_tokenizer, path)
        given = [tok(g, add_special_tokens=False)["input_ids"] if isinstance(g, str) else g for g in given]
    if any(not ids for ids in given):
        raise InvalidRequest("an input has no tokens", "input")
    return given


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    """As OpenAI sends it: a list of floats, or base64 of the float32 bytes in little-endian
    order (what the official client asks for by default, and decodes)."""
    if encoding == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _embed(service: Service, model: str, ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor([ids], dtype=torch.int64)
    reply = await service.infer(model, {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)})
    hidden = reply.outputs.get(_HIDDEN)
    if hidden is None:
        raise BadRequest(f"model {model!r} gives no {_HIDDEN} to pool (a classifier, not an encoder)")
    pooled = hidden[0].float().mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)
