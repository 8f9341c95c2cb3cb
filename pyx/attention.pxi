# The int8 KV cache of one layer and causal attention over it (ks_attention.h); the vision
# encoder's full attention over one image's patches (ks_vision.h).
# Layer layout: kq, vq (n_kv, max_seq, hd) int8; ks, vs (n_kv, max_seq) f32 scales.

cdef int _check_kv_layer(const int8_t[:, :, ::1] kq, const float[:, ::1] ks,
                         const int8_t[:, :, ::1] vq, const float[:, ::1] vs, str what) except -1:
    if (vq.shape[0] != kq.shape[0] or vq.shape[1] != kq.shape[1] or vq.shape[2] != kq.shape[2]):
        raise ValueError(f"{what}: kq and vq must have the same shape, got ({kq.shape[0]}, "
                         f"{kq.shape[1]}, {kq.shape[2]}) and ({vq.shape[0]}, {vq.shape[1]}, {vq.shape[2]})")
    for name, s in (("ks", ks), ("vs", vs)):
        if s.shape[0] != kq.shape[0] or s.shape[1] != kq.shape[1]:
            raise ValueError(f"{what}: {name} must be (n_kv, max_seq) = ({kq.shape[0]}, "
                             f"{kq.shape[1]}), got ({s.shape[0]}, {s.shape[1]})")
    return 0


def kv_store(const float[:, :, ::1] k, const float[:, :, ::1] v, int8_t[:, :, ::1] kq,
             float[:, ::1] ks, int8_t[:, :, ::1] vq, float[:, ::1] vs, int pos0, int nthreads):
    """Stores k, v (n, n_kv, hd) at positions pos0 .. pos0+n-1 of one layer's int8 KV:
    kq[h, pos0+t] = roundf(k[t, h] / s), s = absmax/127 (0 -> all 0), ks[h, pos0+t] = s; same for v."""
    cdef Py_ssize_t n = k.shape[0], n_kv = k.shape[1], hd = k.shape[2], it, t, h
    _check_threads(nthreads)
    _check_kv_layer(kq, ks, vq, vs, "kv_store")
    if v.shape[0] != n or v.shape[1] != n_kv or v.shape[2] != hd:
        raise ValueError(f"kv_store: v must be ({n}, {n_kv}, {hd}) like k, "
                         f"got ({v.shape[0]}, {v.shape[1]}, {v.shape[2]})")
    if kq.shape[0] != n_kv or kq.shape[2] != hd:
        raise ValueError(f"kv_store: the KV layer has {kq.shape[0]} heads of {kq.shape[2]}, "
                         f"k has {n_kv} of {hd}")
    if pos0 < 0 or pos0 + n > kq.shape[1]:
        raise ValueError(f"kv_store: positions {pos0}..{pos0 + n - 1} do not fit "
                         f"max_seq={kq.shape[1]}")
    if n == 0 or n_kv == 0 or hd == 0:
        return
    for it in prange(n * n_kv, nogil=True, num_threads=nthreads, schedule="static"):
        t = it // n_kv
        h = it % n_kv
        ks[h, pos0 + t] = ks_quantize_head(&k[t, h, 0], &kq[h, pos0 + t, 0], <int>hd)
        vs[h, pos0 + t] = ks_quantize_head(&v[t, h, 0], &vq[h, pos0 + t, 0], <int>hd)


def set_attention_tiles(bint enabled):
    """Lets attention share each K / V load among tiles of queries (the default) or compute
    every query alone; the results are the same bits (tests compare the two). Returns the state."""
    return bool(ks_set_attn_tiles(enabled))


