"""NOTE [Tool calls]: a streamed answer read piece by piece gives the calls, arguments and
content a whole answer has, however its text is cut."""

from __future__ import annotations

import json

import pytest

from timeshare.server.tools import CallScanner, ToolDelta, ToolStream, read_calls

HELD = ('[{"name":"get_weather","arguments":{"city":"a \\"}{[\\" b","when":{"day":[1,{"x":"]"}]}}},'
        ' {"name": "get_time", "arguments": {"zone": -3}}]')


def _joined(stream: ToolStream, text: str, cut: int) -> tuple[str, list[tuple[str, str]]]:
    """``text`` fed ``cut`` characters at a time: its content, and its calls (name, arguments)."""
    content, calls = "", []
    pieces = [p for i in range(0, len(text), cut) for p in stream.feed(text[i:i + cut])]
    pieces += stream.close("stop")[0]
    for p in pieces:
        if p.index < 0:
            content += p.content
            continue
        if p.id is not None:
            assert p.index == len(calls)  # opened in order, once each
            calls.append((p.name, ""))
        name, arguments = calls[p.index]
        calls[p.index] = (name, arguments + p.arguments)
    return content, calls


@pytest.mark.parametrize("cut", [1, 2, 7, 1000])
def test_held_calls_streamed_in_any_pieces_are_the_whole_answers(cut):
    _, whole = read_calls(HELD, held=True)
    assert [c["function"]["name"] for c in whole] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in whole] == [c["arguments"] for c in json.loads(HELD)]
    content, streamed = _joined(ToolStream(held=True), HELD, cut)
    assert content == "" and streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]


def test_a_held_answer_cut_short_is_no_call_whole_and_a_partial_one_streamed():
    cut = HELD[:40]
    assert read_calls(cut, held=True) == (cut, [])
    scanner = CallScanner()
    scanner.feed(cut)
    assert scanner.complete == [False] and scanner.calls[0]["function"]["name"] == "get_weather"
    stream = ToolStream(held=True)
    stream.feed(cut)
    assert stream.close("length") == ([], "length")  # its part streamed; it ends as the whole answer does
    early = ToolStream(held=True)
    assert early.feed('[{"na') == []  # cut before a name: nothing sent, the text is its content
    assert early.close("length") == ([ToolDelta(content='[{"na')], "length")
    whole = ToolStream(held=True)
    whole.feed(HELD)
    assert whole.close("stop") == ([], "tool_calls")


@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_auto_streams_content_and_each_block_once_it_closes(cut):
    text = ('let me <tool look <tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call> and '
            '<tool_call>not json</tool_call> then <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_')
    whole_content, whole = read_calls(text, held=False)
    content, streamed = _joined(ToolStream(held=False), text, cut)
    assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert [name for name, _ in streamed] == ["get_time", "a"]
    assert content == 'let me <tool look  and <tool_call>not json</tool_call> then <tool_'
    assert whole_content == content.strip()  # the block that is no call stays in the text both ways


def test_text_with_no_call_streams_as_it_is():
    text = "no calls here, just < and <tool"
    assert _joined(ToolStream(held=False), text, 4) == (text, [])
    assert read_calls(text, held=False) == (text, [])
