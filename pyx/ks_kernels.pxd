# C declarations of the kernel headers (pyx/ks_*.h), cimported by _kernels.pyx.
from libc.stdint cimport int8_t, uint8_t, int32_t, int64_t


cdef extern from "ks_common.h" nogil:
    const char *ks_simd_path()
    void ks_swiglu(const float *gate, const float *up, float *out, int64_t n)
    float ks_fp16_to_f32(unsigned short h)


cdef extern from "ks_q8.h" nogil:
    int KS_QK
    int KS_QBLOCK
    void ks_quantize_row_q8_0(const float *x, int8_t *q, float *d, int k)
    void ks_dequantize_row_q8_0(const uint8_t *w, float *out, int k)
    void ks_q8_matmul_rows(const uint8_t *w, int64_t w_stride, const int8_t *xq,
                           const float *xd, int n, int k, float *out, int m, int r0, int r1)
    int ks_set_vnni(int on)
    void ks_q8_matmul_rows_plain(const uint8_t *w, int64_t w_stride, const int8_t *xq,
                                 const float *xd, int n, int k, float *out, int m,
                                 int r0, int r1)


cdef extern from "ks_attention.h" nogil:
    int KS_ATTN_STRIP
    int KS_ATTN_TOKENS
    float ks_quantize_head(const float *x, int8_t *q, int hd)
    int64_t ks_attn_scratch_floats(int nq, int hd, int kv_bs)
    int64_t ks_attn_part_floats(int G, int hd)
    int ks_attn_split_len(int ctx, int kv_bs)
    int ks_set_attn_tiles(int on)
    void ks_attn_prefill_item(const float *q, const int8_t *kq, const float *ks,
                              const int8_t *vq, const float *vs, float *out,
                              int n_heads, int n_kv, int hd, int max_seq, int pos0,
                              float scale, int kv_bs, int t0, int t1, int g, float *scratch)
    void ks_attn_decode_item(const float *q, const int8_t *kq, const float *ks,
                             const int8_t *vq, const float *vs, float *part,
                             int n_heads, int n_kv, int hd, int max_seq, int pos0,
                             float scale, int kv_bs, int split, int c, int g, float *scratch)
    void ks_attn_decode_merge(const float *parts, float *out, int n_heads, int n_kv, int hd,
                              int nsplit, int h)


cdef extern from "ks_rows.h" nogil:
    void ks_rmsnorm_row(const float *x, const float *w, float eps, float *out, int64_t d)
    void ks_rope_row(float *row, const float *ct, const float *st, int64_t hd, int neox)
    void ks_add_scaled(float *x, const float *y, float w, int64_t d)


cdef extern from "ks_moe.h" nogil:
    void ks_moe_route_row(const float *x, const float *router, int64_t d, int n_exp,
                          int norm_topk, float *probs, int32_t *idx, float *w, int k)


cdef extern from "ks_decode.h" nogil:
    ctypedef struct ks_layer:
        const uint8_t *wq
        const uint8_t *wk
        const uint8_t *wv
        const uint8_t *wo
        const uint8_t *w_gate
        const uint8_t *w_up
        const uint8_t *w_down
        const float *attn_norm
        const float *ffn_norm
        const float *q_norm
        const float *k_norm
        const float *router
        const uint8_t *gate_exps
        const uint8_t *up_exps
        const uint8_t *down_exps
        int8_t *kq
        int8_t *vq
        float *ks
        float *vs
    ctypedef struct ks_model:
        int n_layers, hidden, n_heads, n_kv, hd, ffn, vocab, max_seq, kv_bs, neox
        int n_exp, n_used, expert_ffn, norm_topk
        float eps, scale
        const ks_layer *layers
        const uint8_t *tok_embd
        const uint8_t *output
        const float *out_norm
        const float *cos_t
        const float *sin_t
        float *x
        float *xn
        float *q
        float *k
        float *v
        float *att
        float *proj
        float *gate
        float *up
        float *xd
        float *xnd
        int8_t *xq
        int8_t *xnq
        float *attn_scratch
        float *attn_parts
        float *probs
        float *top_w
        float *egate
        float *eup
        float *ehd
        float *ey
        int32_t *top_idx
        int8_t *ehq
    int KS_ATTN_SPLIT_MAX
    void ks_decode_step(const ks_model *M, int token, int pos, int rope_pos, float *logits,
                        int nthreads)


cdef extern from "ks_vision.h" nogil:
    int KS_VATTN_QUERIES
    void ks_layernorm_row(const float *x, const float *w, const float *b, float eps, float *out,
                          int64_t d)
    void ks_gelu(const float *x, float *out, int64_t n, int use_erf)
    int64_t ks_vattn_scratch_floats(int hd)
    void ks_vattn_item(const float *q, const float *k, const float *v, float *out, int n,
                       int heads, int hd, float scale, int h, int t0, int t1, float *scratch)