def attention(const float[:, :, ::1] q, const int8_t[:, :, ::1] kq, const float[:, ::1] ks,
              const int8_t[:, :, ::1] vq, const float[:, ::1] vs, int pos0, float scale,
              int kv_bs, float[:, :, ::1] out, int nthreads):
    """Causal GQA attention of q (n, n_heads, hd), the queries at positions pos0 .. pos0+n-1,
    over one layer's int8 KV (keys 0 .. pos0+t for query t, already stored):
    out (n, n_heads, hd) = softmax(scale * q . k_j) . v_j, k_j = ks*kq, v_j = vs*vq, with query
    head h reading KV head h // (n_heads // n_kv), each scale * q rounded to the 15 bits of the
    integer scores (ks_attn_quantize_query). Keys go in blocks of kv_bs (a power of two
    >= 16) through an online softmax, in segments of 256 keys from key 0 folded in order, so a
    query's output does not depend on n, pos0's chunking or nthreads. Work items: (16-token
    tile, KV head) in prefill; (KV head, key segment) in decode and passes of up to 8 tokens,
    folded per token and head afterwards."""
    cdef Py_ssize_t n = q.shape[0], n_heads = q.shape[1], hd = q.shape[2]
    cdef Py_ssize_t n_kv = kq.shape[0], max_seq = kq.shape[1]
    cdef Py_ssize_t G, it, n_tiles, n_items, t0, n_seg
    cdef bint split
    cdef int64_t scratch_floats, part_floats
    cdef float *scratch = NULL
    cdef float *parts = NULL
    cdef int8_t *q8 = NULL
    cdef float *qd = NULL
    cdef int32_t *qsum = NULL
    _check_threads(nthreads)
    _check_kv_layer(kq, ks, vq, vs, "attention")
    if kq.shape[2] != hd:
        raise ValueError(f"attention: q has head_dim {hd}, the KV layer {kq.shape[2]}")
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"attention: n_heads={n_heads} is not a multiple of n_kv={n_kv}")
    if hd == 0 or hd % KS_ATTN_STRIP:
        raise ValueError(f"attention: head_dim must be a positive multiple of {KS_ATTN_STRIP}, got {hd}")
    if kv_bs < KS_ATTN_STRIP or kv_bs & (kv_bs - 1):
        raise ValueError(f"attention: kv_bs must be a power of two >= {KS_ATTN_STRIP}, got {kv_bs}")
    if pos0 < 0 or pos0 + n > max_seq:
        raise ValueError(f"attention: positions {pos0}..{pos0 + n - 1} do not fit max_seq={max_seq}")
    if out.shape[0] != n or out.shape[1] != n_heads or out.shape[2] != hd:
        raise ValueError(f"attention: out must be ({n}, {n_heads}, {hd}) like q, "
                         f"got ({out.shape[0]}, {out.shape[1]}, {out.shape[2]})")
    if n == 0 or n_heads == 0:
        return
    G = n_heads // n_kv
    n_seg = part_floats = 0
    try:
        split = n <= KS_ATTN_SPLIT_TOKENS
        if split:
            n_seg = ks_attn_segments(pos0 + n, kv_bs)
            scratch_floats = ks_attn_scratch_floats(<int>(n * G), <int>hd, kv_bs)
            part_floats = ks_attn_part_floats(<int>(n * G), <int>hd)
            parts = <float *>malloc(n_kv * n_seg * part_floats * sizeof(float))
        else:
            scratch_floats = ks_attn_scratch_floats(<int>(KS_ATTN_TOKENS * G), <int>hd, kv_bs)
        scratch = <float *>malloc(nthreads * scratch_floats * sizeof(float))
        q8 = <int8_t *>malloc(n * n_heads * 2 * hd)
        qd = <float *>malloc(n * n_heads * sizeof(float))
        qsum = <int32_t *>malloc(n * n_heads * 2 * sizeof(int32_t))
        if scratch == NULL or (split and parts == NULL) or q8 == NULL or qd == NULL or qsum == NULL:
            raise MemoryError("attention: no memory for the scratch buffers")
        for it in prange(n * n_heads, nogil=True, num_threads=nthreads, schedule="static"):
            ks_attn_quantize_row(&q[0, 0, 0] + it * hd, scale, <int>hd, q8 + it * 2 * hd, qd + it,
                                 qsum + 2 * it)
        if split:
            for it in prange(n_kv * n_seg, nogil=True, num_threads=nthreads, schedule="static"):
                ks_attn_split_item(q8, qd, qsum, &kq[0, 0, 0], &ks[0, 0], &vq[0, 0, 0], &vs[0, 0],
                                   parts + it * part_floats, <int>n_heads, <int>n_kv, <int>hd,
                                   <int>max_seq, pos0, <int>n, kv_bs,
                                   <int>(it % n_seg), <int>(it // n_seg),
                                   scratch + threadid() * scratch_floats)
            for it in prange(n * n_heads, nogil=True, num_threads=nthreads, schedule="static"):
                ks_attn_split_merge(parts, &out[0, 0, 0], <int>n_heads, <int>n_kv, <int>hd,
                                    <int>n, <int>n_seg, <int>(it // n_heads), <int>(it % n_heads))
        else:
            # causal: later tiles see more keys, so they are handed out first
            n_tiles = (n + KS_ATTN_TOKENS - 1) // KS_ATTN_TOKENS
            n_items = n_tiles * n_kv
            for it in prange(n_items, nogil=True, num_threads=nthreads, schedule="dynamic"):
                t0 = (n_tiles - 1 - it // n_kv) * KS_ATTN_TOKENS
                ks_attn_prefill_item(q8, qd, qsum, &kq[0, 0, 0], &ks[0, 0], &vq[0, 0, 0],
                                     &vs[0, 0], &out[0, 0, 0], <int>n_heads, <int>n_kv, <int>hd,
                                     <int>max_seq, pos0, 0, kv_bs, <int>t0,
                                     <int>min(n, t0 + KS_ATTN_TOKENS), <int>(it % n_kv),
                                     scratch + threadid() * scratch_floats)
    finally:
        free(scratch)
        free(parts)
        free(q8)
        free(qd)
        free(qsum)


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
