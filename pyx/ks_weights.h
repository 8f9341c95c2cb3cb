/* Kestrel kernels: the weight ABI, how the C side sees a model's weights (no Python here).
 *
 * Every weight matrix is a ks_matrix: its GGML quant type, its shape, its row stride and a
 * pointer to its first byte, usually inside the model file's memory map. The loader may
 * interleave a matrix instead (ks_interleave_rows, below): a copy whose groups of as many rows
 * as the CPU's tiles take (16 with AVX512-VNNI, 8 with AVX2, 4 on aarch64 with sdot) lay each
 * block field of those rows side by side, so the tiles load them as vectors rather than gather
 * them from the rows.
 * Matrices of different types stand side by side in one model (a Q4_K_M file mixes four), and
 * a stack of MoE experts is one ks_matrix with n_mat > 1, in rows in the map; it may have
 * interleaved copies, which the products make as each expert is first chosen
 * (ks_expert_copy). A layer is a ks_layer of matrices and norm vectors; the model is a
 * ks_model. kestreld/model/weights.py is the Python side (Matrix, ExpertCopies, LayerWeights,
 * ModelWeights); pyx/forward.pxi builds these structs from those dataclasses by field name.
 *
 * The operations every type the kernels compute on provides (one row of ks_type_ops,
 * below), dispatched here on ks_matrix.type:
 *   ks_type_row_bytes      bytes of one row of `cols` values
 *   ks_matrix_dequant_row  one row as float32 (token embeddings)
 *   ks_matrix_rows         rows [r0, r1) of out (n, rows) = W . x^T, x quantized to Q8_0
 *                          with its half sums (ks_quantize_row_q8_0), and
 *                          ks_matrix_rows_plain, its plain C twin (same bits), on either
 *                          layout
 * Each type's header (ks_q8.h, ks_q4.h, ks_kquants.h) says the exact order of its float
 * operations, which all its paths (SIMD and plain) follow.
 */
#ifndef KS_WEIGHTS_H
#define KS_WEIGHTS_H

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
    int type, block, block_bytes;     /* values and bytes per block (GGML's layouts) */
    int fp16_head;                    /* 2-byte fields (fp16 scales) at the block's start, before
                                         4-byte fields (ks_interleave_group) */
    ks_dequant_fn dequant_row;        /* NULL: the kernels do not compute on it */
    ks_rows_fn rows, rows_plain, rows_vnni, rows_il4, rows_il8, rows_il16;
} ks_type_ops;

