# Qwen3-MoE's routing as per-op entry points for the tests: the router (softmax + top-k),
# grouping (token, slot) pairs by expert, and the router-weighted sum of the experts'
# outputs. The C functions (ks_moe.h) are those the forward pass calls, but for the router's
# dot products, which it computes in items of experts before ks_moe_select.


def moe_route(const float[:, ::1] x, const float[:, ::1] router, bint norm_topk,
              float[:, ::1] probs, int32_t[:, ::1] top_idx, float[:, ::1] top_w, int nthreads):
    """Router of n tokens over E experts, choosing k = top_idx.shape[1] per token.

    x (n, d) f32, router (E, d) f32. OUT: probs (n, E) = softmax over e of x[t] . router[e];
    top_idx (n, k) int32 the k most probable experts, most probable first (ties: lower
    index first); top_w (n, k) their probabilities, divided by their sum when norm_topk."""
    cdef Py_ssize_t n = x.shape[0], d = x.shape[1], n_exp = router.shape[0]
    cdef Py_ssize_t k = top_idx.shape[1], t
    _check_threads(nthreads)
    if router.shape[1] != d:
        raise ValueError(f"moe_route: router must be (E, {d}) like x's columns, "
                         f"got ({n_exp}, {router.shape[1]})")
    if probs.shape[0] != n or probs.shape[1] != n_exp:
        raise ValueError(f"moe_route: probs must be ({n}, {n_exp}), "
                         f"got ({probs.shape[0]}, {probs.shape[1]})")
    if not 0 < k <= n_exp:
        raise ValueError(f"moe_route: k = top_idx.shape[1] must be in 1..{n_exp}, got {k}")
    if top_idx.shape[0] != n or top_w.shape[0] != n or top_w.shape[1] != k:
        raise ValueError(f"moe_route: top_idx and top_w must both be ({n}, {k}), got "
                         f"({top_idx.shape[0]}, {k}) and ({top_w.shape[0]}, {top_w.shape[1]})")
    if n == 0:
        return
    for t in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_moe_route_row(&x[t, 0], &router[0, 0], d, <int>n_exp, norm_topk, &probs[t, 0],
                         &top_idx[t, 0], &top_w[t, 0], <int>k)


def moe_group(const int32_t[:, ::1] top_idx, int32_t[::1] counts, int32_t[::1] offsets,
              int32_t[::1] rows, int32_t[:, ::1] slot_pos, int32_t[::1] active):
    """Sorts the n*k (token, slot) pairs of top_idx (n, k) by expert (stable counting sort)
    and returns n_active, the number of experts chosen at least once.

    OUT: counts, offsets (E,): expert e owns sorted entries offsets[e] .. offsets[e] +
    counts[e] - 1, in token order; rows (n*k,): the token of each sorted entry;
    slot_pos (n, k): the sorted entry of pair (t, j); active[:n_active] (E,): the chosen
    experts, ascending."""
    cdef Py_ssize_t n = top_idx.shape[0], k = top_idx.shape[1], n_exp = counts.shape[0]
    cdef Py_ssize_t t, j, e
    cdef int n_active
    if offsets.shape[0] != n_exp or active.shape[0] != n_exp:
        raise ValueError(f"moe_group: counts, offsets and active must all be ({n_exp},), got "
                         f"({offsets.shape[0]},) and ({active.shape[0]},)")
    if rows.shape[0] != n * k:
        raise ValueError(f"moe_group: rows must be ({n * k},), got ({rows.shape[0]},)")
    if slot_pos.shape[0] != n or slot_pos.shape[1] != k:
        raise ValueError(f"moe_group: slot_pos must be ({n}, {k}) like top_idx, "
                         f"got ({slot_pos.shape[0]}, {slot_pos.shape[1]})")
    for t in range(n):
        for j in range(k):
            if top_idx[t, j] < 0 or top_idx[t, j] >= n_exp:
                raise ValueError(f"moe_group: expert {top_idx[t, j]} at ({t}, {j}) is "
                                 f"outside [0, {n_exp})")
    if n == 0:
        for e in range(n_exp):
            counts[e] = 0
            offsets[e] = 0
        return 0
    with nogil:
        n_active = ks_moe_group(&top_idx[0, 0], <int>n, <int>k, <int>n_exp, &counts[0],
                                &offsets[0], &rows[0], &slot_pos[0, 0], &active[0])
    return n_active


def moe_combine(const float[:, ::1] y, const int32_t[:, ::1] slot_pos, const float[:, ::1] top_w,
                float[:, ::1] out, int nthreads):
    """out[t] += sum over j = 0..k-1 (in that order) of top_w[t, j] * y[slot_pos[t, j]]:
    the experts' outputs y (n*k, d), weighted by the router, added into out (n, d).
    slot_pos, top_w: (n, k)."""
    cdef Py_ssize_t n = out.shape[0], d = out.shape[1], k = slot_pos.shape[1], m = y.shape[0]
    cdef Py_ssize_t t, j
    _check_threads(nthreads)
    if y.shape[1] != d:
        raise ValueError(f"moe_combine: y must have {d} columns like out, got {y.shape[1]}")
    if slot_pos.shape[0] != n or top_w.shape[0] != n or top_w.shape[1] != k:
        raise ValueError(f"moe_combine: slot_pos and top_w must both be ({n}, {k}), got "
                         f"({slot_pos.shape[0]}, {k}) and ({top_w.shape[0]}, {top_w.shape[1]})")
    for t in range(n):
        for j in range(k):
            if slot_pos[t, j] < 0 or slot_pos[t, j] >= m:
                raise ValueError(f"moe_combine: slot {slot_pos[t, j]} at ({t}, {j}) is "
                                 f"outside y's {m} rows")
    if n == 0 or d == 0:
        return
    for t in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
        ks_moe_combine_row(&out[t, 0], &y[0, 0], &slot_pos[t, 0], &top_w[t, 0], <int>k, d)
