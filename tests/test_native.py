"""End-to-end: Ollama's native API (through the unmodified `ollama` client, driven as Home
Assistant's integration drives it) and llama.cpp server's native endpoints (through httpx)
on the real kestreld, next to its RPC socket, with hostile inputs on every new route.

One daemon serves the module (SmolLM2, --alias qwen3-vl:2b, a 64 KiB body limit); the
thinking and API-key test starts its own on the scripted Qwen3 model (tests/scripted_model.py).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import jsonschema
import ollama
import pytest

import modelgen_vl
import scripted_model
from daemon import Daemon

ALIAS = "qwen3-vl:2b"
MAX_MESSAGE = 65536
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
         "named Tomas who repaired nets every morning.")
# Home Assistant's shape of a tool (its LLM API's intents, as its Ollama integration sends them)
HASS_TOOL = {"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on/opens a device or entity",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string"}, "area": {"type": "string"},
        "domain": {"type": "array", "items": {"type": "string"}}}, "required": []}}}


ROUTES = [("GET", "/"), ("GET", "/api/version"), ("GET", "/api/tags"), ("GET", "/api/ps"),
          ("POST", "/api/show"), ("POST", "/api/chat"), ("POST", "/api/generate"),
          ("POST", "/api/pull"), ("POST", "/api/embed"), ("DELETE", "/api/delete"),
          ("POST", "/completion"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/props"), ("GET", "/slots"), ("POST", "/apply-template")]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kn") / "k.sock", "--http", "127.0.0.1:0",
                "--alias", ALIAS, "--max-queue", "2",
                "--max-message-bytes", str(MAX_MESSAGE)) as d:
        yield d


@pytest.fixture
def client(daemon):
    return ollama.Client(host=daemon.http_url, timeout=120)


def own_name(client) -> str:
    return client.list().models[0].model


def assert_idle_and_serving(daemon) -> None:
    with daemon.client() as c:
        deadline = time.monotonic() + 60
        while c.status()["busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["busy"] is False and c.status()["queued"] == 0
        assert c.generate(prompt="Hi", max_tokens=2).usage["completion_tokens"] == 2


# ---------------------------------------------------------------- Ollama, as apps use it

def test_probe_version_list_show_ps(daemon, client, http):
    assert http.get("/").text == "Ollama is running"
    assert http.head("/").status_code == 200
    assert http.get("/api/version").json()["version"].count(".") == 2
    names = [m.model for m in client.list().models]
    assert names[0].endswith(":latest") and names[1] == ALIAS
    with daemon.client() as c:
        status = c.status()
    listed = client.list().models[1]
    assert listed.size == status["model"]["file_bytes"]
    assert listed.details.quantization_level == status["model"]["source_dtype"].upper()
    shown = client.show(ALIAS)
    arch = status["model"]["arch"]
    assert shown.modelinfo["general.architecture"] == arch
    assert shown.modelinfo[f"{arch}.context_length"] == status["model"]["context_length"]
    assert shown.details.family == arch and shown.details.parameter_size == "135M"
    assert "im_start" in shown.template and "completion" in shown.capabilities
    loaded = {m.model: m for m in client.ps().models}
    assert loaded[ALIAS].context_length == 512
    assert loaded[ALIAS].size == status["model"]["file_bytes"] + status["kv_arena_bytes"]


def test_home_assistant_flow(daemon, client):
    """tags -> pull if missing -> ps -> chat streamed with keep_alive, options.num_ctx,
    think and tools, as Home Assistant's Ollama integration does; then the same chat
    whole gives the same greedy answer and counters."""
    if ALIAS not in [m.model for m in client.list().models]:
        pytest.fail("the alias must be listed: Home Assistant would try to download it")
    progress = list(client.pull(ALIAS, stream=True))
    assert progress[-1].status == "success"
    assert progress[1].completed == progress[1].total > 0
    assert ALIAS in [m.model for m in client.ps().models]
    kwargs = dict(model=ALIAS, messages=QUESTION, tools=[HASS_TOOL], keep_alive="-1s",
                  options={"num_ctx": 8192, "num_predict": 12}, think=False)
    chunks = list(client.chat(stream=True, **kwargs))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    last = chunks[-1]
    text = "".join(c.message.content or "" for c in chunks)
    assert text and last.done_reason in ("stop", "length")
    assert last.eval_count == 12 or last.done_reason == "stop"
    assert last.prompt_eval_count > 20 and last.eval_duration > 0
    assert last.total_duration >= last.prompt_eval_duration + last.eval_duration
    whole = client.chat(stream=False, **kwargs)
    assert whole.message.content == text and whole.eval_count == last.eval_count
    assert "options.num_ctx 8192 is above the context of 512 tokens" in daemon.log()


def test_async_client_and_the_default_stream(daemon, client, http):
    """Home Assistant's client is the AsyncClient; a body without `stream` is streamed as
    NDJSON, one JSON object a line (Ollama's default)."""
    kwargs = dict(model=ALIAS, messages=QUESTION, options={"num_predict": 6}, keep_alive=-1)

    async def run():
        c = ollama.AsyncClient(host=daemon.http_url)
        return "".join([part.message.content async for part in await c.chat(stream=True,
                                                                            **kwargs)])
    text = asyncio.run(run())
    assert text == client.chat(**kwargs).message.content
    with http.stream("POST", "/api/chat", json={"model": ALIAS, "messages": QUESTION,
                                                "options": {"num_predict": 6}}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        objects = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(o["message"]["content"] for o in objects) == text
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]


def test_chat_answers_as_the_rpc_chat_does(daemon, client):
    """The same request over Ollama's API and the RPC socket: the same greedy text."""
    r = client.chat(model=own_name(client), messages=QUESTION, options={"num_predict": 10})
    with daemon.client() as c:
        rpc = c.chat(messages=QUESTION, max_tokens=10)
    assert r.message.content == rpc.text and r.eval_count == rpc.usage["completion_tokens"]
    assert r.prompt_eval_count == rpc.usage["prompt_tokens"]


def test_format_json_schema_and_json(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 16}}}
    r = client.chat(model=ALIAS, messages=QUESTION, format=schema,
                    options={"num_predict": 60, "temperature": 0.8, "seed": 1})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model=ALIAS, prompt="Describe a cat as JSON.", format="json",
                        options={"num_predict": 120})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)


