"""kestreld.service.ollama: Ollama's bodies -> RPC params (checked by the RPC validation
itself), completion maps and token payloads -> Ollama's objects, the model's names."""
from __future__ import annotations

import base64
import logging

import pytest

from kestreld.errors import BadRequest, NotFound
from kestreld.protocol import ChatParams, GenerateParams, validate_params
from kestreld.service import ollama

MODEL = {"path": "/m/Qwen3-1.7B-Q4_K_M.gguf", "arch": "qwen3", "name": "Qwen3 1.7B",
         "n_params": 1_720_000_000, "context_length": 40960, "source_dtype": "q4_k",
         "file_bytes": 1_100_000_000, "vision": False}
CARD = ollama.model_card(MODEL, "Qwen3-1.7B-Q4_K_M", ("qwen3-vl:2b", "qwen3:1.7b"), 4096,
                         470_000_000, "{% if tools %}...<think>{% endif %}", 1.7e9)
USER = [{"role": "user", "content": "Hi"}]
RESULT = {"text": "Paris", "ids": [1, 2], "finish_reason": "stop",
          "usage": {"prompt_tokens": 12, "cached_tokens": 4, "prefill_tokens": 8,
                    "completion_tokens": 2, "cached_source": "memory"},
          "timings": {"queue_ms": 1.0, "prefill_ms": 20.0, "decode_ms": 30.5, "ttft_ms": 21.0,
                      "prefill_tok_s": 400.0, "decode_tok_s": 65.6}}


def valid(t: ollama.Translated):
    """The params through the RPC validation, as the daemon checks them."""
    return validate_params(t.method, t.params, vocab_size=1000, max_seq=4096)


def test_names_and_card():
    assert ollama.ollama_name("SmolLM2 135M Instruct") == "smollm2-135m-instruct:latest"
    assert ollama.ollama_name("Qwen3-VL:2B") == "qwen3-vl:2b"
    assert CARD.names == ("qwen3-1.7b:latest", "qwen3-vl:2b", "qwen3:1.7b")
    for name in ("qwen3-1.7b", "qwen3-1.7b:latest", "qwen3-vl:2b", "Qwen3-1.7B-Q4_K_M"):
        assert CARD.serves(name) == name
    with pytest.raises(NotFound, match="model 'llama3:8b' not found"):
        CARD.serves("llama3:8b")
    with pytest.raises(BadRequest, match="model is required"):
        CARD.serves(None)
    assert CARD.details == {"parent_model": "", "format": "gguf", "family": "qwen3",
                            "families": ["qwen3"], "parameter_size": "1.7B",
                            "quantization_level": "Q4_K"}
    assert CARD.capabilities == ["completion", "tools", "thinking"]
    assert CARD.memory_bytes == 1_570_000_000 and len(CARD.digest) == 64


def test_tags_ps_show_pull():
    assert [m["name"] for m in ollama.tags(CARD)["models"]] == list(CARD.names)
    ps = ollama.running(CARD)["models"][0]
    assert (ps["size"], ps["context_length"], ps["expires_at"][:4]) == (1_570_000_000, 4096,
                                                                         "2318")
    shown = ollama.show(CARD, {"model": "qwen3-vl:2b"})
    assert shown["model_info"]["general.architecture"] == "qwen3"
    assert shown["model_info"]["qwen3.context_length"] == 40960
    assert shown["template"] == CARD.template
    steps, stream = ollama.pull(CARD, {"model": "qwen3:1.7b"})
    assert stream and steps[-1] == {"status": "success"}
    with pytest.raises(NotFound, match="serves the one model .* --alias llama3"):
        ollama.pull(CARD, {"model": "llama3"})
    with pytest.raises(BadRequest, match="unknown field"):
        ollama.show(CARD, {"model": "qwen3:1.7b", "extra": 1})


