"""kestreld.protocol: parameter validation, message classification, framing, encoders."""
from __future__ import annotations

import math

import msgpack
import pytest

from kestreld.engine.sampler import SamplingOptions
from kestreld.errors import BadRequest, TooLarge, UnknownMethod
from kestreld.protocol import (ChatParams, FrameError, FrameReader, GenerateParams, NoParams,
                               Notification, Request, Response,
                               decode_message, encode_notification, encode_request,
                               encode_response, msgid_of, validate_params)

VOCAB = 1000


def gen(**p):
    return validate_params("generate", [p], VOCAB)


# ---------------------------------------------------------------- validation

def test_generate_defaults_and_typed_values():
    g = gen(prompt="hi")
    assert g == GenerateParams(prompt="hi", ids=None, options={}, stream=True)
    g = gen(ids=[0, 999], max_tokens=5, temperature=1, top_k=0, top_p=1, min_p=0,
            repeat_penalty=1.1, seed=2**64 - 1, stop=["\n", "END"], ignore_eos=True,
            logprobs=20, stream=False)
    assert g.ids == (0, 999) and g.stream is False
    assert g.options == {"max_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                         "min_p": 0.0, "repeat_penalty": 1.1, "seed": 2**64 - 1,
                         "stop": ("\n", "END"), "ignore_eos": True, "logprobs": 20}
    assert isinstance(g.options["temperature"], float)
    # every option name is a SamplingOptions field, so the server can build one
    SamplingOptions(**g.options)


@pytest.mark.parametrize("name, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.01), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -1), ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
    ("repeat_penalty", 0), ("repeat_penalty", -1), ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("stop", "x"), ("stop", [""]), ("stop", ["x" * 257]), ("stop", ["a"] * 17), ("stop", [1]),
    ("ignore_eos", 1), ("logprobs", -1), ("logprobs", 21), ("stream", "yes"),
])
def test_each_option_out_of_range_names_itself(name, value):
    with pytest.raises(BadRequest) as e:
        gen(prompt="hi", **{name: value})
    assert name in str(e.value)


@pytest.mark.parametrize("p, needle", [
    ({}, "exactly one"), ({"prompt": "a", "ids": [1]}, "exactly one"),
    ({"prompt": b"bytes"}, "prompt"), ({"ids": [1, VOCAB]}, f"0..{VOCAB - 1}"),
    ({"ids": [-1]}, "ids"), ({"ids": "1 2"}, "ids"), ({"prompt": "a", "tempreature": 1}, "tempreature"),
    ({"prompt": "a", "messages": []}, "messages"),
])
def test_generate_shape_errors(p, needle):
    with pytest.raises(BadRequest) as e:
        gen(**p)
    assert needle in str(e.value)


def test_chat_messages():
    c = validate_params("chat", [{"messages": [{"role": "user", "content": "hi"}],
                                  "enable_thinking": True, "max_tokens": 3}], VOCAB)
    assert c == ChatParams(({"role": "user", "content": "hi"},), True, {"max_tokens": 3}, True)
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 1}],
                [{"role": "user", "content": "x", "name": "n"}], "hi"):
        with pytest.raises(BadRequest):
            validate_params("chat", [{"messages": bad}], VOCAB)
    with pytest.raises(BadRequest, match="needs messages"):
        validate_params("chat", [{}], VOCAB)


def test_other_methods():
    assert validate_params("tokenize", [{"text": "a"}], VOCAB).add_special is False
    assert validate_params("detokenize", [{"ids": [3]}], VOCAB).ids == (3,)
    assert validate_params("cancel", [{"id": 7}], VOCAB).id == 7
    assert validate_params("status", [], VOCAB) == NoParams()
    assert validate_params("ping", [{}], VOCAB) == NoParams()
    for method, p in (("tokenize", {}), ("tokenize", {"text": 1}), ("cancel", {"id": "7"}),
                      ("detokenize", {"ids": [VOCAB]}), ("status", {"verbose": True}),
                      ("generate", [{"prompt": "a"}, {"prompt": "b"}]), ("ping", "x")):
        with pytest.raises(BadRequest):
            validate_params(method, p if isinstance(p, (list, str)) else [p], VOCAB)
    with pytest.raises(UnknownMethod, match="frobnicate"):
        validate_params("frobnicate", [], VOCAB)


# ---------------------------------------------------------------- messages

def test_decode_message_kinds_and_bin_method():
    assert decode_message([0, 1, b"ping", []]) == Request(1, "ping", [])
    assert decode_message([1, 2, None, {"ok": True}]) == Response(2, None, {"ok": True})
    assert decode_message([2, "hello", [1]]) == Notification("hello", [1])
    for bad in (5, [], [0, 1, "ping"], [0, "1", "ping", []], [3, 1, "x", []], [0, 1, 5, []],
                [0, 1, b"\xff", []], [True, 1, "ping", []]):
        with pytest.raises(BadRequest):
            decode_message(bad)


def test_msgid_of():
    assert msgid_of([0, 5, "x"]) == 5
    assert msgid_of([0, "5"]) is None and msgid_of([1, 5]) is None and msgid_of("x") is None


def test_encoders_round_trip():
    assert msgpack.unpackb(encode_request(3, "generate", {"prompt": "a"})) == \
        [0, 3, "generate", [{"prompt": "a"}]]
    assert msgpack.unpackb(encode_request(4, "status")) == [0, 4, "status", []]
    assert msgpack.unpackb(encode_response(3, None, {"x": 1})) == [1, 3, None, {"x": 1}]
    assert msgpack.unpackb(encode_notification("token", 3, {"text": "é"})) == \
        [2, "token", [3, {"text": "é"}]]


# ---------------------------------------------------------------- framing

def packed(*objs) -> bytes:
    return b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)


def test_frames_survive_any_chunking():
    objs = [[0, i, "ping", [{"pad": "x" * (i * 37)}]] for i in range(20)]
    data = packed(*objs)
    for size in (1, 7, 64, len(data)):
        r = FrameReader(4096, max_chunk=max(size, 1))
        out = []
        for i in range(0, len(data), size):
            out += r.feed(data[i:i + size])
        assert out == objs


def test_too_large_complete_message_in_one_chunk():
    r = FrameReader(100, max_chunk=1 << 16)
    out = r.feed(packed([0, 1, "ping", []], [0, 2, "generate", [{"prompt": "x" * 200}]]))
    assert out[0] == [0, 1, "ping", []]
    assert isinstance(out[1], FrameError) and out[1].msgid == 2
    assert isinstance(out[1].error, TooLarge) and "100" in str(out[1].error)
    assert r.dead and r.feed(packed([0, 3, "ping", []])) == []


def test_too_large_refused_while_still_arriving_with_msgid_from_split_head():
    r = FrameReader(1000, max_chunk=1 << 16)
    data = packed([0, 4, "ping", []], [0, 77777, "generate", [{"prompt": "y" * 5000}]])
    out = []
    for i in range(len(data)):                       # byte by byte: the head is split too
        out += r.feed(data[i:i + 1])
        if r.dead:
            break
    assert out[0] == [0, 4, "ping", []]
    assert isinstance(out[1], FrameError) and out[1].msgid == 77777
    assert i < 1000 + 20                              # refused before the rest arrived


def test_malformed_bytes():
    out = FrameReader(1000).feed(b"\xc1")
    assert isinstance(out[0], FrameError) and out[0].msgid is None
    assert isinstance(out[0].error, BadRequest)
    out = FrameReader(1000).feed(packed([0, 1, "ping", []]) + b"\x94\x00\x09\xc1")
    assert out[0] == [0, 1, "ping", []] and out[1].msgid == 9
