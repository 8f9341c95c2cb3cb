/* Kestrel kernels: the product of a ks_matrix (no Python here), dispatched on its type
 * (ks_weights.h's ks_types) and its layout: rows as the file lays them out, interleaved groups
 * (ks_interleave.h) or an expert's copy (ks_expert_copy.h); and a row of it as float32.
 *   ks_matrix_dequant_row  one row as float32 (token embeddings)
 *   ks_matrix_rows         rows [r0, r1) of out (n, rows) = W . x^T, x quantized to Q8_0
 *                          with its half sums (ks_quantize_row_q8_0), and
 *   ks_matrix_rows_plain   its plain C twin (same bits), on either layout */
#ifndef KS_MATMUL_H
#define KS_MATMUL_H

#include <stdlib.h>

#include "ks_expert_copy.h"

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
    ks_interleave_group(w->type, W, w->cols / t->block, (uint8_t *)ks_matrix_row(w, e, g), row,
                        r - g, r - g + 1, 1);
    t->dequant_row(row, out, w->cols);
}

/* Rows [r0, r1) of out (n, rows) = matrix e of w (rows, cols) . x^T, for the n activation
 * rows x as ks_quantize_row_q8_0 made them (ks_act: x->q (n, cols) int8, x->d (n, cols/32)
 * scales, x->h (n, cols/16) half sums); r0 a multiple of w's group rows where it is interleaved. Experts'
 * copies are made first where they are not yet (an r0 off their groups reads the rows). Every
 * type computes each output from exact integer block sums and a fixed-order float epilogue, so
 * the result does not depend on the layout, r0, r1 or the thread that computes it. */
static inline void ks_matrix_rows(const ks_matrix *w, int e, const ks_act *x, int n, float *out,
                                  int r0, int r1)
{
    const ks_type_ops *t = ks_type(w->type);
    if (w->copies && r0 % w->copy_rows == 0) {
        ks_il_product(t, w->copy_rows)(ks_expert_copy(t, w, e, r0, r1), w->row_stride, x, n,
                                       w->cols, out, w->rows, r0, r1);
        return;
    }
    if (w->n_mat > 1 && !w->interleave && t->rows_il4 && n >= KS_EXPERT_GROUP_TOKENS &&
        r0 % 4 == 0 && ks_matrix_rows_grouped(t, w, w->data + (int64_t)e * w->mat_stride, x, n,
                                              out, r0, r1) == 0)
        return;
    (w->interleave ? ks_il_product(t, w->interleave)
     : t->rows_vnni && ks_use_vnni() ? t->rows_vnni : t->rows)(
        w->data + (int64_t)e * w->mat_stride, w->row_stride, x, n, w->cols, out,
        w->rows, r0, r1);
}

/* The plain C twin of ks_matrix_rows (the reference every SIMD path must equal exactly); an
 * interleaved matrix's groups are put back into rows first. Returns -1 if that memory cannot
 * be had, else 0. */
static inline int ks_matrix_rows_plain(const ks_matrix *w, int e, const ks_act *x, int n,
                                       float *out, int r0, int r1)
{
    const ks_type_ops *t = ks_type(w->type);
    const uint8_t *data = w->data + (int64_t)e * w->mat_stride;
    if (!w->interleave) {
        t->rows_plain(data, w->row_stride, x, n, w->cols, out, w->rows, r0, r1);
        return 0;
    }
    const int W = w->interleave;
    uint8_t *rows = malloc((size_t)W * w->row_stride);
    if (rows == NULL)
        return -1;
    for (int r = r0; r < r1; r += W) {
        const int rv = r1 - r < W ? r1 - r : W;
        ks_interleave_group(w->type, W, w->cols / t->block, (uint8_t *)data + r * w->row_stride,
                            rows, 0, rv, 1);
        t->rows_plain(rows, w->row_stride, x, n, w->cols, out + r, w->rows, 0, rv);
    }
    free(rows);
    return 0;
}

#endif /* KS_MATMUL_H */
