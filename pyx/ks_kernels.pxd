# C declarations of the kernel headers (pyx/ks_*.h), cimported by _kernels.pyx.
from libc.stdint cimport int8_t, uint8_t, int64_t


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
