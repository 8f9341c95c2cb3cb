# C declarations of the kernel headers (pyx/ks_*.h), cimported by _kernels.pyx.
from libc.stdint cimport int8_t, int16_t, uint8_t, int32_t, uint32_t, int64_t


cdef extern from "ks_common.h" nogil:
    const char *ks_simd_path()
    void ks_swiglu(const float *gate, const float *up, float *out, int64_t n)
    float ks_fp16_to_f32(unsigned short h)


cdef extern from "ks_q8.h" nogil:
    int KS_QK
    int KS_QBLOCK
    void ks_quantize_row_q8_0(const float *x, int8_t *q, float *d, int16_t *h, int k)
    void ks_q8_half_sums(const int8_t *q, int64_t k, int16_t *h)
    void ks_dequantize_row_q8_0(const uint8_t *w, float *out, int k)
    ctypedef struct ks_act:
        const int8_t *q
        const float *d
        const int16_t *h
    int ks_set_vnni(int on)


cdef extern from "ks_attention.h" nogil:
    int KS_ATTN_STRIP
    int KS_ATTN_TOKENS
    int KS_ATTN_SPLIT_TOKENS
    float ks_quantize_head(const float *x, int8_t *q, int hd)
    int64_t ks_attn_scratch_floats(int nq, int hd, int kv_bs)
    int64_t ks_attn_part_floats(int nq, int hd)
    int ks_attn_segments(int ctx, int kv_bs)
    int ks_set_attn_tiles(int on)
    void ks_attn_quantize_row(const float *q, float scale, int hd, int8_t *q8, float *qd,
                              int32_t *qsum)
    void ks_attn_prefill_item(const int8_t *q8, const float *qd, const int32_t *qsum,
                              const int8_t *kq, const float *ks, const int8_t *vq,
                              const float *vs, float *out, int n_heads, int n_kv, int hd,
                              int max_seq, int pos0, int kfirst, int kv_bs, int t0, int t1,
                              int g, float *scratch)
    void ks_attn_split_item(const int8_t *q8, const float *qd, const int32_t *qsum,
                            const int8_t *kq, const float *ks, const int8_t *vq,
                            const float *vs, float *part, int n_heads, int n_kv, int hd,
                            int max_seq, int pos0, int n, int kv_bs, int c, int g,
                            float *scratch)
    void ks_attn_split_merge(const float *parts, float *out, int n_heads, int n_kv, int hd,
                             int n, int n_seg, int t, int h)


cdef extern from "ks_rows.h" nogil:
    void ks_rmsnorm_row(const float *x, const float *w, float eps, float *out, int64_t d)
    void ks_rope_row(float *row, const float *ct, const float *st, int64_t hd, int neox)
    void ks_add_scaled(float *x, const float *y, float w, int64_t d)


cdef extern from "ks_moe.h" nogil:
    void ks_moe_route_row(const float *x, const float *router, int64_t d, int n_exp,
                          int norm_topk, float *probs, int32_t *idx, float *w, int k)
    int ks_moe_group(const int32_t *top_idx, int n, int k, int n_exp, int32_t *counts,
                     int32_t *offsets, int32_t *rows, int32_t *slot_pos, int32_t *active)
    void ks_moe_combine_row(float *out, const float *y, const int32_t *slot, const float *w,
                            int k, int64_t d)


cdef extern from "ks_weights.h" nogil:
    int KS_TYPE_F32
    int KS_TYPE_Q8_0
    ctypedef struct ks_matrix:
        const uint8_t *data
        int64_t row_stride
        int64_t mat_stride
        int32_t type
        int32_t rows, cols
        int32_t n_mat
        int32_t interleave
        uint8_t *copies
        uint8_t *copy_state
        int32_t *copy_left
        int64_t copy_stride
        int32_t copy_rows
        int32_t copy_release
    int KS_TYPE_COUNT
    int ks_type_supported(int type)
    int64_t ks_type_row_bytes(int type, int64_t cols)
    int ks_type_block(int type)


