"""End-to-end over RPC: a real kestreld (SmolLM2), its socket and kestrelctl's client:
forced tool calls ("required", a named function), streamed calls, response_format on
generate and chat, and bad schemas refused while the daemon goes on serving."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from daemon import Daemon
from kestrelctl import KestrelClientError, Result, Token
from test_constraint import ADD, WEATHER

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kt") / "k.sock", "--max-seq", "1024") as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


def _check_calls(calls, names):
    assert calls and [c["function"]["name"] for c in calls] == names
    for c in calls:
        assert c["type"] == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"])
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


def test_named_function_gives_one_valid_call(client):
    for name in ("get_weather", "add"):
        for seed in range(3):
            r = client.chat(ASK, tools=[WEATHER, ADD], seed=seed, temperature=0.8,
                            tool_choice={"type": "function", "function": {"name": name}},
                            max_tokens=120)
            assert r.finish_reason == "tool_calls" and r.text == ""
            _check_calls(r.tool_calls, [name])


def test_required_gives_valid_calls_and_streams_them(client):
    events = list(client.stream_chat(ASK, tools=[WEATHER, ADD], tool_choice="required",
                                     temperature=0.7, seed=7, max_tokens=120))
    result = events[-1]
    assert isinstance(result, Result) and result.tool_calls
    for c in result.tool_calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])
    tokens = [e for e in events if isinstance(e, Token)]
    streamed = [c for t in tokens if t.tool_calls for c in t.tool_calls]
    assert streamed == result.tool_calls                  # each call once, as it completed
    assert "".join(t.text for t in tokens) == result.text
    assert "<tool_call>" not in result.text or result.finish_reason == "length"
    assert sum(len(t.ids) for t in tokens) == len(result.ids)


def test_tools_auto_leaves_the_answer_free(client):
    r = client.chat([{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=8)
    assert r.finish_reason in ("stop", "length") and r.tool_calls is None


def test_response_format_on_generate_and_chat(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "legs"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}
    rf = {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}}
    r = client.chat([{"role": "user", "content": "Name an animal and its legs, as JSON."}],
                    response_format=rf, temperature=0.8, seed=3, max_tokens=100)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), schema)
    primes = {"type": "array", "minItems": 3, "maxItems": 3,
              "items": {"type": "integer", "minimum": 0, "maximum": 100}}
    r = client.generate(prompt="The first three primes as a JSON list:", max_tokens=40,
                        response_format={"type": "json_schema",
                                         "json_schema": {"name": "primes", "schema": primes}})
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), primes)
    # any object has no bound (tests/test_constraint.py has it at length): here, its start
    r = client.generate(prompt="A kestrel, as JSON:", response_format={"type": "json_object"},
                        max_tokens=6)
    assert r.text.lstrip().startswith("{")


def test_bad_schemas_are_bad_requests_and_the_daemon_goes_on(client):
    bad = [({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "text"}}},
            "schema.type must be one of"),                 # caught by protocol.py
           ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/nope"}}},
            "JSON schema cannot be used")]                 # caught by the grammar engine
    for rf, needle in bad:
        with pytest.raises(KestrelClientError) as e:
            client.generate(prompt="x", response_format=rf, max_tokens=4)
        assert e.value.code == "bad_request" and needle in e.value.message
    with pytest.raises(KestrelClientError) as e:
        client.chat(ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "add"}})
    assert e.value.code == "bad_request" and "not in tools" in e.value.message
    assert client.generate(prompt="Hello", max_tokens=2).finish_reason == "length"


def test_a_conversation_with_calls_and_results_goes_on(client):
    """The call and its result sent back (arguments as a JSON string, as OpenAI clients
    do); SmolLM2's template renders the tool turn too."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat(msgs, tools=[WEATHER], max_tokens=8)
    assert r.finish_reason in ("stop", "length") and r.usage["prompt_tokens"] > 20
