"""OpenAI's shapes <-> Kestrel's RPC params and completion maps (service/openai.py), without
a daemon; the daemon through real clients is tests/test_http.py."""
from __future__ import annotations

import base64

import pytest

from kestreld.errors import BadRequest, QueueFull, ShuttingDown
from kestreld.protocol import ChatParams, validate_params
from kestreld.service.openai import Answer, chat_request, completion_request, error_body

MODEL = "m"
USER = [{"role": "user", "content": "Hi"}]
RESULT = {"text": "Paris", "ids": [5, 6], "finish_reason": "stop",
          "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 2},
          "timings": {"ttft_ms": 1.0}, "reasoning": "The user asks.",
          "logprobs": [{"id": 5, "logprob": -0.1, "top": [[5, -0.1], [7, -2.0]]},
                       {"id": 6, "logprob": -0.2, "top": [[6, -0.2], [8, -3.0]]}]}
TOKENS = {5: b"Par", 6: b"is", 7: b" Lyon", 8: b"\xe2\x82"}


def token_bytes(i: int) -> bytes:
    return TOKENS[i]


def test_chat_request_becomes_rpc_chat_params():
    png = b"\x89PNG fake bytes"
    req = chat_request({
        "model": MODEL, "max_tokens": 9, "max_completion_tokens": 5, "stop": "END",
        "temperature": 0.7, "top_p": 0.9, "seed": 3, "top_k": 4, "min_p": 0.1,
        "repeat_penalty": 1.1, "presence_penalty": 0, "user": "ignored", "n": 1,
        "chat_template_kwargs": {"enable_thinking": True},
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "name": "ann", "content": [
                         {"type": "text", "text": "What is this?"},
                         {"type": "image_url", "image_url": {
                             "url": "data:image/png;base64," + base64.b64encode(png).decode()}}]},
                     {"role": "assistant", "content": None}]}, MODEL)
    params = validate_params("chat", req.params, vocab_size=100)
    assert isinstance(params, ChatParams) and params.enable_thinking and params.split_reasoning
    assert params.options == {"max_tokens": 5, "stop": ("END",), "temperature": 0.7,
                              "top_p": 0.9, "seed": 3, "top_k": 4, "min_p": 0.1,
                              "repeat_penalty": 1.1}
    assert params.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ({"type": "text", "text": "What is this?"},
                                     {"type": "image", "data": png})},
        {"role": "assistant", "content": ""})
    assert not req.stream and not req.include_usage and req.top_logprobs is None


def test_features_of_the_engine_branch_are_passed_through_by_name():
    """presence_penalty, response_format, tools: handed to the RPC params as OpenAI names
    them, so the RPC validation decides (refused there until the engine has them)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = chat_request({"messages": USER, "presence_penalty": 0.5, "frequency_penalty": 0.2,
                        "response_format": {"type": "json_object"}, "tools": tools,
                        "tool_choice": "required"}, MODEL)
    assert {k: req.params[k] for k in ("presence_penalty", "frequency_penalty",
                                       "response_format", "tools", "tool_choice")} == {
        "presence_penalty": 0.5, "frequency_penalty": 0.2,
        "response_format": {"type": "json_object"}, "tools": tools, "tool_choice": "required"}
    neutral = chat_request({"messages": USER, "presence_penalty": 0, "frequency_penalty": 0,
                            "response_format": {"type": "text"}, "tools": []}, MODEL)
    assert not {"presence_penalty", "frequency_penalty", "response_format", "tools"} & set(neutral.params)


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": True}, "n"),
    ({"messages": USER, "model": 5}, "model"),
    ({"messages": USER, "logit_bias": {"x1": 5}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"-1": 5}}, "logit_bias"),
    ({"messages": USER, "logit_bias": [1]}, "logit_bias"),
    ({"messages": USER, "stream": 1}, "stream"),
    ({"messages": USER, "stream": True, "stream_options": []}, "stream_options"),
    ({"messages": USER, "logprobs": "yes"}, "logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [3]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,@@"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
     "messages[0].content[0]"),
])
def test_chat_request_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        chat_request(body, MODEL)
    assert e.value.param == param and error_body(e.value)["error"]["param"] == param


def test_another_model_name_is_answered_unless_strict():
    """Clients that hard-code a model name get the loaded model (llama.cpp's behaviour);
    under --strict-model they get OpenAI's model_not_found, unless they name an alias."""
    from kestreld.errors import ModelNotFound
    assert chat_request({"messages": USER, "model": "gpt-4o"}, MODEL).params["messages"]
    served = (MODEL, "qwen3:0.6b")
    assert chat_request({"messages": USER, "model": MODEL}, MODEL, strict=served).n == 1
    assert chat_request({"messages": USER, "model": "qwen3:0.6b"}, MODEL, strict=served).n == 1
    with pytest.raises(ModelNotFound) as e:
        completion_request({"prompt": "x", "model": "gpt-4o"}, MODEL, strict=served)
    assert e.value.http_status == 404 and error_body(e.value)["error"] == {
        "message": e.value.args[0], "type": "not_found_error", "param": "model",
        "code": "model_not_found"}


def test_n_logit_bias_and_parallel_tool_calls_reach_the_rpc_params():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = chat_request({"messages": USER, "n": 3, "logit_bias": {"5": -100, "17": 2.5},
                        "tools": tools, "parallel_tool_calls": False}, MODEL)
    assert req.n == 3 and req.params["logit_bias"] == {5: -100, 17: 2.5}
    params = validate_params("chat", req.params, vocab_size=100)
    assert params.options["logit_bias"] == {5: -100.0, 17: 2.5}
    assert params.parallel_tool_calls is False
    for bias in ({"100": 1}, {"5": 101}, {"5": "x"}):
        with pytest.raises(BadRequest, match="logit_bias"):
            validate_params("chat", chat_request({"messages": USER, "logit_bias": bias},
                                                 MODEL).params, vocab_size=100)


def test_completion_request():
    assert completion_request({"prompt": ["Hi"], "logprobs": 2}, MODEL).params == {
        "prompt": "Hi", "stream": False, "logprobs": 2}
    req = completion_request({"prompt": [[1, 2, 3]], "stream": True,
                              "stream_options": {"include_usage": True}}, MODEL)
    assert req.params["ids"] == [1, 2, 3] and req.stream and req.include_usage
    assert completion_request({"prompt": "x", "logprobs": 0}, MODEL).top_logprobs is None
    for bad, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [True]}, "prompt"),
                       ({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "suffix": "z"}, "suffix"),
                       ({"prompt": "a", "best_of": 2}, "best_of")):
        with pytest.raises(BadRequest) as e:
            completion_request(bad, MODEL)
        assert e.value.param == param


