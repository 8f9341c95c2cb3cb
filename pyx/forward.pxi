# The forward pass (ks_forward.h) over typed weights: the C structs of the weight ABI
# (ks_weights.h) are built here from kestreld/model/weights.py's dataclasses, and each chunk's
# ks_batch from kestreld/engine/forward.py's Batch, by field name.
from libc.stdlib cimport calloc, free
from libc.string cimport memset


cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)


cdef int _fill_matrix(ks_matrix *out, object m, Py_ssize_t rows, Py_ssize_t cols,
                      Py_ssize_t n_mat, str what, bint router=False) except -1:
    """out := the ks_matrix of the Matrix m, checked to be n_mat x (rows, cols) of a type the
    kernels compute on (a router: F32)."""
    cdef const uint8_t[:, ::1] mv2
    cdef const uint8_t[:, :, ::1] mv3
    cdef int qtype = int(m.qtype)
    cdef int64_t rb
    if router and qtype != KS_TYPE_F32:
        raise ValueError(f"Forward: {what} must be F32, got {m.qtype.name}")
    if not router and not ks_type_supported(qtype):
        raise ValueError(f"Forward: {what} is {m.qtype.name}, which the kernels do not compute on")
    if m.rows != rows or m.cols != cols or m.n_mat != n_mat:
        raise ValueError(f"Forward: {what} must be {n_mat} x ({rows}, {cols}), got "
                         f"{m.n_mat} x ({m.rows}, {m.cols})")
    if cols % ks_type_block(qtype):
        raise ValueError(f"Forward: {what} has {cols} columns, not whole blocks of {m.qtype.name}")
    if m.group_rows and (n_mat != 1 or m.group_rows != ks_il_rows(qtype)):
        raise ValueError(f"Forward: {what} ({m.qtype.name}) cannot be interleaved by "
                         f"{m.group_rows} rows here")
    rb = ks_type_row_bytes(qtype, cols)
    out.type, out.rows, out.cols, out.n_mat = qtype, <int32_t>rows, <int32_t>cols, <int32_t>n_mat
    out.row_stride, out.mat_stride = rb, rb * rows
    out.interleave = m.group_rows
    out.copies = NULL
    if m.copies is not None:
        _fill_copies(out, m.copies, what)
    if n_mat == 1 and m.data.ndim == 2:
        mv2 = m.data
        if mv2.shape[1] != rb:
            raise ValueError(f"Forward: {what} rows have {mv2.shape[1]} bytes, want {rb}")
        out.data = &mv2[0, 0]
    else:
        mv3 = m.data
        if mv3.shape[2] != rb:
            raise ValueError(f"Forward: {what} rows have {mv3.shape[2]} bytes, want {rb}")
        out.data = &mv3[0, 0, 0]
    return 0


cdef int _fill_copies(ks_matrix *out, object c, str what) except -1:
    """out's expert copies := the ExpertCopies c (checked against out's shape and type)."""
    cdef uint8_t[:, :, ::1] data = c.data
    cdef uint8_t[:, ::1] state = c.state
    cdef int32_t[::1] left = c.left
    cdef Py_ssize_t groups = (out.rows + c.group_rows - 1) // c.group_rows
    if (c.group_rows != ks_il_rows(out.type) or data.shape[0] != out.n_mat
            or data.shape[1] != groups * c.group_rows or data.shape[2] != out.row_stride
            or state.shape[0] != out.n_mat or state.shape[1] != groups
            or left.shape[0] != out.n_mat):
        raise ValueError(f"Forward: {what} have copies that do not fit them here")
    out.copies, out.copy_state, out.copy_left = &data[0, 0, 0], &state[0, 0], &left[0]
    out.copy_stride = data.shape[1] * data.shape[2]
    out.copy_rows, out.copy_release = c.group_rows, bool(c.release)
    return 0


cdef const float *_vector(object a, Py_ssize_t n, str what) except NULL:
    cdef const float[::1] mv = a
    if mv.shape[0] != n:
        raise ValueError(f"Forward: {what} must have {n} values, got {mv.shape[0]}")
    return &mv[0]


