# One decode step in one call: every layer of a single token, in C (ks_decode.h).
# Layer tuples: (wq, wk, wv, wo, w_gate, w_up, w_down) Q8_0 bytes, then attn_norm, ffn_norm,
# q_norm, k_norm (f32; q_norm/k_norm may be None), then moe: None, or for a Qwen3-MoE layer
# (router (E, hidden) f32, gate, up, down: E stacked Q8_0 matrices as uint8 (E, rows, bytes))
# with w_gate/w_up/w_down None; KV tuples: one arena layer (kq, ks, vq, vs).

cdef const uint8_t *_q8_ptr(object a, Py_ssize_t rows, Py_ssize_t cols, str what) except NULL:
    cdef const uint8_t[:, ::1] mv = a
    if mv.shape[0] != rows or mv.shape[1] != cols // KS_QK * KS_QBLOCK:
        raise ValueError(f"DecodeStep: {what} must be Q8_0 ({rows}, {cols}) = bytes ({rows}, "
                         f"{cols // KS_QK * KS_QBLOCK}), got ({mv.shape[0]}, {mv.shape[1]})")
    return &mv[0, 0]


cdef const float *_vec_ptr(object a, Py_ssize_t n, str what) except NULL:
    cdef const float[::1] mv = a
    if mv.shape[0] != n:
        raise ValueError(f"DecodeStep: {what} must have {n} values, got {mv.shape[0]}")
    return &mv[0]


cdef const uint8_t *_q8_stack_ptr(object a, Py_ssize_t n, Py_ssize_t rows, Py_ssize_t cols,
                                  str what) except NULL:
    cdef const uint8_t[:, :, ::1] mv = a
    if mv.shape[0] != n or mv.shape[1] != rows or mv.shape[2] != cols // KS_QK * KS_QBLOCK:
        raise ValueError(f"DecodeStep: {what} must be {n} stacked Q8_0 ({rows}, {cols}) = bytes "
                         f"({n}, {rows}, {cols // KS_QK * KS_QBLOCK}), got ({mv.shape[0]}, "
                         f"{mv.shape[1]}, {mv.shape[2]})")
    return &mv[0, 0, 0]


cdef float *_buf(object a) except NULL:
    cdef float[::1] mv = a
    return &mv[0]