def test_chat_response_shape():
    req = chat_request({"messages": USER, "logprobs": True, "top_logprobs": 1}, MODEL)
    out = Answer(req, MODEL, token_bytes, created=123).response([RESULT])
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["created"] == 123 and out["model"] == MODEL
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Paris",
                                            "reasoning_content": "The user asks."}
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 4}}
    content = out["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Par", "logprob": -0.1, "bytes": list(b"Par"),
                          "top_logprobs": [{"token": "Par", "logprob": -0.1, "bytes": list(b"Par")}]}
    # an incomplete UTF-8 token: replacement character in `token`, the raw bytes in `bytes`
    half = Answer(chat_request({"messages": USER, "logprobs": True, "top_logprobs": 2}, MODEL),
                  MODEL, token_bytes, 0).response([RESULT])["choices"][0]["logprobs"]["content"][1]
    assert half["top_logprobs"][1] == {"token": "\ufffd", "logprob": -3.0, "bytes": [0xe2, 0x82]}


def test_tool_calls_of_the_completion_map_come_back_in_openai_shape():
    """The wire's tool calls (methods.wire_tool_calls) as OpenAI's message and deltas: each
    streamed call with its index among the answer's calls."""
    from kestreld.service.methods import wire_tool_calls
    from kestreld.text.tools import ToolCall
    calls = wire_tool_calls([ToolCall("call_1", "weather", "{\"city\": \"Oslo\"}")])
    req = chat_request({"messages": USER, "stream": True}, MODEL)
    answer = Answer(req, MODEL, token_bytes, 0)
    out = answer.response([dict(RESULT, text="", tool_calls=calls, finish_reason="tool_calls")])
    assert out["choices"][0]["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    for n in range(2):
        (chunk,) = answer.token({"text": "", "ids": [], "tool_calls": calls})
        assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == n


def test_stream_chunks():
    req = chat_request({"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
                       MODEL)
    a = Answer(req, MODEL, token_bytes, 0)
    (first,) = a.opening(0)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert a.token({"text": "", "ids": [1]}) == []           # nothing to show yet
    (think,) = a.token({"text": "", "ids": [2], "reasoning": "hmm"})
    assert think["choices"][0]["delta"] == {"reasoning_content": "hmm"} and think["usage"] is None
    (last,) = a.finish(RESULT)
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    a.opening(1)                                              # the second choice (n = 2)
    (last,) = a.finish(RESULT)
    assert last["choices"][0]["index"] == 1
    (usage,) = a.closing([RESULT, RESULT])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 14
    plain = Answer(chat_request({"messages": USER, "stream": True}, MODEL), MODEL, token_bytes, 0)
    assert plain.closing([RESULT]) == [] and "usage" not in plain.finish(RESULT)[0]
    text = Answer(completion_request({"prompt": "x", "stream": True, "logprobs": 1}, MODEL),
                  MODEL, token_bytes, 0)
    assert text.opening(0) == []
    (first,) = text.token({"text": "Par", "ids": [5], "logprobs": RESULT["logprobs"][:1]})
    (second,) = text.token({"text": "is", "ids": [6], "logprobs": RESULT["logprobs"][1:]})
    assert first["choices"][0]["text"] == "Par" and first["object"] == "text_completion"
    assert second["choices"][0]["logprobs"]["text_offset"] == [3]


def test_error_body_types():
    assert error_body(QueueFull("full"))["error"] == {
        "message": "full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    assert error_body(ShuttingDown("bye"))["error"]["type"] == "unavailable_error"
    assert error_body(BadRequest("x", param="n"))["error"]["param"] == "n"
    # OpenAI's code for a prompt the context cannot hold (the RPC socket keeps its own)
    from kestreld.errors import PromptTooLong
    too_long = PromptTooLong("the prompt has 9000 tokens", param="messages")
    assert too_long.to_wire()["code"] == "prompt_too_long"
    assert error_body(too_long)["error"] == {
        "message": "the prompt has 9000 tokens", "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}
