"""service/methods.py: wire params -> engine requests and options, engine results -> wire maps."""
from kestreld.engine.generate import Completion, TokenEvent
from kestreld.engine.prompt import ChatInput, TextInput
from kestreld.engine.sampler import SamplingOptions
from kestreld.protocol import validate_params
from kestreld.service.methods import (KINDS, completion_result, engine_request,
                                      sampling_options, token_payload)
from kestreld.protocol import METHODS
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
                   prefill_ms=30.0, decode_ms=500.0, ttft_ms=35.0, logprobs=None)
    m = completion_result(c, queue_ms=1.5, ttft_ms=40.0)
    assert m == {"text": "ab", "ids": [5, 6], "finish_reason": "length",
                 "usage": {"prompt_tokens": 10, "cached_tokens": 4, "cached_source": None,
                           "prefill_tokens": 6, "completion_tokens": 2},
                 "timings": {"queue_ms": 1.5, "prefill_ms": 30.0, "decode_ms": 500.0,
                             "ttft_ms": 40.0, "prefill_tok_s": 200.0, "decode_tok_s": 4.0}}
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
