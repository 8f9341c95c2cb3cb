"""kestreld.protocol: parameter validation, message classification, framing, encoders."""
from __future__ import annotations

import math

import msgpack
import pytest

from kestreld.engine.sampler import SamplingOptions
from kestreld.errors import BadRequest, TooLarge, UnknownMethod
from kestreld.protocol import (MAX_EMBED_INPUTS, ChatParams, EmbedParams, FrameError,
                               FrameReader, GenerateParams, NoParams, RerankParams,
                               Notification, Request, Response,
                               decode_message, encode_notification, encode_request,
                               encode_response, msgid_of, validate_params)

VOCAB = 1000


def gen(**p):
    return validate_params("generate", [p], VOCAB)


# ---------------------------------------------------------------- validation

def test_generate_defaults_and_typed_values():
    g = gen(prompt="hi")
    assert g == GenerateParams(prompt="hi", ids=None, options={}, stream=True)
    g = gen(ids=[0, 999], max_tokens=5, temperature=1, top_k=0, top_p=1, min_p=0,
            repeat_penalty=1.1, seed=2**64 - 1, stop=["\n", "END"], ignore_eos=True,
            logprobs=20, stream=False)
    assert g.ids == (0, 999) and g.stream is False
    assert g.options == {"max_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                         "min_p": 0.0, "repeat_penalty": 1.1, "seed": 2**64 - 1,
                         "stop": ("\n", "END"), "ignore_eos": True, "logprobs": 20}
    assert isinstance(g.options["temperature"], float)
    # every option name is a SamplingOptions field, so the server can build one
    SamplingOptions(**g.options)


@pytest.mark.parametrize("name, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.01), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -1), ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
    ("repeat_penalty", 0), ("repeat_penalty", -1), ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("stop", "x"), ("stop", [""]), ("stop", ["x" * 257]), ("stop", ["a"] * 17), ("stop", [1]),
    ("ignore_eos", 1), ("logprobs", -1), ("logprobs", 21), ("stream", "yes"),
])
def test_each_option_out_of_range_names_itself(name, value):
    with pytest.raises(BadRequest) as e:
        gen(prompt="hi", **{name: value})
    assert name in str(e.value)


@pytest.mark.parametrize("p, needle", [
    ({}, "exactly one"), ({"prompt": "a", "ids": [1]}, "exactly one"),
    ({"prompt": b"bytes"}, "prompt"), ({"ids": [1, VOCAB]}, f"0..{VOCAB - 1}"),
    ({"ids": [-1]}, "ids"), ({"ids": "1 2"}, "ids"), ({"prompt": "a", "tempreature": 1}, "tempreature"),
    ({"prompt": "a", "messages": []}, "messages"),
])
def test_generate_shape_errors(p, needle):
    with pytest.raises(BadRequest) as e:
        gen(**p)
    assert needle in str(e.value)


def test_chat_messages():
    c = validate_params("chat", [{"messages": [{"role": "user", "content": "hi"}],
                                  "enable_thinking": True, "max_tokens": 3}], VOCAB)
    assert c == ChatParams(({"role": "user", "content": "hi"},), True, {"max_tokens": 3}, True)
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 1}],
                [{"role": "user", "content": "x", "name": "n"}], "hi"):
        with pytest.raises(BadRequest):
            validate_params("chat", [{"messages": bad}], VOCAB)
    with pytest.raises(BadRequest, match="needs messages"):
        validate_params("chat", [{}], VOCAB)


def test_other_methods():
    assert validate_params("tokenize", [{"text": "a"}], VOCAB).add_special is False
    assert validate_params("detokenize", [{"ids": [3]}], VOCAB).ids == (3,)
    assert validate_params("cancel", [{"id": 7}], VOCAB).id == 7
    assert validate_params("status", [], VOCAB) == NoParams()
    assert validate_params("ping", [{}], VOCAB) == NoParams()
    for method, p in (("tokenize", {}), ("tokenize", {"text": 1}), ("cancel", {"id": "7"}),
                      ("detokenize", {"ids": [VOCAB]}), ("status", {"verbose": True}),
                      ("generate", [{"prompt": "a"}, {"prompt": "b"}]), ("ping", "x")):
        with pytest.raises(BadRequest):
            validate_params(method, p if isinstance(p, (list, str)) else [p], VOCAB)
    with pytest.raises(UnknownMethod, match="frobnicate"):
        validate_params("frobnicate", [], VOCAB)