def test_tool_turns_in_ollama_shape_are_rendered(client):
    """A conversation holding a call (arguments as an object) and its result is accepted
    and prompts the model with both: the prompt grows by their tokens."""
    base = client.chat(model=ALIAS, messages=QUESTION, tools=[HASS_TOOL],
                       options={"num_predict": 1})
    turns = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}}]},
        {"role": "tool", "content": "the kitchen light is on", "tool_name": "HassTurnOn"}]
    r = client.chat(model=ALIAS, messages=turns, tools=[HASS_TOOL], options={"num_predict": 4})
    assert r.prompt_eval_count > base.prompt_eval_count + 10


def test_generate_templated_raw_and_load(daemon, client):
    templated = client.generate(model=ALIAS, prompt=QUESTION[0]["content"],
                                options={"num_predict": 8})
    chat = client.chat(model=ALIAS, messages=QUESTION, options={"num_predict": 8})
    assert templated.response == chat.message.content
    raw = client.generate(model=ALIAS, prompt="Once upon a time", raw=True,
                          options={"num_predict": 8, "stop": ["\n"]})
    with daemon.client() as c:
        rpc = c.generate(prompt="Once upon a time", max_tokens=8, stop=["\n"])
    assert raw.response == rpc.text
    streamed = "".join(c.response for c in client.generate(
        model=ALIAS, prompt="Once upon a time", raw=True, stream=True,
        options={"num_predict": 8, "stop": ["\n"]}))
    assert streamed == rpc.text
    assert client.generate(model=ALIAS).done_reason == "load"
    assert client.generate(model=ALIAS, keep_alive=0).done_reason == "unload"
    assert client.chat(model=ALIAS, messages=QUESTION, keep_alive=0,
                       options={"num_predict": 2}).eval_count == 2      # still loaded


