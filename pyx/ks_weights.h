/* Kestrel kernels: the weight ABI, how the C side sees a model's weights (no Python here).
 *
 * Every weight matrix is a ks_matrix: its GGML quant type, its shape, its row stride and a
 * pointer to its first byte, usually inside the model file's memory map. Matrices of
 * different types stand side by side in one model (a Q4_K_M file mixes four), and a stack of
 * MoE experts is one ks_matrix with n_mat > 1. A layer is a ks_layer of matrices and norm
 * vectors; the model is a ks_model. kestreld/model/weights.py is the Python side (Matrix,
 * LayerWeights, ModelWeights); pyx/forward.pxi builds these structs from those dataclasses
 * by field name.
 *
 * The operations every type provides, dispatched here on ks_matrix.type:
 *   ks_matrix_row_bytes    bytes of one row of `cols` values
 *   ks_matrix_dequant_row  one row as float32 (token embeddings)
 *   ks_matrix_rows         rows [r0, r1) of out (n, rows) = W . x^T, x quantized to Q8_0
 */
#ifndef KS_WEIGHTS_H
#define KS_WEIGHTS_H

#include "ks_common.h"
#include "ks_q8.h"
#include "ks_kquants.h"

/* GGML's type ids (ggml.h), so a GGUF tensor's type needs no translation. */
enum {
    KS_TYPE_F32 = 0,
    KS_TYPE_Q4_0 = 2,
    KS_TYPE_Q4_1 = 3,
    KS_TYPE_Q5_0 = 6,
    KS_TYPE_Q8_0 = 8,
    KS_TYPE_Q4_K = 12,
    KS_TYPE_Q5_K = 13,
    KS_TYPE_Q6_K = 14,
};

/* Values and bytes per block of each type (GGML's layouts); 0: not a type Kestrel knows. */
static inline int ks_type_block(int type)
{
    switch (type) {
    case KS_TYPE_F32: return 1;
    case KS_TYPE_Q4_0: case KS_TYPE_Q4_1: case KS_TYPE_Q5_0: case KS_TYPE_Q8_0: return 32;
    case KS_TYPE_Q4_K: case KS_TYPE_Q5_K: case KS_TYPE_Q6_K: return 256;
    default: return 0;
    }
}

static inline int ks_type_block_bytes(int type)
{
    switch (type) {
    case KS_TYPE_F32: return 4;
    case KS_TYPE_Q4_0: return 18;
    case KS_TYPE_Q4_1: return 20;
    case KS_TYPE_Q5_0: return 22;
    case KS_TYPE_Q8_0: return KS_QBLOCK;
    case KS_TYPE_Q4_K: return 144;
    case KS_TYPE_Q5_K: return 176;
    case KS_TYPE_Q6_K: return 210;
    default: return 0;
    }
}

typedef struct {
    const uint8_t *data;      /* row r of matrix e at data + e * mat_stride + r * row_stride */
    int64_t row_stride;       /* bytes between rows */
    int64_t mat_stride;       /* bytes between stacked matrices (MoE experts) */
    int32_t type;             /* KS_TYPE_* */
    int32_t rows, cols;       /* of one matrix */
    int32_t n_mat;            /* 1, or the number of stacked experts */
} ks_matrix;

/* The types the kernels compute on (F32 only for MoE routers, read by dot products);
 * weights of other types are converted at load. */
static const int ks_compute_types[] = {KS_TYPE_F32, KS_TYPE_Q8_0,
                                        KS_TYPE_Q4_K, KS_TYPE_Q5_K, KS_TYPE_Q6_K};
#define KS_N_COMPUTE_TYPES ((int)(sizeof(ks_compute_types) / sizeof(ks_compute_types[0])))

static inline int ks_type_supported(int type)
{
    for (int i = 0; i < KS_N_COMPUTE_TYPES; i++)
        if (ks_compute_types[i] == type)
            return 1;
    return 0;
}

/* Bytes of one row of `cols` values (cols a multiple of the type's block), 0 if unknown. */
static inline int64_t ks_type_row_bytes(int type, int64_t cols)
{
    const int block = ks_type_block(type);
    return block ? cols / block * ks_type_block_bytes(type) : 0;
}

static inline const uint8_t *ks_matrix_row(const ks_matrix *w, int e, int r)
{
    return w->data + (int64_t)e * w->mat_stride + (int64_t)r * w->row_stride;
}

/* Row r of matrix e as float32 (cols values). */
static inline void ks_matrix_dequant_row(const ks_matrix *w, int e, int r, float *out)
{
    const uint8_t *row = ks_matrix_row(w, e, r);
    switch (w->type) {
    case KS_TYPE_Q8_0:
        ks_dequantize_row_q8_0(row, out, w->cols);
        break;
    case KS_TYPE_Q4_K: ks_q4k_dequant_row(row, out, w->cols); break;
    case KS_TYPE_Q5_K: ks_q5k_dequant_row(row, out, w->cols); break;
    case KS_TYPE_Q6_K: ks_q6k_dequant_row(row, out, w->cols); break;
    case KS_TYPE_F32:
        memcpy(out, row, sizeof(float) * w->cols);
        break;
    }
}

/* Rows [r0, r1) of out (n, rows) = matrix e of w (rows, cols) . x^T, for the n activation
 * rows x quantized to Q8_0 (xq (n, cols) int8, xd (n, cols/32) scales). Every type computes
 * each output from exact integer block sums and a fixed-order float epilogue, so the result
 * does not depend on r0, r1 or the thread that computes it. */
static inline void ks_matrix_rows(const ks_matrix *w, int e, const int8_t *xq, const float *xd,
                                  int n, float *out, int r0, int r1)
{
    const uint8_t *base = w->data + (int64_t)e * w->mat_stride;
    switch (w->type) {
    case KS_TYPE_Q8_0:
        ks_q8_matmul_rows(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1);
        break;
    case KS_TYPE_Q4_K: ks_q4k_matmul_rows(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    case KS_TYPE_Q5_K: ks_q5k_matmul_rows(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    case KS_TYPE_Q6_K: ks_q6k_matmul_rows(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    }
}

/* The plain C twin of ks_matrix_rows (the reference every SIMD path must equal exactly). */
static inline void ks_matrix_rows_plain(const ks_matrix *w, int e, const int8_t *xq,
                                        const float *xd, int n, float *out, int r0, int r1)
{
    const uint8_t *base = w->data + (int64_t)e * w->mat_stride;
    switch (w->type) {
    case KS_TYPE_Q8_0:
        ks_q8_matmul_rows_plain(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1);
        break;
    case KS_TYPE_Q4_K: ks_q4k_matmul_rows_plain(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    case KS_TYPE_Q5_K: ks_q5k_matmul_rows_plain(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    case KS_TYPE_Q6_K: ks_q6k_matmul_rows_plain(base, w->row_stride, xq, xd, n, w->cols, out, w->rows, r0, r1); break;
    }
}

#endif /* KS_WEIGHTS_H */