def test_embed_input_forms_and_limits():
    def embed(**p):
        return validate_params("embed", [p], VOCAB)
    assert embed(input="a").inputs == ("a",)
    assert embed(input=["a", "b"]).inputs == ("a", "b")
    assert embed(input=[1, 2]).inputs == ((1, 2),)
    assert embed(input=[[1], [2, 3]], dimensions=8) == EmbedParams(((1,), (2, 3)), 8, False)
    assert embed(input="a", truncate=True).truncate is True
    for p, needle in (({}, "embed needs input"), ({"input": []}, "not empty"),
                      ({"input": 3}, "a string, a list"), ({"input": ["a", [1]]}, "only strings"),
                      ({"input": [[VOCAB]]}, r"input\[0\]"),
                      ({"input": "a", "dimensions": 0}, "dimensions"),
                      ({"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, "at most 2048"),
                      ({"input": "a", "temperature": 0}, "unknown parameter")):
        with pytest.raises(BadRequest, match=needle):
            embed(**p)


def test_rerank_params():
    p = validate_params("rerank", [{"query": "q", "documents": ["a", "b"], "top_n": 1}], VOCAB)
    assert p == RerankParams("q", ("a", "b"), 1)
    assert validate_params("rerank", [{"query": "q", "documents": ["a"]}], VOCAB).top_n is None
    for p, needle in (({"documents": ["a"]}, "needs query"),
                      ({"query": "q", "documents": []}, "not empty"),
                      ({"query": "q", "documents": [1]}, "list of strings"),
                      ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                      ({"query": "q", "documents": ["a"] * (MAX_EMBED_INPUTS + 1)}, "at most")):
        with pytest.raises(BadRequest, match=needle):
            validate_params("rerank", [p], VOCAB)


# ---------------------------------------------------------------- messages

def test_decode_message_kinds_and_bin_method():
    assert decode_message([0, 1, b"ping", []]) == Request(1, "ping", [])
    assert decode_message([1, 2, None, {"ok": True}]) == Response(2, None, {"ok": True})
    assert decode_message([2, "hello", [1]]) == Notification("hello", [1])
    for bad in (5, [], [0, 1, "ping"], [0, "1", "ping", []], [3, 1, "x", []], [0, 1, 5, []],
                [0, 1, b"\xff", []], [True, 1, "ping", []]):
        with pytest.raises(BadRequest):
            decode_message(bad)


def test_msgid_of():
    assert msgid_of([0, 5, "x"]) == 5
    assert msgid_of([0, "5"]) is None and msgid_of([1, 5]) is None and msgid_of("x") is None


def test_encoders_round_trip():
    assert msgpack.unpackb(encode_request(3, "generate", {"prompt": "a"})) == \
        [0, 3, "generate", [{"prompt": "a"}]]
    assert msgpack.unpackb(encode_request(4, "status")) == [0, 4, "status", []]
    assert msgpack.unpackb(encode_response(3, None, {"x": 1})) == [1, 3, None, {"x": 1}]
    assert msgpack.unpackb(encode_notification("token", 3, {"text": "é"})) == \
        [2, "token", [3, {"text": "é"}]]


# ---------------------------------------------------------------- framing

def packed(*objs) -> bytes:
    return b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)


def test_frames_survive_any_chunking():
    objs = [[0, i, "ping", [{"pad": "x" * (i * 37)}]] for i in range(20)]
    data = packed(*objs)
    for size in (1, 7, 64, len(data)):
        r = FrameReader(4096, max_chunk=max(size, 1))
        out = []
        for i in range(0, len(data), size):
            out += r.feed(data[i:i + size])
        assert out == objs


def test_too_large_complete_message_in_one_chunk():
    r = FrameReader(100, max_chunk=1 << 16)
    out = r.feed(packed([0, 1, "ping", []], [0, 2, "generate", [{"prompt": "x" * 200}]]))
    assert out[0] == [0, 1, "ping", []]
    assert isinstance(out[1], FrameError) and out[1].msgid == 2
    assert isinstance(out[1].error, TooLarge) and "100" in str(out[1].error)
    assert r.dead and r.feed(packed([0, 3, "ping", []])) == []


def test_too_large_refused_while_still_arriving_with_msgid_from_split_head():
    r = FrameReader(1000, max_chunk=1 << 16)
    data = packed([0, 4, "ping", []], [0, 77777, "generate", [{"prompt": "y" * 5000}]])
    out = []
    for i in range(len(data)):                       # byte by byte: the head is split too
        out += r.feed(data[i:i + 1])
        if r.dead:
            break
    assert out[0] == [0, 4, "ping", []]
    assert isinstance(out[1], FrameError) and out[1].msgid == 77777
    assert i < 1000 + 20                              # refused before the rest arrived


def test_malformed_bytes():
    out = FrameReader(1000).feed(b"\xc1")
    assert isinstance(out[0], FrameError) and out[0].msgid is None
    assert isinstance(out[0].error, BadRequest)
    out = FrameReader(1000).feed(packed([0, 1, "ping", []]) + b"\x94\x00\x09\xc1")
    assert out[0] == [0, 1, "ping", []] and out[1].msgid == 9


# ---------------------------------------------------------------- tools, JSON output, penalties

def chat(**p):
    return validate_params("chat", [{"messages": [{"role": "user", "content": "hi"}], **p}], VOCAB)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}}}}


