/* Kestrel kernels: one decode step (a single token through every layer and the output
 * matrix) in one OpenMP parallel region (no Python here).
 *
 * Decode is memory-bound and its kernels are tiny: calling them one by one from Python costs
 * a Python call, a GIL release and an OpenMP fork/join each, ~15 per layer. Here the threads
 * stay in one team for the whole token; the matrix products, attention and per-head work are
 * shared with `omp for`, and each thread keeps its own copy of the residual stream. Every value is computed
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
    /* one token's buffers. x, xn, xnq, xnd: one residual stream per thread (ks_residual);
     * xq, xd: the Q8_0 of att (q_dim), then of swiglu (ffn) */
    float *x, *xn, *xnd, *q, *k, *v, *att, *proj, *gate, *up, *xd;
    int8_t *xnq, *xq;
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

/* One thread's copy of the residual stream: every thread adds, norms and quantizes it itself
 * (the same bits on each), so no thread waits for another between a product and the next. */
typedef struct {
    float *x, *xn, *xd;       /* (hidden), (hidden), (hidden / 32) */
    int8_t *xq;               /* (hidden): xn as Q8_0 (values; xd its scales) */
} ks_residual;

/* r.xn, r.xq, r.xd = Q8_0 of rmsnorm(r.x) with weights w */
static inline void ks_decode_norm(const ks_model *M, const ks_residual *r, const float *w)
{
    ks_rmsnorm_row(r->x, w, M->eps, r->xn, M->hidden);
    ks_quantize_row_q8_0(r->xn, r->xq, r->xd, M->hidden);
}

/* The routed experts of the token whose normed row and its Q8_0 are in r: the router, the k
 * experts' gate and up, swiglu, down into M->ey. Call from every thread of the team; the
 * caller adds the weighted outputs (ks_decode_ffn_add) after a barrier. */
static inline void ks_decode_moe(const ks_model *M, const ks_layer *L, const ks_residual *r)
{
    const int H = M->hidden, F = M->expert_ffn, k = M->n_used;
    #pragma omp for schedule(static)
    for (int e = 0; e < M->n_exp; e++)
        M->probs[e] = ks_dot_f32(r->xn, L->router + (int64_t)e * H, H);
    #pragma omp single
    ks_moe_select(M->probs, M->n_exp, M->norm_topk, M->top_idx, M->top_w, k);
    ks_decode_matmul_stack(L->gate_exps, M->top_idx, k, F, H, r->xq, r->xd, 0, M->egate);
    ks_decode_matmul_stack(L->up_exps, M->top_idx, k, F, H, r->xq, r->xd, 0, M->eup);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int j = 0; j < k; j++) {
        float *g = M->egate + (int64_t)j * F;
        ks_swiglu(g, M->eup + (int64_t)j * F, g, F);
        ks_quantize_row_q8_0(g, M->ehq + (int64_t)j * F, M->ehd + (int64_t)j * (F / KS_QK), F);
    }
    ks_decode_matmul_stack(L->down_exps, M->top_idx, k, H, F, M->ehq, M->ehd, F, M->ey);
}

/* The dense feed-forward's gate and up, swiglu and its Q8_0 (M->xq, M->xd), by blocks of 32
 * rows so each block is finished by the thread that computed it; then down into M->proj. */
static inline void ks_decode_mlp(const ks_model *M, const ks_layer *L, const ks_residual *r)
{
    const int H = M->hidden, F = M->ffn;
    const int64_t stride = (int64_t)H / KS_QK * KS_QBLOCK;
    #pragma omp for schedule(static)
    for (int b = 0; b < F / KS_QK; b++) {
        const int r0 = b * KS_QK;
        ks_q8_matmul_rows(L->w_gate, stride, r->xq, r->xd, 1, H, M->gate, F, r0, r0 + KS_QK);
        ks_q8_matmul_rows(L->w_up, stride, r->xq, r->xd, 1, H, M->up, F, r0, r0 + KS_QK);
        ks_swiglu(M->gate + r0, M->up + r0, M->gate + r0, KS_QK);
        ks_quantize_row_q8_0(M->gate + r0, M->xq + r0, M->xd + b, KS_QK);
    }
    ks_decode_matmul(L->w_down, H, F, M->xq, M->xd, M->proj);
}

