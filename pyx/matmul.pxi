# What the loader asks of the weight ABI (ks_weights.h, ks_interleave.h): the types the kernels
# compute on, and the interleaved copy of a matrix.

def compute_types():
    """The GGML type ids the kernels compute on in place (ks_weights.h)."""
    return tuple(t for t in range(KS_TYPE_COUNT) if ks_type_supported(t))


def interleaves(int qtype):
    """The rows per group in which matrices of GGML type qtype are interleaved on this CPU
    (ks_weights.h): 16 where the AVX512-VNNI product on such groups runs, 8 where the AVX2
    one does, 4 where the NEON dotprod one does, 0 if there is none."""
    return ks_il_rows(qtype)


def interleave_rows(const uint8_t[:, ::1] w, int qtype, int cols, out=None):
    """The interleaved copy of w (rows of `cols` values of type qtype, as GGUF lays them
    out): a uint8 array of w's row bytes and its rows rounded up to whole groups of
    interleaves(qtype) rows, aligned to 64 bytes (ks_weights.h gives the layout); new, or
    `out` filled and returned (a C-contiguous uint8 array of that shape, 64-byte aligned)."""
    cdef int group = ks_il_rows(qtype)
    if not group:
        raise ValueError(f"interleave_rows: weight type {qtype} is not interleaved on this CPU")
    cdef Py_ssize_t m = w.shape[0], rows = (m + group - 1) // group * group
    if cols <= 0 or cols % ks_type_block(qtype) or w.shape[1] != ks_type_row_bytes(qtype, cols):
        raise ValueError(f"interleave_rows: w must have {ks_type_row_bytes(qtype, cols)} bytes "
                         f"per row of {cols} values, got {w.shape[1]}")
    if out is None:
        raw = np.empty(rows * w.shape[1] + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        dst = raw[start:start + rows * w.shape[1]].reshape(-1, w.shape[1])
    elif (out.dtype != np.uint8 or out.shape != (rows, w.shape[1])
          or not out.flags.c_contiguous or out.ctypes.data % 64):
        raise ValueError(f"interleave_rows: out must be C-contiguous uint8 ({rows}, "
                         f"{w.shape[1]}), 64-byte aligned")
    else:
        dst = out
    cdef uint8_t[:, ::1] dv = dst
    if m:
        with nogil:
            ks_interleave_rows(qtype, &w[0, 0], <int>m, <int>cols, &dv[0, 0])
    return dst