cdef class Forward:
    """The forward pass of one model over one KV arena, for chunks of 1 .. max_chunk tokens,
    in one C call per chunk (every layer), on a team of nthreads threads of its own (the
    caller's and nthreads - 1 started here, which live as long as this object).

    Forward(config, weights, kv, max_chunk, nthreads): config a ModelConfig, weights its
    ModelWeights, kv the KVCache (its arrays are written in place). `run` checks a chunk's
    Batch and runs it; results do not depend on nthreads."""
    cdef ks_model m
    cdef ks_kv kv
    cdef ks_scratch s
    cdef ks_batch b          # the chunk being run (kept after it: see ks_forward)
    cdef ks_forward_job job
    cdef ks_team team
    cdef bint team_up
    cdef ks_layer *layers
    cdef char *scratch
    cdef list _keep          # every array the pointers point into
    cdef int n_moe_layers
    cdef readonly int max_chunk, nthreads

    def __cinit__(self):
        self.layers = NULL
        self.scratch = NULL
        self.team_up = False

    def __dealloc__(self):
        if self.team_up:
            ks_team_free(&self.team)
        free(self.layers)
        free(self.scratch)

    def __init__(self, config, weights, kv, int max_chunk, int nthreads):
        cdef ks_model *m = &self.m
        cdef ks_layer *L
        cdef int8_t[:, :, :, ::1] kq = kv.k_q
        cdef int8_t[:, :, :, ::1] vq = kv.v_q
        cdef float[:, :, ::1] ks = kv.k_s
        cdef float[:, :, ::1] vs = kv.v_s
        cdef Py_ssize_t H = config.hidden, hd = config.head_dim, q_dim, kv_dim, li
        cdef int64_t nbytes
        cdef void *mem = NULL
        _check_threads(nthreads)
        c = config
        if max_chunk < 1:
            raise ValueError(f"Forward: max_chunk must be >= 1, got {max_chunk}")
        if c.n_kv_heads <= 0 or c.n_heads % c.n_kv_heads:
            raise ValueError(f"Forward: n_heads={c.n_heads} is not a multiple of n_kv={c.n_kv_heads}")
        if hd % KS_ATTN_STRIP or hd % KS_QK or H % KS_QK:
            raise ValueError(f"Forward: head_dim {hd} and hidden {H} must be multiples of {KS_QK}")
        if kv.kv_bs < KS_ATTN_STRIP or kv.kv_bs & (kv.kv_bs - 1):
            raise ValueError(f"Forward: kv_bs must be a power of two >= {KS_ATTN_STRIP}, got {kv.kv_bs}")
        if (kq.shape[0] != c.n_layers or kq.shape[1] != c.n_kv_heads or kq.shape[3] != hd
                or vq.shape[0] != kq.shape[0] or vq.shape[1] != kq.shape[1]
                or vq.shape[2] != kq.shape[2] or vq.shape[3] != hd
                or ks.shape[2] != kq.shape[2] or vs.shape[2] != kq.shape[2]):
            raise ValueError(f"Forward: the KV arena is not ({c.n_layers}, {c.n_kv_heads}, max_seq, {hd})")
        q_dim, kv_dim = c.n_heads * hd, c.n_kv_heads * hd
        if len(weights.layers) != c.n_layers:
            raise ValueError(f"Forward: {len(weights.layers)} layers, the config says {c.n_layers}")
        self.max_chunk, self.nthreads = max_chunk, nthreads
        m.n_layers, m.hidden, m.n_heads, m.n_kv, m.hd = c.n_layers, H, c.n_heads, c.n_kv_heads, hd
        m.ffn, m.vocab, m.neox = c.ffn, c.vocab, c.rope_neox
        m.n_exp, m.n_used, m.expert_ffn = c.n_experts, c.n_experts_used, c.expert_ffn
        m.norm_topk, m.eps = c.norm_topk_prob, c.norm_eps
        m.scale = float(1.0 / np.sqrt(hd))
        if c.moe_layers and (not 0 < m.n_used <= m.n_exp or m.expert_ffn % KS_QK):
            raise ValueError(f"Forward: MoE top-{m.n_used} of {m.n_exp} experts of "
                             f"{m.expert_ffn} (a multiple of {KS_QK})")
        if m.ffn % KS_QK:
            raise ValueError(f"Forward: ffn {m.ffn} must be a multiple of {KS_QK}")
        _fill_matrix(&m.tok_embd, weights.tok_embd, c.vocab, H, 1, "tok_embd")
        _fill_matrix(&m.output, weights.output, c.vocab, H, 1, "output")
        m.out_norm = _vector(weights.out_norm, H, "out_norm")
        self.layers = <ks_layer *>calloc(c.n_layers, sizeof(ks_layer))
        if self.layers == NULL:
            raise MemoryError("Forward: no memory for the layer table")
        m.layers = self.layers
        self.n_moe_layers = 0
        for li in range(c.n_layers):
            w = weights.layers[li]
            L = &self.layers[li]
            at = f"layer {li} "
            _fill_matrix(&L.wq, w.wq, q_dim, H, 1, at + "wq")
            _fill_matrix(&L.wk, w.wk, kv_dim, H, 1, at + "wk")
            _fill_matrix(&L.wv, w.wv, kv_dim, H, 1, at + "wv")
            _fill_matrix(&L.wo, w.wo, H, q_dim, 1, at + "wo")
            L.attn_norm = _vector(w.attn_norm, H, at + "attn_norm")
            L.ffn_norm = _vector(w.ffn_norm, H, at + "ffn_norm")
            L.q_norm = _vector(w.q_norm, hd, at + "q_norm") if w.q_norm is not None else NULL
            L.k_norm = _vector(w.k_norm, hd, at + "k_norm") if w.k_norm is not None else NULL
            if w.moe is None:
                _fill_matrix(&L.gate, w.w_gate, m.ffn, H, 1, at + "w_gate")
                _fill_matrix(&L.up, w.w_up, m.ffn, H, 1, at + "w_up")
                _fill_matrix(&L.down, w.w_down, H, m.ffn, 1, at + "w_down")
            else:
                _fill_matrix(&L.router, w.moe.router, m.n_exp, H, 1, at + "router", True)
                _fill_matrix(&L.gate, w.moe.gate, m.expert_ffn, H, m.n_exp, at + "gate experts")
                _fill_matrix(&L.up, w.moe.up, m.expert_ffn, H, m.n_exp, at + "up experts")
                _fill_matrix(&L.down, w.moe.down, H, m.expert_ffn, m.n_exp, at + "down experts")
                self.n_moe_layers += 1
        self.kv.k_q, self.kv.v_q = &kq[0, 0, 0, 0], &vq[0, 0, 0, 0]
        self.kv.k_s, self.kv.v_s = &ks[0, 0, 0], &vs[0, 0, 0]
        self.kv.max_seq, self.kv.kv_bs = kq.shape[2], kv.kv_bs
        self._keep = [weights, kv]
        nbytes = ks_scratch_layout(&self.s, NULL, m, max_chunk, nthreads, self.kv.max_seq, kv.kv_bs)
        if posix_memalign(&mem, 64, nbytes) != 0:
            raise MemoryError(f"Forward: no memory for {nbytes} bytes of buffers")
        self.scratch = <char *>mem
        ks_scratch_layout(&self.s, self.scratch, m, max_chunk, nthreads, self.kv.max_seq,
                          kv.kv_bs)
        memset(&self.b, 0, sizeof(ks_batch))
        self.job.M, self.job.kv, self.job.S, self.job.B = &self.m, &self.kv, &self.s, &self.b
        if ks_team_init(&self.team, nthreads, ks_forward_phases(c.n_layers), ks_forward_walk) != 0:
            raise MemoryError(f"Forward: cannot start {nthreads - 1} threads")
        self.team_up = True

    @property
    def working_threads(self):
        """Threads that took work in their last pass: nthreads on a quiet machine, fewer
        while other processes hold cores (their share then goes to the threads that run)."""
        return ks_team_working(&self.team)

    @property
    def scratch_bytes(self):
        """Bytes of the buffers allocated for one chunk (once, at construction)."""
        cdef ks_scratch s
        return ks_scratch_layout(&s, NULL, &self.m, self.max_chunk, self.nthreads,
                                 self.kv.max_seq, self.kv.kv_bs)

    def run(self, batch):
        """Runs one chunk, `batch` a kestreld.engine.forward.Batch (ks_batch's fields, read
        by name): its `tokens` (n <= max_chunk) at KV rows pos0 .. pos0 + n - 1 (rows before
        pos0 valid), storing their KV. rope_cos, rope_sin (n, head_dim/2): each token's
        rotation. logits: (1, vocab) for the last token's, or (n, vocab) for every token's.
        Qwen3-VL: vis_rows (r,) int32 rows of the chunk whose input embeddings are
        vis_embd (r, hidden); deep (d, r, hidden): DeepStack features added to those rows
        after layers 0 .. d-1. routing: None or int32 (MoE layers, n, n_used), filled with
        the experts each token chose. hidden: None, or (1, hidden) / (n, hidden) that
        receives the last / every token's row after the output norm instead of logits
        (embeddings; logits is then not read and may be None). seq_starts: None, or int32
        (s,) from 0, increasing: packed sequences, each from its token to the next one's,
        whose tokens attend only their own sequence's keys (rows before pos0 included: none)."""
        cdef const int32_t[::1] tokens = batch.tokens
        cdef int pos0 = batch.pos0
        cdef const float[:, ::1] rope_cos = batch.rope_cos
        cdef const float[:, ::1] rope_sin = batch.rope_sin
        cdef float[:, ::1] logits = batch.logits
        cdef float[:, ::1] hidden = batch.hidden
        vis_rows, vis_embd, deep = batch.vis_rows, batch.vis_embd, batch.deep
        routing = batch.routing
        cdef const int32_t[::1] starts = batch.seq_starts
        cdef ks_batch b
        cdef Py_ssize_t n = tokens.shape[0], i
        cdef const int32_t[::1] vr
        cdef const float[:, ::1] ve
        cdef const float[:, :, ::1] dp
        cdef int32_t[:, :, ::1] rt
        if not 0 < n <= self.max_chunk:
            raise ValueError(f"Forward: a chunk of {n} tokens; 1..{self.max_chunk} allowed")
        if pos0 < 0 or pos0 + n > self.kv.max_seq:
            raise ValueError(f"Forward: rows {pos0}..{pos0 + n - 1} do not fit max_seq={self.kv.max_seq}")
        for i in range(n):
            if not 0 <= tokens[i] < self.m.vocab:
                raise ValueError(f"Forward: token {tokens[i]} is outside [0, {self.m.vocab})")
        if (rope_cos.shape[0] != n or rope_cos.shape[1] != self.m.hd // 2
                or rope_sin.shape[0] != n or rope_sin.shape[1] != self.m.hd // 2):
            raise ValueError(f"Forward: rope tables must be ({n}, {self.m.hd // 2})")
        b.n, b.pos0, b.tokens = <int>n, pos0, &tokens[0]
        b.rope_cos, b.rope_sin = &rope_cos[0, 0], &rope_sin[0, 0]
        if hidden is not None:
            if hidden.shape[1] != self.m.hidden or hidden.shape[0] not in (1, n):
                raise ValueError(f"Forward: hidden must be (1, {self.m.hidden}) or ({n}, "
                                 f"{self.m.hidden}), got ({hidden.shape[0]}, {hidden.shape[1]})")
            b.logits, b.hidden, b.all_logits = NULL, &hidden[0, 0], hidden.shape[0] == n and n > 1
        elif logits is None or logits.shape[1] != self.m.vocab or logits.shape[0] not in (1, n):
            raise ValueError(f"Forward: logits must be (1, {self.m.vocab}) or ({n}, {self.m.vocab})"
                             + ("" if logits is None else
                                f", got ({logits.shape[0]}, {logits.shape[1]})"))
        else:
            b.logits, b.hidden, b.all_logits = &logits[0, 0], NULL, logits.shape[0] == n and n > 1
        b.n_vis, b.vis_rows, b.vis_embd, b.n_deep, b.deep, b.routing = 0, NULL, NULL, 0, NULL, NULL
        b.n_seqs, b.seq_starts = 0, NULL
        if starts is not None:
            ok = starts.shape[0] > 0 and starts[0] == 0
            for i in range(1, starts.shape[0]):
                ok = ok and starts[i - 1] < starts[i] < n
            if not ok:
                raise ValueError(f"Forward: seq_starts must rise from 0 within the chunk of {n}")
            b.n_seqs, b.seq_starts = <int>starts.shape[0], &starts[0]
        if vis_rows is not None and len(vis_rows):
            vr, ve = vis_rows, vis_embd
            if ve.shape[0] != vr.shape[0] or ve.shape[1] != self.m.hidden:
                raise ValueError(f"Forward: vis_embd must be ({vr.shape[0]}, {self.m.hidden})")
            for i in range(vr.shape[0]):
                if not 0 <= vr[i] < n:
                    raise ValueError(f"Forward: visual row {vr[i]} is outside the chunk of {n}")
            b.n_vis, b.vis_rows, b.vis_embd = <int>vr.shape[0], &vr[0], &ve[0, 0]
            if deep is not None and len(deep):
                dp = deep
                if (dp.shape[0] > self.m.n_layers or dp.shape[1] != vr.shape[0]
                        or dp.shape[2] != self.m.hidden):
                    raise ValueError(f"Forward: deep must be (<= {self.m.n_layers}, "
                                     f"{vr.shape[0]}, {self.m.hidden})")
                b.n_deep, b.deep = <int>dp.shape[0], &dp[0, 0, 0]
        if routing is not None:
            rt = routing
            if rt.shape[0] != self.n_moe_layers or rt.shape[1] != n or rt.shape[2] != self.m.n_used:
                raise ValueError(f"Forward: routing must be ({self.n_moe_layers}, {n}, {self.m.n_used})")
            b.routing = &rt[0, 0, 0]
        self.b = b
        with nogil:
            ks_forward(&self.team, &self.job)