/* x += the feed-forward output of layer L (after the barrier that ends its products) */
static inline void ks_decode_ffn_add(const ks_model *M, const ks_layer *L, float *x)
{
    if (!L->router) {
        ks_add_scaled(x, M->proj, 1.0f, M->hidden);
        return;
    }
    for (int j = 0; j < M->n_used; j++)
        ks_add_scaled(x, M->ey + (int64_t)j * M->hidden, M->top_w[j], M->hidden);
}

/* Token `token` at position pos (KV of 0 .. pos-1 stored): stores its KV, writes logits (vocab).
 * RoPE turns it by rope_pos (pos, except for Qwen3-VL text after images). Shared buffers are
 * written inside work-shared loops and read after the barrier that ends them: 7 barriers a
 * dense layer. */
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
        const int tid = omp_get_thread_num();
        float *scratch = M->attn_scratch + tid * scratch_floats;
        const ks_residual r = {M->x + (int64_t)tid * H, M->xn + (int64_t)tid * H,
                               M->xnd + (int64_t)tid * (H / KS_QK), M->xnq + (int64_t)tid * H};
        ks_dequantize_row_q8_0(M->tok_embd + (int64_t)token * (H / KS_QK * KS_QBLOCK), r.x, H);

        for (int li = 0; li < M->n_layers; li++) {
            const ks_layer *L = &M->layers[li];
            if (li > 0)
                ks_decode_ffn_add(M, L - 1, r.x);
            ks_decode_norm(M, &r, L->attn_norm);
            ks_decode_matmul(L->wq, q_dim, H, r.xq, r.xd, M->q);
            ks_decode_matmul(L->wk, kv_dim, H, r.xq, r.xd, M->k);
            ks_decode_matmul(L->wv, kv_dim, H, r.xq, r.xd, M->v);
            #pragma omp barrier
            /* q heads: norm, rope; then KV heads: norm, rope, into the arena */
            #pragma omp for schedule(static)
            for (int h = 0; h < M->n_heads + M->n_kv; h++) {
                if (h < M->n_heads) {
                    float *qh = M->q + h * hd;
                    if (L->q_norm)
                        ks_rmsnorm_row(qh, L->q_norm, M->eps, qh, hd);
                    ks_rope_row(qh, ct, st, hd, M->neox);
                    continue;
                }
                const int g = h - M->n_heads;
                float *kh = M->k + g * hd;
                if (L->k_norm)
                    ks_rmsnorm_row(kh, L->k_norm, M->eps, kh, hd);
                ks_rope_row(kh, ct, st, hd, M->neox);
                const int64_t row = (int64_t)g * M->max_seq + pos;
                L->ks[row] = ks_quantize_head(kh, L->kq + row * hd, hd);
                L->vs[row] = ks_quantize_head(M->v + g * hd, L->vq + row * hd, hd);
            }
            #pragma omp for schedule(static)
            for (int it = 0; it < M->n_kv * n_split; it++)
                ks_attn_decode_item(M->q, L->kq, L->ks, L->vq, L->vs,
                                    M->attn_parts + it * part_floats, M->n_heads, M->n_kv, hd,
                                    M->max_seq, pos, M->scale, M->kv_bs, split, it % n_split,
                                    it / n_split, scratch);
            /* each head's output and its Q8_0 blocks (hd is a multiple of 32) */
            #pragma omp for schedule(static)
            for (int h = 0; h < M->n_heads; h++) {
                ks_attn_decode_merge(M->attn_parts, M->att, M->n_heads, M->n_kv, hd, n_split, h);
                ks_quantize_row_q8_0(M->att + h * hd, M->xq + h * hd, M->xd + h * (hd / KS_QK), hd);
            }
            ks_decode_matmul(L->wo, H, q_dim, M->xq, M->xd, M->proj);
            #pragma omp barrier
            ks_add_scaled(r.x, M->proj, 1.0f, H);
            ks_decode_norm(M, &r, L->ffn_norm);
            if (L->router)
                ks_decode_moe(M, L, &r);
            else
                ks_decode_mlp(M, L, &r);
            #pragma omp barrier
        }
        ks_decode_ffn_add(M, &M->layers[M->n_layers - 1], r.x);
        ks_decode_norm(M, &r, M->out_norm);
        ks_decode_matmul(M->output, M->vocab, H, r.xq, r.xd, logits);
    }
}

#endif /* KS_DECODE_H */