cdef class DecodeStep:
    """The decode forward pass of one model over one KV arena, in one C call per token.

    DecodeStep(tok_embd, output, out_norm, cos_t, sin_t, layers, kv_layers, n_heads, n_kv,
               eps, scale, kv_bs, neox, nthreads, n_experts_used=0, norm_topk_prob=False):
    arrays as forward.py holds them (see decode.pxi's header for the tuples); the last two
    are the MoE layers' top-k and its renormalization. `step(token, pos, logits (1, vocab))`
    runs the token at pos, stores its KV, writes its logits: the same bits as the per-kernel
    path."""
    cdef ks_model m
    cdef ks_layer *layers
    cdef list _keep          # every array the pointers point into
    cdef int nthreads
    cdef Py_ssize_t rope_rows   # positions the RoPE tables cover

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, tok_embd, output, out_norm, cos_t, sin_t, list layers, list kv_layers,
                 int n_heads, int n_kv, float eps, float scale, int kv_bs, bint neox, int nthreads,
                 int n_experts_used=0, bint norm_topk_prob=False):
        cdef const uint8_t[:, ::1] emb = tok_embd
        cdef const float[:, ::1] ct = cos_t
        cdef const float[:, ::1] st = sin_t
        cdef int8_t[:, :, ::1] kq
        cdef int8_t[:, :, ::1] vq
        cdef float[:, ::1] ks
        cdef float[:, ::1] vs
        cdef int8_t[::1] xq_mv
        cdef int32_t[::1] idx_mv
        cdef ks_model *m = &self.m
        cdef ks_layer *L
        cdef const float[:, ::1] router
        cdef Py_ssize_t H = emb.shape[1] // KS_QBLOCK * KS_QK, li, G, hd, q_dim, kv_dim, ffn
        cdef Py_ssize_t n_exp = 0, eff = 0
        _check_threads(nthreads)
        if len(layers) != len(kv_layers) or not layers:
            raise ValueError(f"DecodeStep: {len(layers)} layers and {len(kv_layers)} KV layers")
        if n_kv <= 0 or n_heads % n_kv:
            raise ValueError(f"DecodeStep: n_heads={n_heads} is not a multiple of n_kv={n_kv}")
        kq = kv_layers[0][0]
        hd = kq.shape[2]
        if kq.shape[0] != n_kv or hd % KS_ATTN_STRIP or hd % KS_QK:
            raise ValueError(f"DecodeStep: the KV has {kq.shape[0]} heads of {hd}; want {n_kv} "
                             f"heads of a multiple of {KS_QK}")
        if kv_bs < KS_ATTN_STRIP or kv_bs & (kv_bs - 1):
            raise ValueError(f"DecodeStep: kv_bs must be a power of two >= {KS_ATTN_STRIP}, got {kv_bs}")
        G = n_heads // n_kv
        q_dim, kv_dim = n_heads * hd, n_kv * hd
        dense = [w for w in layers if w[11] is None]
        ffn = dense[0][4].shape[0] if dense else 0
        moe = [w[11] for w in layers if w[11] is not None]
        if moe:
            n_exp, eff = moe[0][1].shape[0], moe[0][1].shape[1]
            if not 0 < n_experts_used <= n_exp:
                raise ValueError(f"DecodeStep: n_experts_used must be in 1..{n_exp}, "
                                 f"got {n_experts_used}")
        if ct.shape[0] < kq.shape[1] or ct.shape[1] != hd // 2 or st.shape[0] != ct.shape[0] \
                or st.shape[1] != ct.shape[1]:
            raise ValueError(f"DecodeStep: rope tables must be ({kq.shape[1]}, {hd // 2})")
        self._keep = [tok_embd, output, out_norm, cos_t, sin_t, layers, kv_layers]
        self.nthreads = nthreads
        self.rope_rows = ct.shape[0]
        m.n_layers, m.hidden, m.n_heads, m.n_kv, m.hd = len(layers), H, n_heads, n_kv, hd
        m.ffn, m.vocab, m.max_seq, m.kv_bs, m.neox = ffn, emb.shape[0], kq.shape[1], kv_bs, neox
        m.eps, m.scale = eps, scale
        m.n_exp, m.n_used, m.expert_ffn, m.norm_topk = n_exp, n_experts_used, eff, norm_topk_prob
        m.tok_embd = &emb[0, 0]
        m.output = _q8_ptr(output, m.vocab, H, "output")
        m.out_norm = _vec_ptr(out_norm, H, "out_norm")
        m.cos_t, m.sin_t = &ct[0, 0], &st[0, 0]
        self.layers = <ks_layer *>malloc(len(layers) * sizeof(ks_layer))
        if self.layers == NULL:
            raise MemoryError("DecodeStep: no memory for the layer table")
        m.layers = self.layers
        for li in range(len(layers)):
            w = layers[li]
            L = &self.layers[li]
            L.wq = _q8_ptr(w[0], q_dim, H, "wq")
            L.wk = _q8_ptr(w[1], kv_dim, H, "wk")
            L.wv = _q8_ptr(w[2], kv_dim, H, "wv")
            L.wo = _q8_ptr(w[3], H, q_dim, "wo")
            L.w_gate = L.w_up = L.w_down = L.gate_exps = L.up_exps = L.down_exps = NULL
            L.router = NULL
            if w[11] is None:
                L.w_gate = _q8_ptr(w[4], ffn, H, "w_gate")
                L.w_up = _q8_ptr(w[5], ffn, H, "w_up")
                L.w_down = _q8_ptr(w[6], H, ffn, "w_down")
            else:
                router = w[11][0]
                if router.shape[0] != n_exp or router.shape[1] != H:
                    raise ValueError(f"DecodeStep: router must be ({n_exp}, {H}), "
                                     f"got ({router.shape[0]}, {router.shape[1]})")
                L.router = &router[0, 0]
                L.gate_exps = _q8_stack_ptr(w[11][1], n_exp, eff, H, "gate experts")
                L.up_exps = _q8_stack_ptr(w[11][2], n_exp, eff, H, "up experts")
                L.down_exps = _q8_stack_ptr(w[11][3], n_exp, H, eff, "down experts")
            L.attn_norm = _vec_ptr(w[7], H, "attn_norm")
            L.ffn_norm = _vec_ptr(w[8], H, "ffn_norm")
            L.q_norm = L.k_norm = NULL
            if w[9] is not None:
                L.q_norm = _vec_ptr(w[9], hd, "q_norm")
            if w[10] is not None:
                L.k_norm = _vec_ptr(w[10], hd, "k_norm")
            kq, ks, vq, vs = kv_layers[li]
            _check_kv_layer(kq, ks, vq, vs, "DecodeStep")
            if kq.shape[0] != n_kv or kq.shape[1] != m.max_seq or kq.shape[2] != hd:
                raise ValueError(f"DecodeStep: KV layer {li} is not ({n_kv}, {m.max_seq}, {hd})")
            L.kq, L.ks, L.vq, L.vs = &kq[0, 0, 0], &ks[0, 0], &vq[0, 0, 0], &vs[0, 0]
        widest = max(H, q_dim, ffn)
        bufs = {name: np.zeros(size, dtype=np.float32) for name, size in (
            ("x", nthreads * H), ("xn", nthreads * H), ("xnd", nthreads * H // KS_QK), ("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("att", q_dim),
            ("proj", H), ("gate", max(ffn, 1)), ("up", max(ffn, 1)), ("xd", widest // KS_QK),
            ("attn_scratch", nthreads * ks_attn_scratch_floats(<int>G, <int>hd, kv_bs)),
            ("attn_parts", n_kv * KS_ATTN_SPLIT_MAX * ks_attn_part_floats(<int>G, <int>hd)),
            ("probs", max(n_exp, 1)), ("top_w", max(n_experts_used, 1)),
            ("egate", max(n_experts_used * eff, 1)), ("eup", max(n_experts_used * eff, 1)),
            ("ehd", max(n_experts_used * eff // KS_QK, 1)), ("ey", max(n_experts_used * H, 1)))}
        xq = np.zeros(widest, dtype=np.int8)
        xnq = np.zeros(nthreads * H, dtype=np.int8)
        ehq = np.zeros(max(n_experts_used * eff, 1), dtype=np.int8)
        top_idx = np.zeros(max(n_experts_used, 1), dtype=np.int32)
        self._keep += [bufs, xq, xnq, ehq, top_idx]
        m.x, m.xn, m.q, m.k = _buf(bufs["x"]), _buf(bufs["xn"]), _buf(bufs["q"]), _buf(bufs["k"])
        m.v, m.att, m.proj = _buf(bufs["v"]), _buf(bufs["att"]), _buf(bufs["proj"])
        m.gate, m.up, m.xd = _buf(bufs["gate"]), _buf(bufs["up"]), _buf(bufs["xd"])
        m.attn_scratch, m.attn_parts = _buf(bufs["attn_scratch"]), _buf(bufs["attn_parts"])
        m.probs, m.top_w = _buf(bufs["probs"]), _buf(bufs["top_w"])
        m.egate, m.eup, m.ehd, m.ey = _buf(bufs["egate"]), _buf(bufs["eup"]), _buf(bufs["ehd"]), _buf(bufs["ey"])
        xq_mv = xq
        m.xq = &xq_mv[0]
        xq_mv = xnq
        m.xnq = &xq_mv[0]
        m.xnd = _buf(bufs["xnd"])
        xq_mv = ehq
        m.ehq = &xq_mv[0]
        idx_mv = top_idx
        m.top_idx = &idx_mv[0]

    def step(self, int token, int pos, float[:, ::1] logits, int rope_pos=-1):
        """Runs `token` at position `pos` (KV of 0 .. pos-1 stored); logits (1, vocab).
        rope_pos >= 0: RoPE turns the token by rope_pos instead of pos (Qwen3-VL text after
        images, whose three M-RoPE components are all rope_pos)."""
        if rope_pos < 0:
            rope_pos = pos
        if not 0 <= token < self.m.vocab:
            raise ValueError(f"DecodeStep: token {token} is outside [0, {self.m.vocab})")
        if not 0 <= pos < self.m.max_seq:
            raise ValueError(f"DecodeStep: position {pos} is outside [0, {self.m.max_seq})")
        if rope_pos >= self.rope_rows:
            raise ValueError(f"DecodeStep: RoPE position {rope_pos} is outside [0, {self.rope_rows})")
        if logits.shape[0] != 1 or logits.shape[1] != self.m.vocab:
            raise ValueError(f"DecodeStep: logits must be (1, {self.m.vocab}), "
                             f"got ({logits.shape[0]}, {logits.shape[1]})")
        with nogil:
            ks_decode_step(&self.m, token, pos, rope_pos, &logits[0, 0], self.nthreads)
