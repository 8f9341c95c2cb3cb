# cython: language_level=3
# (boundscheck, wraparound, initializedcheck, cdivision: set by setup.py, on under KESTREL_DEBUG=1)
"""Kestrel's compute kernels: `Forward` (the whole forward pass of a chunk of tokens, every
layer in one C call), `VisionBlocks` (every block of a vision tower over one image in one C
call), and the per-op kernels they are made of, for the tests and the vision encoder's
mergers: the weight x activation product of each weight type, norms, RoPE, SwiGLU, int8 KV
store, attention, MoE routing, and the vision encoder's LayerNorm, GELU and full attention.

Every function takes C-contiguous numpy arrays (float = float32), checks their shapes and
raises ValueError on a mismatch, then computes with the GIL released on `nthreads` threads
(OpenMP's for the per-op functions, a ks_team of its own for `Forward` and `VisionBlocks`).
Results do not depend on `nthreads`. The C (pyx/ks_*.h) holds the SIMD paths;
`simd_path()` says which one this build uses, and `matmul_plain` always takes the portable
path, which the SIMD one matches bit for bit. On x86 the products also have AVX512-VNNI
paths, chosen at run time (`set_matmul_vnni`), bit-identical too.
"""
from libc.stdint cimport int8_t, int16_t, uint8_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from libc.math cimport sqrtf
from cython.parallel cimport prange, threadid
import numpy as np
from ks_kernels cimport *


def simd_path():
    """Which compute path this build uses: "avx2", "neon-dotprod", "neon" or "plain"."""
    return ks_simd_path().decode()


cdef int _check_threads(int nthreads) except -1:
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    return 0


include "matmul.pxi"
include "elementwise.pxi"
include "attention.pxi"
include "moe.pxi"
include "forward.pxi"
include "vision.pxi"
