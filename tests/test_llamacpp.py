"""kestreld.service.llamacpp: llama.cpp server's /completion, /tokenize, /detokenize bodies
-> RPC params (checked by the RPC validation itself), and its answers' shapes."""
from __future__ import annotations

import pytest

from kestreld.errors import BadRequest
from kestreld.protocol import GenerateParams, validate_params
from kestreld.service import llamacpp

PIECES = {1: b"Hello", 2: b" world", 3: b"\xc3", 4: b"\xa1", 5: b"\n", 6: b"END"}
RESULT = {"text": "Hello world", "ids": [1, 2], "finish_reason": "stop",
          "usage": {"prompt_tokens": 10, "cached_tokens": 6, "prefill_tokens": 4,
                    "completion_tokens": 2, "cached_source": "memory"},
          "timings": {"queue_ms": 0.5, "prefill_ms": 8.0, "decode_ms": 40.0, "ttft_ms": 9.0,
                      "prefill_tok_s": 500.0, "decode_tok_s": 50.0}}


def test_completion_request_maps_to_generate():
    t = llamacpp.completion_request({
        "prompt": "Once", "n_predict": 16, "temperature": 0.5, "top_k": 40, "top_p": 0.9,
        "min_p": 0.05, "seed": 3, "stop": ["\n"], "repeat_penalty": 1.1, "n_probs": 2,
        "cache_prompt": True, "stream": True, "json_schema": {"type": "object"},
        "samplers": ["top_k"], "typical_p": 1.0, "id_slot": -1, "model": "whatever"}, 512)
    p = validate_params("generate", t.params, vocab_size=100, max_seq=512)
    assert isinstance(p, GenerateParams) and p.prompt == "Once" and p.stream
    assert p.options["max_tokens"] == 16 and p.options["logprobs"] == 2
    assert p.options["response_format"]["kind"] == "json_schema"
    assert (t.stream, t.n_probs, t.prompt, t.n_predict) == (True, 2, "Once", 16)
    ids = llamacpp.completion_request({"prompt": [[1, 2, 3]], "seed": -1}, 512)
    assert ids.params == {"ids": [1, 2, 3], "max_tokens": 512, "stream": False}


@pytest.mark.parametrize("body, needle", [
    ({}, "prompt is required"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"prompt": [1, "a"]}, "one prompt"),
    ({"prompt": "x", "n_predict": 0}, "n_predict must be"),
    ({"prompt": "x", "n_predict": "5"}, "n_predict must be an integer"),
    ({"prompt": "x", "n_probs": 99}, "n_probs must be in"),
    ({"prompt": "x", "grammar": "root ::= \"a\""}, "grammar=.* is not supported"),
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"prompt": "x", "logit_bias": [[1, 2.0]]}, "logit_bias"),
    ({"prompt": "x", "stream": "true"}, "stream must be"),
    ({"prompt": "x", "cache_prompt": 1}, "cache_prompt must be"),
    ({"prompt": "x", "json_schema": "{}"}, "json_schema must be"),
    ({"prompt": "x", "surprise": 1}, "unknown field 'surprise'"),
    ("text", "JSON object"),
])
def test_bad_completion_bodies_are_named(body, needle):
    with pytest.raises(BadRequest, match=needle):
        llamacpp.completion_request(body, 512)


def test_completion_answer_and_stream():
    req = llamacpp.completion_request({"prompt": "Hi", "n_predict": 2, "return_tokens": True,
                                       "stop": ["END"]}, 512)
    answer = llamacpp.Completion(req, "m", 512, lambda i: PIECES[i])
    out = answer.final(RESULT, False)
    assert (out["content"], out["tokens"], out["stop"], out["stop_type"]) == \
        ("Hello world", [1, 2], True, "eos")
    assert out["timings"]["cache_n"] == 6 and out["timings"]["prompt_n"] == 4
    assert out["timings"]["predicted_per_token_ms"] == 20.0
    assert out["generation_settings"]["n_ctx"] == 512 and out["tokens_evaluated"] == 10
    stopped = answer.final(dict(RESULT, ids=[1, 2, 6]), False)
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", "END")
    assert answer.final(dict(RESULT, finish_reason="length"), True)["stop_type"] == "limit"
    assert answer.chunk({"text": "", "ids": []}) is None
    assert answer.chunk({"text": "Hello", "ids": [1]}) == {
        "index": 0, "content": "Hello", "tokens": [1], "id_slot": 0, "stop": False}


def test_tokens_pieces_and_params():
    assert llamacpp.tokens([1, 3], False, PIECES.get) == {"tokens": [1, 3]}
    assert llamacpp.tokens([1, 3, 4], True, PIECES.get) == {"tokens": [
        {"id": 1, "piece": "Hello"}, {"id": 3, "piece": [0xc3]}, {"id": 4, "piece": [0xa1]}]}
    assert llamacpp.tokenize_params({"content": "Hi", "with_pieces": True}) == \
        ({"text": "Hi", "add_special": False}, True)
    with pytest.raises(BadRequest, match="unknown field"):
        llamacpp.tokenize_params({"content": "Hi", "text": "Hi"})
    with pytest.raises(BadRequest, match="parse_special"):
        llamacpp.tokenize_params({"content": "Hi", "parse_special": False})
    assert llamacpp.detokenize_params({"tokens": [1]}) == {"ids": [1]}
    with pytest.raises(BadRequest, match="tokens"):
        llamacpp.detokenize_params({"ids": [1]})


def test_props_and_slot():
    props = llamacpp.props("m", "/m/x.gguf", "{{ t }}", False, 512, 64, True)
    assert (props["total_slots"], props["model_path"], props["chat_template"]) == \
        (1, "/m/x.gguf", "{{ t }}")
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 512 and settings["is_processing"] is True
    assert settings["params"]["n_predict"] == 64
