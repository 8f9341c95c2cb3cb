/* Kestrel kernels: one decode step (a single token through every layer and the output
 * matrix) in one OpenMP parallel region (no Python here).
 *
 * Decode is memory-bound and its kernels are tiny: calling them one by one from Python costs
 * a Python call, a GIL release and an OpenMP fork/join each, ~15 per layer. Here the threads
 * stay in one team for the whole token; the matrix products and attention are shared with
 * `omp for`, the small row kernels run on one thread (`omp single`). Every value is computed
 * by the same functions, in the same order, as the per-kernel path of forward.py, so the two
 * give the same bits.
 */
#ifndef KS_DECODE_H
#define KS_DECODE_H

#include <omp.h>
#include "ks_common.h"
#include "ks_q8.h"
#include "ks_rows.h"
#include "ks_attention.h"

#define KS_DECODE_ROWS 16     /* output rows per work item of a decode product */

typedef struct {
    const uint8_t *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;    /* Q8_0 rows */
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;          /* q/k_norm NULL: none */
    int8_t *kq, *vq;          /* this layer's KV arena: (n_kv, max_seq, hd) */
    float *ks, *vs;           /* (n_kv, max_seq) */
} ks_layer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, hd, ffn, vocab, max_seq, kv_bs, neox;
    float eps, scale;
    const ks_layer *layers;
    const uint8_t *tok_embd, *output;
    const float *out_norm, *cos_t, *sin_t;   /* tables (max_seq, hd/2) */
    /* one token's buffers */
    float *x, *xn, *q, *k, *v, *att, *proj, *gate, *up, *xd;
    int8_t *xq;
    float *attn_scratch;      /* nthreads * ks_attn_scratch_floats(G, hd, kv_bs) */
    float *attn_parts;        /* n_kv * KS_ATTN_SPLIT_MAX * ks_attn_part_floats(G, hd) */
} ks_model;

/* out (m) = w (m, k) . xq; a work-shared loop: call from every thread of the team. */
static inline void ks_decode_matmul(const uint8_t *w, int m, int k, const int8_t *xq,
                                    const float *xd, float *out)
{
    const int64_t stride = (int64_t)k / KS_QK * KS_QBLOCK;
    const int items = (m + KS_DECODE_ROWS - 1) / KS_DECODE_ROWS;
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < items; it++) {
        const int r0 = it * KS_DECODE_ROWS;
        const int r1 = r0 + KS_DECODE_ROWS < m ? r0 + KS_DECODE_ROWS : m;
        ks_q8_matmul_rows(w, stride, xq, xd, 1, k, out, m, r0, r1);
    }
}

static inline void ks_add_inplace(float *x, const float *y, int n)
{
    for (int i = 0; i < n; i++)
        x[i] += y[i];
}

/* Token `token` at position pos (KV of 0 .. pos-1 stored): stores its KV, writes logits (vocab). */
static void ks_decode_step(const ks_model *M, int token, int pos, float *logits, int nthreads)
{
    const int H = M->hidden, hd = M->hd, G = M->n_heads / M->n_kv;
    const int q_dim = M->n_heads * hd, kv_dim = M->n_kv * hd;
    const int split = ks_attn_split_len(pos + 1, M->kv_bs);
    const int n_split = (pos + split) / split;
    const int64_t scratch_floats = ks_attn_scratch_floats(G, hd, M->kv_bs);
    const int64_t part_floats = ks_attn_part_floats(G, hd);
    const float *ct = M->cos_t + (int64_t)pos * (hd / 2), *st = M->sin_t + (int64_t)pos * (hd / 2);

    #pragma omp parallel num_threads(nthreads)
    {
        float *scratch = M->attn_scratch + omp_get_thread_num() * scratch_floats;
        #pragma omp single
        ks_dequantize_row_q8_0(M->tok_embd + (int64_t)token * (H / KS_QK * KS_QBLOCK), M->x, H);

        for (int li = 0; li < M->n_layers; li++) {
            const ks_layer *L = &M->layers[li];
            #pragma omp single
            {
                ks_rmsnorm_row(M->x, L->attn_norm, M->eps, M->xn, H);
                ks_quantize_row_q8_0(M->xn, M->xq, M->xd, H);
            }
            ks_decode_matmul(L->wq, q_dim, H, M->xq, M->xd, M->q);
            ks_decode_matmul(L->wk, kv_dim, H, M->xq, M->xd, M->k);
            ks_decode_matmul(L->wv, kv_dim, H, M->xq, M->xd, M->v);
            #pragma omp barrier
            #pragma omp single
            {
                for (int h = 0; h < M->n_heads; h++) {
                    if (L->q_norm)
                        ks_rmsnorm_row(M->q + h * hd, L->q_norm, M->eps, M->q + h * hd, hd);
                    ks_rope_row(M->q + h * hd, ct, st, hd, M->neox);
                }
                for (int g = 0; g < M->n_kv; g++) {
                    if (L->k_norm)
                        ks_rmsnorm_row(M->k + g * hd, L->k_norm, M->eps, M->k + g * hd, hd);
                    ks_rope_row(M->k + g * hd, ct, st, hd, M->neox);
                    const int64_t row = (int64_t)g * M->max_seq + pos;
                    L->ks[row] = ks_quantize_head(M->k + g * hd, L->kq + row * hd, hd);
                    L->vs[row] = ks_quantize_head(M->v + g * hd, L->vq + row * hd, hd);
                }
            }
            #pragma omp for schedule(static)
            for (int it = 0; it < M->n_kv * n_split; it++)
                ks_attn_decode_item(M->q, L->kq, L->ks, L->vq, L->vs,
                                    M->attn_parts + it * part_floats, M->n_heads, M->n_kv, hd,
                                    M->max_seq, pos, M->scale, M->kv_bs, split, it % n_split,
                                    it / n_split, scratch);
            #pragma omp for schedule(static)
            for (int h = 0; h < M->n_heads; h++)
                ks_attn_decode_merge(M->attn_parts, M->att, M->n_heads, M->n_kv, hd, n_split, h);
            #pragma omp single
            ks_quantize_row_q8_0(M->att, M->xq, M->xd, q_dim);
            ks_decode_matmul(L->wo, H, q_dim, M->xq, M->xd, M->proj);
            #pragma omp barrier
            #pragma omp single
            {
                ks_add_inplace(M->x, M->proj, H);
                ks_rmsnorm_row(M->x, L->ffn_norm, M->eps, M->xn, H);
                ks_quantize_row_q8_0(M->xn, M->xq, M->xd, H);
            }
            ks_decode_matmul(L->w_gate, M->ffn, H, M->xq, M->xd, M->gate);
            ks_decode_matmul(L->w_up, M->ffn, H, M->xq, M->xd, M->up);
            #pragma omp barrier
            #pragma omp single
            {
                ks_swiglu(M->gate, M->up, M->gate, M->ffn);
                ks_quantize_row_q8_0(M->gate, M->xq, M->xd, M->ffn);
            }
            ks_decode_matmul(L->w_down, H, M->ffn, M->xq, M->xd, M->proj);
            #pragma omp barrier
            #pragma omp single
            ks_add_inplace(M->x, M->proj, H);
        }
        #pragma omp single
        {
            ks_rmsnorm_row(M->x, M->out_norm, M->eps, M->xn, H);
            ks_quantize_row_q8_0(M->xn, M->xq, M->xd, H);
        }
        ks_decode_matmul(M->output, M->vocab, H, M->xq, M->xd, logits);
    }
}

#endif /* KS_DECODE_H */