def test_errors_in_ollama_shape(client, http):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2:3b", messages=QUESTION)
    assert (e.value.status_code, e.value.error) == (404, "model 'llama3.2:3b' not found")
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull("llama3.2:3b", stream=True))
    assert e.value.status_code == 404 and "downloads" in e.value.error
    assert "--alias llama3.2:3b" in e.value.error
    for call in (lambda: client.delete(ALIAS), lambda: client.copy(ALIAS, "x"),
                 lambda: client.create("x", from_=ALIAS), lambda: client.push(ALIAS)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "serves the one model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=ALIAS, input="hi")          # a chat model: no pooling
    assert e.value.status_code == 400 and "--pooling" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=ALIAS, messages=QUESTION, options={"top_p": 5})
    assert e.value.status_code == 400 and "top_p" in e.value.error
    for method, path in ROUTES:
        r = http.request(method, path, json={"model": ALIAS, "messages": QUESTION},
                         headers={"Host": "evil.example"})
        assert r.status_code == 403 and "loopback" in r.text, (path, r.text)
    r = http.get("/api/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


def test_thinking_and_api_key_on_a_scripted_qwen3(tmp_path):
    """think and message.thinking on a model whose greedy answers are known; with an API
    key, the client sends it as Ollama's (Bearer) and without it gets 401."""
    key = tmp_path / "key"
    key.write_text("k3y\n")
    model = scripted_model.write(tmp_path / "scripted.gguf")
    with Daemon(tmp_path / "s.sock", "--http", "127.0.0.1:0", "--http-api-key-file", str(key),
                model=str(model)) as d:
        c = ollama.Client(host=d.http_url, headers={"Authorization": "Bearer k3y"})
        name = own_name(c)
        hi = [{"role": "user", "content": "Hello!"}]
        r = c.chat(model=name, messages=hi, think=True)
        assert (r.message.thinking, r.message.content) == (scripted_model.THOUGHT,
                                                           scripted_model.ANSWER)
        chunks = list(c.chat(model=name, messages=hi, think=True, stream=True))
        assert "".join(x.message.thinking or "" for x in chunks) == scripted_model.THOUGHT
        assert "".join(x.message.content for x in chunks) == scripted_model.ANSWER
        r = c.chat(model=name, messages=hi, think=False)
        assert (r.message.thinking, r.message.content) == (None, scripted_model.PLAIN)
        g = c.generate(model=name, prompt="Hello!", think=True)
        assert (g.thinking, g.response) == (scripted_model.THOUGHT, scripted_model.ANSWER)
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=d.http_url).list()
        assert e.value.status_code == 401 and "API key" in e.value.error
        for method, path in ROUTES:
            r = httpx.request(method, d.http_url + path, json={})
            assert r.status_code == 401, (path, r.text)
        r = httpx.get(d.http_url + "/props", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.json()["chat_template"] == scripted_model.CHAT_TEMPLATE


def test_images_reach_a_qwen3_vl_model(tmp_path):
    """Ollama's base64 `images` (the client encodes the bytes) on a generated Qwen3-VL: the
    same answer and prompt as the RPC chat with the image's bytes; a model without vision
    answers 400 (the module's daemon)."""
    gen = modelgen_vl.generate(tmp_path / "model")
    picture = modelgen_vl.test_image(1, 100, 75)
    with Daemon(tmp_path / "v.sock", "--http", "127.0.0.1:0", "--cache-dir",
                str(tmp_path / "cache"), model=str(gen.dir)) as d:
        c = ollama.Client(host=d.http_url)
        name = own_name(c)
        assert "vision" in c.show(name).capabilities
        r = c.chat(model=name, messages=[{"role": "user", "content": "What is this?",
                                          "images": [picture]}], options={"num_predict": 4})
        with d.client() as rpc:
            want = rpc.chat(messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image", "data": picture}]}],
                max_tokens=4)
        assert (r.message.content, r.prompt_eval_count) == (want.text,
                                                            want.usage["prompt_tokens"])
        assert want.usage["images"] == 1
        g = c.generate(model=name, prompt="What is this?", images=[picture],
                       options={"num_predict": 4})
        assert (g.response, g.prompt_eval_count) == (r.message.content, r.prompt_eval_count)


def test_images_to_a_model_without_vision_are_refused(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=ALIAS, messages=[{"role": "user", "content": "What is this?",
                                            "images": [modelgen_vl.test_image(1, 8, 8)]}])
    assert e.value.status_code == 400 and "takes no images" in e.value.error


# ---------------------------------------------------------------- llama.cpp's endpoints

def test_completion_whole_and_streamed(daemon, http):
    prompt = STORY      # longer than --prefix-min: the repeat reuses its KV
    body = {"prompt": prompt, "n_predict": 8, "return_tokens": True, "n_probs": 2}
    r = http.post("/completion", json=body).json()
    with daemon.client() as c:
        rpc = c.generate(prompt=prompt, max_tokens=8)
    assert (r["content"], r["tokens"], r["tokens_predicted"]) == (rpc.text, rpc.ids, 8)
    assert r["stop"] is True and r["stop_type"] == "limit" and r["id_slot"] == 0
    assert r["generation_settings"]["n_ctx"] == 512
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == rpc.ids and all(len(p["top_logprobs"]) == 2 for p in probs)
    again = http.post("/completion", json=body).json()["timings"]
    assert again["cache_n"] + again["prompt_n"] == r["tokens_evaluated"]
    assert again["cache_n"] > 0 and again["predicted_n"] == 8
    with http.stream("POST", "/completion", json=dict(body, stream=True)) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    events = [json.loads(line[len("data: "):]) for line in lines]
    assert all(line.startswith("data: ") for line in lines)
    assert "".join(e["content"] for e in events) == rpc.text
    assert [t for e in events[:-1] for t in e["tokens"]] == rpc.ids
    assert events[-1]["stop"] is True and "timings" in events[-1]
    assert all(e["stop"] is False for e in events[:-1])


def test_tokenize_detokenize_props_slots_apply_template(daemon, client, http):
    with daemon.client() as c:
        ids = c.tokenize(text="Hello world, café")
    r = http.post("/tokenize", json={"content": "Hello world, café"}).json()
    assert r == {"tokens": ids}
    pieces = http.post("/tokenize", json={"content": "Hello world, café",
                                          "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] if isinstance(p["piece"], str) else bytes(p["piece"]).decode(
        "latin-1") for p in pieces).startswith("Hello world, ")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {
        "content": "Hello world, café"}
    props = http.get("/props").json()
    assert props["total_slots"] == 1 and props["model_path"] == daemon.model
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert "im_start" in props["chat_template"]
    slots = http.get("/slots").json()
    assert len(slots) == 1 and slots[0]["id"] == 0 and slots[0]["is_processing"] is False
    assert http.post("/slots").status_code == 405
    prompt = http.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and QUESTION[0]["content"] in prompt
    chat = client.chat(model=ALIAS, messages=QUESTION, options={"num_predict": 1})
    assert len(http.post("/tokenize", json={"content": prompt}).json()["tokens"]) == \
        chat.prompt_eval_count


# ---------------------------------------------------------------- hostile inputs

JSON = {"Content-Type": "application/json"}     # a body of any other type is refused (CSRF)
POSTS = ["/api/chat", "/api/generate", "/api/show", "/api/pull", "/completion", "/tokenize",
         "/detokenize", "/apply-template"]


@pytest.mark.parametrize("path", POSTS)
def test_hostile_bodies_get_a_clear_4xx(daemon, http, path):
    ollama_route = path.startswith("/api/")

    def message(r: httpx.Response) -> str:
        err = r.json()["error"]
        assert isinstance(err, str) == ollama_route, err     # each API's own shape
        return err if ollama_route else err["message"]

    bad = [b"{not json", b'{"model": "x"}\n{"model": "y"}\n', b"[]", b"null", b'"text"',
           b'{"model": ' * 5000, "\udcff".encode("utf-8", "surrogatepass")]
    for body in bad:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body[:40], r.text)
        assert message(r)
    good = {"/api/chat": {"model": ALIAS, "messages": QUESTION},
            "/api/generate": {"model": ALIAS, "prompt": "Hi"},
            "/api/show": {"model": ALIAS}, "/api/pull": {"model": ALIAS},
            "/completion": {"prompt": "Hi"}, "/tokenize": {"content": "Hi"},
            "/detokenize": {"tokens": [1]}, "/apply-template": {"messages": QUESTION}}[path]
    key = next(iter(good))
    cases = [dict(good, unknown_field=1),                           # unknown field
             dict(good, **{key: 12345}),                            # wrong type
             dict(good, **{key: [{"deep": [[[]]]}] * 3})]           # wrong shape
    if path in ("/api/chat", "/api/generate"):
        cases.append(dict(good, options={f"opt{i}": i for i in range(3000)}))   # huge options
        cases.append(dict(good, options={"num_predict": 10 ** 30, "temperature": "hot"}))
    numbers = {"/api/chat": dict(good, options={"num_ctx": "N"}),
               "/api/generate": dict(good, options={"num_predict": "N"}),
               "/completion": dict(good, n_predict="N"), "/tokenize": {"content": "N"},
               "/detokenize": {"tokens": ["N"]}}
    for number in ("Infinity", "NaN", "1e400", "-1e400"):      # JSON that Python reads
        if path in numbers:
            raw = json.dumps(numbers[path]).replace('"N"', number)
            r = http.post(path, content=raw.encode(), headers=JSON)
            assert r.status_code == 400 and message(r), (raw, r.text)
    if path == "/completion":
        cases.append(dict(good, n_predict=[1], samplers="x" * 100, grammar="root ::= x"))
    if path == "/apply-template":
        cases = cases[1:]                  # it reads messages and tools only
    for body in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert message(r)
    r = http.post(path, content=b"x" * (MAX_MESSAGE + 1), headers=JSON)
    assert r.status_code == 413 and "max-message-bytes" in message(r)
    assert_idle_and_serving(daemon)


