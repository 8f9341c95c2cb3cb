"""End-to-end: what OpenAI clients really send, through the unmodified `openai` SDK (and
httpx for what the SDK will not send) against the real kestreld: another model's name, a
base URL without /v1, `n`, `logit_bias`, `parallel_tool_calls`, forced calls, OpenAI's
error codes, and the Responses API (service/responses.py) whole and streamed, with tools.

One daemon (SmolLM2, --http on a free loopback port, --max-seq 512 so that a too-long
prompt is cheap to send); the --strict-model test starts its own.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import jsonschema
import openai
import pytest

from daemon import Daemon
from test_constraint import ADD, WEATHER
from test_http import MODEL, QUESTION, assert_error, sse_events

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
# the Responses API's flat function tools
FLAT = [{"type": "function", **WEATHER["function"]}, {"type": "function", **ADD["function"]}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kh") / "k.sock", "--http", "127.0.0.1:0",
                "--max-seq", "512", "--max-queue", "2") as d:
        yield d


def assert_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- chat and completions

def test_another_model_name_and_no_v1(daemon, sdk):
    """A hard-coded model name is answered by the loaded model, which `model` names; the
    same routes answer without /v1 (a base URL given without it)."""
    r = sdk.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=8)
    same = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    assert r.model == MODEL and r.choices[0].message.content == same.choices[0].message.content
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0) as bare:
        assert [m.id for m in bare.models.list()] == [MODEL]
        c = bare.chat.completions.create(model="llama3", messages=QUESTION, max_tokens=8)
        assert c.choices[0].message.content == same.choices[0].message.content
        t = bare.completions.create(model="davinci", prompt="The capital of France is",
                                    max_tokens=4)
        assert t.model == MODEL and t.choices[0].text
        resp = bare.responses.create(model="gpt-4.1", input="What is the capital of France?",
                                     max_output_tokens=8)
        assert resp.model == MODEL and resp.output_text == same.choices[0].message.content


def test_strict_model_refuses_other_names(tmp_path):
    with Daemon(tmp_path / "k.sock", "--http", "127.0.0.1:0", "--strict-model") as d:
        with openai.OpenAI(base_url=d.http_url + "/v1", api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.NotFoundError) as e:
                c.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
            assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
            with pytest.raises(openai.NotFoundError) as e:
                c.responses.create(model="gpt-4o", input="Hi", max_output_tokens=2)
            assert e.value.code == "model_not_found"
            ok = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
            assert ok.choices[0].message.content


def test_n_choices_decode_from_one_prefill(daemon, sdk):
    """n = 3: three choices of one prompt; the prompt is prefilled once and each later
    choice reuses all of it but its last token (the prefix rule); with a seed, choice i is
    the single request with seed + i."""
    r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, n=3,
                                    temperature=1.0, seed=11)
    lines = [ln for ln in daemon.log().splitlines() if "[KV-PREFIX]" in ln][-3:]
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10,
                                           temperature=1.0, seed=11 + i) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content
                                                      for s in singles]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    keep = r.usage.prompt_tokens - 1
    assert all(f"hit keep={keep} prompt={keep + 1} prefill=1" in ln for ln in lines[1:]), lines
    # greedy choices are all the one greedy answer; streamed, each choice has its index
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=2,
                                              stream=True))
    by_index: dict = {}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + (ch.delta.content or "")
    finals = [(ch.index, ch.finish_reason) for c in chunks for ch in c.choices if ch.finish_reason]
    assert [i for i, _ in finals] == [0, 1] and by_index[0] == by_index[1] != ""


def test_logit_bias_bans_and_forces_tokens(daemon, sdk):
    """-100 bans a token: the greedy answer's first token never appears; +100 makes a token
    every token of the answer."""
    first = sdk.completions.create(model=MODEL, prompt="The capital of France is",
                                   max_tokens=6, logprobs=1)
    with daemon.client() as c:
        ids = c.generate("The capital of France is", max_tokens=6).ids
    banned = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                    logit_bias={str(ids[0]): -100})
    with daemon.client() as c:
        again = c.tokenize(banned.choices[0].text)
    assert banned.choices[0].text != first.choices[0].text and ids[0] not in again
    with daemon.client() as c:
        (x,) = c.tokenize(" x")
    forced = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                         logit_bias={str(x): 100})
    assert forced.choices[0].message.content == " x" * 5


def test_parallel_tool_calls_false_gives_one_call(sdk):
    """tool_choice "required" with parallel_tool_calls false: exactly one valid call, the
    answer ends at it (finish_reason tool_calls, no text), over several seeds."""
    for seed in range(4):
        r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD],
                                        tool_choice="required", parallel_tool_calls=False,
                                        temperature=0.9, seed=seed, max_tokens=160)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_calls_end_at_the_calls(sdk):
    """tool_choice "required" (parallel calls allowed) on a model that repeats its calls:
    the answer ends at the first repeat, never at max_tokens with a cut-off block in the
    content; streamed the same."""
    for seed in range(4):
        r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD],
                                        tool_choice="required", temperature=0.9, seed=seed,
                                        max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content and choice.message.tool_calls
        keys = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(set(keys)) == len(keys)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD],
                                              tool_choice="required", max_tokens=300,
                                              stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_prompt_too_long_is_context_length_exceeded(sdk):
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=long, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt="word " * 600, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input="word " * 600, max_output_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "input"


# ---------------------------------------------------------------- the Responses API

def test_responses_whole_equals_chat(sdk):
    """input as text with instructions: the answer of the same chat; as items: the same."""
    chat = sdk.chat.completions.create(
        model=MODEL, max_tokens=12,
        messages=[{"role": "system", "content": "Answer briefly."}] + QUESTION)
    r = sdk.responses.create(model=MODEL, instructions="Answer briefly.",
                             input=QUESTION[0]["content"], max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp") and r.store is False
    assert r.output_text == chat.choices[0].message.content
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    items = sdk.responses.create(model=MODEL, max_output_tokens=12, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": QUESTION[0]["content"]}]}])
    assert items.output_text == r.output_text


def test_responses_stream_event_sequence(sdk):
    """The SDK's event sequence, and its own accumulation of the stream, equal the whole
    answer."""
    whole = sdk.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=24,
                                 temperature=0)
    events = list(sdk.responses.create(model=MODEL, input="Tell me a story.",
                                       max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[len(deltas) + 4:] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    # an answer that ends before the limit: response.completed, which the SDK's stream
    # helper needs (it has no final response after response.incomplete). Asked for one
    # sentence: SmolLM2's greedy answer to the bare question starts with a near tie (top-2
    # logits 0.02 apart) and may run on past the limit.
    ask = QUESTION[0]["content"] + " Answer in one sentence."
    whole = sdk.responses.create(model=MODEL, input=ask, max_output_tokens=64)
    with sdk.responses.stream(model=MODEL, input=ask, max_output_tokens=64) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and text == final.output_text == whole.output_text


def test_responses_function_call_round_trip(sdk):
    """A forced function call comes back as a function_call item; its output goes back as a
    function_call_output item (with the call) and the model answers in text."""
    r = sdk.responses.create(model=MODEL, input="What is 2 + 3?", tools=FLAT,
                             tool_choice={"type": "function", "name": "add"},
                             max_output_tokens=120)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS["add"])
    assert not r.output_text
    follow = sdk.responses.create(model=MODEL, tools=FLAT, max_output_tokens=8, input=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": call.call_id, "name": "add",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]
    # an agent's habit: the previous output items sent back as they came (ids, statuses)
    again = sdk.responses.create(model=MODEL, tools=FLAT, max_output_tokens=8, input=[
        {"role": "user", "content": "What is 2 + 3?"},
        *[i.model_dump(exclude_none=True) for i in r.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        *[i.model_dump(exclude_none=True) for i in follow.output],
        {"role": "user", "content": "Thanks!"}])
    assert again.output_text and again.usage.input_tokens > follow.usage.input_tokens
    # streamed: the call as an item with its arguments' events
    events = list(sdk.responses.create(model=MODEL, input="What is 2 + 3?", tools=FLAT,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=120, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    done = events[-1].response.output
    assert [i.type for i in done] == ["function_call"]
    jsonschema.validate(json.loads(done[0].arguments), PARAMS[done[0].name])


def test_responses_refusals(sdk, http):
    """What the daemon does not do is a clear 400 naming the field."""
    for kwargs, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"background": True}, "background"),
                          ({"input": [{"type": "computer_call_output"}]}, "input")):
        body = {"model": MODEL, "input": "Hi", **kwargs}
        assert_error(http.post("/v1/responses", json=body), 400, "bad_request", param)


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": "Hi", "max_output_tokens": "ten"}, None),
    ({"input": "Hi", "temperature": [1]}, None),
    ({"input": "Hi", "stream": "yes"}, "stream"),
    ({"input": "Hi", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input"),
    ({"input": "Hi", "text": {"format": "json"}}, "text"),
    ({"input": "Hi", "reasoning": "high"}, "reasoning"),
    ({"input": "Hi", "store": "no"}, "store"),
])
def test_hostile_responses_bodies(http, body, param):
    assert_error(http.post("/v1/responses", json=body), 400, "bad_request", param)


def test_hostile_inputs_on_the_new_routes(daemon, http):
    """Malformed JSON, wrong types, a disconnect mid-stream: clear 4xx, the daemon serves on."""
    for path in ("/v1/responses", "/responses", "/chat/completions", "/completions"):
        r = http.post(path, content=b'{"input": "Hi", ',
                      headers={"Content-Type": "application/json"})
        assert_error(r, 400, "bad_request")
        assert_error(http.post(path, json=[1, 2]), 400, "bad_request")
    assert_error(http.get("/responses"), 405, "method_not_allowed")
    assert_error(http.post("/v1/chat/completions", json={"messages": QUESTION, "n": 99}),
                 400, "bad_request", "n")
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": QUESTION, "logit_bias": {"999999": 1}}),
                 400, "bad_request")
    # a client that goes away mid-stream: its job stops; the next request is answered
    host, port = daemon.http_url.removeprefix("http://").split(":")
    body = json.dumps({"input": "Tell me a long story.", "max_output_tokens": 400,
                       "stream": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        assert b"response.output_text.delta" in _read_until(s, b"response.output_text.delta")
    deadline = time.monotonic() + 60
    while "finish=cancelled" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "finish=cancelled" in daemon.log()
    assert_serving(http)


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    s.settimeout(60)
    while marker not in got:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_raw_responses_stream_names_its_events(http):
    """Each SSE event has an `event:` line naming its type, as OpenAI's stream has."""
    with http.stream("POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 3,
                                                    "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        lines = list(r.iter_lines())
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = sse_events([ln for ln in lines if not ln.startswith("event: ")])
    assert names == [d["type"] for d in data] and names[0] == "response.created"
