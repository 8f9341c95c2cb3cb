"""The Responses API's shapes <-> Kestrel's RPC chat params and completion maps
(service/responses.py), without a daemon; through the daemon and the unmodified openai SDK:
tests/test_http_habits.py."""
from __future__ import annotations

import pytest

from kestreld.errors import BadRequest, ModelNotFound
from kestreld.protocol import ChatParams, validate_params
from kestreld.service.responses import ResponseAnswer, responses_request

MODEL = "m"
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": "{\"x\": 1, \"y\": 2}"}}
RESULT = {"text": "Paris", "ids": [5, 6], "finish_reason": "stop", "reasoning": "Think.",
          "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 2},
          "timings": {}}
ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}}


def test_input_items_become_chat_messages():
    req = responses_request({
        "model": "gpt-4.1", "instructions": "Be brief.", "max_output_tokens": 7,
        "temperature": 0.5, "tools": [ADD], "tool_choice": {"type": "function", "name": "add"},
        "parallel_tool_calls": False, "store": True, "metadata": {"k": "v"},
        "reasoning": {"effort": "low"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "1 + 2?"}]},
                  {"type": "reasoning", "summary": []},
                  {"type": "function_call", "call_id": "call_1", "name": "add",
                   "arguments": "{\"x\": 1, \"y\": 2}"},
                  {"type": "function_call", "call_id": "call_2", "name": "add",
                   "arguments": "{\"x\": 3, \"y\": 4}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "3"},
                  {"type": "function_call_output", "call_id": "call_2",
                   "output": [{"type": "input_text", "text": "7"}]}]}, MODEL)
    params = validate_params("chat", req.params, vocab_size=100)
    assert isinstance(params, ChatParams) and params.enable_thinking and params.split_reasoning
    assert params.options == {"max_tokens": 7, "temperature": 0.5}
    assert params.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert not params.parallel_tool_calls
    assert params.tools[0]["function"]["name"] == "add"
    roles = [m["role"] for m in params.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in params.messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert params.messages[4] == {"role": "tool", "content": ({"type": "text", "text": "7"},),
                                  "tool_call_id": "call_2"}
    assert req.prompt_param == "input" and req.echo["instructions"] == "Be brief."
    assert responses_request({"input": "Hi"}, MODEL).params["messages"] == [
        {"role": "user", "content": "Hi"}]
    fmt = responses_request({"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": {"type": "object"}}}}, MODEL)
    assert fmt.params["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}


def test_refusals_name_the_field():
    for body, param in (({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "Hi", "tools": [{"type": "file_search"}]}, "tools"),
                        ({"input": "Hi", "bogus": 1}, "bogus"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
                        ({"input": "Hi", "background": True}, "background"),
                        ({"input": None}, "input")):
        with pytest.raises(BadRequest) as e:
            responses_request(body, MODEL)
        assert e.value.param == param
    with pytest.raises(ModelNotFound):
        responses_request({"input": "Hi", "model": "gpt-4.1"}, MODEL, strict=(MODEL,))


def test_whole_response_items():
    req = responses_request({"input": "Hi", "tools": [ADD]}, MODEL)
    out = ResponseAnswer(req, MODEL, None, 123).response([dict(RESULT, tool_calls=[CALL])])
    assert out["object"] == "response" and out["status"] == "completed" and not out["store"]
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert out["output"][1]["content"][0]["text"] == "Paris"
    assert {k: out["output"][2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_1", "name": "add", "arguments": "{\"x\": 1, \"y\": 2}"}
    assert out["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                            "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 12}
    cut = ResponseAnswer(req, MODEL, None, 0).response([dict(RESULT, finish_reason="length")])
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_events_follow_openais_sequence():
    a = ResponseAnswer(responses_request({"input": "Hi", "stream": True}, MODEL), MODEL, None, 0)
    events = a.opening(0)
    events += a.token({"text": "", "ids": [1], "reasoning": "Hm"})
    events += a.token({"text": "", "ids": [2], "reasoning": "m."})
    events += a.token({"text": "\n\n", "ids": [3]})          # blanks before the text: no item
    events += a.token({"text": "Par", "ids": [4]})
    events += a.token({"text": "is", "ids": [5]})
    events += a.token({"text": "", "ids": [], "tool_calls": [CALL]})
    events += a.finish(dict(RESULT, text="Paris", reasoning="Hmm.", tool_calls=[CALL]))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == "Paris" and text_done["output_index"] == 1
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hmm."
    assert all(i["status"] == "completed" for i in final["output"])
    failed = ResponseAnswer(responses_request({"input": "Hi"}, MODEL), MODEL, None, 0)
    failed.opening(0)
    failed.token({"text": "Hi", "ids": [1]})
    *closed, last = failed.failure(BadRequest("boom"))
    assert [e["type"] for e in closed][-1] == "response.output_item.done"
    assert last["type"] == "response.failed" and last["response"]["error"] == {
        "code": "bad_request", "message": "boom"}
