"""JSON schemas drawn from a seed, for structured outputs' tests and benches: nested
objects, arrays, enums, required fields, bounded integers and numbers, patterned and
bounded strings. Every schema is one a client could send as ``response_format``'s
``json_schema``; each is bounded (string lengths, array sizes, depth), so that a
constrained answer always ends within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "beta", "gamma", "delta", "model", "layer", "token", "device", "host", "page")
PATTERNS = ("^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{2,4}$", "^(yes|no)$")


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1 to 4 properties, each any of the kinds above (objects and
    arrays nested at most two levels)."""
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}  # bounded digits too
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "object":
        return schema(rng, depth)
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3)}


def schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [schema(rng) for _ in range(n)]
