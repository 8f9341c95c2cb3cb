# What both kernel modules hold: _kernels.pyx (the daemon's) and _kernels_ops.pyx (the tests').
# Each module is its own copy of the C, with its own switches: set_matmul_vnni sets the one of
# the module it is called on.

cdef enum:
    ELEMENTWISE_CHUNK = 4096    # elements per work item of the element-wise kernels


def simd_path():
    """Which compute path this build uses: "avx2", "neon-dotprod", "neon" or "plain"."""
    return ks_simd_path().decode()


cdef int _check_threads(int nthreads) except -1:
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    return 0


def set_matmul_vnni(bint enabled):
    """Lets the products take their AVX512-VNNI paths and the attention its 16-float
    vectors (the default where the CPU has them), or not (tests compare both with the plain
    twin and the 8-float attention). Returns True if those paths are now on."""
    return bool(ks_set_vnni(enabled))