/* a type's products, by the stem of their names (ks_<stem>_matmul_rows...) */
#define KS_ROWS_FNS(stem) ks_##stem##_matmul_rows, ks_##stem##_matmul_rows_plain, \
    KS_VNNI_ROWS(ks_##stem##_matmul_rows_vnni)
/* ... and its products on interleaved groups */
#define KS_IL_FNS(stem) KS_NEON_IL_ROWS(ks_##stem##_matmul_rows_x4), \
    KS_AVX2_ROWS(ks_##stem##_matmul_rows_x8), KS_VNNI_ROWS(ks_##stem##_matmul_rows_x16)

static const ks_type_ops ks_types[] = {
    {KS_TYPE_F32, 1, 4, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL},  /* MoE routers: float dots */
    {KS_TYPE_Q4_0, 32, 18, 1, ks_q4_0_dequant_row, KS_ROWS_FNS(q4_0), KS_IL_FNS(q4_0)},
    {KS_TYPE_Q4_1, 32, 20, 2, ks_q4_1_dequant_row, KS_ROWS_FNS(q4_1), KS_IL_FNS(q4_1)},
    {KS_TYPE_Q5_0, 32, 22, 1, ks_q5_0_dequant_row, KS_ROWS_FNS(q5_0), KS_IL_FNS(q5_0)},
    {KS_TYPE_Q8_0, 32, KS_QBLOCK, 1, ks_dequantize_row_q8_0, KS_ROWS_FNS(q8),
     KS_NEON_IL_ROWS(ks_q8_matmul_rows_x4), NULL, KS_VNNI_ROWS(ks_q8_matmul_rows_x16)},
    {KS_TYPE_Q4_K, 256, 144, 2, ks_q4k_dequant_row, KS_ROWS_FNS(q4k), KS_IL_FNS(q4k)},
    {KS_TYPE_Q5_K, 256, 176, 2, ks_q5k_dequant_row, KS_ROWS_FNS(q5k), KS_IL_FNS(q5k)},
    {KS_TYPE_Q6_K, 256, 210, 0, ks_q6k_dequant_row, KS_ROWS_FNS(q6k), KS_IL_FNS(q6k)},
};
#define KS_N_TYPES ((int)(sizeof(ks_types) / sizeof(ks_types[0])))

/* The type's row of ks_types, or NULL for a type Kestrel does not know. */
static inline const ks_type_ops *ks_type(int type)
{
    for (int i = 0; i < KS_N_TYPES; i++)
        if (ks_types[i].type == type)
            return &ks_types[i];
    return NULL;
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


/* ---- interleaved groups --------------------------------------------------------------------
 * A type's block is a run of fields: fp16_head 2-byte fields, then 4-byte ones (a last 2 bytes
 * are one more field: Q6_K's d). Group g of a matrix interleaved by W rows holds rows g*W ..
 * g*W + W - 1 in the bytes of those W rows; its block b holds each field of the W rows' blocks
 * b side by side: row i's field at offset o of its block sits at g's block b + W * o + i * (the
 * field's size). A field at offset o of the block thus becomes one W-lane vector at W * o (fp16
 * scales, Q5_0's high bits, dwords of codes). Rows past the matrix's end are zero. */

/* What the 4-byte fields at block offsets lo <= o < hi are xor-ed with (x) in a type's groups
 * of W rows. In the 4-row groups (the NEON dotprod tile's) the codes are stored so that,
 * shifted to the top of a byte, they read as signed q - offset times a power of two, with no
 * offset term:
 *   Q4_0's codes ^ 0x88: each nibble is q ^ 8, a signed (q - 8) at the top (llama.cpp's ARM
 *       repack of Q4_0 stores them so too);
 *   Q5_0's high bits (the dword at 2) inverted: each 5-bit q ^ 16, a signed (q - 16);
 *   Q6_K's high bits (bytes 128..191) ^ 0xAA, the top bit of each pair: each 6-bit q ^ 32, a
 *       signed (q - 32).
 * The same xor undoes it. */
typedef struct {
    uint32_t x;
    int lo, hi;
} ks_il_xor;

static inline ks_il_xor ks_il_code_xor(const ks_type_ops *t, const int W)
{
    const ks_il_xor none = {0, 0, 0};
    if (W != 4)
        return none;
    switch (t->type) {
    case KS_TYPE_Q4_0: return (ks_il_xor){0x88888888u, 0, t->block_bytes};
    case KS_TYPE_Q5_0: return (ks_il_xor){0xFFFFFFFFu, 2, 6};
    case KS_TYPE_Q6_K: return (ks_il_xor){0xAAAAAAAAu, 128, 192};
    default: return none;
    }
}

#if defined(KS_NEON) || defined(KS_NEON_DOT)
/* The first words - words % 4 words of 4 rows (row i's at src + i * rb) into a 4-row group's
 * word fields at dst (word k of row i at dst + 16 * k + 4 * i), xor-ed as x says for the
 * block offset head + 4 * k, 4 at a time: the 4 rows' next 16 bytes, transposed as 4 x 4
 * words, are the group's next 64. Returns how many it copied. */
static inline int ks_il4_copy_words(uint8_t *dst, const uint8_t *src, int64_t rb, int words,
                                    int head, ks_il_xor x)
{
    int k = 0;
    for (; k + 4 <= words; k += 4) {
        uint32x4_t a[4], t[4];
        for (int i = 0; i < 4; i++)
            a[i] = vld1q_u32((const uint32_t *)(src + i * rb + 4 * k));
        t[0] = vtrn1q_u32(a[0], a[1]);
        t[1] = vtrn2q_u32(a[0], a[1]);
        t[2] = vtrn1q_u32(a[2], a[3]);
        t[3] = vtrn2q_u32(a[2], a[3]);
        for (int j = 0; j < 4; j++) {     /* word k + j of the 4 rows */
            const uint64x2_t lo = vreinterpretq_u64_u32(t[j % 2]);
            const uint64x2_t hi = vreinterpretq_u64_u32(t[j % 2 + 2]);
            const int o = head + 4 * (k + j);
            vst1q_u32((uint32_t *)(dst + 16 * (k + j)),
                      veorq_u32(vreinterpretq_u32_u64(j < 2 ? vtrn1q_u64(lo, hi)
                                                            : vtrn2q_u64(lo, hi)),
                                vdupq_n_u32(o >= x.lo && o < x.hi ? x.x : 0)));
        }
    }
    return k;
}
#endif

/* Rows i0 .. i1 - 1 of a group (W rows of nb blocks) between the rows' layout, row i at
 * rows + (i - i0) * rb, and the interleaved one at il; back: il -> rows, else rows -> il (the
 * group's other rows then zero: rows past the matrix's end). The 4-byte fields, most of a
 * block, go as words in loops of their own (on NEON a whole 4-row group's by transposes): a
 * load at start-up copies every dense matrix so, and the NEON products copy the experts they
 * multiply. */
static inline void ks_interleave_group(const ks_type_ops *t, const int W, int nb, uint8_t *il,
                                       uint8_t *rows, int i0, int i1, int back)
{
    const int B = t->block_bytes, head = 2 * t->fp16_head, words = (B - head) / 4;
    const int64_t rb = (int64_t)nb * B;
    const ks_il_xor x = ks_il_code_xor(t, W);
    if (!back && (i0 > 0 || i1 < W))
        memset(il, 0, (size_t)W * rb);
    for (int b = 0; b < nb; b++) {
        uint8_t *g = il + (int64_t)b * W * B;
        int k0 = 0;     /* words already copied (and xor-ed) for every row */
#if defined(KS_NEON) || defined(KS_NEON_DOT)
        if (!back && W == 4 && i0 == 0 && i1 == 4)
            k0 = ks_il4_copy_words(g + 4 * head, rows + (int64_t)b * B + head, rb, words, head,
                                   x);
#endif
        for (int i = i0; i < i1; i++) {
            uint8_t *r = rows + (i - i0) * rb + (int64_t)b * B;
#define KS_IL_FIELD(o, size) (back ? memcpy(r + (o), g + W * (o) + (size) * i, size) \
                                   : memcpy(g + W * (o) + (size) * i, r + (o), size))
            for (int o = 0; o < head; o += 2)
                KS_IL_FIELD(o, 2);
            uint8_t *gw = g + W * head + 4 * i, *rw = r + head;   /* the words */
            for (int k = k0; k < words; k++)
                memcpy(back ? rw + 4 * k : gw + 4 * W * k, back ? gw + 4 * W * k : rw + 4 * k, 4);
            for (int o = x.lo < head + 4 * k0 ? head + 4 * k0 : x.lo; o + 4 <= x.hi; o += 4) {
                uint8_t *f = back ? r + o : g + W * o + 4 * i;
                uint32_t v;
                memcpy(&v, f, 4);
                v ^= x.x;
                memcpy(f, &v, 4);
            }
            if ((B - head) % 4)
                KS_IL_FIELD(B - 2, 2);
#undef KS_IL_FIELD
        }
    }
}

/* The rows per group in which matrices of this type are interleaved on this CPU: 16 where
 * the AVX512-VNNI product on such groups runs, 8 where the AVX2 one does, 4 where the NEON
 * dotprod one does, 0 if none. */
static inline int ks_il_rows(int type)
{
    const ks_type_ops *t = ks_type(type);
    if (t == NULL)
        return 0;
    return t->rows_il16 != NULL && ks_use_vnni() ? 16 : t->rows_il8 != NULL ? 8
           : t->rows_il4 != NULL ? 4 : 0;
}

/* dst := src (rows x cols of type `type`, rows as GGUF lays them out) interleaved by
 * W = ks_il_rows(type) > 0: dst holds ceil(rows / W) groups of W rows' bytes. */
static inline void ks_interleave_rows(int type, const uint8_t *src, int rows, int cols,
                                      uint8_t *dst)
{
    const ks_type_ops *t = ks_type(type);
    const int nb = cols / t->block, W = ks_il_rows(type);
    const int64_t gb = (int64_t)W * nb * t->block_bytes;
    for (int g = 0; g * W < rows; g++)
        ks_interleave_group(t, W, nb, dst + g * gb, (uint8_t *)src + g * gb, 0,
                            rows - g * W < W ? rows - g * W : W, 0);
}

/* Row r of matrix e as float32 (cols values); w's type is one the kernels compute on. A row of
 * an interleaved matrix is put back together first (token embeddings: one row per token). */
static inline void ks_matrix_dequant_row(const ks_matrix *w, int e, int r, float *out)
{
    const ks_type_ops *t = ks_type(w->type);
    if (!w->interleave) {
        t->dequant_row(ks_matrix_row(w, e, r), out, w->cols);
        return;
    }
    const int W = w->interleave, g = r / W * W;
    uint8_t row[w->row_stride];
    ks_interleave_group(t, W, w->cols / t->block, (uint8_t *)ks_matrix_row(w, e, g), row,
                        r - g, r - g + 1, 1);
    t->dequant_row(row, out, w->cols);
}

/* The product on groups of W interleaved rows of the type on this CPU (ks_il_rows). */
static inline ks_rows_fn ks_il_product(const ks_type_ops *t, int W)
{
    return W == 16 ? t->rows_il16 : W == 8 ? t->rows_il8 : W == 4 ? t->rows_il4 : NULL;
}

/* ---- MoE experts' copies, made as they are first used -------------------------------------
 * A stack of experts stays in the map as the file lays it out, so that loading reads none and
 * a request reads only the experts it chooses. Where the CPU has an interleaved product, each
 * expert's groups are copied into their interleaved layout the first time a product needs
 * them, by the thread whose work item that is; the first thread to come to a group copies it,
 * another that needs it meanwhile waits. Once all of an expert's groups are copied, the whole
 * pages of its rows in the file's map are released: the copy takes their place in memory. */
enum { KS_COPY_NONE, KS_COPY_BUSY, KS_COPY_MADE };

/* Drops the whole pages within [p, p + n) from this process (the file's page cache keeps
 * them: a later read faults them back in). */
static inline void ks_release_pages(const uint8_t *p, int64_t n)
{
#ifdef MADV_DONTNEED
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)p + page - 1) / page * page;
    const uintptr_t hi = ((uintptr_t)p + n) / page * page;
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p; (void)n;
#endif
}

