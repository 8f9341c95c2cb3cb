"""End-to-end: the OpenAI-compatible HTTP API of the real kestreld, through real HTTP clients
(httpx, and the unmodified official `openai` SDK), next to the RPC socket of the same daemon.

One daemon serves the module (SmolLM2, --http on a free loopback port and on a Unix socket,
small prefill chunks, a 64 KiB body limit, --max-queue 1); the API key / CORS, loading and
cancel tests start their own.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon import REPO, Daemon, daemon_env, model_path
from kestreld.service.main import model_id

MAX_MESSAGE = 65536
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
         "named Tomas who repaired nets every morning and told stories every evening. ")
MODEL = model_id(model_path())


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kh")
    with Daemon(tmp / "k.sock", "--http", "127.0.0.1:0", "--http", f"unix:{tmp / 'http.sock'}",
                "--max-queue", "1", "--prefill-chunk", "32",
                "--max-message-bytes", str(MAX_MESSAGE)) as d:
        d.http_socket = str(tmp / "http.sock")
        yield d


def sse_events(lines) -> list:
    """The `data:` payloads of a server-sent event stream, [DONE] included, in order."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def metrics(http: httpx.Client) -> dict:
    """{(sample name, frozen labels): value} from /metrics, read by prometheus_client's parser."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def assert_error(r: httpx.Response, status: int, code: str, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert err["param"] == param and err["message"]
    return err


# ---------------------------------------------------------------- endpoints

def test_health_and_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(http.get("/v1/models/gpt-4"), 404, "model_not_found", "model")


def test_sdk_chat_equals_rpc_chat(daemon, sdk):
    """The unmodified OpenAI SDK gets the answer the RPC socket gives for the same chat."""
    r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    with daemon.client() as c:
        want = c.chat(QUESTION, max_tokens=12)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == want.usage["prompt_tokens"]
    assert r.usage.completion_tokens == want.usage["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_sdk_stream_equals_whole_answer(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_sdk_tool_calls_named_required_and_streamed(sdk):
    """An unmodified OpenAI SDK calls tools: a named tool_choice gives exactly one valid call
    of it (finish_reason "tool_calls"), "required" valid calls, streamed as deltas with their
    index, the whole call in one delta."""
    import jsonschema
    from test_constraint import ADD, WEATHER
    params = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ADD], max_tokens=120,
                                    tool_choice={"type": "function", "function": {"name": "add"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), params["add"])
    # the tool's answer goes back as a `tool` message, rendered by the model's template
    follow = ask + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    again = sdk.chat.completions.create(model=MODEL, messages=follow, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length")
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ADD],
                                              tool_choice="required", temperature=0.7, seed=3,
                                              max_tokens=120, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        jsonschema.validate(json.loads(d.function.arguments), params[d.function.name])


def test_sdk_json_schema_answers_are_valid(sdk):
    """response_format json_schema through the SDK: valid JSON for the schema on every seed
    (sampled at temperature 0.8); json_object: a JSON object; OpenAI's penalties accepted."""
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "legs"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}}
    for seed in range(6):
        r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, response_format=fmt,
                                        temperature=0.8, seed=seed, max_tokens=60,
                                        presence_penalty=0.5, frequency_penalty=0.3)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200,
                                    response_format={"type": "json_object"}, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_raw_sse_stream_shape(http):
    """The wire form itself: `data: {...}` events, chat.completion.chunk objects, [DONE] last,
    no usage chunk unless asked for."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert all(len(e["choices"]) == 1 and "usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_sdk_completions_equal_rpc_generate(daemon, sdk):
    prompt = "The capital of France is"
    r = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=2)
    with daemon.client() as c:
        want = c.generate(prompt=prompt, max_tokens=8, logprobs=2)
    choice = r.choices[0]
    assert choice.text == want.text and r.object == "text_completion"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == want.text
    assert lp.token_logprobs == [e["logprob"] for e in want.logprobs]
    assert all(len(t) == 2 and max(t.values()) == lp.token_logprobs[i]   # greedy: the best one
               for i, t in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    stream = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_completions_take_token_ids(daemon, http):
    with daemon.client() as c:
        ids = c.tokenize("The capital of France is", add_special=True)
        want = c.generate(ids=ids, max_tokens=6)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6}).json()
    assert r["choices"][0]["text"] == want.text


def test_chat_logprobs_in_openai_shape(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and bytes(t.bytes).decode() == t.token
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)  # greedy
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    none = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_prefix_reuse_across_http_turns(daemon, sdk):
    """A chat that resends its history over HTTP reuses the KV of the previous turn (the
    [KV-PREFIX] rule, as over RPC): cached_tokens says how much."""
    history = [{"role": "system", "content": "You are a helpful assistant. " + STORY},
               {"role": "user", "content": "Who is Tomas?"}]
    first = sdk.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    with daemon.client() as c:
        hits = c.status()["prefix"]["hits"]
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "What does he do in the evening?"}]
    second = sdk.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens > 16, (cached, first.usage.prompt_tokens)
    assert cached < second.usage.prompt_tokens
    with daemon.client() as c:
        status = c.status()
    assert status["prefix"]["hits"] == hits + 1
    assert f"[KV-PREFIX] hit keep={cached} prompt={second.usage.prompt_tokens}" in daemon.log()


def test_sampling_parameters(sdk, http):
    counting = "1, 2, 3, 4, 5,"
    stopped = sdk.completions.create(model=MODEL, prompt=counting, max_tokens=20, stop=" 8")
    assert stopped.choices[0].finish_reason == "stop" and " 8" not in stopped.choices[0].text
    assert " 7" in stopped.choices[0].text          # it counted on, and stopped before 8
    listed = sdk.completions.create(model=MODEL, prompt=counting, max_tokens=20, stop=["7", " 8"])
    assert "7" not in listed.choices[0].text and listed.choices[0].finish_reason == "stop"
    sampled = [sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                           temperature=1.5, top_p=0.95, seed=seed,
                                           extra_body={"top_k": 40, "min_p": 0.01,
                                                       "repeat_penalty": 1.1})
               .choices[0].message.content for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 10,
                                                "max_completion_tokens": 3}).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    long = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 30,
                                                   "ignore_eos": True}).json()
    assert long["usage"]["completion_tokens"] == 30
    neutral = http.post("/v1/chat/completions", json={  # OpenAI's neutral values are accepted
        "messages": QUESTION, "max_tokens": 2, "n": 1, "presence_penalty": 0,
        "frequency_penalty": 0, "response_format": {"type": "text"}, "logit_bias": {},
        "user": "someone", "chat_template_kwargs": {"enable_thinking": False}})
    assert neutral.status_code == 200, neutral.text


def test_sdk_errors(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, n=20)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, code, param, needle", [
    ({"messages": []}, "bad_request", "messages", "non-empty"),
    ({"messages": QUESTION, "temperature": "hot"}, "bad_request", None, "temperature"),
    ({"messages": QUESTION, "max_tokens": 0}, "bad_request", None, "max_tokens"),
    ({"messages": QUESTION, "stop": [1]}, "bad_request", None, "stop"),
    ({"messages": QUESTION, "stream": "yes"}, "bad_request", "stream", "stream"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 99}, "bad_request", "top_logprobs", "0..20"),
    ({"messages": [{"role": "user", "content": 5}]}, "bad_request", None, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "http://x/y.png"}}]}]},
     "bad_request", "messages[0].content[0]", "data: URI"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "bad_request", None, "takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "bad_request",
     "messages[0].content[0]", "image_url"),
    ({"messages": QUESTION, "chat_template_kwargs": {"x": 1}}, "bad_request", "chat_template_kwargs", "enable_thinking"),
])
def test_chat_errors(http, body, code, param, needle):
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, code, param)
    assert needle in err["message"]


def test_errors_in_openai_shape(http):
    js = {"Content-Type": "application/json"}
    assert "not valid JSON" in assert_error(
        http.post("/v1/chat/completions", content=b"{nope", headers=js), 400,
        "bad_request")["message"]
    assert_error(http.post("/v1/chat/completions", content=b"\xff\xfe", headers=js), 400,
                 "bad_request")
    assert_error(http.post("/v1/chat/completions", content=b"[" * 60000, headers=js), 400,
                 "bad_request")
    assert_error(http.post("/v1/chat/completions", json=[1, 2]), 400, "bad_request")
    assert_error(http.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "bad_request", "prompt")
    assert_error(http.post("/v1/completions", json={"prompt": "a", "echo": True}), 400, "bad_request", "echo")
    assert_error(http.get("/v1/nothing"), 404, "not_found")
    assert_error(http.delete("/health"), 405, "method_not_allowed")
    assert_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")
    big = {"messages": [{"role": "user", "content": "x" * MAX_MESSAGE}]}
    assert str(MAX_MESSAGE) in assert_error(http.post("/v1/chat/completions", json=big), 413,
                                            "too_large")["message"]
    too_long = {"prompt": "word " * 2000, "max_tokens": 1}
    assert_error(http.post("/v1/completions", json=too_long), 400, "context_length_exceeded",
                 "prompt")


def test_a_stream_that_fails_before_its_first_token_is_a_json_error(http):
    too_long = {"messages": [{"role": "user", "content": "word " * 1000}], "stream": True}
    assert_error(http.post("/v1/chat/completions", json=too_long), 400, "context_length_exceeded",
                 "messages")


# ---------------------------------------------------------------- security

def test_host_header_must_be_loopback(daemon, http):
    """DNS rebinding: a page of evil.example that resolves to 127.0.0.1 sends its own Host."""
    port = daemon.http_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "10.0.0.1", "localhost.evil.example",
                 "[::1]evil.example", "localhost:1@evil.example", "[::1]:1@evil.example",
                 "127.0.0.1 evil.example", "localhost:", "[::1"):
        assert_error(http.get("/health", headers={"Host": host}), 403, "permission_denied")
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"):
        assert http.get("/health", headers={"Host": host}).status_code == 200, host


def test_unix_socket_listener(daemon):
    """`unix:PATH`: created mode 0660 like the RPC socket; no Host check (no browser gets there)."""
    st = os.stat(daemon.http_socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_socket),
                      base_url="http://kestrel") as c:
        assert c.get("/health", headers={"Host": "anything.example"}).json() == {"status": "ok"}
        r = c.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3


def test_no_cors_unless_configured(http):
    port = http.base_url.port
    r = http.get("/health", headers={"Origin": f"http://localhost:{port}"})
    assert r.status_code == 200 and not any(h.startswith("access-control") for h in r.headers)
    assert_error(http.options("/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}),
        405, "method_not_allowed")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1.evil.example",
                                    "http://localhost:1@evil.example", "file://"])
def test_pages_of_other_origins_are_refused(http, origin):
    """CSRF: a page elsewhere makes the browser POST a text/plain or form body (no
    preflight) with its Origin; it is refused before any work, and so is its preflight."""
    for headers, body in (({"Content-Type": "text/plain"}, json.dumps({"messages": QUESTION})),
                          ({"Content-Type": "application/x-www-form-urlencoded"}, "a=b")):
        r = http.post("/v1/chat/completions", content=body, headers={**headers, "Origin": origin})
        assert_error(r, 403, "permission_denied")
        assert "is not allowed" in r.json()["error"]["message"]
    assert_error(http.get("/v1/models", headers={"Origin": origin}), 403, "permission_denied")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_bodies_must_be_declared_json(daemon, content_type):
    """What a page may send without a preflight is refused even without an Origin
    (415), and no work is done; application/json (with a charset) is served."""
    host, port = daemon.http_url[len("http://"):].rsplit(":", 1)
    body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
    head = b"" if content_type is None else b"Content-Type: %s\r\n" % content_type.encode()
    reply = _raw(daemon, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n" + head
                 + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    assert reply.startswith(b"HTTP/1.1 415") and b'"unsupported_media_type"' in reply, reply[:300]
    with httpx.Client(base_url=daemon.http_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", content=body,
                      headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key_and_cors(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    origin = "http://app.example"
    with Daemon(tmp_path / "k.sock", "--http", "127.0.0.1:0", "--http-api-key-file",
                str(key_file), "--http-cors-origin", origin) as d, \
            httpx.Client(base_url=d.http_url, timeout=60) as http:
        assert http.get("/health").status_code == 200          # monitoring needs no key
        assert_error(http.get("/v1/models"), 401, "unauthorized")
        assert_error(http.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
        assert_error(http.get("/v1/models", headers={"Authorization": "s3cret-key"}), 401, "unauthorized")
        good = {"Authorization": "Bearer s3cret-key"}
        assert http.get("/v1/models", headers=good).status_code == 200
        sdk = openai.OpenAI(base_url=d.http_url + "/v1", api_key="s3cret-key", max_retries=0)
        assert sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=d.http_url + "/v1", api_key="nope", max_retries=0).models.list()
        pre = http.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = http.get("/v1/models", headers={**good, "Origin": origin})
        assert r.headers["access-control-allow-origin"] == origin
        other = http.get("/v1/models", headers={**good, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_remote_addresses_are_refused_unless_allowed(tmp_path):
    for address in ("0.0.0.0:8080", "192.168.1.2:80", "example.com:80", "[::]:80"):
        out = subprocess.run([sys.executable, "-m", "kestreld", "--http", address,
                              "--socket", str(tmp_path / "k.sock"), "--config", os.devnull],
                             cwd=REPO, env=daemon_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "not a loopback address" in out.stderr, out.stderr


# ---------------------------------------------------------------- metrics

def test_metrics_count_what_was_sent(daemon, http, sdk):
    """Parsed with prometheus_client's own parser; RPC requests are counted too."""
    def value(m, name, **labels):
        return m.get((name, frozenset(labels.items())), 0.0)

    before = metrics(http)
    replies = [sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=n)
               for n in (3, 5)]
    with daemon.client() as c:
        rpc = c.generate(prompt="Hello there", max_tokens=4)
        status = c.status()
    http.post("/v1/chat/completions", json={"messages": QUESTION, "n": 30})   # a 400
    after = metrics(http)
    chat = dict(transport="http", endpoint="/v1/chat/completions")
    finished = {r.choices[0].finish_reason for r in replies}
    assert sum(value(after, "kestrel_requests_total", result=f, **chat)
               - value(before, "kestrel_requests_total", result=f, **chat) for f in finished) == 2
    assert value(after, "kestrel_requests_total", transport="rpc", endpoint="generate",
                 result=rpc.finish_reason) - value(before, "kestrel_requests_total", transport="rpc",
                                                   endpoint="generate", result=rpc.finish_reason) == 1
    sent = replies + [rpc]
    for name, got in (("kestrel_prompt_tokens_total", [r.usage.prompt_tokens for r in replies] + [rpc.usage["prompt_tokens"]]),
                      ("kestrel_generated_tokens_total", [r.usage.completion_tokens for r in replies] + [rpc.usage["completion_tokens"]]),
                      ("kestrel_cached_tokens_total", [r.usage.prompt_tokens_details.cached_tokens for r in replies] + [rpc.usage["cached_tokens"]])):
        assert value(after, name) - value(before, name) == sum(got), name
    for name in ("kestrel_prefill_seconds_count", "kestrel_decode_seconds_count", "kestrel_ttft_seconds_count"):
        assert value(after, name) - value(before, name) == len(sent), name
    assert value(after, "kestrel_ttft_seconds_sum") > value(before, "kestrel_ttft_seconds_sum")
    assert value(after, "kestrel_http_responses_total", path="/v1/chat/completions", status="400") \
        - value(before, "kestrel_http_responses_total", path="/v1/chat/completions", status="400") == 1
    assert value(after, "kestrel_kv_arena_bytes") == status["kv_arena_bytes"]
    assert value(after, "kestrel_max_seq_tokens") == status["max_seq"] == 512
    assert value(after, "kestrel_prefix_hits_total") == status["prefix"]["hits"]
    assert value(after, "kestrel_prefix_misses_total") == status["prefix"]["misses"]
    mem = status["kv_memory"]                     # the KV store's memory tier, on by default
    assert value(after, "kestrel_kv_store_max_bytes", tier="memory") == mem["max_bytes"] > 0
    assert value(after, "kestrel_kv_store_hits_total", tier="memory") >= mem["hits"]
    assert ("kestrel_kv_store_bytes", frozenset({("tier", "disk")})) not in after   # no --disk-kv
    assert value(after, "kestrel_busy") == 0 and value(after, "kestrel_queue_depth") == 0
    assert value(after, "kestrel_rss_bytes") > 50e6
    copied = ("kestrel_experts_copied_bytes", frozenset())
    assert copied in after and after[copied] == 0                       # a dense model


