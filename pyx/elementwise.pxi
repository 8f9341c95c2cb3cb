# Row-wise and element-wise float kernels: RMSNorm, RoPE, SwiGLU.

def rmsnorm(const float[:, ::1] x, const float[::1] w, float eps, float[:, ::1] out, int nthreads):
    """out (n, d) = x / sqrt(mean(x^2, row) + eps) * w (d); out may be x (in place).

    Also the per-head q/k norm of Qwen3: x (n * heads, head_dim), w (head_dim)."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], i
    _check_threads(nthreads)
    if w.shape[0] != d:
        raise ValueError(f"rmsnorm: w must have {d} values (x's columns), got {w.shape[0]}")
    if out.shape[0] != n or out.shape[1] != d:
        raise ValueError(f"rmsnorm: out must be ({n}, {d}) like x, got ({out.shape[0]}, {out.shape[1]})")
    if n == 0 or d == 0:
        return
    for i in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_rmsnorm_row(&x[i, 0], &w[0], eps, &out[i, 0], d)


def rope(float[:, :, ::1] x, const float[:, ::1] cos_t, const float[:, ::1] sin_t, int pos0,
         bint neox, int nthreads):
    """Rotates x (n, heads, hd) in place; row t is at position pos0 + t and uses
    cos_t[pos0 + t], sin_t[pos0 + t] (tables (max_pos, hd/2)).

    neox: pairs (x[i], x[i + hd/2]) (Qwen3, HF Llama); else pairs (x[2i], x[2i+1]) (GGUF Llama)."""
    cdef Py_ssize_t n = x.shape[0], heads = x.shape[1], hd = x.shape[2], half = hd // 2
    cdef Py_ssize_t it, t
    _check_threads(nthreads)
    if hd % 2:
        raise ValueError(f"rope: head_dim must be even, got {hd}")
    if cos_t.shape[1] != half or sin_t.shape[1] != half or cos_t.shape[0] != sin_t.shape[0]:
        raise ValueError(f"rope: cos_t and sin_t must both be (max_pos, {half}), got "
                         f"({cos_t.shape[0]}, {cos_t.shape[1]}) and ({sin_t.shape[0]}, {sin_t.shape[1]})")
    if pos0 < 0 or pos0 + n > cos_t.shape[0]:
        raise ValueError(f"rope: positions {pos0}..{pos0 + n - 1} are outside the tables' "
                         f"{cos_t.shape[0]} positions")
    if n == 0 or heads == 0 or hd == 0:
        return
    for it in prange(n * heads, nogil=True, num_threads=nthreads, schedule="static"):
        t = it // heads
        ks_rope_row(&x[t, it % heads, 0], &cos_t[pos0 + t, 0], &sin_t[pos0 + t, 0], hd, neox)


def swiglu(const float[:, ::1] gate, const float[:, ::1] up, float[:, ::1] out, int nthreads):
    """out = gate * sigmoid(gate) * up, all (n, f); out may be gate."""
    cdef Py_ssize_t n = gate.shape[0], f = gate.shape[1], total = n * f
    cdef Py_ssize_t it, i0
    cdef const float *g
    cdef const float *u
    cdef float *o
    _check_threads(nthreads)
    if up.shape[0] != n or up.shape[1] != f or out.shape[0] != n or out.shape[1] != f:
        raise ValueError(f"swiglu: gate, up and out must all be ({n}, {f}), got up "
                         f"({up.shape[0]}, {up.shape[1]}) and out ({out.shape[0]}, {out.shape[1]})")
    if total == 0:
        return
    g = &gate[0, 0]
    u = &up[0, 0]
    o = &out[0, 0]
    # flat chunks, so a single decode row is split across threads too
    for it in prange((total + ELEMENTWISE_CHUNK - 1) // ELEMENTWISE_CHUNK, nogil=True,
                     num_threads=nthreads, schedule="static"):
        i0 = it * ELEMENTWISE_CHUNK
        ks_swiglu(g + i0, u + i0, o + i0, min(total - i0, <Py_ssize_t>ELEMENTWISE_CHUNK))
