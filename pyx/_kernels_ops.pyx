# cython: language_level=3
# (boundscheck, wraparound, initializedcheck, cdivision: set by setup.py, on under KESTREL_DEBUG=1)
"""Kestrel's per-op kernels, for the tests and the kernel benchmarks (built with
KESTREL_TEST_KERNELS=1, as `make test` does; the daemon does not import it): the weight x
activation product of each weight type on either layout, with its plain twin, Q8_0
quantization, embedding rows, norms, RoPE, SwiGLU, the int8 KV store and attention, MoE
routing, and the vision encoder's full attention, each on its own. The C (pyx/ks_*.h) is the
one the forward pass runs; `matmul_plain` always takes the portable path, which the SIMD ones
match bit for bit. This module is its own copy of the C: its `set_matmul_vnni` and
`set_attention_tiles` switch its own paths, not those of kestreld._kernels.

Every function takes C-contiguous numpy arrays (float = float32), checks their shapes and
raises ValueError on a mismatch, then computes with the GIL released on `nthreads` OpenMP
threads. Results do not depend on `nthreads`.
"""
from libc.stdint cimport int8_t, int16_t, uint8_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from cython.parallel cimport prange, threadid
import numpy as np
from ks_kernels cimport *


include "common.pxi"
include "products.pxi"
include "elementwise.pxi"
include "attention.pxi"
include "moe.pxi"