/* Expert e's interleaved copy (w->copies), made first where the groups holding rows
 * [r0, r1) are not yet (r0 a multiple of w->copy_rows). */
static inline const uint8_t *ks_expert_copy(const ks_type_ops *t, const ks_matrix *w, int e,
                                            int r0, int r1)
{
    const int W = w->copy_rows, groups = (w->rows + W - 1) / W;
    const int64_t gb = (int64_t)W * w->row_stride;
    uint8_t *il = w->copies + (int64_t)e * w->copy_stride;
    uint8_t *rows = (uint8_t *)ks_matrix_row(w, e, 0);
    for (int g = r0 / W; g * W < r1; g++) {
        uint8_t *state = w->copy_state + (int64_t)e * groups + g;
        uint8_t none = KS_COPY_NONE;
        if (__atomic_load_n(state, __ATOMIC_ACQUIRE) == KS_COPY_MADE)
            continue;
        if (!__atomic_compare_exchange_n(state, &none, KS_COPY_BUSY, 0, __ATOMIC_ACQUIRE,
                                         __ATOMIC_ACQUIRE)) {
            while (__atomic_load_n(state, __ATOMIC_ACQUIRE) != KS_COPY_MADE)
                ks_cpu_relax();
            continue;
        }
        ks_interleave_group(t, W, w->cols / t->block, il + g * gb, rows + g * gb, 0,
                            w->rows - g * W < W ? w->rows - g * W : W, 0);
        __atomic_store_n(state, KS_COPY_MADE, __ATOMIC_RELEASE);
        if (__atomic_sub_fetch(w->copy_left + e, 1, __ATOMIC_ACQ_REL) == 0 && w->copy_release)
            ks_release_pages(rows, (int64_t)w->rows * w->row_stride);
    }
    return il;
}

