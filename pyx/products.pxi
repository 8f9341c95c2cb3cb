# The weight x activation product of every weight type (ks_matmul.h) one op at a time, on
# either layout, with its plain C twin; activation quantization to Q8_0 (ks_q8.h); embedding
# rows. For the tests and the kernel benchmarks: the forward pass calls the same C.

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
    # no half sums (the forward pass keeps them beside each row; matmul makes its own from xq)
    for i in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_quantize_row_q8_0(&x[i, 0], &xq[i, 0], &xd[i, 0], NULL, <int>k)


cdef int _matmul(const uint8_t[:, ::1] w, int qtype, const int8_t[:, ::1] xq,
                 const float[:, ::1] xd, float[:, ::1] out, int nthreads, bint plain,
                 bint interleaved) except -1:
    cdef Py_ssize_t m = out.shape[1], n = xq.shape[0], k = xq.shape[1]
    cdef Py_ssize_t rows_per_item, n_items, it, r0, r1
    cdef int group = ks_il_rows(qtype) if interleaved else 0
    cdef Py_ssize_t want_rows = (m + group - 1) // group * group if group else m
    cdef int failed = 0
    cdef ks_matrix W
    cdef ks_act x
    _check_q8_cols(k, "matmul")
    _check_threads(nthreads)
    if not ks_type_supported(qtype):
        raise ValueError(f"matmul: weight type {qtype} is not one the kernels compute on")
    if k % ks_type_block(qtype):
        raise ValueError(f"matmul: k must be a multiple of {ks_type_block(qtype)} for weight "
                         f"type {qtype}, got {k}")
    if w.shape[1] != ks_type_row_bytes(qtype, k):
        raise ValueError(f"matmul: w must have {ks_type_row_bytes(qtype, k)} bytes per row for "
                         f"k={k}, got {w.shape[1]}")
    if xd.shape[0] != n or xd.shape[1] != k // KS_QK:
        raise ValueError(f"matmul: xd must be ({n}, {k // KS_QK}), got ({xd.shape[0]}, {xd.shape[1]})")
    if out.shape[0] != n or w.shape[0] != want_rows:
        rows = f"{w.shape[0]}, less the last group's padding" if interleaved else f"{w.shape[0]}"
        raise ValueError(f"matmul: out must be ({n}, {rows}), got ({out.shape[0]}, {out.shape[1]})")
    if interleaved and not group:
        raise ValueError(f"matmul: weight type {qtype} is not interleaved on this CPU")
    if m == 0 or n == 0:
        return 0
    W.data, W.row_stride, W.mat_stride = &w[0, 0], w.shape[1], 0
    W.type, W.rows, W.cols, W.n_mat = qtype, <int32_t>m, <int32_t>k, 1
    W.interleave = group
    W.copies = NULL
    cdef int16_t[:, ::1] xh = np.empty((n, k // 16), np.int16)    # xq's half sums
    for it in range(n):
        ks_q8_half_sums(&xq[it, 0], k, &xh[it, 0])
    x.q, x.d, x.h = &xq[0, 0], &xd[0, 0], &xh[0, 0]
    # runs of output rows, as the forward pass shares them out (the split changes no result)
    rows_per_item = 16 if n == 1 else max(16, min(64, m // (4 * nthreads) // 16 * 16))
    n_items = (m + rows_per_item - 1) // rows_per_item
    for it in prange(n_items, nogil=True, num_threads=nthreads, schedule="static"):
        r0 = it * rows_per_item
        r1 = min(m, r0 + rows_per_item)
        if plain:
            if ks_matrix_rows_plain(&W, 0, &x, <int>n, &out[0, 0], <int>r0, <int>r1) < 0:
                failed = 1
        else:
            ks_matrix_rows(&W, 0, &x, <int>n, &out[0, 0], <int>r0, <int>r1)
    if failed:
        raise MemoryError("matmul_plain: no memory to put interleaved rows back")
    return 0


def matmul(const uint8_t[:, ::1] w, int qtype, const int8_t[:, ::1] xq, const float[:, ::1] xd,
           float[:, ::1] out, int nthreads, bint interleaved=False):
    """out (n, m) = w . (xq (n, k), xd (n, k/32))^T for a weight matrix w of GGML type qtype:
    uint8 (m, bytes of a row of k values), e.g. Q8_0's (m, k/32*34); interleaved: w is
    interleave_rows' copy of such a matrix, made on this CPU (m rounded up to whole groups).

    out[t, r] = sum over blocks b in order of isum * (scales of w's block and x's block), isum
    the exact int32 block dot product: bit-identical to matmul_plain. n == 1 is decode.
    xq must come from quantize_q8_0 (values in -127..127; the AVX2 path relies on it)."""
    _matmul(w, qtype, xq, xd, out, nthreads, False, interleaved)


def matmul_plain(const uint8_t[:, ::1] w, int qtype, const int8_t[:, ::1] xq,
                 const float[:, ::1] xd, float[:, ::1] out, int nthreads,
                 bint interleaved=False):
    """matmul on the portable C path (the reference the SIMD paths must equal exactly)."""
    _matmul(w, qtype, xq, xd, out, nthreads, True, interleaved)


def dequantize_rows(const uint8_t[:, ::1] w, int qtype, const int32_t[::1] ids, float[:, ::1] out,
                    bint interleaved=False, Py_ssize_t rows=-1):
    """Embedding lookup: out[i, :] = row ids[i] of the matrix w (GGML type qtype, rows of
    k = out.shape[1] values; interleaved: interleave_rows' copy of them, made on this CPU),
    as float32. rows: the matrix's row count, w.shape[0] by default; an interleaved w needs
    it, as the last group's padding rows are no rows of the matrix."""
    cdef Py_ssize_t m = rows if rows >= 0 else w.shape[0], n = ids.shape[0], k = out.shape[1], i
    cdef int group = ks_il_rows(qtype) if interleaved else 0
    cdef Py_ssize_t want_rows = (m + group - 1) // group * group if group else m
    cdef ks_matrix W
    if interleaved and (not group or w.shape[0] % group):
        raise ValueError(f"dequantize_rows: w is not interleaved by rows of type {qtype} here")
    if interleaved and rows < 0:
        raise ValueError("dequantize_rows: an interleaved w needs rows, its count before padding")
    if w.shape[0] != want_rows:
        have = f"{w.shape[0]}, less the last group's padding" if group else f"{w.shape[0]}"
        raise ValueError(f"dequantize_rows: rows must be {have}, got {m}")
    if not ks_type_supported(qtype):
        raise ValueError(f"dequantize_rows: weight type {qtype} is not one the kernels compute on")
    if k <= 0 or k % ks_type_block(qtype):
        raise ValueError(f"dequantize_rows: k must be a positive multiple of {ks_type_block(qtype)}, got {k}")
    if w.shape[1] != ks_type_row_bytes(qtype, k):
        raise ValueError(f"dequantize_rows: w must have {ks_type_row_bytes(qtype, k)} bytes "
                         f"per row for k={k}, got {w.shape[1]}")
    if out.shape[0] != n:
        raise ValueError(f"dequantize_rows: out must have {n} rows (one per id), "
                         f"got {out.shape[0]}")
    for i in range(n):
        if ids[i] < 0 or ids[i] >= m:
            raise ValueError(f"dequantize_rows: id {ids[i]} at {i} is outside [0, {m})")
    W.data, W.row_stride, W.mat_stride = &w[0, 0], w.shape[1], 0
    W.type, W.rows, W.cols, W.n_mat = qtype, <int32_t>m, <int32_t>k, 1
    W.interleave = group
    with nogil:
        for i in range(n):
            ks_matrix_dequant_row(&W, 0, ids[i], &out[i, 0])
