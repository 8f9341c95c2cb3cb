/* Kestrel kernels: the weight ABI, how the C side sees a model's weights (no Python here).
 *
 * Every weight matrix is a ks_matrix: its GGML quant type, its shape, its row stride and a
 * pointer to its first byte, usually inside the model file's memory map. The loader may
 * interleave a matrix instead (ks_interleave.h): a copy whose groups of as many rows as the
 * CPU's tiles take lay each block field of those rows side by side. Matrices of different
 * types stand side by side in one model (a Q4_K_M file mixes four), and a stack of MoE experts
 * is one ks_matrix with n_mat > 1, in rows in the map; it may have interleaved copies, which
 * the products make as each expert is first chosen (ks_expert_copy.h). A layer is a ks_layer
 * of matrices and norm vectors; the model is a ks_model (ks_forward.h).
 * kestreld/model/weights.py is the Python side (Matrix, ExpertCopies, LayerWeights,
 * ModelWeights); pyx/forward.pxi builds these structs from those dataclasses by field name.
 *
 * ks_types, indexed by the type id, says what each type is and, for the types the kernels
 * compute on, its products (ks_rows_fn); ks_matmul.h dispatches a ks_matrix's product on it.
 * Each type's header (ks_q8.h, ks_q4.h, ks_kquants.h) says the exact order of its float
 * operations, which all its paths (SIMD and plain) follow.
 */
#ifndef KS_WEIGHTS_H
#define KS_WEIGHTS_H

#include "ks_common.h"
#include "ks_q8.h"
#include "ks_q4.h"
#include "ks_kquants.h"
#include "ks_il4_neon.h"

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
    KS_TYPE_COUNT            /* one past the highest id ks_types has a row for */
};

typedef struct {
    const uint8_t *data;      /* row r of matrix e at data + e * mat_stride + r * row_stride */
    int64_t row_stride;       /* bytes between rows */
    int64_t mat_stride;       /* bytes between stacked matrices (MoE experts) */
    int32_t type;             /* KS_TYPE_* */
    int32_t rows, cols;       /* of one matrix */
    int32_t n_mat;            /* 1, or the number of stacked experts */
    int32_t interleave;       /* 0: rows as the file lays them out; else the rows per
                                 interleaved group (n_mat 1; rows rounded up to whole groups) */
    /* MoE experts (n_mat > 1, in rows) may have interleaved copies, made as each expert is
       first multiplied (ks_expert_copy); copies NULL: none */
    uint8_t *copies;          /* expert e's copy at copies + e * copy_stride (whole groups) */
    uint8_t *copy_state;      /* (n_mat, groups): KS_COPY_* of each group of each expert */
    int32_t *copy_left;       /* (n_mat): groups of each expert not yet KS_COPY_MADE */
    int64_t copy_stride;      /* bytes between experts' copies */
    int32_t copy_rows;        /* rows per group of the copies (ks_il_rows(type)) */
    int32_t copy_release;     /* 1: data is a file's map, whose pages an expert's finished
                                 copy releases (madvise MADV_DONTNEED) */
} ks_matrix;

/* rows [r0, r1) of out (n, m) = w (m, k) . xq (n, k)^T (KS_ROWS_PARAMS, ks_q8.h) */
typedef void (*ks_rows_fn)(KS_ROWS_PARAMS);
typedef void (*ks_dequant_fn)(const uint8_t *row, float *out, int k);

/* What a weight type is and, for the types the kernels compute on, its kernels: the build's
 * product (AVX2, NEON or plain C), its plain C twin, the AVX512-VNNI product that
 * ks_matrix_rows takes instead on CPUs that have it (NULL where the build has none), and the
 * products on 4-row (NEON with sdot), 8-row (AVX2) and 16-row (AVX512-VNNI) interleaved
 * groups (NULL: none). */
typedef struct {
    int block, block_bytes;           /* values and bytes per block (GGML's layouts); 0: a type
                                         Kestrel does not know */
    int fp16_head;                    /* 2-byte fields (fp16 scales) at the block's start, before
                                         4-byte fields (ks_interleave_group) */
    ks_dequant_fn dequant_row;        /* NULL: the kernels do not compute on it */
    ks_rows_fn rows, rows_plain, rows_vnni, rows_il4, rows_il8, rows_il16;
} ks_type_ops;

