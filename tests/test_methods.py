"""service/methods.py: wire params -> engine requests and options, engine results -> wire maps."""
from kestreld.engine.generate import Completion, TokenEvent
from kestreld.engine.prompt import ChatInput, TextInput
from kestreld.engine.sampler import ResponseFormat, SamplingOptions
from kestreld.protocol import validate_params
from kestreld.service.methods import (KINDS, completion_result, engine_request,
                                      sampling_options, token_payload)
from kestreld.protocol import METHODS
from kestreld.text.tools import ToolCall
from kestreld.vision.prompt import ImageFigures


def test_every_method_has_a_kind():
    assert set(KINDS) == set(METHODS)


def test_generate_and_chat_params_become_engine_requests():
    g = validate_params("generate", [{"prompt": "hi", "temperature": 0.5, "stop": ["x"]}], 100)
    assert engine_request(g) == TextInput(text="hi")
    assert sampling_options(g, 64) == SamplingOptions(max_tokens=64, temperature=0.5, stop=("x",))
    g = validate_params("generate", [{"ids": [1, 2], "max_tokens": 3}], 100)
    assert engine_request(g) == TextInput(ids=(1, 2))
    assert sampling_options(g, 64).max_tokens == 3
    c = validate_params("chat", [{"messages": [{"role": "user", "content": "a"}],
                                  "enable_thinking": True}], 100)
    assert engine_request(c) == ChatInput(({"role": "user", "content": "a"},), True)
    c = validate_params("chat", [{"messages": [{"role": "user", "content": "a"}],
                                  "split_reasoning": True}], 100)
    assert engine_request(c).split_reasoning is True


def test_completion_result_map():
    c = Completion(text="ab", ids=[5, 6], finish_reason="length", prompt_tokens=10,
                   cached_tokens=4, cached_source=None, prefill_tokens=6, completion_tokens=2,
                   prefill_ms=30.0, decode_ms=500.0, ttft_ms=35.0, logprobs=None,
                   drafted_tokens=3, accepted_tokens=1)
    m = completion_result(c, queue_ms=1.5, ttft_ms=40.0)
    assert m == {"text": "ab", "ids": [5, 6], "finish_reason": "length",
                 "usage": {"prompt_tokens": 10, "cached_tokens": 4, "cached_source": None,
                           "prefill_tokens": 6, "completion_tokens": 2},
                 "timings": {"queue_ms": 1.5, "prefill_ms": 30.0, "decode_ms": 500.0,
                             "ttft_ms": 40.0, "prefill_tok_s": 200.0, "decode_tok_s": 4.0,
                             "drafted_tokens": 3, "accepted_tokens": 1}}
    lp = [{"id": 5, "logprob": -0.1, "top": [[5, -0.1]]}]
    c.logprobs = lp
    assert completion_result(c, 0, 0)["logprobs"] == lp
    c.cached_source = "disk"
    c.images = ImageFigures(images=2, visual_tokens=40, encoded=1, encode_ms=12.5)
    m = completion_result(c, 0, 0)
    assert m["usage"]["cached_source"] == "disk"
    assert m["usage"]["images"] == 2 and m["usage"]["visual_tokens"] == 40
    assert m["timings"]["encode_ms"] == 12.5
    assert "reasoning" not in m
    c.reasoning = "because"
    assert completion_result(c, 0, 0)["reasoning"] == "because"


def test_token_payload():
    assert token_payload(TokenEvent([3], "a")) == {"text": "a", "ids": [3]}
    assert token_payload(TokenEvent([3], "", None, "hm")) == {"text": "", "ids": [3], "reasoning": "hm"}


def test_tools_response_format_and_penalties_reach_the_engine():
    weather = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    c = validate_params("chat", [{"messages": [{"role": "user", "content": "a"}],
                                  "tools": [weather], "tool_choice": "required",
                                  "response_format": {"type": "json_object"},
                                  "presence_penalty": 0.5, "frequency_penalty": -1}], 100)
    assert engine_request(c) == ChatInput(({"role": "user", "content": "a"},), tools=(weather,),
                                          tool_choice="required")
    assert sampling_options(c, 8) == SamplingOptions(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-1.0,
        response_format=ResponseFormat("json_object"))
    schema = {"type": "array"}
    g = validate_params("generate", [{"prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}], 100)
    assert sampling_options(g, 8).response_format == ResponseFormat("json_schema", schema)
    g = validate_params("generate", [{"prompt": "a", "response_format": {"type": "text"}}], 100)
    assert sampling_options(g, 8).response_format is None


def test_tool_calls_on_the_wire():
    calls = [ToolCall("call_a", "w", '{"city": "Oslo"}'), ToolCall("call_b", "now", "{}")]
    wire = [{"id": "call_a", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    c = Completion(text="", ids=[5, 6], finish_reason="tool_calls", prompt_tokens=10,
                   cached_tokens=0, cached_source=None, prefill_tokens=10, completion_tokens=2,
                   prefill_ms=1.0, decode_ms=1.0, ttft_ms=1.0, tool_calls=calls)
    m = completion_result(c, 0, 0)
    assert m["tool_calls"] == wire and m["finish_reason"] == "tool_calls"
    c.tool_calls = None
    assert "tool_calls" not in completion_result(c, 0, 0)
    assert token_payload(TokenEvent([5], "", tool_calls=calls[:1])) == \
        {"text": "", "ids": [5], "tool_calls": wire[:1]}
    assert "tool_calls" not in token_payload(TokenEvent([5], "x"))