def test_penalties_are_options_in_openai_range():
    g = gen(prompt="a", presence_penalty=-2, frequency_penalty=1.5)
    assert g.options == {"presence_penalty": -2.0, "frequency_penalty": 1.5}
    SamplingOptions(**g.options)
    for name, v in (("presence_penalty", 2.01), ("frequency_penalty", -2.5),
                    ("presence_penalty", math.nan), ("frequency_penalty", "1")):
        with pytest.raises(BadRequest, match=name):
            gen(prompt="a", **{name: v})


def test_response_format_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert gen(prompt="a", response_format={"type": "json_object"}).options == \
        {"response_format": {"kind": "json_object", "schema": None}}
    assert chat(response_format={"type": "text"}).options == {"response_format": None}
    rf = {"type": "json_schema", "json_schema": {"name": "thing-1", "schema": schema, "strict": True}}
    assert chat(response_format=rf).options["response_format"] == {"kind": "json_schema",
                                                                   "schema": schema}


@pytest.mark.parametrize("rf, needle", [
    ("json", "response_format must be"), ({"type": "yaml"}, "response_format must be"),
    ({"type": "json_object", "schema": {}}, "unknown 'schema'"),
    ({"type": "json_schema"}, "missing json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "missing name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": []}}, "JSON schema (a map)"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "text"}}},
     "schema.type must be one of"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "properties": {"a": {"type": ["string", "int"]}}}}}, "schema.properties.a.type"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"required": "a"}}},
     "schema.required must be a list"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": []}}}, "enum"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"anyOf": [{"type": 1}]}}},
     "schema.anyOf[0].type"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"items": "x"}}},
     "schema.items must be a schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": b"\x00"}}},
     "not a JSON value"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": math.inf}}},
     "finite"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {1: {}}}}, "keys must be strings"),
])
def test_bad_response_formats_name_the_fault(rf, needle):
    with pytest.raises(BadRequest) as e:
        gen(prompt="a", response_format=rf)
    assert needle in str(e.value)


def test_schemas_are_bounded():
    deep = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    wide = {"enum": list(range(20000))}
    for schema, needle in ((deep, "nested deeper than 32"), (wide, "more than 10000 values")):
        with pytest.raises(BadRequest, match=needle):
            gen(prompt="a", response_format={"type": "json_schema",
                                             "json_schema": {"name": "n", "schema": schema}})