/* a type's products, by the stem of their names (ks_<stem>_matmul_rows...) */
#define KS_ROWS_FNS(stem) .rows = ks_##stem##_matmul_rows, \
    .rows_plain = ks_##stem##_matmul_rows_plain, \
    .rows_vnni = KS_VNNI_ROWS(ks_##stem##_matmul_rows_vnni)
/* ... and its products on interleaved groups */
#define KS_IL_FNS(stem) .rows_il4 = KS_NEON_IL_ROWS(ks_##stem##_matmul_rows_x4), \
    .rows_il8 = KS_AVX2_ROWS(ks_##stem##_matmul_rows_x8), \
    .rows_il16 = KS_VNNI_ROWS(ks_##stem##_matmul_rows_x16)

/* The row of each type id (GGML's type_traits is laid out so too); the ids between are zero. */
static const ks_type_ops ks_types[KS_TYPE_COUNT] = {
    [KS_TYPE_F32] = {.block = 1, .block_bytes = 4},      /* MoE routers: float dot products */
    [KS_TYPE_Q4_0] = {.block = 32, .block_bytes = 18, .fp16_head = 1,
                      .dequant_row = ks_q4_0_dequant_row, KS_ROWS_FNS(q4_0), KS_IL_FNS(q4_0)},
    [KS_TYPE_Q4_1] = {.block = 32, .block_bytes = 20, .fp16_head = 2,
                      .dequant_row = ks_q4_1_dequant_row, KS_ROWS_FNS(q4_1), KS_IL_FNS(q4_1)},
    [KS_TYPE_Q5_0] = {.block = 32, .block_bytes = 22, .fp16_head = 1,
                      .dequant_row = ks_q5_0_dequant_row, KS_ROWS_FNS(q5_0), KS_IL_FNS(q5_0)},
    [KS_TYPE_Q8_0] = {.block = 32, .block_bytes = KS_QBLOCK, .fp16_head = 1,
                      .dequant_row = ks_dequantize_row_q8_0, KS_ROWS_FNS(q8),
                      .rows_il4 = KS_NEON_IL_ROWS(ks_q8_matmul_rows_x4),
                      .rows_il16 = KS_VNNI_ROWS(ks_q8_matmul_rows_x16)},
    [KS_TYPE_Q4_K] = {.block = 256, .block_bytes = 144, .fp16_head = 2,
                      .dequant_row = ks_q4k_dequant_row, KS_ROWS_FNS(q4k), KS_IL_FNS(q4k)},
    [KS_TYPE_Q5_K] = {.block = 256, .block_bytes = 176, .fp16_head = 2,
                      .dequant_row = ks_q5k_dequant_row, KS_ROWS_FNS(q5k), KS_IL_FNS(q5k)},
    [KS_TYPE_Q6_K] = {.block = 256, .block_bytes = 210, .fp16_head = 0,
                      .dequant_row = ks_q6k_dequant_row, KS_ROWS_FNS(q6k), KS_IL_FNS(q6k)},
};

/* The type's row of ks_types, or NULL for a type Kestrel does not know. */
static inline const ks_type_ops *ks_type(int type)
{
    return type >= 0 && type < KS_TYPE_COUNT && ks_types[type].block ? &ks_types[type] : NULL;
}

/* Whether the kernels compute on matrices of this type; weights of other types are
 * converted at load. (MoE routers stay F32 and are read by float dot products.) */
static inline int ks_type_supported(int type)
{
    const ks_type_ops *t = ks_type(type);
    return t != NULL && t->rows != NULL;
}

/* Values per block of the type (cols must be a multiple of it); 0 if unknown. */
static inline int ks_type_block(int type)
{
    const ks_type_ops *t = ks_type(type);
    return t ? t->block : 0;
}

/* Bytes of one row of `cols` values (cols a multiple of the type's block), 0 if unknown. */
static inline int64_t ks_type_row_bytes(int type, int64_t cols)
{
    const ks_type_ops *t = ks_type(type);
    return t ? cols / t->block * t->block_bytes : 0;
}

static inline const uint8_t *ks_matrix_row(const ks_matrix *w, int e, int r)
{
    return w->data + (int64_t)e * w->mat_stride + (int64_t)r * w->row_stride;
}

#endif /* KS_WEIGHTS_H */
