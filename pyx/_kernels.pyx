# cython: language_level=3
# (boundscheck, wraparound, initializedcheck, cdivision: set by setup.py, on under KESTREL_DEBUG=1)
"""Kestrel's compute kernels, what the daemon runs: `Forward` (the whole forward pass of a chunk
of tokens, every layer in one C call), `VisionBlocks` (every block of a vision tower over one
image in one C call), the vision encoder's mergers' LayerNorm and GELU, and what the loader asks
of the weight ABI (the types the kernels compute on, interleaved copies). The per-op kernels the
tests and benchmarks call one at a time are the test-only module _kernels_ops.pyx.

Every function takes C-contiguous numpy arrays (float = float32), checks their shapes and
raises ValueError on a mismatch, then computes with the GIL released on `nthreads` threads
(OpenMP's for the functions, a ks_team of its own for `Forward` and `VisionBlocks`). Results do
not depend on `nthreads`. The C (pyx/ks_*.h) holds the SIMD paths; `simd_path()` says which one
this build uses. On x86 the products also have AVX512-VNNI paths, chosen at run time
(`set_matmul_vnni`), bit-identical to the others.
"""
from libc.stdint cimport int8_t, int16_t, uint8_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from cython.parallel cimport prange
import numpy as np
from ks_kernels cimport *


include "common.pxi"
include "matmul.pxi"
include "forward.pxi"
include "vision.pxi"
