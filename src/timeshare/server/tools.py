"""Tool calls in OpenAI's chat API: the tools a request offers, what ``tool_choice``
makes of the answer, and the answer read back as ``tool_calls``. Pure; runs in the
server's event loop.

# NOTE [Tool calls]
The tools reach the model through its chat template (``apply_chat_template(tools=...)``),
as do earlier calls (an assistant message's ``tool_calls``) and their results (messages
of role ``tool``). With ``tool_choice`` "required" or a named function the answer is held
to a JSON schema (NOTE [Constrained decoding]): an object ``{"name": ..., "arguments":
...}`` whose name is one of the tools (or the one named) and whose arguments validate
against that tool's ``parameters``; it is read back as one call. With "auto" (the default
when tools are given) the model answers freely and each ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>`` in its text (the format of Hermes-style templates, which
Qwen2.5 and others use) is read back as a call, the rest of the text as its content;
"none" leaves the answer as it is. An answer with calls ends with ``finish_reason``
"tool_calls"; streamed, a choice that may call a tool sends its text and calls once its
answer is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from timeshare.llm.constrained import OutputFormat

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolPlan:
    """What ``tool_choice`` makes of one request: whether calls are read from the answer
    (``reads``), and the format that holds it (None: free)."""

    reads: bool
    output: OutputFormat | None


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be used, with the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def plan(tools: list[dict] | None, choice: str | dict | None) -> ToolPlan:
    """``tools`` (each ``{"type": "function", "function": {"name", "parameters"}}``, already
    checked) and ``tool_choice`` as one plan (NOTE [Tool calls])."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return ToolPlan(False, None)
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice is None or choice == "auto":
        return ToolPlan(True, None)
    if choice == "none":
        return ToolPlan(False, None)
    if choice == "required":
        return ToolPlan(True, OutputFormat.json_schema({"anyOf": [_call_schema(f) for f in by_name.values()]}))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in by_name:
            raise ToolError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return ToolPlan(True, OutputFormat.json_schema(_call_schema(by_name[name])))
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                    '{"name": ...}}', "tool_choice")


def _call_schema(function: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}}}


def read_calls(text: str, held: bool) -> tuple[str | None, list[dict]]:
    """An answer's content and its calls in OpenAI's shape (``id``, ``type``, ``function``
    with ``name`` and ``arguments`` as a JSON string). ``held``: the whole answer is one
    call's JSON (a held format); else calls are the ``<tool_call>`` blocks in it."""
    if held:
        found = [text]
        rest = ""
    else:
        found = CALL.findall(text)
        rest = CALL.sub("", text).strip()
    calls = []
    for body in found:
        try:
            call = json.loads(body)
        except ValueError:
            continue  # not a call: it stays in the text
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    if not calls:
        return text, []
    return (rest or None), calls


def rendered(message: Any) -> dict:
    """A chat message as the chat template reads it: its role, its text, its earlier
    calls (arguments parsed back into objects, as templates expect) and the call a tool's
    result answers."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
            calls.append({"id": call.get("id"), "type": "function", "function": function})
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
