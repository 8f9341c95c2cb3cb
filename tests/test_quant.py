"""Q8_0 conversions against gguf.quants (llama.cpp's reference rules, in numpy)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from ggml_blocks import random_blocks
from kestreld.model.quant import (bf16_to_f32, dequantize_q8_0, float_to_q8_0, gguf_to_q8_0,
                                   quantize_q8_0)

RNG = np.random.default_rng(1234)

def test_quantize_matches_gguf_bytes():
    x = RNG.standard_normal((37, 256)).astype(np.float32)
    x[3, :32] = 0.0                     # an all-zero block (d = 0)
    x[4, 5] = 1e-3                      # tiny values
    x[5, :32] = np.arange(32) - 15.5    # exact halves: round half away from zero
    # d = 127/127 = 1, so these are the scaled values: ties and the float32 trap
    # 0.49999997 (0.49999997 + 0.5 rounds to 1.0 in float32; roundf gives 0)
    x[6, :32] = np.float32(0.49999997)
    x[6, :6] = [127, -0.49999997, 2.5, -2.5, 126.5, -0.5]
    ours = quantize_q8_0(x)
    assert ours.shape == (37, 256 // 32 * 34) and ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, gq.quantize(x, T.Q8_0))
    q6 = ours[6, 2:34].view(np.int8)
    assert list(q6[:7]) == [127, 0, 3, -3, 127, -1, 0]


def test_dequantize_matches_gguf():
    data = random_blocks(RNG, T.Q8_0, 9, 128)
    np.testing.assert_array_equal(dequantize_q8_0(data), gq.dequantize(data, T.Q8_0))


def test_round_trip_error_is_within_rounding():
    x = RNG.standard_normal((16, 64)).astype(np.float32)
    back = dequantize_q8_0(quantize_q8_0(x))
    step = np.abs(x.reshape(16, 2, 32)).max(axis=2, keepdims=True) / 127
    err = np.abs(back - x).reshape(16, 2, 32)
    # half a step from rounding q, plus up to 127 * (fp16 rounding of d = d * 2**-11)
    assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all(), float((err / step).max())


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_quantized_types_to_q8_0(qtype):
    data = random_blocks(RNG, qtype, 6, 512)
    want_f32 = gq.dequantize(data, qtype)
    ours = gguf_to_q8_0(data, qtype)
    np.testing.assert_array_equal(ours, gq.quantize(want_f32, T.Q8_0))
    # and the values are the source's within Q8_0's rounding
    step = np.abs(want_f32.reshape(6, -1, 32)).max(axis=2, keepdims=True) / 127
    err = np.abs(dequantize_q8_0(ours) - want_f32).reshape(6, -1, 32)
    assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all(), float((err / step).max())


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda q: q.name)
def test_float_types_to_q8_0(qtype):
    x = RNG.standard_normal((5, 96)).astype(np.float32)
    data = x if qtype == T.F32 else x.astype(np.float16) if qtype == T.F16 else gq.quantize(x, T.BF16)
    ours = gguf_to_q8_0(data, qtype)
    np.testing.assert_array_equal(ours, gq.quantize(gq.dequantize(data, qtype), T.Q8_0))


def test_q8_0_is_passed_through_without_copy():
    data = random_blocks(RNG, T.Q8_0, 4, 64)
    assert gguf_to_q8_0(data, T.Q8_0) is data


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="TQ2_0"):      # ternary: no kernel, no conversion
        gguf_to_q8_0(np.zeros((1, 66), np.uint8), T.TQ2_0)


def test_float_to_q8_0_chunks_and_bf16(monkeypatch):
    import kestreld.model.quant as quant
    monkeypatch.setattr(quant, "_CHUNK_VALUES", 64)  # force several chunks
    x = RNG.standard_normal((11, 64)).astype(np.float32)
    np.testing.assert_array_equal(float_to_q8_0(x), gq.quantize(x, T.Q8_0))
    bits = gq.quantize(x, T.BF16).view(np.uint16)
    np.testing.assert_array_equal(bf16_to_f32(bits), gq.dequantize(bits.view(np.uint8), T.BF16))
    np.testing.assert_array_equal(float_to_q8_0(bits, bf16=True),
                                  gq.quantize(bf16_to_f32(bits), T.Q8_0))