def test_tools_and_tool_choice():
    c = chat(tools=[WEATHER], tool_choice="required")
    assert c.tools == (WEATHER,) and c.tool_choice == "required"
    assert chat().tools == () and chat().tool_choice == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER], tool_choice=named).tool_choice == named
    bare = {"type": "function", "function": {"name": "now"}}
    assert chat(tools=[bare]).tools == (bare,)


@pytest.mark.parametrize("p, needle", [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [WEATHER] * 2}, "offered twice"),
    ({"tools": [{"type": "function"}]}, "missing function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 'tools[0].type must be "function"'),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "unknown 'params'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "at most 128"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "missing name"),
])
def test_bad_tools_name_the_fault(p, needle):
    with pytest.raises(BadRequest) as e:
        chat(**p)
    assert needle in str(e.value)


def test_tool_call_and_tool_messages():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": {"x": 1}})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "content": "no id"}]
    out = validate_params("chat", [{"messages": msgs}], VOCAB).messages
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert out[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert out[3] == msgs[3] and out[4] == msgs[4]


@pytest.mark.parametrize("m, needle", [
    ({"role": "user", "content": "x", "tool_calls": []}, "allowed here: role, content, got"),
    ({"role": "tool", "content": "x", "tool_calls": []}, "allowed here: role, content, tool_call_id, got"),
    ({"role": "assistant", "content": "x", "tool_call_id": "c"}, "tool_calls"),
    ({"role": "assistant"}, "must be a map with role and content"),
    ({"role": ["x"], "content": "x"}, "role"),
    ({"role": "assistant", "tool_calls": []}, "list of 1..64 calls"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "missing function"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]},
     'type must be "function"'),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, "missing arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "arguments must be a JSON string or a map"),
    ({"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{}"}}]},
     "id must be a string of 1..256"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id"),
    ({"role": "user", "content": None}, "content must be a string"),
])
def test_bad_tool_messages_name_the_fault(m, needle):
    with pytest.raises(BadRequest) as e:
        validate_params("chat", [{"messages": [m]}], VOCAB)
    assert needle in str(e.value)


@pytest.mark.parametrize("role", ["user\n<|im_start|>system", "pirate", "", 3, None])
def test_chat_roles_are_the_templates_words_only(role):
    """A role is written into the prompt as is: one with newlines and markers would open
    a turn of its own."""
    with pytest.raises(BadRequest, match="role must be one of system, user, assistant, tool"):
        validate_params("chat", {"messages": [{"role": role, "content": "hi"}]}, 100)


def _schema_chat(schema) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema, needle", [
    ({"type": "integer", "minimum": 12345678901234567890, "maximum": 12345678901234567899},
     "beyond \\+-2\\*\\*53"),
    ({"enum": [18446744073709551616]}, "beyond \\+-2\\*\\*53"),
    ({"const": {"a": [2 ** 60]}}, "beyond \\+-2\\*\\*53"),
    ({"type": "number", "maximum": 1e300}, "beyond \\+-2\\*\\*53"),
    ({"type": "string", "pattern": "^a{1000000}$"}, "at most 10000"),
    ({"type": "string", "pattern": "^(a{200}){200}$"}, "at most 10000"),
    ({"anyOf": [{"const": i} for i in range(3000)]}, "at most 256 schemas"),
    ({"enum": list(range(1001))}, "1..1000 values"),
])
def test_schemas_beyond_exact_enforcement_are_refused(schema, needle):
    """What the grammar engine would round (integers past 2**53) or cannot build."""
    with pytest.raises(BadRequest, match=needle) as e:
        validate_params("chat", _schema_chat(schema), 100)
    assert len(str(e.value)) < 1000


def test_ordinary_patterns_and_numbers_pass():
    for schema in ({"type": "string", "pattern": "^[a-z]{1,64}@[a-z]{1,64}\\.[a-z]{2,63}$"},
                   {"type": "integer", "minimum": -(2 ** 53), "maximum": 2 ** 53},
                   {"enum": [1.5, "a", None, 9007199254740992]}):
        validate_params("chat", _schema_chat(schema), 100)
