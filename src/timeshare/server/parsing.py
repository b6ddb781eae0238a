"""Parsing inference request bodies: :func:`parse_infer` (JSON or the binary tensor data
extension) into the request and its input tensors, and the helpers the routes share
(:func:`load_json`, :func:`describe_validation`). Pure functions; they run in the
server's process (small bodies, on the event loop) or in a parser process for large
ones (``server/parser_pool.py``, NOTE [Parsing off the event loop]).
"""

from __future__ import annotations

import json
import math

import torch
from pydantic import ValidationError

from timeshare.errors import BadRequest
from timeshare.server.schemas import InferenceRequest
from timeshare.server.tensors import KNOWN, from_binary, from_json

HEADER_LENGTH = "inference-header-content-length"  # the binary tensor data extension's header
# How deeply a request body's arrays and objects may nest: far more than any request of
# the APIs served needs (a JSON schema of a structured output included), and shallow
# enough that no later walk of the document (validation, a copy, a dump) recurses into
# trouble.
MAX_JSON_DEPTH = 100
MAX_DIMENSION = 1 << 31  # larger dimensions are refused even when another one is 0


def describe_validation(errors) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts[:5]) + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")


def load_json(body: bytes | bytearray | str):
    """The JSON document of a request body; malformed JSON, text that is not UTF-8 and
    arrays or objects nested deeper than ``MAX_JSON_DEPTH`` are a :class:`BadRequest`."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the interpreter's own limit
        raise BadRequest(f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep") from None
    if _too_deep(doc, MAX_JSON_DEPTH):
        raise BadRequest(f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep")
    return doc


def _too_deep(doc, limit: int) -> bool:
    """Whether ``doc``'s containers nest deeper than ``limit`` (walked without recursion;
    a flat list of numbers costs one pass over it)."""
    stack = [(doc, 1)] if isinstance(doc, (list, dict)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return False


def parse_infer(body: bytes | bytearray | str,
                header_length: str | None) -> tuple[InferenceRequest, dict[str, torch.Tensor]]:
    """The request (its inputs without their ``data``) and its input tensors by name,
    from a JSON body or a binary tensor data body (a JSON header of ``header_length``
    bytes, then the inputs' bytes)."""
    return build_request(*read_body(body, header_length))


def read_body(body: bytes | bytearray | str, header_length: str | None) -> tuple[dict, memoryview]:
    """The first half of :func:`parse_infer`: the body's JSON document, and its binary
    part (empty without the binary extension). ``body`` may be the text of a JSON body."""
    binary = memoryview(b"")
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
        binary = memoryview(body)[n:]  # type: ignore[arg-type]  # a str never comes with a header length
        body = body[:n]
    obj = load_json(body)
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object with 'inputs'")
    return obj, binary


def build_request(obj: dict, binary: memoryview) -> tuple[InferenceRequest, dict[str, torch.Tensor]]:
    """The second half of :func:`parse_infer`: the request and its tensors from the
    body's JSON document (whose ``data`` lists it takes out) and binary part."""
    # The data lists skip pydantic, which would copy them (millions of values); from_json
    # checks them. Only lists are taken out, so any other 'data' gets pydantic's message.
    data = _take_data_lists(obj)
    try:
        req = InferenceRequest.model_validate(obj)
    except ValidationError as exc:
        raise BadRequest(describe_validation(exc.errors())) from None
    tensors, offset = {}, 0
    for i, inp in enumerate(req.inputs):
        if any(d > MAX_DIMENSION for d in inp.shape):
            raise BadRequest(f"input {inp.name!r}: shape {inp.shape} has a dimension over {MAX_DIMENSION}")
        if inp.name in tensors:
            raise BadRequest(f"input {inp.name!r} is given twice")
        if inp.datatype not in KNOWN:
            raise BadRequest(f"input {inp.name!r}: unknown datatype {inp.datatype!r}; known: {sorted(KNOWN)}")
        if any(d < 0 for d in inp.shape):
            raise BadRequest(f"input {inp.name!r}: shape {inp.shape} has a negative dimension")
        if math.prod(max(d, 1) for d in inp.shape) > MAX_DIMENSION:  # even an empty tensor needs its strides
            raise BadRequest(f"input {inp.name!r}: shape {inp.shape} is too large (its non-zero dimensions "
                             f"multiply past {MAX_DIMENSION})")
        size = (inp.parameters or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"input {inp.name!r}: binary_data_size must be a non-negative integer")
            if data[i] is not None:
                raise BadRequest(f"input {inp.name!r}: give either 'data' or binary_data_size, not both")
            if offset + size > len(binary):
                raise BadRequest(f"input {inp.name!r}: binary_data_size {size} runs past the body's binary part "
                                 f"({len(binary)} bytes)")
            tensors[inp.name] = from_binary(inp.name, inp.datatype, inp.shape, binary[offset:offset + size])
            offset += size
        elif data[i] is None:
            raise BadRequest(f"input {inp.name!r} has no 'data' (nor binary_data_size)")
        else:  # from_json gets the only reference: the values go once read (NOTE [Parsing off the event loop])
            tensors[inp.name] = from_json(inp.name, inp.datatype, inp.shape, _take(data, i))
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data belong to no input")
    return req, tensors


def _take(items: list, i: int):
    """``items[i]``, leaving None in its place."""
    item, items[i] = items[i], None
    return item


def _take_data_lists(obj: dict) -> list[list | None]:
    """Remove each input's ``data`` list from the parsed body; returns them by input."""
    inputs = obj.get("inputs")
    if not isinstance(inputs, list):
        return []
    return [inp.pop("data") if isinstance(inp, dict) and isinstance(inp.get("data"), list) else None
            for inp in inputs]


def json_size(body: bytes, header_length: str | None) -> int:
    """How many bytes of ``body`` are JSON (all of it, unless the binary extension says less)."""
    if header_length is None:
        return len(body)
    try:
        n = int(header_length)
    except ValueError:
        return 0  # parse_infer refuses it before reading any JSON
    return n if 0 <= n <= len(body) else 0