# ---------------------------------------------------------------- hostile HTTP

def _raw(daemon, data: bytes, read: bool = True) -> bytes:
    """Send bytes on a fresh TCP connection; what comes back until the server closes."""
    host, port = daemon.http_url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
        return out


def assert_serving(http):
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_hostile_http_leaves_the_daemon_serving(daemon, http):
    # a body shorter than its Content-Length, then the connection closed
    _raw(daemon, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"messages\": [", read=False)
    # a header far beyond aiohttp's line limit: refused with 400 (aiohttp's own, not JSON);
    # a thousand headers: refused, or the connection closed
    huge = _raw(daemon, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n")
    assert huge.split(b"\r\n")[0].endswith(b" 400 Bad Request"), huge[:100]
    many = _raw(daemon, b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                + b"".join(b"X-%d: y\r\n" % i for i in range(1000)) + b"\r\n")
    assert many == b"" or many.split(b"\r\n")[0].endswith(b" 400 Bad Request"), many[:100]
    # garbage, a bad request line, a bad chunked body
    assert b" 400 " in _raw(daemon, b"\x16\x03\x01\x02\x00hello\r\n\r\n").split(b"\r\n")[0]
    bad_chunk = _raw(daemon, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n")
    assert b" 400 " in bad_chunk.split(b"\r\n")[0], bad_chunk[:100]
    # a body that lies about its size and a Content-Length beyond the limit
    over = _raw(daemon, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: 99999999\r\n\r\n" + b"x" * 70000)
    assert over.startswith(b"HTTP/1.1 413") and b'"too_large"' in over, over[:300]
    assert_serving(http)


def test_slow_clients_do_not_hold_the_daemon(daemon, http):
    """Slowloris: connections that send headers or bodies a byte at a time stay open while
    other clients are served."""
    host, port = daemon.http_url[len("http://"):].rsplit(":", 1)
    slow = []
    try:
        for i in range(20):
            s = socket.create_connection((host, int(port)), timeout=30)
            if i % 2:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                          b"Content-Length: 500\r\n\r\n{\"mess")
            else:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
            slow.append(s)
        for _ in range(3):
            for s in slow:
                s.sendall(b"a")
            assert_serving(http)
    finally:
        for s in slow:
            s.close()
    assert_serving(http)


# ---------------------------------------------------------------- cancel on disconnect

def _stream_request(host: str, port: int, body: dict) -> socket.socket:
    s = socket.create_connection((host, port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def _wait_for(what: str, predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A daemon with room for a long prefill in small chunks, for the cancel tests."""
    tmp = tmp_path_factory.mktemp("kc")
    with Daemon(tmp / "k.sock", "--http", "127.0.0.1:0", "--max-seq", "2048",
                "--prefill-chunk", "16", "--max-queue", "2") as d:
        yield d


def _cancelled_lines(d: Daemon) -> list:
    return [line for line in d.log().splitlines()
            if "request conn=0 " in line and "finish=cancelled" in line]


def test_disconnect_mid_stream_cancels(big):
    host, port = big.http_url[len("http://"):].rsplit(":", 1)
    s = _stream_request(host, int(port), {"messages": QUESTION, "max_tokens": 1500,
                                          "ignore_eos": True, "stream": True})
    seen = b""
    while seen.count(b"data: ") < 5:               # tokens are flowing
        seen += s.recv(65536)
    before = len(_cancelled_lines(big))
    s.close()
    _wait_for("the cancel", lambda: len(_cancelled_lines(big)) > before)
    line = _cancelled_lines(big)[-1]
    completion = int(line.split(" completion=")[1].split()[0])
    assert 0 < completion < 1500, line
    with big.client() as c:
        assert c.status()["busy"] is False
        assert c.generate(prompt="Hi", max_tokens=3).usage["completion_tokens"] == 3


def test_disconnect_mid_prefill_cancels(big):
    """An 800-token prompt in chunks of 16: the client leaves during the prefill and the
    request stops before its first token."""
    host, port = big.http_url[len("http://"):].rsplit(":", 1)
    prompt = [{"role": "user", "content": STORY * 24}]
    before = len(_cancelled_lines(big))
    s = _stream_request(host, int(port), {"messages": prompt, "max_tokens": 4})
    with big.client() as c:
        _wait_for("the prefill to start", lambda: c.status()["busy"])
    s.close()
    _wait_for("the cancel", lambda: len(_cancelled_lines(big)) > before)
    line = _cancelled_lines(big)[-1]
    assert " completion=0 " in line and " prompt=799 " in line, line
    with big.client() as c:
        assert c.status()["busy"] is False
        assert c.generate(prompt="Hi", max_tokens=2).usage["completion_tokens"] == 2


def test_disconnect_while_queued_forgets_the_request(big):
    host, port = big.http_url[len("http://"):].rsplit(":", 1)
    with httpx.Client(base_url=big.http_url, timeout=120) as http, big.client() as c:
        before = metrics(http)
        running = _stream_request(host, int(port), {"messages": QUESTION, "max_tokens": 600,
                                                    "ignore_eos": True, "stream": True})
        _wait_for("the first request to run", lambda: c.status()["busy"])
        queued = _stream_request(host, int(port), {"messages": QUESTION, "max_tokens": 600})
        _wait_for("the second request to queue", lambda: c.status()["queued"] == 1)
        queued.close()
        _wait_for("the queued request to go", lambda: c.status()["queued"] == 0)
        assert c.status()["busy"] is True             # the first one runs on
        running.close()
        _wait_for("the running request to stop", lambda: not c.status()["busy"])
        after = metrics(http)
        key = ("kestrel_requests_total", frozenset(dict(
            transport="http", endpoint="/v1/chat/completions", result="cancelled").items()))
        assert after.get(key, 0) - before.get(key, 0) == 2
        assert c.generate(prompt="Hi", max_tokens=2).usage["completion_tokens"] == 2


# ---------------------------------------------------------------- life cycle

def test_health_is_503_while_loading_and_sigterm_stops_the_load(tmp_path):
    """The HTTP listener is up before the model is loaded: a model path that blocks (a FIFO
    nobody writes) keeps the daemon loading; /health says 503, requests too, no READY; SIGTERM
    then exits 0 at once and removes the HTTP socket file."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    sock = tmp_path / "http.sock"
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kestreld", "--model", str(fifo),
                                 "--socket", str(tmp_path / "k.sock"), "--http", f"unix:{sock}",
                                 "--config", os.devnull], cwd=REPO, env=daemon_env(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("the HTTP socket", sock.exists)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://k") as c:
            assert_error(c.get("/health"), 503, "loading")
            assert_error(c.post("/v1/chat/completions", json={"messages": QUESTION}), 503, "loading")
        assert not (tmp_path / "k.sock").exists()        # the RPC socket waits for the model
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sock.exists() and "stopped during the model load" in log.read_text()
