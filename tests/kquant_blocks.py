"""Valid GGUF Q4_K / Q5_K / Q6_K blocks for the tests, written from ggml-common.h's layouts
(gguf-py dequantizes these types but has no quantizer for them).

    quantize(x, qtype)        float (rows, cols) -> block bytes (rows, cols/256 * bytes): a
                              simple min/max quantizer (not llama.cpp's search), good to about
                              1/qmax of each sub-block's range
    random_blocks(rng, ...)   random codes and scales (every byte pattern is a valid block),
                              with finite fp16 scales and, on request, the edge cases

Nothing here is the project's code: the tests judge the kernels by gguf-py's dequantize of
these bytes.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

QK_K = 256
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
_FP16_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}   # d (and dmin)


def _round(v):
    """Halves away from zero, like C's roundf."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _safe_div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0.0)


def _pack_scales_mins(sc, m):
    """6-bit sc, m (n, 8) -> the 12 packed bytes (n, 12)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _quantize_q45k(x, qtype):
    """x (n, 256) -> Q4_K / Q5_K blocks (n, 144 or 176)."""
    qmax = 15 if qtype == QT.Q4_K else 31
    n = x.shape[0]
    xb = x.reshape(n, 8, 32).astype(np.float64)
    lo = np.minimum(xb.min(axis=2), 0.0)
    scale = (xb.max(axis=2) - lo) / qmax                   # (n, 8)
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16)
    sc = np.clip(_round(_safe_div(scale, d.astype(np.float64)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(_round(_safe_div(-lo, dmin.astype(np.float64)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float64)[:, None] * sc                # (n, 8)
    base = dmin.astype(np.float64)[:, None] * m
    q = np.clip(_round(_safe_div(xb + base[:, :, None], step[:, :, None])), 0, qmax).astype(np.uint8)
    lo4 = (q & 15).reshape(n, 4, 2, 32)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
             _pack_scales_mins(sc, m)]
    if qtype == QT.Q5_K:
        bits = (q >> 4).astype(np.uint8)                     # (n, 8, 32): bit s of byte e
        parts.append(np.bitwise_or.reduce(bits << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append((lo4[:, :, 0] | (lo4[:, :, 1] << 4)).reshape(n, 128))
    return np.concatenate(parts, axis=1)


def _quantize_q6k(x):
    """x (n, 256) -> Q6_K blocks (n, 210)."""
    n = x.shape[0]
    xb = x.reshape(n, 16, 16).astype(np.float64)
    scale = np.abs(xb).max(axis=2) / 31                      # (n, 16)
    d = (scale.max(axis=1) / 127).astype(np.float16)
    sc = np.clip(_round(_safe_div(scale, d.astype(np.float64)[:, None])), -128, 127).astype(np.int8)
    step = d.astype(np.float64)[:, None] * sc
    q = (np.clip(_round(_safe_div(xb, step[:, :, None])), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)                               # value 128h + 32g + e
    ql = np.empty((n, 2, 2, 32), np.uint8)                   # ql[64h + 32*(g&1) + e]
    ql[:, :, 0] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 1] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(n, 2)], axis=1)


def quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    """Float (rows, cols), cols a multiple of 256 -> uint8 (rows, cols/256 * block bytes)."""
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} rows hold multiples of {QK_K} values, not {cols}")
    flat = np.asarray(x, np.float32).reshape(-1, QK_K)
    blocks = _quantize_q6k(flat) if qtype == QT.Q6_K else _quantize_q45k(flat, qtype)
    return blocks.reshape(rows, -1)


def random_blocks(rng, qtype: QT, rows: int, cols: int, special: bool = False) -> np.ndarray:
    """Random blocks (rows, cols/256 * bytes): random code and 6-bit scale bytes, fp16 scales
    of either sign around 1e-2. special: also fp16 subnormal and zero scales, superblocks whose
    code bytes are all 0x00 or all 0xff, and Q6_K's extreme int8 scales -128 and 127."""
    nbytes = GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, size=(rows * cols // QK_K, nbytes), dtype=np.uint8)
    for off in _FP16_OFFSETS[qtype]:
        h = (rng.uniform(0.5, 2.0, len(b)) * 0.01 * rng.choice([-1.0, 1.0], len(b))).astype(np.float16)
        if special:
            h[::7] = np.float16(3e-6)            # subnormal in fp16
            h[1::11] = np.float16(0)
        b[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    if special:
        codes = slice(0, 192) if qtype == QT.Q6_K else slice(16, nbytes)
        b[2::5, codes] = 0
        b[3::5, codes] = 0xFF
        if qtype == QT.Q6_K:
            b[4::5, 192:208] = np.array([-128, 127] * 8, np.int8).view(np.uint8)
    return b.reshape(rows, -1)