#define KS_EXPERT_GROUP_TOKENS 4     /* an expert's rows go through 4-row groups from here on */

/* The product of ks_matrix_rows on stacked experts' rows without copies (r0 a multiple of 4)
 * through 4-row groups copied for the call, for the NEON dotprod tiles: with a few tokens an
 * expert's rows cost less copied and multiplied in groups than multiplied as rows. The same
 * results (every layout gives the same bits). Returns -1 if the copy's memory cannot be had,
 * else 0. */
static inline int ks_matrix_rows_grouped(const ks_type_ops *t, const ks_matrix *w,
                                         const uint8_t *data, const int8_t *xq, const float *xd,
                                         const int16_t *xh, int n, float *out, int r0, int r1)
{
    uint8_t *groups = malloc((size_t)((r1 - r0 + 3) / 4 * 4) * w->row_stride);
    if (groups == NULL)
        return -1;
    for (int r = r0; r < r1; r += 4)
        ks_interleave_group(t, 4, w->cols / t->block, groups + (int64_t)(r - r0) * w->row_stride,
                            (uint8_t *)data + r * w->row_stride, 0, r1 - r < 4 ? r1 - r : 4, 0);
    t->rows_il4(groups, w->row_stride, xq, xd, xh, n, w->cols, out + r0, w->rows, 0, r1 - r0);
    free(groups);
    return 0;
}