def _stream_then_leave(url: str, path: str, body: dict, marker: bytes) -> None:
    host, port = url[len("http://"):].rsplit(":", 1)
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        seen = b""
        while seen.count(marker) < 3:              # tokens are flowing
            seen += s.recv(65536)


@pytest.mark.parametrize("path, body, marker", [
    ("/api/chat", {"model": ALIAS, "messages": QUESTION,
                   "options": {"num_predict": 400}}, b'"done": false'),
    ("/api/generate", {"model": ALIAS, "prompt": "Count to a thousand:",
                       "options": {"num_predict": 400}}, b'"done": false'),
    ("/completion", {"prompt": "Count to a thousand:", "n_predict": 400, "ignore_eos": True,
                     "stream": True}, b"data: "),
])
def test_a_client_that_leaves_mid_stream_stops_its_request(daemon, path, body, marker):
    before = daemon.log().count("finish=cancelled")
    _stream_then_leave(daemon.http_url, path, body, marker)
    deadline = time.monotonic() + 60
    while daemon.log().count("finish=cancelled") == before:
        assert time.monotonic() < deadline, "the request ran on for nobody"
        time.sleep(0.05)
    line = [x for x in daemon.log().splitlines() if "finish=cancelled" in x][-1]
    assert 0 < int(line.split(" completion=")[1].split()[0]) < 400, line
    assert_idle_and_serving(daemon)
