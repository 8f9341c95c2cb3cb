# Q8_0: activation quantization, the weight x activation product, embedding rows.
# Weights are GGUF Q8_0 rows: k/32 blocks of 34 bytes (fp16 scale, 32 int8), see ks_q8.h.

cdef int _check_q8_cols(Py_ssize_t k, str what) except -1:
    if k <= 0 or k % KS_QK:
        raise ValueError(f"{what}: k must be a positive multiple of {KS_QK}, got {k}")
    return 0


def quantize_q8_0(const float[:, ::1] x, int8_t[:, ::1] xq, float[:, ::1] xd, int nthreads):
    """x (n, k) f32 -> xq (n, k) int8 and xd (n, k/32) f32, per 32-block: d = absmax/127,
    q = roundf(x * (1/d)) (0 where d == 0): llama.cpp's quantize_row_q8_0_ref."""
    cdef Py_ssize_t n = x.shape[0], k = x.shape[1], i
    _check_q8_cols(k, "quantize_q8_0")
    _check_threads(nthreads)
    if xq.shape[0] != n or xq.shape[1] != k:
        raise ValueError(f"quantize_q8_0: xq must be ({n}, {k}), got ({xq.shape[0]}, {xq.shape[1]})")
    if xd.shape[0] != n or xd.shape[1] != k // KS_QK:
        raise ValueError(f"quantize_q8_0: xd must be ({n}, {k // KS_QK}), "
                         f"got ({xd.shape[0]}, {xd.shape[1]})")
    for i in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_quantize_row_q8_0(&x[i, 0], &xq[i, 0], &xd[i, 0], <int>k)


cdef int _matmul(const uint8_t[:, ::1] w, const int8_t[:, ::1] xq, const float[:, ::1] xd,
                 float[:, ::1] out, int nthreads, bint plain) except -1:
    cdef Py_ssize_t m = w.shape[0], n = xq.shape[0], k = xq.shape[1]
    cdef Py_ssize_t nb = k // KS_QK, rows_per_item, n_items, it, r0, r1
    _check_q8_cols(k, "matmul_q8_0")
    _check_threads(nthreads)
    if w.shape[1] != nb * KS_QBLOCK:
        raise ValueError(f"matmul_q8_0: w must have {nb * KS_QBLOCK} bytes per row for "
                         f"k={k} ({nb} blocks of {KS_QBLOCK}), got {w.shape[1]}")
    if xd.shape[0] != n or xd.shape[1] != nb:
        raise ValueError(f"matmul_q8_0: xd must be ({n}, {nb}), got ({xd.shape[0]}, {xd.shape[1]})")
    if out.shape[0] != n or out.shape[1] != m:
        raise ValueError(f"matmul_q8_0: out must be ({n}, {m}), got ({out.shape[0]}, {out.shape[1]})")
    if m == 0 or n == 0:
        return 0
    # Work items are runs of output rows: each weight row is read by one thread only. In
    # prefill, runs of up to 64 rows keep their weights in cache while all tokens go past, but
    # short enough to give every thread a few. (Each output is computed the same way whatever
    # the run, so the split does not change results.)
    rows_per_item = 16 if n == 1 else max(8, min(64, m // (4 * nthreads) // 8 * 8))
    n_items = (m + rows_per_item - 1) // rows_per_item
    for it in prange(n_items, nogil=True, num_threads=nthreads, schedule="static"):
        r0 = it * rows_per_item
        r1 = min(m, r0 + rows_per_item)
        if plain:
            ks_q8_matmul_rows_plain(&w[0, 0], w.shape[1], &xq[0, 0], &xd[0, 0], <int>n, <int>k,
                                    &out[0, 0], <int>m, <int>r0, <int>r1)
        else:
            ks_q8_matmul_rows(&w[0, 0], w.shape[1], &xq[0, 0], &xd[0, 0], <int>n, <int>k,
                              &out[0, 0], <int>m, <int>r0, <int>r1)
    return 0


def matmul_q8_0(const uint8_t[:, ::1] w, const int8_t[:, ::1] xq, const float[:, ::1] xd,
                float[:, ::1] out, int nthreads):
    """out (n, m) = w (m, k as Q8_0 bytes (m, k/32*34)) . (xq (n, k), xd (n, k/32))^T.

    out[t, r] = sum over blocks b in order of isum * (d_w[r, b] * xd[t, b]), isum the exact
    int32 block dot product: bit-identical to matmul_q8_0_plain. n == 1 is decode.
    xq must come from quantize_q8_0 (values in -127..127; the AVX2 path relies on it)."""
    _matmul(w, xq, xd, out, nthreads, False)


def set_matmul_vnni(bint enabled):
    """Lets matmul_q8_0 take its AVX512-VNNI prefill path (the default where the CPU has it) or
    not (tests compare both with the plain twin). Returns True if the VNNI path is now on."""
    return bool(ks_set_vnni(enabled))


def matmul_q8_0_plain(const uint8_t[:, ::1] w, const int8_t[:, ::1] xq, const float[:, ::1] xd,
                      float[:, ::1] out, int nthreads):
    """matmul_q8_0 on the portable C path (the reference the SIMD path must equal exactly)."""
    _matmul(w, xq, xd, out, nthreads, True)


def dequantize_rows_q8_0(const uint8_t[:, ::1] w, const int32_t[::1] ids, float[:, ::1] out):
    """Embedding lookup: out[i, :] = row ids[i] of the Q8_0 matrix w, as float32 (k values)."""
    cdef Py_ssize_t m = w.shape[0], n = ids.shape[0], k = out.shape[1], i
    _check_q8_cols(k, "dequantize_rows_q8_0")
    if w.shape[1] != k // KS_QK * KS_QBLOCK:
        raise ValueError(f"dequantize_rows_q8_0: w must have {k // KS_QK * KS_QBLOCK} bytes "
                         f"per row for k={k}, got {w.shape[1]}")
    if out.shape[0] != n:
        raise ValueError(f"dequantize_rows_q8_0: out must have {n} rows (one per id), "
                         f"got {out.shape[0]}")
    for i in range(n):
        if ids[i] < 0 or ids[i] >= m:
            raise ValueError(f"dequantize_rows_q8_0: id {ids[i]} at {i} is outside [0, {m})")
    with nogil:
        for i in range(n):
            ks_dequantize_row_q8_0(&w[ids[i], 0], &out[i, 0], <int>k)