/* Rows [r0, r1) of out (n, rows) = matrix e of w (rows, cols) . x^T, for the n activation
 * rows x as ks_quantize_row_q8_0 made them (xq (n, cols) int8, xd (n, cols/32) scales, xh
 * (n, cols/16) half sums); r0 a multiple of w's group rows where it is interleaved. Experts'
 * copies are made first where they are not yet (an r0 off their groups reads the rows). Every
 * type computes each output from exact integer block sums and a fixed-order float epilogue, so
 * the result does not depend on the layout, r0, r1 or the thread that computes it. */
static inline void ks_matrix_rows(const ks_matrix *w, int e, const int8_t *xq, const float *xd,
                                  const int16_t *xh, int n, float *out, int r0, int r1)
{
    const ks_type_ops *t = ks_type(w->type);
    if (w->copies && r0 % w->copy_rows == 0) {
        ks_il_product(t, w->copy_rows)(ks_expert_copy(t, w, e, r0, r1), w->row_stride, xq, xd,
                                       xh, n, w->cols, out, w->rows, r0, r1);
        return;
    }
    if (w->n_mat > 1 && !w->interleave && t->rows_il4 && n >= KS_EXPERT_GROUP_TOKENS &&
        r0 % 4 == 0 && ks_matrix_rows_grouped(t, w, w->data + (int64_t)e * w->mat_stride, xq, xd,
                                              xh, n, out, r0, r1) == 0)
        return;
    (w->interleave ? ks_il_product(t, w->interleave)
     : t->rows_vnni && ks_use_vnni() ? t->rows_vnni : t->rows)(
        w->data + (int64_t)e * w->mat_stride, w->row_stride, xq, xd, xh, n, w->cols, out,
        w->rows, r0, r1);
}

/* The plain C twin of ks_matrix_rows (the reference every SIMD path must equal exactly); an
 * interleaved matrix's groups are put back into rows first. Returns -1 if that memory cannot
 * be had, else 0. */
static inline int ks_matrix_rows_plain(const ks_matrix *w, int e, const int8_t *xq,
                                       const float *xd, const int16_t *xh, int n, float *out,
                                       int r0, int r1)
{
    const ks_type_ops *t = ks_type(w->type);
    const uint8_t *data = w->data + (int64_t)e * w->mat_stride;
    if (!w->interleave) {
        t->rows_plain(data, w->row_stride, xq, xd, xh, n, w->cols, out, w->rows, r0, r1);
        return 0;
    }
    const int W = w->interleave;
    uint8_t *rows = malloc((size_t)W * w->row_stride);
    if (rows == NULL)
        return -1;
    for (int r = r0; r < r1; r += W) {
        const int rv = r1 - r < W ? r1 - r : W;
        ks_interleave_group(t, W, w->cols / t->block, (uint8_t *)data + r * w->row_stride, rows,
                            0, rv, 1);
        t->rows_plain(rows, w->row_stride, xq, xd, xh, n, w->cols, out + r, w->rows, 0, rv);
    }
    free(rows);
    return 0;
}

#endif /* KS_WEIGHTS_H */