cdef extern from "ks_interleave.h" nogil:
    int ks_il_rows(int type)
    void ks_interleave_rows(int type, const uint8_t *src, int rows, int cols, uint8_t *dst)


cdef extern from "ks_matmul.h" nogil:
    void ks_matrix_dequant_row(const ks_matrix *w, int e, int r, float *out)
    void ks_matrix_rows(const ks_matrix *w, int e, const ks_act *x, int n, float *out, int r0,
                        int r1)
    int ks_matrix_rows_plain(const ks_matrix *w, int e, const ks_act *x, int n, float *out,
                             int r0, int r1)


cdef extern from "ks_forward.h" nogil:
    ctypedef struct ks_layer:
        const float *attn_norm
        const float *ffn_norm
        const float *q_norm
        const float *k_norm
        ks_matrix wq, wk, wv, wo, gate, up, down, router
    ctypedef struct ks_model:
        int n_layers, hidden, n_heads, n_kv, hd, ffn, vocab
        int n_exp, n_used, expert_ffn, norm_topk, neox
        float eps, scale
        ks_matrix tok_embd, output
        const float *out_norm
        const ks_layer *layers
    ctypedef struct ks_kv:
        int8_t *k_q
        int8_t *v_q
        float *k_s
        float *v_s
        int max_seq, kv_bs
    ctypedef struct ks_batch:
        int n, pos0
        const int32_t *tokens
        const float *rope_cos
        const float *rope_sin
        int n_vis
        const int32_t *vis_rows
        const float *vis_embd
        int n_deep
        const float *deep
        float *logits
        int all_logits
        float *hidden
        int32_t *routing
        int n_seqs
        const int32_t *seq_starts
    ctypedef struct ks_scratch:
        int max_chunk, nthreads
    int64_t ks_scratch_layout(ks_scratch *S, char *base, const ks_model *M, int max_chunk,
                              int nthreads, int max_seq, int kv_bs)
    ctypedef struct ks_team:
        int nthreads
    ctypedef void (*ks_team_fn)(ks_team *T, int tid, uint32_t pass_)
    int ks_team_init(ks_team *T, int nthreads, int n_phases, ks_team_fn fn)
    void ks_team_free(ks_team *T)
    int ks_team_working(const ks_team *T)
    ctypedef struct ks_forward_job:
        const ks_model *M
        const ks_kv *kv
        ks_scratch *S
        const ks_batch *B
    int ks_forward_phases(int n_layers)
    void ks_forward_walk(ks_team *T, int tid, uint32_t pass_)
    void ks_forward(ks_team *T, const ks_forward_job *job)


cdef extern from "ks_vision.h" nogil:
    int KS_VATTN_QUERIES
    void ks_layernorm_row(const float *x, const float *w, const float *b, float eps, float *out,
                          int64_t d)
    void ks_gelu(const float *x, float *out, int64_t n, int use_erf)
    int64_t ks_vattn_scratch_floats(int hd)
    void ks_vattn_item(const float *q, const float *k, const float *v, float *out, int n,
                       int heads, int hd, float scale, int h, int t0, int t1, float *scratch)
    ctypedef struct ks_vblock:
        const float *norm1_w
        const float *norm1_b
        const float *norm2_w
        const float *norm2_b
        ks_matrix qkv, proj, fc1, fc2
        const float *qkv_b
        const float *proj_b
        const float *fc1_b
        const float *fc2_b
    ctypedef struct ks_vtower:
        int depth, hidden, n_heads, ffn
        float eps, scale
        const ks_vblock *blocks
        int n_deep
        const int32_t *deep_after
    ctypedef struct ks_vpass:
        int n, nthreads
        float *x
        const float *rope_cos
        const float *rope_sin
        float *deep
    ctypedef struct ks_vision_job:
        const ks_vtower *V
        ks_vpass *P
    int64_t ks_vpass_layout(ks_vpass *P, char *base, const ks_vtower *V, int n, int nthreads)
    int ks_vision_phases(int depth)
    void ks_vision_walk(ks_team *T, int tid, uint32_t pass_)
    void ks_vision_blocks(ks_team *T, const ks_vision_job *job)
