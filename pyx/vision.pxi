# The vision encoder's float kernels (ks_vision.h): LayerNorm with bias, GELU (tanh and erf)
# and full (non-causal) attention over one image's patches.

def layernorm(const float[:, ::1] x, const float[::1] w, const float[::1] b, float eps,
              float[:, ::1] out, int nthreads):
    """out (n, d) = (x - mean) / sqrt(var + eps) * w + b per row (torch's LayerNorm: biased
    variance); w, b (d); out may be x (in place)."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i
    _check_threads(nthreads)
    if w.shape[0] != d or b.shape[0] != d:
        raise ValueError(f"layernorm: w and b must have {d} values (x's columns), "
                         f"got {w.shape[0]} and {b.shape[0]}")
    if out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"layernorm: out must be ({n}, {d}) like x, got ({out.shape[0]}, {out.shape[1]})")
    if n == 0 or d == 0:
        return
    for i in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_layernorm_row(&x[i, 0], &w[0], &b[0], eps, &out[i, 0], d)


cdef int _gelu(const float[:, ::1] x, float[:, ::1] out, int nthreads, bint use_erf,
               str what) except -1:
    cdef Py_ssize_t n = x.shape[0], f = x.shape[1], total = n * f, it, i0
    cdef const float *src
    cdef float *dst
    _check_threads(nthreads)
    if out.shape[0] != n or out.shape[1] != f:
        raise ValueError(f"{what}: out must be ({n}, {f}) like x, got ({out.shape[0]}, {out.shape[1]})")
    if total == 0:
        return 0
    src = &x[0, 0]
    dst = &out[0, 0]
    for it in prange((total + ELEMENTWISE_CHUNK - 1) // ELEMENTWISE_CHUNK, nogil=True,
                     num_threads=nthreads, schedule="static"):
        i0 = it * ELEMENTWISE_CHUNK
        ks_gelu(src + i0, dst + i0, min(total - i0, <Py_ssize_t>ELEMENTWISE_CHUNK), use_erf)
    return 0


def gelu_tanh(const float[:, ::1] x, float[:, ::1] out, int nthreads):
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), both (n, f) (torch's
    gelu_pytorch_tanh); out may be x."""
    _gelu(x, out, nthreads, False, "gelu_tanh")


def gelu_erf(const float[:, ::1] x, float[:, ::1] out, int nthreads):
    """out = 0.5 x (1 + erf(x / sqrt(2))), both (n, f) (torch's exact gelu), to a relative
    ~1e-6 also in the negative tail; out may be x."""
    _gelu(x, out, nthreads, True, "gelu_erf")


def full_attention(const float[:, :, ::1] q, const float[:, :, ::1] k, const float[:, :, ::1] v,
                   float scale, float[:, :, ::1] out, int nthreads):
    """Bidirectional multi-head attention over n patches: q, k, v, out (n, heads, hd),
    out[t, h] = softmax_j(scale * q[t, h] . k[j, h]) . v[j, h] over all j < n. Online softmax
    over key blocks (no n x n scores); work items (head, tile of queries). Any hd >= 1."""
    cdef Py_ssize_t n = q.shape[0], heads = q.shape[1], hd = q.shape[2]
    cdef Py_ssize_t n_tiles, it, t0
    cdef int64_t scratch_floats
    cdef float *scratch = NULL
    _check_threads(nthreads)
    for name, a in (("k", k), ("v", v), ("out", out)):
        if a.shape[0] != n or a.shape[1] != heads or a.shape[2] != hd:
            raise ValueError(f"full_attention: {name} must be ({n}, {heads}, {hd}) like q, "
                             f"got ({a.shape[0]}, {a.shape[1]}, {a.shape[2]})")
    if n == 0 or heads == 0 or hd == 0:
        return
    n_tiles = (n + KS_VATTN_QUERIES - 1) // KS_VATTN_QUERIES
    scratch_floats = ks_vattn_scratch_floats(<int>hd)
    scratch = <float *>malloc(nthreads * scratch_floats * sizeof(float))
    if scratch == NULL:
        raise MemoryError("full_attention: no memory for the scratch buffers")
    try:
        # an item's head is it // n_tiles: consecutive items read the same head's keys;
        # dynamic, as the cores are shared with whatever else runs
        for it in prange(heads * n_tiles, nogil=True, num_threads=nthreads, schedule="dynamic"):
            t0 = (it % n_tiles) * KS_VATTN_QUERIES
            ks_vattn_item(&q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0], &out[0, 0, 0], <int>n,
                          <int>heads, <int>hd, scale, <int>(it // n_tiles), <int>t0,
                          <int>min(n, t0 + KS_VATTN_QUERIES), scratch + threadid() * scratch_floats)
    finally:
        free(scratch)
