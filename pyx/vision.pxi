# The vision encoder (ks_vision.h): `VisionBlocks`, every block of the tower over one image in
# one C call, and the float kernels the mergers call: LayerNorm with bias, GELU (erf, and its
# tanh twin). Its full (non-causal) attention on its own, for the tests: attention.pxi.

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


cdef class VisionBlocks:
    """The blocks of a vision tower, run over one image in one C call (ks_vision.h) on a team
    of nthreads threads started for that call: per block LayerNorm, the qkv product, 2-D
    RoPE, full attention, proj, LayerNorm, fc1, GELU (tanh), fc2, residual adds; the linears
    in any weight type the kernels compute on. Results do not depend on nthreads.

    VisionBlocks(blocks, n_heads, eps, deepstack): blocks a list of VisionBlock
    (kestreld/vision/encoder.py), deepstack the indices of the blocks whose outputs are
    DeepStack features."""
    cdef ks_vtower V
    cdef ks_vblock *blocks
    cdef int32_t[::1] deep_after
    cdef list _keep          # every array the pointers point into

    def __cinit__(self):
        self.blocks = NULL

    def __dealloc__(self):
        free(self.blocks)

    def __init__(self, blocks, int n_heads, float eps, deepstack):
        cdef ks_vblock *B
        cdef Py_ssize_t depth = len(blocks), H, F, i
        if depth < 1:
            raise ValueError("VisionBlocks: no blocks")
        H, F = blocks[0].qkv.cols, blocks[0].fc1.rows
        if n_heads < 1 or H % n_heads or (H // n_heads) % 2 or H % KS_QK or F % KS_QK:
            raise ValueError(f"VisionBlocks: hidden {H} in {n_heads} heads of an even size, "
                             f"hidden and ffn {F} multiples of {KS_QK}")
        self.deep_after = np.asarray(deepstack, np.int32).reshape(-1).copy()
        for i in range(self.deep_after.shape[0]):
            if not 0 <= self.deep_after[i] < depth:
                raise ValueError(f"VisionBlocks: DeepStack block {self.deep_after[i]} of {depth}")
        self.blocks = <ks_vblock *>calloc(depth, sizeof(ks_vblock))
        if self.blocks == NULL:
            raise MemoryError("VisionBlocks: no memory for the block table")
        for i in range(depth):
            b, at = blocks[i], f"vision block {i} "
            B = &self.blocks[i]
            _fill_matrix(&B.qkv, b.qkv, 3 * H, H, 1, at + "qkv")
            _fill_matrix(&B.proj, b.proj, H, H, 1, at + "proj")
            _fill_matrix(&B.fc1, b.fc1, F, H, 1, at + "fc1")
            _fill_matrix(&B.fc2, b.fc2, H, F, 1, at + "fc2")
            B.qkv_b = _vector(b.qkv_b, 3 * H, at + "qkv_b")
            B.proj_b = _vector(b.proj_b, H, at + "proj_b")
            B.fc1_b = _vector(b.fc1_b, F, at + "fc1_b")
            B.fc2_b = _vector(b.fc2_b, H, at + "fc2_b")
            B.norm1_w = _vector(b.norm1_w, H, at + "norm1_w")
            B.norm1_b = _vector(b.norm1_b, H, at + "norm1_b")
            B.norm2_w = _vector(b.norm2_w, H, at + "norm2_w")
            B.norm2_b = _vector(b.norm2_b, H, at + "norm2_b")
        self._keep = list(blocks)
        self.V.depth, self.V.hidden, self.V.n_heads, self.V.ffn = <int>depth, <int>H, n_heads, <int>F
        self.V.eps, self.V.scale = eps, (H // n_heads) ** -0.5
        self.V.blocks = self.blocks
        self.V.n_deep = <int>self.deep_after.shape[0]
        self.V.deep_after = &self.deep_after[0] if self.V.n_deep else NULL

    def run(self, float[:, ::1] x, const float[:, ::1] rope_cos, const float[:, ::1] rope_sin,
            float[:, :, ::1] deep, int nthreads):
        """Every block over x (n patches, hidden), in place: x becomes the last block's output
        and deep (len(deepstack), n, hidden) the DeepStack blocks' outputs. rope_cos,
        rope_sin (n, head_dim/2): each patch's rotation (rotate-half pairs)."""
        cdef Py_ssize_t n = x.shape[0], H = self.V.hidden, half = H // self.V.n_heads // 2
        cdef ks_vpass P
        cdef ks_vision_job job
        cdef ks_team team
        cdef int64_t nbytes
        cdef void *mem = NULL
        _check_threads(nthreads)
        if n < 1 or x.shape[1] != H:
            raise ValueError(f"VisionBlocks: x must be (n >= 1, {H}), got ({n}, {x.shape[1]})")
        if (rope_cos.shape[0] != n or rope_cos.shape[1] != half
                or rope_sin.shape[0] != n or rope_sin.shape[1] != half):
            raise ValueError(f"VisionBlocks: rope tables must be ({n}, {half})")
        if deep.shape[0] != self.V.n_deep or deep.shape[1] != n or deep.shape[2] != H:
            raise ValueError(f"VisionBlocks: deep must be ({self.V.n_deep}, {n}, {H}), "
                             f"got ({deep.shape[0]}, {deep.shape[1]}, {deep.shape[2]})")
        memset(&P, 0, sizeof(ks_vpass))
        nbytes = ks_vpass_layout(&P, NULL, &self.V, <int>n, nthreads)
        if posix_memalign(&mem, 64, nbytes) != 0:
            raise MemoryError(f"VisionBlocks: no memory for {nbytes} bytes of buffers")
        ks_vpass_layout(&P, <char *>mem, &self.V, <int>n, nthreads)
        P.x, P.rope_cos, P.rope_sin = &x[0, 0], &rope_cos[0, 0], &rope_sin[0, 0]
        P.deep = &deep[0, 0, 0] if self.V.n_deep else NULL
        job.V, job.P = &self.V, &P
        if ks_team_init(&team, nthreads, ks_vision_phases(self.V.depth), ks_vision_walk) != 0:
            free(mem)
            raise MemoryError(f"VisionBlocks: cannot start {nthreads - 1} threads")
        with nogil:
            ks_vision_blocks(&team, &job)
            ks_team_free(&team)
        free(mem)