def test_chat_maps_options_format_think_and_streams_by_default(caplog):
    body = {"model": "qwen3-vl:2b", "messages": USER, "think": True, "keep_alive": "5m",
            "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "options": {"num_ctx": 32768, "num_predict": 20, "temperature": 0.7, "top_k": 20,
                        "top_p": 0.8, "min_p": 0.05, "seed": 7, "stop": ["\n\n"],
                        "repeat_penalty": 1.1, "presence_penalty": 0.5,
                        "frequency_penalty": 0, "num_thread": 4, "mirostat": 0}}
    with caplog.at_level(logging.INFO, "kestreld.service.ollama"):
        t = ollama.chat_request(body, CARD)
    assert "num_ctx 32768 is above the context of 4096 tokens (--max-seq): clamped" in caplog.text
    assert (t.method, t.stream, t.model, t.chat) == ("chat", True, "qwen3-vl:2b", True)
    p = valid(t)
    assert isinstance(p, ChatParams) and p.enable_thinking and p.split_reasoning and p.stream
    options = dict(p.options)
    assert options.pop("response_format")["kind"] == "json_schema"
    assert options == {"max_tokens": 20, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                       "min_p": 0.05, "seed": 7, "stop": ("\n\n",), "repeat_penalty": 1.1,
                       "presence_penalty": 0.5}
    assert ollama.chat_request(dict(body, format="json", stream=False, think="high"),
                               CARD).params["response_format"] == {"type": "json_object"}
    unlimited = ollama.chat_request({"model": "qwen3:1.7b", "messages": USER,
                                     "options": {"num_predict": -1, "seed": -1}}, CARD)
    assert unlimited.params["max_tokens"] == 4096 and "seed" not in unlimited.params


def test_tools_tool_calls_and_images_reach_the_rpc_shape():
    image = base64.b64encode(b"\x89PNG fake").decode()
    messages = [{"role": "user", "content": "Turn on the light", "images": [image]},
                {"role": "assistant", "content": "", "thinking": "ok",
                 "tool_calls": [{"function": {"name": "light", "arguments": {"on": True}}}]},
                {"role": "tool", "content": "done", "tool_name": "light"}]
    tools = [{"function": {"name": "light", "description": "Switch the light",
                           "parameters": {"type": "object",
                                          "properties": {"on": {"type": "boolean"}}}}}]
    p = valid(ollama.chat_request({"model": "qwen3:1.7b", "messages": messages,
                                   "tools": tools}, CARD))
    assert p.tools[0]["function"]["name"] == "light"
    assert p.messages[0]["content"][1] == {"type": "image", "data": b"\x89PNG fake"}
    call = p.messages[1]["tool_calls"][0]
    assert call["function"]["name"] == "light" and call["id"] == "call_0"
    assert p.messages[2] == {"role": "tool", "content": "done"}


@pytest.mark.parametrize("body, needle", [
    ({"messages": USER}, "model is required"),
    ({"model": "qwen3:1.7b", "messages": USER, "bogus": 1}, "unknown field.*'bogus'"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"num_gpu_typo": 1}},
     "unknown option 'num_gpu_typo'"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"mirostat": 2}}, "mirostat=2"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"num_ctx": "big"}}, "integer"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"num_predict": 0}}, "num_predict"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": []}, "options must be an object"),
    ({"model": "qwen3:1.7b", "messages": USER, "stream": "yes"}, "stream must be"),
    ({"model": "qwen3:1.7b", "messages": USER, "keep_alive": "forever"}, "keep_alive"),
    ({"model": "qwen3:1.7b", "messages": USER, "think": "very"}, "think must be"),
    ({"model": "qwen3:1.7b", "messages": USER, "format": "xml"}, "format must be"),
    ({"model": "qwen3:1.7b", "messages": [{"role": "user", "content": "x", "images": ["@@"]}]},
     "not valid base64"),
    ({"model": "qwen3:1.7b", "messages": [{"role": "user", "content": "x", "name": "a"}]},
     "unknown key"),
    ({"model": "qwen3:1.7b", "messages": []}, "non-empty array"),
    ({"model": "qwen3:1.7b", "messages": [{"role": "user", "content": [
        {"type": "image", "path": "/etc/passwd"}]}]}, "content must be a string"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"num_ctx": float("inf")}},
     "integer"),
    ({"model": "qwen3:1.7b", "messages": USER, "options": {"num_predict": float("nan")}},
     "integer"),
    ([1, 2], "JSON object"),
])
def test_bad_chat_bodies_are_named(body, needle):
    with pytest.raises(BadRequest, match=needle):
        ollama.chat_request(body, CARD)


