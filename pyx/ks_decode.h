/* Kestrel kernels: one decode step (a single token through every layer and the output
 * matrix) in one OpenMP parallel region (no Python here).
 *
 * Decode is memory-bound and its kernels are tiny: calling them one by one from Python costs
 * a Python call, a GIL release and an OpenMP fork/join each, ~15 per layer. Here the threads
 * stay in one team for the whole token; the matrix products and attention are shared with
 * `omp for`, the small row kernels run on one thread (`omp single`). Every value is computed
 * by the same functions, in the same order, as the per-kernel path of forward.py, so the two
 * give the same bits. A Qwen3-MoE layer (router != NULL) routes the token here too and runs
 * only its k experts, like moe.py does for a chunk.
 */
#ifndef KS_DECODE_H
#define KS_DECODE_H

#include <omp.h>
#include "ks_common.h"
#include "ks_q8.h"
#include "ks_rows.h"
#include "ks_attention.h"
#include "ks_moe.h"

#define KS_DECODE_ROWS 16     /* output rows per work item of a decode product */

typedef struct {
    const uint8_t *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;    /* Q8_0 rows */
    const float *router;      /* (n_exp, hidden); NULL: a dense layer (w_gate, w_up, w_down) */
    const uint8_t *gate_exps, *up_exps, *down_exps;  /* n_exp stacked Q8_0 matrices */
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;          /* q/k_norm NULL: none */
    int8_t *kq, *vq;          /* this layer's KV arena: (n_kv, max_seq, hd) */
    float *ks, *vs;           /* (n_kv, max_seq) */
} ks_layer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, hd, ffn, vocab, max_seq, kv_bs, neox;
    int n_exp, n_used, expert_ffn, norm_topk;     /* MoE layers; n_exp 0: none */
    float eps, scale;
    const ks_layer *layers;
    const uint8_t *tok_embd, *output;
    const float *out_norm, *cos_t, *sin_t;   /* tables (max_seq, hd/2) */
    /* one token's buffers */
    float *x, *xn, *q, *k, *v, *att, *proj, *gate, *up, *xd;
    int8_t *xq;
    float *attn_scratch;      /* nthreads * ks_attn_scratch_floats(G, hd, kv_bs) */
    float *attn_parts;        /* n_kv * KS_ATTN_SPLIT_MAX * ks_attn_part_floats(G, hd) */
    /* MoE: router probabilities (n_exp), the chosen experts and their weights (n_used), their
     * gate / up / swiglu rows (n_used, expert_ffn) and its Q8_0, their outputs (n_used, hidden) */
    float *probs, *top_w, *egate, *eup, *ehd, *ey;
    int32_t *top_idx;
    int8_t *ehq;
} ks_model;

/* out (n_mat, m): row block j = matrix idx[j] of the stack w (each (m, k) Q8_0) times the
 * activation xq + j * x_step (k values; scales xd + j * x_step / 32). A work-shared loop
 * over every (matrix, row block): call from every thread of the team. */
static inline void ks_decode_matmul_stack(const uint8_t *w, const int32_t *idx, int n_mat, int m,
                                          int k, const int8_t *xq, const float *xd,
                                          int64_t x_step, float *out)
{
    const int64_t stride = (int64_t)k / KS_QK * KS_QBLOCK;
    const int per = (m + KS_DECODE_ROWS - 1) / KS_DECODE_ROWS;
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < n_mat * per; it++) {
        const int j = it / per, r0 = (it % per) * KS_DECODE_ROWS;
        const int r1 = r0 + KS_DECODE_ROWS < m ? r0 + KS_DECODE_ROWS : m;
        ks_q8_matmul_rows(w + (int64_t)idx[j] * m * stride, stride, xq + j * x_step,
                          xd + j * x_step / KS_QK, 1, k, out + (int64_t)j * m, m, r0, r1);
    }
}

/* out (m) = w (m, k) . xq; a work-shared loop: call from every thread of the team. */
static inline void ks_decode_matmul(const uint8_t *w, int m, int k, const int8_t *xq,
                                    const float *xd, float *out)
{
    static const int32_t first = 0;
    ks_decode_matmul_stack(w, &first, 1, m, k, xq, xd, 0, out);
}

/* x += the routed experts of the token whose normed row (xn) and its Q8_0 (xq, xd) are
 * ready: the router, the k experts' gate and up, swiglu, down, the weighted sum. Call from
 * every thread of the team; ends with x updated and the team in step. */
static inline void ks_decode_moe(const ks_model *M, const ks_layer *L)
{
    const int H = M->hidden, F = M->expert_ffn, k = M->n_used;
    #pragma omp for schedule(static)
    for (int e = 0; e < M->n_exp; e++)
        M->probs[e] = ks_dot_f32(M->xn, L->router + (int64_t)e * H, H);
    #pragma omp single
    ks_moe_select(M->probs, M->n_exp, M->norm_topk, M->top_idx, M->top_w, k);
    ks_decode_matmul_stack(L->gate_exps, M->top_idx, k, F, H, M->xq, M->xd, 0, M->egate);
    ks_decode_matmul_stack(L->up_exps, M->top_idx, k, F, H, M->xq, M->xd, 0, M->eup);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int j = 0; j < k; j++) {
        float *g = M->egate + (int64_t)j * F;
        ks_swiglu(g, M->eup + (int64_t)j * F, g, F);
        ks_quantize_row_q8_0(g, M->ehq + (int64_t)j * F, M->ehd + (int64_t)j * (F / KS_QK), F);
    }
    ks_decode_matmul_stack(L->down_exps, M->top_idx, k, H, F, M->ehq, M->ehd, F, M->ey);
    #pragma omp barrier
    #pragma omp single
    for (int j = 0; j < k; j++)
        ks_add_scaled(M->x, M->ey + (int64_t)j * H, M->top_w[j], H);
}

/* Token `token` at position pos (KV of 0 .. pos-1 stored): stores its KV, writes logits (vocab).
 * RoPE turns it by rope_pos (pos, except for Qwen3-VL text after images). */
static void ks_decode_step(const ks_model *M, int token, int pos, int rope_pos, float *logits,
                           int nthreads)
{
    const int H = M->hidden, hd = M->hd, G = M->n_heads / M->n_kv;
    const int q_dim = M->n_heads * hd, kv_dim = M->n_kv * hd;
    const int split = ks_attn_split_len(pos + 1, M->kv_bs);
    const int n_split = (pos + split) / split;
    const int64_t scratch_floats = ks_attn_scratch_floats(G, hd, M->kv_bs);
    const int64_t part_floats = ks_attn_part_floats(G, hd);
    const float *ct = M->cos_t + (int64_t)rope_pos * (hd / 2);
    const float *st = M->sin_t + (int64_t)rope_pos * (hd / 2);

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
                ks_add_scaled(M->x, M->proj, 1.0f, H);
                ks_rmsnorm_row(M->x, L->ffn_norm, M->eps, M->xn, H);
                ks_quantize_row_q8_0(M->xn, M->xq, M->xd, H);
            }
            if (L->router) {
                ks_decode_moe(M, L);
                continue;
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
            ks_add_scaled(M->x, M->proj, 1.0f, H);
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
