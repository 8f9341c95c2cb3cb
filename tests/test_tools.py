"""text/tools.py: Qwen3 tool-call blocks parsed out of answers, whole and streamed in pieces
of every size; malformed blocks stay text; messages as templates read them."""
import json
import re

import pytest

from kestreld.text.tools import (ToolCallParser, ToolUse, parse_call, template_messages)

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": [2, {"z": null}]}}\n</tool_call>'
WANT_A = ("get_weather", {"city": "Zürich", "unit": "c"})
WANT_B = ("add", {"x": 1, "y": [2, {"z": None}]})

# answer -> (text outside the blocks, [(name, arguments)])
ANSWERS = [
    (CALL_A, "", [WANT_A]),
    (CALL_A + "\n" + CALL_B + "\n", "", [WANT_A, WANT_B]),                 # several calls
    ("Let me check.\n" + CALL_A, "Let me check.\n", [WANT_A]),             # text before
    (CALL_A + "\nDone <tool", "\nDone <tool", [WANT_A]),                   # text after, a tag start
    ("no tools here, just < and <tool_ and </tool_call>", "no tools here, just < and <tool_ and </tool_call>", []),
    # malformed JSON, a non-call object, arguments not an object: the block stays text
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>",
     "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>", []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>' + CALL_B,
     '<tool_call>\n{"arguments": {}}\n</tool_call>', [WANT_B]),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', []),
    # arguments as a JSON string (some models), and missing (no arguments)
    ('<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 2}"}\n</tool_call>', "", [("f", {"k": 2})]),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", {})]),
    # an unclosed block (max_tokens) comes back as text
    (CALL_A + "\n<tool_call>\n{\"name\": \"add\", \"argu", "<tool_call>\n{\"name\": \"add\", \"argu",
     [WANT_A]),
]


def _parse(pieces):
    p = ToolCallParser()
    text, calls = [], []
    for piece in pieces:
        t, c = p.feed(piece)
        text.append(t)
        calls += c
    t, c = p.flush()
    return "".join(text) + t, calls


def _check(calls, want):
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    for c in calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("answer, text, want", ANSWERS)
def test_whole_answer(answer, text, want):
    got_text, calls = _parse([answer])
    assert got_text == text
    _check(calls, want)


@pytest.mark.parametrize("answer, text, want", ANSWERS)
def test_streamed_in_pieces_of_every_size(answer, text, want):
    for size in range(1, len(answer) + 1):
        pieces = [answer[i:i + size] for i in range(0, len(answer), size)]
        got_text, calls = _parse(pieces)
        assert got_text == text, size
        _check(calls, want)


def test_a_call_arrives_with_the_piece_that_closes_its_block():
    p = ToolCallParser()
    head, tail = CALL_A[:-3], CALL_A[-3:]
    assert p.feed("Sure. ") == ("Sure. ", [])
    assert p.feed(head) == ("", [])              # the block's text is withheld
    text, calls = p.feed(tail)
    assert text == "" and [c.name for c in calls] == ["get_weather"]
    assert p.feed("\n") == ("", [])              # blanks after a call: held, then dropped
    assert p.flush() == ("", [])


def test_arguments_keep_their_text_as_json():
    call = parse_call('{"name": "f", "arguments": {"s": "ü \\" \\n", "n": 1.5e3}}')
    assert json.loads(call.arguments) == {"s": 'ü " \n', "n": 1500.0}
    assert "ü" in call.arguments                 # not \u-escaped
    assert parse_call("not json") is None and parse_call('{"name": ""}') is None
    assert parse_call('["f"]') is None and parse_call('{"name": 3}') is None


def test_call_schemas():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    bare = {"type": "function", "function": {"name": "now"}}
    schemas = ToolUse((weather, bare), required=True).call_schemas()
    assert [s["properties"]["name"] for s in schemas] == [{"const": "get_weather"}, {"const": "now"}]
    assert schemas[0]["properties"]["arguments"] == weather["function"]["parameters"]
    assert schemas[1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert all(s["required"] == ["name", "arguments"] and s["additionalProperties"] is False
               for s in schemas)
    only = ToolUse((weather, bare), required=True, only="now").call_schemas()
    assert [s["properties"]["name"]["const"] for s in only] == ["now"]


def test_template_messages_turn_arguments_into_objects():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": '{"a": [1, "x"]}'}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "g", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    out = template_messages(msgs)
    assert out[0] == msgs[0] and out[2] == msgs[2]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": [1, "x"]}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"a": [1, "x"]}'   # untouched