def test_generate_routes_raw_system_suffix_and_load():
    chat = ollama.generate_request({"model": "qwen3:1.7b", "prompt": "Hi", "system": "Be brief",
                                    "stream": False}, CARD, None)
    p = valid(chat)
    assert isinstance(p, ChatParams) and not chat.chat and not chat.stream
    assert [m["role"] for m in p.messages] == ["system", "user"]
    raw = valid(ollama.generate_request({"model": "qwen3:1.7b", "prompt": "<s>x", "raw": True},
                                        CARD, None))
    assert isinstance(raw, GenerateParams) and raw.prompt == "<s>x"
    fim = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    infill = ollama.generate_request({"model": "qwen3:1.7b", "prompt": "def f(", "suffix": "):"},
                                     CARD, fim)
    assert infill.params["prompt"] == "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>"
    with pytest.raises(BadRequest, match="no fill-in-the-middle"):
        ollama.generate_request({"model": "qwen3:1.7b", "prompt": "a", "suffix": "b"}, CARD, None)
    for keep_alive, reason in ((None, "load"), (0, "unload"), ("0s", "unload"), ("5m", "load")):
        t = ollama.generate_request({"model": "qwen3:1.7b", "keep_alive": keep_alive}, CARD, None)
        assert (t.method, t.done_reason) == ("", reason)
    for field, value, needle in (("template", "{{ .Prompt }}", "template overrides"),
                                 ("context", [1, 2], "context"), ("raw", 1, "raw must be"),
                                 ("prompt", 3, "prompt must be a string")):
        with pytest.raises(BadRequest, match=needle):
            ollama.generate_request({"model": "qwen3:1.7b", "prompt": "x", field: value},
                                    CARD, None)


def test_answers_chunks_and_counters():
    t = ollama.chat_request({"model": "qwen3-vl:2b", "messages": USER}, CARD)
    answer = ollama.Answer(t, lambda i: b"x")
    assert answer.chunk({"text": "", "ids": []}) is None
    c = answer.chunk({"text": "Par", "ids": [1], "reasoning": "hmm"})
    assert c["message"] == {"role": "assistant", "content": "Par", "thinking": "hmm"}
    assert c["done"] is False and c["model"] == "qwen3-vl:2b" and c["created_at"].endswith("Z")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "light", "arguments": '{"on": true}'}}
    whole = answer.final(dict(RESULT, finish_reason="tool_calls", tool_calls=[call]), False)
    assert whole["message"]["tool_calls"] == [{"id": "call_1", "function": {
        "name": "light", "arguments": {"on": True}}}]
    assert whole["done_reason"] == "stop" and whole["done"] is True
    assert (whole["total_duration"], whole["prompt_eval_count"], whole["prompt_eval_duration"],
            whole["eval_count"], whole["eval_duration"], whole["load_duration"]) == \
        (51_500_000, 12, 20_000_000, 2, 30_500_000, 0)
    last = answer.final(RESULT, True)
    assert last["message"] == {"role": "assistant", "content": ""}
    g = ollama.Answer(ollama.generate_request({"model": "qwen3:1.7b", "prompt": "Hi",
                                               "logprobs": True, "top_logprobs": 1}, CARD, None),
                      lambda i: b"tok%d" % i)
    chunk = g.chunk({"text": "tok3", "ids": [3], "logprobs": [
        {"id": 3, "logprob": -0.1, "top": [[3, -0.1], [4, -2.5]]}]})
    assert chunk["response"] == "tok3"
    assert chunk["logprobs"] == [{"token": "tok3", "logprob": -0.1, "bytes": list(b"tok3"),
                                  "top_logprobs": [{"token": "tok3", "logprob": -0.1,
                                                    "bytes": list(b"tok3")}]}]
