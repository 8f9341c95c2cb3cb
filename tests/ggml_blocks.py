"""Valid GGML weight blocks for the kernel and conversion tests. Every byte pattern of a block's
codes is valid, so random bytes with finite fp16 scales written over the scale fields are a
valid block of each quantized type; gguf-py's dequantizer is the reference for their values."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

# Byte offsets of the fp16 scales inside one block of each quantized type (ggml-common.h).
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q4_K: (0, 2),
              T.Q5_K: (0, 2), T.Q6_K: (208,)}

# fp16 scales that stress the conversions: zeros, subnormals, negative, the largest normal
EDGE_SCALES = np.array([0.0, -0.0, 2.0 ** -24, 3e-6, 6.1e-5, -0.02, 0.01, 1.0, -1.0, 65504.0],
                       np.float16)


def random_blocks(rng, qtype, rows: int, cols: int, edge_cases: bool = False) -> np.ndarray:
    """(rows, row bytes) uint8 of random valid blocks, scales ~N(0, 0.01). edge_cases: every
    third scale from EDGE_SCALES, and every fifth block's other bytes all 0x00 (the next all
    0xFF): the extreme codes."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * (cols // block)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if edge_cases:
        raw[1::5] = 0x00
        raw[2::5] = 0xFF
    for off in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(n) * 0.01).astype(np.float16)
        if edge_cases:
            scales[::3] = rng.choice(EDGE_SCALES, size=scales[::3].shape)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)
