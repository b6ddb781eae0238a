"""Tool calls in OpenAI's chat API: the tools a request offers, what ``tool_choice``
makes of the answer, and the answer read back as ``tool_calls``. Pure; runs in the
server's event loop.

# NOTE [Tool calls]
The tools reach the model through its chat template (``apply_chat_template(tools=...)``),
as do earlier calls (an assistant message's ``tool_calls``) and their results (messages
of role ``tool``). With ``tool_choice`` "required" or a named function the answer is held
to a JSON schema (NOTE [Constrained decoding]): an array of objects ``{"name": ...,
"arguments": ...}``, each name one of the tools (or the one named) and its arguments
valid against that tool's ``parameters``; one call at most when ``parallel_tool_calls``
is false. Each is read back as a call, its arguments the answer's own text of them.
With "auto" (the default when tools are given) the model answers freely and each
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in its text (the format of
Hermes-style templates, which Qwen2.5 and others use) that parses is read back as a
call, the rest of the text as its content; "none" leaves the answer as it is. An answer
with calls ends with ``finish_reason`` "tool_calls".

Streamed (``ToolStream``), a held answer's calls come as they are written: a call's id
and name once its name is complete, then its arguments piece by piece, read by one
scanner (``CallScanner``) that also reads the whole answer, so the pieces join to the
arguments a whole answer has. With "auto" the text streams as content up to a
``<tool_call>``; each block is sent once it closes: as a call if it parses, else as
content (as the whole answer keeps it). An answer cut short inside a held call has
streamed part of its arguments, as vLLM's does, and ends with its own finish reason
("length"), not "tool_calls"; the whole answer is then its text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from timeshare.llm.constrained import OutputFormat

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# A held call's opening: anything of the array or the call before it, then its name and
# the key of its arguments (the schema puts "name" first).
_OPENING = re.compile(r'[\s\[\],}]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


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


def plan(tools: list[dict] | None, choice: str | dict | None, parallel: bool = True) -> ToolPlan:
    """``tools`` (each ``{"type": "function", "function": {"name", "parameters"}}``, already
    checked), ``tool_choice`` and ``parallel_tool_calls`` as one plan (NOTE [Tool calls])."""
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
        return ToolPlan(True, _held([_call_schema(f) for f in by_name.values()], parallel))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in by_name:
            raise ToolError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return ToolPlan(True, _held([_call_schema(by_name[name])], parallel))
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                    '{"name": ...}}', "tool_choice")


def _held(calls: list[dict], parallel: bool) -> OutputFormat:
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return OutputFormat.json_schema(schema)


def _call_schema(function: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}}}


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolDelta:
    """A piece of a streamed answer that may call tools: more of its ``content``, or of
    call ``index``: its opening (``id`` and ``name``) or more of its ``arguments``."""

    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class CallScanner:
    """A held answer's calls as its text grows (NOTE [Tool calls]): each call's name once
    complete, and the text of its arguments (a JSON object) as it comes. Calls found so far
    are ``calls`` (their arguments' text so far, and whether complete)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[dict] = []
        self.complete: list[bool] = []
        self.broken = False  # not of the shape above: nothing more is read
        self._at = 0  # where scanning goes on
        self._depth = 0  # inside the arguments: brackets open; in a string; after a backslash
        self._string = self._escape = False

    def feed(self, more: str) -> list[ToolDelta]:
        self.text += more
        out: list[ToolDelta] = []
        while not self.broken:
            if not self.calls or self.complete[-1]:
                found = _OPENING.match(self.text, self._at)
                if found is None:
                    break
                try:
                    name = json.loads(f'"{found.group(1)}"')
                except ValueError:
                    self.broken = True
                    break
                self.calls.append(_call(name, ""))
                self.complete.append(False)
                self._at = found.end()
                out.append(ToolDelta(index=len(self.calls) - 1, id=self.calls[-1]["id"], name=name))
            piece = self._arguments()
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                out.append(ToolDelta(index=len(self.calls) - 1, arguments=piece))
            if not self.complete[-1]:
                break
        return out

    def _arguments(self) -> str:
        """More of the open call's arguments: up to the end of the text or of the value."""
        text, i, begun = self.text, self._at, self._depth > 0
        start = i
        while i < len(text):
            c = text[i]
            i += 1
            if not begun:
                if c.isspace():
                    start = i
                    continue
                if c != "{":
                    self.broken = True
                    return ""
                begun = True
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.complete[-1] = True
                    break
        self._at = i
        return text[start:i]


def read_calls(text: str, held: bool) -> tuple[str | None, list[dict]]:
    """An answer's content and its calls in OpenAI's shape (``id``, ``type``, ``function``
    with ``name`` and ``arguments`` as a JSON string). ``held``: the whole answer is its
    calls' JSON array (a held format); else calls are the ``<tool_call>`` blocks in it
    that parse, the other blocks left in its text."""
    if held:
        found = _held_calls(text)
        return (None, found) if found else (text, [])
    calls: list[dict] = []

    def taken(block: re.Match) -> str:
        call = _block_call(block.group(1))
        if call is None:
            return block.group(0)
        calls.append(call)
        return ""

    rest = CALL.sub(taken, text).strip()
    if not calls:
        return text, []
    return (rest or None), calls


def _held_calls(text: str) -> list[dict]:
    """A held answer's calls (none unless it is a whole array of whole calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    scanner = CallScanner()
    scanner.feed(text)
    if not isinstance(items, list) or len(items) != len(scanner.calls) or not all(scanner.complete) or \
            [item.get("name") if isinstance(item, dict) else None for item in items] != \
            [call["function"]["name"] for call in scanner.calls]:
        return []
    return scanner.calls


def _block_call(body: str) -> dict | None:
    """A ``<tool_call>`` block's call, or None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return _call(call["name"], json.dumps(call.get("arguments", {})))


class ToolStream:
    """A streamed answer that may call tools, read as it comes (NOTE [Tool calls]):
    ``feed`` its text, ``close`` at its end; ``calls`` says how many were sent."""

    def __init__(self, held: bool):
        self.held = held
        self._scanner = CallScanner() if held else None
        self._pending = ""  # "auto": text that may be, or is, a block not yet closed
        self.calls = 0

    def feed(self, text: str) -> list[ToolDelta]:
        if self._scanner is not None:
            out = self._scanner.feed(text)
            self.calls = len(self._scanner.calls)
            return out
        self._pending += text
        out = []
        while self._pending:
            at = self._pending.find(OPEN_TAG)
            if at < 0:  # content, but for an end that may begin a tag
                cut = len(self._pending) - _tag_prefix(self._pending)
                content, self._pending = self._pending[:cut], self._pending[cut:]
                if content:
                    out.append(ToolDelta(content=content))
                break
            if at:
                out.append(ToolDelta(content=self._pending[:at]))
                self._pending = self._pending[at:]
            end = self._pending.find(CLOSE_TAG)
            if end < 0:
                break  # the block is not closed yet
            block, self._pending = self._pending[:end + len(CLOSE_TAG)], self._pending[end + len(CLOSE_TAG):]
            out.extend(self._block(block))
        return out

    def _block(self, block: str) -> list[ToolDelta]:
        found = CALL.fullmatch(block)
        call = _block_call(found.group(1)) if found is not None else None
        if call is None:
            return [ToolDelta(content=block)]
        self.calls += 1
        return [ToolDelta(index=self.calls - 1, id=call["id"], name=call["function"]["name"],
                          arguments=call["function"]["arguments"])]

    def close(self, reason: str) -> tuple[list[ToolDelta], str]:
        """At the answer's end (``reason``, its finish reason): the text held back, and the
        finish reason to send, as the whole answer has them (``read_calls``). Held: the
        text is content if no call opened (nothing was sent); "tool_calls" once the calls
        are whole (a call cut short, its part streamed already, keeps ``reason``). Auto: an
        unclosed block is content; "tool_calls" if a call was sent."""
        if self._scanner is not None:
            text = self._scanner.text
            if not self._scanner.calls:
                return ([ToolDelta(content=text)] if text else []), reason
            return [], "tool_calls" if _held_calls(text) else reason
        rest, self._pending = self._pending, ""
        return ([ToolDelta(content=rest)] if rest else []), "tool_calls" if self.calls else reason


def _tag_prefix(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


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
