"""Numpy conversions to and from GGUF Q8_0, the layout a weight of a type the kernels do not
compute on (model/weights.py: compute_types) is converted to at load.

    Q8_0 row of `cols` values = cols/32 blocks of 34 bytes: fp16 scale d, then 32 int8 q.
    Quantization follows llama.cpp's `quantize_row_q8_0_ref`:
        d = max|x| / 127 per block, q = round_half_away_from_zero(x * (1/d)), d stored as fp16.

Everything is vectorized over whole matrices; large matrices are converted in row chunks
so that a float32 copy of a 600M-value embedding never exists at once.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .weights import Q8_BLOCK, Q8_BLOCK_BYTES

# GGUF tensor types a model file may hold: those the kernels compute on are used in place
# (model/weights.py: computes_on), the others are converted to Q8_0 (gguf-py dequantizes
# them all; its dequantizers are llama.cpp's reference ones).
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
    "IQ1_M", "IQ1_S"))

_CHUNK_VALUES = 1 << 22  # float32 values converted per step (16 MiB of scratch)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize float (rows, cols) to Q8_0 bytes uint8 (rows, cols/32*34), cols % 32 == 0."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    if cols % Q8_BLOCK:
        raise ValueError(f"Q8_0 needs a multiple of {Q8_BLOCK} columns, got {cols}")
    blocks = x.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)           # (rows, nb, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)  # (rows, nb, 1)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    # roundf(): half away from zero (np.rint rounds half to even, and floor(a + 0.5) is
    # off by one at 0.49999997, where the float32 sum rounds up to 1); a - floor(a) is exact
    a = np.abs(blocks * inv_d)
    q = np.floor(a)
    a -= q
    q += a >= np.float32(0.5)
    q = np.copysign(q, blocks, out=q).astype(np.int8)
    out = np.empty((rows, cols // Q8_BLOCK, Q8_BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(rows, cols // Q8_BLOCK * Q8_BLOCK_BYTES)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 bytes uint8 (rows, nb*34) -> float32 (rows, nb*32)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, Q8_BLOCK_BYTES)  # (rows, nb, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)          # (rows, nb, 1)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)                    # (rows, nb, 32)
    return (d * q).reshape(rows, -1)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16, any shape) -> float32 of the same shape."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def float_to_q8_0(x: np.ndarray, bf16: bool = False) -> np.ndarray:
    """Float (rows, cols) -> Q8_0, converted in row chunks.

    `x` is float32/float16, or with `bf16` the uint16 bit patterns of bfloat16."""
    rows, cols = x.shape
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    out = np.empty((rows, cols // Q8_BLOCK * Q8_BLOCK_BYTES), dtype=np.uint8)
    for r in range(0, rows, step):
        chunk = bf16_to_f32(x[r:r + step]) if bf16 else x[r:r + step]
        out[r:r + step] = quantize_q8_0(chunk)
    return out


def gguf_to_q8_0(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's data as the reader gives it (rows, ...) -> Q8_0 uint8 (rows, cols/32*34).

    Q8_0 is returned as is (a view of the memory map, no copy); every other supported
    type is dequantized with gguf.quants in row chunks and re-quantized to Q8_0."""
    if qtype == GGMLQuantizationType.Q8_0:
        return data
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    rows = data.shape[0]
    row_bytes = data.nbytes // max(rows, 1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    cols = row_bytes // type_size * block_size
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    out = np.empty((rows, cols // Q8_BLOCK * Q8_BLOCK_BYTES), dtype=np.uint8)
    for r in range(0, rows, step):
        out[r:r + step] = quantize_q8_0(gguf_quants.dequantize(data[r:r + step], qtype))
    return out


def dequantize_gguf(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's data, of any type gguf-py dequantizes, as float32: its shape with the
    last axis in values rather than bytes (the caller reshapes). Every tensor read as floats
    goes through it: norm vectors, biases, F32 routers, an mmproj's vision weights, the
    conversions' sources, and the tests' references."""
    return np.asarray(gguf_quants.dequantize(data, qtype), dtype=np.float32)

