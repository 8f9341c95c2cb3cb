/* Kestrel kernels: the forward pass, one for any number of tokens (no Python here).
 *
 * ks_forward runs a chunk of n >= 1 tokens through every layer and the output matrix as one
 * pass of the team of threads (ks_team.h): n == 1 is a decode step, n > 1 a prefill chunk.
 * Per layer, with the chunk's tokens at KV rows pos0 .. pos0 + n - 1:
 *
 *   x (n, hidden) --rmsnorm, Q8_0--> q, k, v = Wq, Wk, Wv . x
 *     per (token, head): q/k norm (Qwen3), RoPE by the token's tables; k, v -> the KV arena
 *     attention over KV rows 0 .. pos0 + t (int8 K/V, online softmax) -> att, Q8_0 per head
 *     x += Wo . att
 *   x --rmsnorm, Q8_0--> dense: swiglu(Wgate . x, Wup . x) -> Q8_0 -> x += Wdown . h
 *                        MoE:   router -> top-k experts -> the same per expert, over the
 *                               tokens routed to it -> x += the router-weighted sum
 *   Qwen3-VL: visual tokens' input rows come from the vision encoder, and the first
 *   layers' DeepStack features are added to their rows after those layers.
 * Then rmsnorm, Q8_0, logits = Woutput . x (the last token's, or every token's).
 *
 * Each step above is a phase of work items that any thread of the team takes (per token:
 * the residual add and the norm; row runs of the products; q, k or v heads; attention's key
 * ranges or token tiles), so the threads that get to run do the work of one the kernel
 * has descheduled. One token's residual step is the tail of the phase before it, done by
 * the thread that finishes that phase, and the q/k/v items are whole heads with their norm,
 * RoPE and KV store: a dense layer is 6 phases in decode, 7 in prefill.
 *
 * The rule: a token's KV rows and logits are the same bits whatever n (a decode step, a
 * prefill chunk, a verification pass), however its prompt was cut into chunks, whatever its
 * depth's neighbours, the thread count, which thread takes which item and which tile or SIMD
 * path runs, and whether the KV rows it reads were written by prefill, decode or restored from
 * a cache tier. The prefix cache and every tier rest on this (a hit must equal recomputing),
 * and so would speculation's multi-token verification. Every reduction therefore has an order
 * fixed by the data alone:
 *   - a product's output float sums its row's blocks in row order, one fma per block, with the
 *     same integer dot products in every tile (decode tiles, prefill tiles, the plain twin);
 *   - a norm, a softmax over experts, RoPE, SwiGLU: one token's row, in index order;
 *   - attention: a query's keys 0 .. p in segments of KS_ATTN_SEGMENT keys counted from key 0,
 *     online softmax within each, the segments folded in order (ks_attention.h); decode runs
 *     the segments as parallel items, prefill in turn, with the same arithmetic;
 *   - MoE: a token's experts added in the order the router ranked them.
 * Threads change who computes an item, never how: no reduction is split by thread count.
 * tests/test_same_bits.py holds every path to it with assert_array_equal.
 */
#ifndef KS_FORWARD_H
#define KS_FORWARD_H

#include <stdlib.h>
#include "ks_common.h"
#include "ks_matmul.h"        /* the weight ABI and its products */
#include "ks_rows.h"
#include "ks_attention.h"
#include "ks_moe.h"
#include "ks_team.h"

#define KS_DECODE_ROWS 16     /* output rows per work item of a one-token product */
#define KS_FFN_BLOCK 32       /* FFN rows per work item: one Q8_0 block of the swiglu output */

/* One transformer block (kestreld/model/weights.py's LayerWeights). */
typedef struct {
    const float *attn_norm, *ffn_norm;   /* (hidden) */
    const float *q_norm, *k_norm;        /* (hd); NULL: none (Llama) */
    ks_matrix wq, wk, wv, wo;            /* (n_heads*hd, hidden), (n_kv*hd, hidden) x2, (hidden, n_heads*hd) */
    ks_matrix gate, up, down;            /* dense: (ffn, hidden) x2, (hidden, ffn); MoE: n_exp stacked */
    ks_matrix router;                    /* F32 (n_exp, hidden); data NULL: a dense layer */
} ks_layer;

/* The model (ModelWeights + ModelConfig). */
typedef struct {
    int n_layers, hidden, n_heads, n_kv, hd, ffn, vocab;
    int n_exp, n_used, expert_ffn, norm_topk;   /* MoE layers; n_exp 0: none */
    int neox;                                    /* RoPE pairs: halves (1) or adjacent (0) */
    float eps, scale;                            /* RMSNorm epsilon, 1/sqrt(hd) */
    ks_matrix tok_embd, output;                  /* (vocab, hidden) */
    const float *out_norm;                       /* (hidden) */
    const ks_layer *layers;                      /* (n_layers) */
} ks_model;

/* The KV arena (kestreld/engine/kvcache.py's layout). */
typedef struct {
    int8_t *k_q, *v_q;        /* (n_layers, n_kv, max_seq, hd) */
    float *k_s, *v_s;         /* (n_layers, n_kv, max_seq) */
    int max_seq, kv_bs;
} ks_kv;

/* One chunk of tokens and what comes out of it. */
typedef struct {
    int n, pos0;                      /* n tokens at KV rows pos0 .. pos0 + n - 1 */
    const int32_t *tokens;            /* (n) */
    const float *rope_cos, *rope_sin; /* (n, hd/2): each token's rotation */
    int n_vis;                        /* Qwen3-VL: visual tokens in the chunk */
    const int32_t *vis_rows;          /* (n_vis) their indices in the chunk */
    const float *vis_embd;            /* (n_vis, hidden) their input rows */
    int n_deep;                       /* DeepStack: added after layers 0 .. n_deep - 1 */
    const float *deep;                /* (n_deep, n_vis, hidden) */
    float *logits;                    /* (all_logits ? n : 1, vocab) */
    int all_logits;
    float *hidden;                    /* NULL, or (all_logits ? n : 1, hidden): the pass stops
                                         at the output norm, its rows go here, no logits */
    int32_t *routing;                 /* NULL, or (MoE layers, n, n_used): the experts chosen */
    int n_seqs;                       /* 0: one sequence, keys from row 0. Else packed */
    const int32_t *seq_starts;        /* sequences (embeddings), sequence s from token
                                         seq_starts[s] (seq_starts[0] = 0) to the next's: its
                                         tokens see only its own keys, from row pos0 +
                                         seq_starts[s] */
} ks_batch;

/* Every buffer of a forward pass, allocated once for max_chunk tokens and nthreads threads. */
typedef struct {
    int max_chunk, nthreads;
    /* the residual stream, its norm and the norm's Q8_0 */
    float *x, *xn, *xd;               /* (max_chunk, hidden) x2, (max_chunk, hidden/32) */
    int8_t *xq;                       /* (max_chunk, hidden) */
    int16_t *xh;                      /* (max_chunk, hidden/16): xq's half sums */
    float *q, *k, *v, *att, *proj;    /* (max_chunk, q_dim | kv_dim | kv_dim | q_dim | hidden) */
    int8_t *q8;                       /* (max_chunk, n_heads, 2 hd): q for the integer scores */
    float *qd;                        /* (max_chunk, n_heads) */
    int32_t *qsum;                    /* (max_chunk, n_heads, 2) */
    float *gate, *up;                 /* (max_chunk, ffn) */
    int8_t *sq;                       /* Q8_0 of att (q_dim), then of swiglu (ffn): (max_chunk, widest) */
    float *sd;                        /* (max_chunk, widest/32) */
    int16_t *sh;                      /* (max_chunk, widest/16) */
    float *attn_scratch;              /* nthreads * attn_floats: each thread's own */
    float *attn_parts;                /* (n_kv, segments of max_seq, ks_attn_part_floats) */
    int64_t attn_floats;
    /* MoE, for max_chunk * n_used (token, slot) pairs */
    float *probs;                     /* (max_chunk, n_exp) */
    float *top_w;                     /* (max_chunk, n_used) */
    int32_t *top_idx, *slot_pos;      /* (max_chunk, n_used) */
    int32_t *counts, *offsets, *active;   /* (n_exp) */
    int32_t *rows;                    /* (max_chunk * n_used) */
    int8_t *gxq;                      /* (pairs, hidden): each pair's token's Q8_0 row */
    float *gxd;                       /* (pairs, hidden/32) */
    int16_t *gxh;                     /* (pairs, hidden/16) */
    float *egate, *eup, *ey;          /* (pairs, expert_ffn) x2, (pairs, hidden) */
    int8_t *ehq;                      /* (pairs, expert_ffn) */
    float *ehd;                       /* (pairs, expert_ffn/32) */
    int16_t *ehh;                     /* (pairs, expert_ffn/16) */
    int n_active;
} ks_scratch;

/* ---- allocation --------------------------------------------------------------------------- */

static inline int ks_max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* The next n elements of `size` bytes at base + *off (64-byte aligned offsets); NULL, only
 * counting, while base is NULL. */
static inline void *ks_carve(char *base, int64_t *off, int64_t n, int64_t size)
{
    void *p = base ? base + *off : NULL;
    *off += ((n * size + 63) / 64) * 64;
    return p;
}

/* The next rows x cols Q8_0 activation (int8 values, one scale per 32 and one half sum per
 * 16: rounded up, so a partial or empty row set still gets their room) at base + *off, as
 * ks_carve. */
static inline void ks_carve_q8(char *base, int64_t *off, int64_t rows, int64_t cols, int8_t **q,
                               float **d, int16_t **h)
{
    *q = ks_carve(base, off, rows * cols, 1);
    *d = ks_carve(base, off, rows * cols / KS_QK + 1, 4);
    *h = ks_carve(base, off, rows * cols / 16 + 1, 2);
}

/* Lays out S over `base` (NULL: just measure; base must be 64-byte aligned) for chunks of up
 * to max_chunk tokens, nthreads threads and an arena of max_seq tokens in KV blocks of kv_bs;
 * returns the bytes it takes. */
static int64_t ks_scratch_layout(ks_scratch *S, char *base, const ks_model *M, int max_chunk,
                                 int nthreads, int max_seq, int kv_bs)
{
    const int64_t H = M->hidden, T = max_chunk, P = (int64_t)max_chunk * (M->n_used > 0 ? M->n_used : 1);
    const int q_dim = M->n_heads * M->hd, kv_dim = M->n_kv * M->hd, G = M->n_heads / M->n_kv;
    const int widest = ks_max3(q_dim, M->ffn, 1);
    const int64_t F = M->expert_ffn > 0 ? M->expert_ffn : 1, E = M->n_exp > 0 ? M->n_exp : 1;
    const int64_t dec = ks_attn_scratch_floats(KS_ATTN_SPLIT_TOKENS * G, M->hd, kv_bs);
    const int64_t pre = ks_attn_scratch_floats(KS_ATTN_TOKENS * G, M->hd, kv_bs);
    int64_t off = 0;
    int64_t *cur = &off;
    S->max_chunk = max_chunk;
    S->nthreads = nthreads;
    S->attn_floats = dec > pre ? dec : pre;
    S->x = ks_carve(base, cur, T * H, 4);
    S->xn = ks_carve(base, cur, T * H, 4);
    ks_carve_q8(base, cur, T, H, &S->xq, &S->xd, &S->xh);
    S->q = ks_carve(base, cur, T * q_dim, 4);
    S->q8 = ks_carve(base, cur, T * 2 * q_dim, 1);
    S->qd = ks_carve(base, cur, T * M->n_heads, 4);
    S->qsum = ks_carve(base, cur, T * M->n_heads * 2, 4);
    S->k = ks_carve(base, cur, T * kv_dim, 4);
    S->v = ks_carve(base, cur, T * kv_dim, 4);
    S->att = ks_carve(base, cur, T * q_dim, 4);
    S->proj = ks_carve(base, cur, T * H, 4);
    S->gate = ks_carve(base, cur, T * (M->ffn > 0 ? M->ffn : 1), 4);
    S->up = ks_carve(base, cur, T * (M->ffn > 0 ? M->ffn : 1), 4);
    ks_carve_q8(base, cur, T, widest, &S->sq, &S->sd, &S->sh);
    S->attn_scratch = ks_carve(base, cur, nthreads * S->attn_floats, 4);
    S->attn_parts = ks_carve(base, cur, (int64_t)M->n_kv * ks_attn_segments(max_seq, kv_bs)
                             * ks_attn_part_floats(KS_ATTN_SPLIT_TOKENS * G, M->hd), 4);
    S->probs = ks_carve(base, cur, T * E, 4);
    S->top_w = ks_carve(base, cur, P, 4);
    S->top_idx = ks_carve(base, cur, P, 4);
    S->slot_pos = ks_carve(base, cur, P, 4);
    S->counts = ks_carve(base, cur, E, 4);
    S->offsets = ks_carve(base, cur, E, 4);
    S->active = ks_carve(base, cur, E, 4);
    S->rows = ks_carve(base, cur, P, 4);
    if (M->n_exp > 0) {
        ks_carve_q8(base, cur, P, H, &S->gxq, &S->gxd, &S->gxh);
        S->egate = ks_carve(base, cur, P * F, 4);
        S->eup = ks_carve(base, cur, P * F, 4);
        S->ey = ks_carve(base, cur, P * H, 4);
        ks_carve_q8(base, cur, P, F, &S->ehq, &S->ehd, &S->ehh);
    }
    return off;
}

/* ---- the phases' items (the walk of one thread through a pass) --------------------------- */

/* Output rows per work item of a product over n tokens: one-token products go in small
 * items (many threads share one matrix); in prefill, runs of up to 64 rows keep their weights
 * in cache while the tokens go past, short enough to give every thread a few, and whole
 * 16-row tiles (the widest, AVX512-VNNI's). The split does not change results. */
static inline int ks_rows_per_item(int m, int n, int nthreads)
{
    if (n == 1)
        return KS_DECODE_ROWS;
    int r = m / (4 * nthreads) / 16 * 16;
    return r < 16 ? 16 : r > 64 ? 64 : r;
}

static inline int ks_items_of(int rows, int per) { return (rows + per - 1) / per; }

/* Item it of a product's row runs of `per`: out (n, w.rows) rows r0 .. r1 - 1 = matrix e
 * of w . x (n rows, Q8_0 with half sums). */
static inline void ks_rows_item(const ks_matrix *w, int e, int per, int it, const ks_act *x,
                                int n, float *out)
{
    const int r0 = it * per, r1 = r0 + per < w->rows ? r0 + per : w->rows;
    ks_matrix_rows(w, e, x, n, out, r0, r1);
}

/* A phase of the products of one activation (n rows) by every matrix of ws (up to 3, into
 * outs), their row runs one item space. Like every phase helper below, it leaves its (last)
 * phase open: the caller ends it, after any tail (ks_residual_step). */
static inline void ks_phase_matmuls(ks_walk *w, const ks_matrix *const *ws, float *const *outs,
                                    int nw, const ks_act *x, int n, int nthreads)
{
    int per[3], first[4] = {0};
    for (int i = 0; i < nw; i++) {
        per[i] = ks_rows_per_item(ws[i]->rows, n, nthreads);
        first[i + 1] = first[i] + ks_items_of(ws[i]->rows, per[i]);
    }
    KS_EACH_ITEM(w, first[nw], it) {
        int i = 0;
        while (it >= first[i + 1])
            i++;
        ks_rows_item(ws[i], 0, per[i], it - first[i], x, n, outs[i]);
    }
}

/* Rows [b*32, b*32 + 32) of a SwiGLU pair for n activation rows: gate and up rows, then
 * swiglu and its Q8_0 block b of each row, finished by the thread that computed them.
 * gate, up (n, F) scratch; hq (n, F), hd (n, F/32), hh (n, F/16) the result. */
static inline void ks_ffn_block(const ks_matrix *gate, const ks_matrix *up, int e, int b,
                                const ks_act *x, int n, float *g, float *u, int8_t *hq,
                                float *hd, int16_t *hh)
{
    const int F = gate->rows, r0 = b * KS_FFN_BLOCK;
    ks_matrix_rows(gate, e, x, n, g, r0, r0 + KS_FFN_BLOCK);
    ks_matrix_rows(up, e, x, n, u, r0, r0 + KS_FFN_BLOCK);
    for (int t = 0; t < n; t++) {
        float *gt = g + (int64_t)t * F + r0;
        ks_swiglu(gt, u + (int64_t)t * F + r0, gt, KS_FFN_BLOCK);
        ks_quantize_row_q8_0(gt, hq + (int64_t)t * F + r0, hd + (int64_t)t * (F / KS_QK) + b,
                             hh + (int64_t)t * (F / 16) + 2 * b, KS_FFN_BLOCK);
    }
}

/* Row t of x -> xn = rmsnorm(x) * w, and its Q8_0 (xq, xd, xh), at row `to` of those. */
static inline void ks_norm_row(const ks_model *M, const ks_scratch *S, int t, int to, const float *w)
{
    const int H = M->hidden;
    float *xn = S->xn + (int64_t)to * H;
    ks_rmsnorm_row(S->x + (int64_t)t * H, w, M->eps, xn, H);
    ks_quantize_row_q8_0(xn, S->xq + (int64_t)to * H, S->xd + (int64_t)to * (H / KS_QK),
                         S->xh + (int64_t)to * (H / 16), H);
}

/* Row t of x += the feed-forward output of layer L (a finished phase), then, Qwen3-VL, the
 * DeepStack features of layer li if t is a visual row. */
static inline void ks_ffn_add_row(const ks_model *M, const ks_layer *L, int li,
                                  const ks_scratch *S, const ks_batch *B, int t)
{
    const int H = M->hidden, k = M->n_used;
    float *x = S->x + (int64_t)t * H;
    if (!L->router.data)
        ks_add_scaled(x, S->proj + (int64_t)t * H, 1.0f, H);
    else
        ks_moe_combine_row(x, S->ey, S->slot_pos + t * k, S->top_w + t * k, k, H);
    if (li < B->n_deep)
        for (int r = 0; r < B->n_vis; r++)
            if (B->vis_rows[r] == t)
                ks_add_scaled(x, B->deep + ((int64_t)li * B->n_vis + r) * H, 1.0f, H);
}

/* Row i of the residual step before a sublayer of layer li: before the attention (part 0),
 * x += layer li - 1's feed-forward output (li > 0), then the attention norm; before the
 * feed-forward (part 1), x += the attention output, then the feed-forward norm; li ==
 * n_layers: the output norm, of row first + i into row i (the rows whose logits are made). */
static inline void ks_residual_row(const ks_model *M, const ks_scratch *S, const ks_batch *B,
                                   int li, int part, int first, int i)
{
    const int t = first + i;
    if (part == 1) {
        ks_add_scaled(S->x + (int64_t)t * M->hidden, S->proj + (int64_t)t * M->hidden, 1.0f, M->hidden);
        ks_norm_row(M, S, t, t, M->layers[li].ffn_norm);
        return;
    }
    if (li > 0)
        ks_ffn_add_row(M, &M->layers[li - 1], li - 1, S, B, t);
    ks_norm_row(M, S, t, i, li < M->n_layers ? M->layers[li].attn_norm : M->out_norm);
}

/* The residual step (ks_residual_row) of rows 0 .. count - 1 after the phase just done. One
 * row is that phase's tail, done by the thread that finished it before the team moves on (a
 * decode step's two per layer cost no hand-over); more rows make a phase of their own. The
 * walk is left in an open phase; 0 if the pass is over. */
static inline int ks_residual_step(ks_walk *w, const ks_model *M, const ks_scratch *S,
                                   const ks_batch *B, int li, int part, int first, int count)
{
    if (count == 1) {
        if (ks_phase_last(w))
            ks_residual_row(M, S, B, li, part, first, 0);
        return 1;
    }
    if (!ks_phase_end(w))
        return 0;
    KS_EACH_ITEM(w, count, i)
        ks_residual_row(M, S, B, li, part, first, i);
    return 1;
}

/* Token t's part of head item h < n_heads + 2 n_kv (ks_phase_qkv): q/k norm and RoPE of
 * query head h and its codes for the attention's integer scores, or of K head h - n_heads
 * and its row into the arena, or V head h - n_heads - n_kv's row into the arena. */
static inline void ks_head_item(const ks_model *M, const ks_layer *L, const ks_kv *kv, int li,
                                const ks_scratch *S, const ks_batch *B, int t, int h)
{
    const int hd = M->hd, nh = M->n_heads, nkv = M->n_kv;
    const float *ct = B->rope_cos + (int64_t)t * (hd / 2), *st = B->rope_sin + (int64_t)t * (hd / 2);
    if (h < nh) {
        const int64_t r = (int64_t)t * nh + h;
        float *qh = S->q + r * hd;
        if (L->q_norm)
            ks_rmsnorm_row(qh, L->q_norm, M->eps, qh, hd);
        ks_rope_row(qh, ct, st, hd, M->neox);
        ks_attn_quantize_row(qh, M->scale, hd, S->q8 + 2 * r * hd, S->qd + r, S->qsum + 2 * r);
        return;
    }
    const int g = (h - nh) % nkv;
    const int64_t row = (int64_t)li * nkv * kv->max_seq + (int64_t)g * kv->max_seq + B->pos0 + t;
    if (h >= nh + nkv) {
        kv->v_s[row] = ks_quantize_head(S->v + ((int64_t)t * nkv + g) * hd, kv->v_q + row * hd, hd);
        return;
    }
    float *kh = S->k + ((int64_t)t * nkv + g) * hd;
    if (L->k_norm)
        ks_rmsnorm_row(kh, L->k_norm, M->eps, kh, hd);
    ks_rope_row(kh, ct, st, hd, M->neox);
    kv->k_s[row] = ks_quantize_head(kh, kv->k_q + row * hd, hd);
}

/* The phase from the normed rows to the arena: one item per head of q, k or v (n_heads +
 * 2 n_kv), the head's rows of the product for every token of the chunk, then each token's
 * ks_head_item, while those rows are in the cache of the thread that made them. */
static inline void ks_phase_qkv(ks_walk *w, const ks_model *M, const ks_layer *L,
                                const ks_kv *kv, int li, const ks_scratch *S, const ks_batch *B)
{
    const int n = B->n, hd = M->hd, nh = M->n_heads, nkv = M->n_kv;
    KS_EACH_ITEM(w, nh + 2 * nkv, h) {
        const ks_matrix *m = h < nh ? &L->wq : h < nh + nkv ? &L->wk : &L->wv;
        float *out = h < nh ? S->q : h < nh + nkv ? S->k : S->v;
        const int r0 = (h < nh ? h : (h - nh) % nkv) * hd;
        ks_matrix_rows(m, 0, &(ks_act){S->xq, S->xd, S->xh}, n, out, r0, r0 + hd);
        for (int t = 0; t < n; t++)
            ks_head_item(M, L, kv, li, S, B, t, h);
    }
}

/* Prefill's attention tiles, up to KS_ATTN_TOKENS tokens of one sequence each. With ti < 0:
 * their number. With ti >= 0: tile ti's first and end token and its sequence's first KV row
 * go in tile[0..2] (the count returned is then partial). */
static inline int ks_attn_tiles_of(const ks_batch *B, int ti, int tile[3])
{
    const int ns = B->n_seqs ? B->n_seqs : 1;
    int count = 0;
    for (int s = 0; s < ns; s++) {
        const int a = B->n_seqs ? B->seq_starts[s] : 0;
        const int b = s + 1 < ns ? B->seq_starts[s + 1] : B->n;
        const int here = (b - a + KS_ATTN_TOKENS - 1) / KS_ATTN_TOKENS;
        if (ti >= count && ti < count + here) {
            tile[0] = a + (ti - count) * KS_ATTN_TOKENS;
            tile[1] = tile[0] + KS_ATTN_TOKENS < b ? tile[0] + KS_ATTN_TOKENS : b;
            tile[2] = B->n_seqs ? B->pos0 + a : 0;
            return count + here;
        }
        count += here;
    }
    return count;
}

/* The attention phases of layer li: the chunk's queries over KV rows 0 (or their packed
 * sequence's first) .. pos0 + t, into
 * att (n, q_dim) and its Q8_0 per head (sq, sd, sh: hd is a multiple of 32, so a head's blocks
 * are the row's). Decode and passes of up to KS_ATTN_SPLIT_TOKENS: (KV head, key segment) items,
 * then one merge item per token and head. Prefill: (token tile, KV head) items, later tiles
 * (more keys: causal) first. */
static inline int ks_phases_attention(ks_walk *w, const ks_model *M, const ks_kv *kv, int li,
                                      const ks_scratch *S, const ks_batch *B, float *scratch)
{
    const int hd = M->hd, nh = M->n_heads, nkv = M->n_kv, G = nh / nkv, n = B->n;
    const int64_t lq = (int64_t)li * nkv * kv->max_seq;
    const int8_t *kq = kv->k_q + lq * hd, *vq = kv->v_q + lq * hd;
    const float *ks = kv->k_s + lq, *vs = kv->v_s + lq;
    if (n <= KS_ATTN_SPLIT_TOKENS && B->n_seqs == 0) {
        const int n_seg = ks_attn_segments(B->pos0 + n, kv->kv_bs);
        const int64_t pf = ks_attn_part_floats(n * G, hd);
        KS_EACH_ITEM(w, nkv * n_seg, it)
            ks_attn_split_item(S->q8, S->qd, S->qsum, kq, ks, vq, vs, S->attn_parts + it * pf,
                               nh, nkv, hd, kv->max_seq, B->pos0, n, kv->kv_bs, it % n_seg,
                               it / n_seg, scratch);
        if (!ks_phase_end(w))
            return 0;
        KS_EACH_ITEM(w, n * nh, it) {
            const int64_t o = (int64_t)it * hd;     /* row (it / nh, it % nh) */
            ks_attn_split_merge(S->attn_parts, S->att, nh, nkv, hd, n, n_seg, it / nh, it % nh);
            ks_quantize_row_q8_0(S->att + o, S->sq + o, S->sd + o / KS_QK, S->sh + o / 16, hd);
        }
        return 1;
    }
    const int n_tiles = ks_attn_tiles_of(B, -1, NULL);
    KS_EACH_ITEM(w, n_tiles * nkv, it) {
        int tile[3] = {0, 0, 0};
        ks_attn_tiles_of(B, n_tiles - 1 - it / nkv, tile);
        const int t0 = tile[0], t1 = tile[1], g = it % nkv;
        ks_attn_prefill_item(S->q8, S->qd, S->qsum, kq, ks, vq, vs, S->att, nh, nkv, hd,
                             kv->max_seq, B->pos0, tile[2], kv->kv_bs, t0, t1, g, scratch);
        for (int t = t0; t < t1; t++)
            for (int h = g * G; h < g * G + G; h++) {
                const int64_t o = ((int64_t)t * nh + h) * hd;
                ks_quantize_row_q8_0(S->att + o, S->sq + o, S->sd + o / KS_QK, S->sh + o / 16, hd);
            }
    }
    return 1;
}

#define KS_ROUTER_EXPERTS 16    /* router rows per work item */

/* The MoE phases of layer L over the normed rows (xn and its Q8_0): the router (token,
 * 16 experts) items, whose tail picks every token's top-k, groups the (token, slot) pairs by
 * expert and gathers each pair's activation row; per chosen expert the gate/up/swiglu and
 * the down products of its tokens into S->ey. `routing`: NULL or (n, n_used) where the
 * choices are copied. The weighted sum is added by the next residual step. */
static inline int ks_phases_moe(ks_walk *w, const ks_model *M, const ks_layer *L,
                                ks_scratch *S, int n, int32_t *routing)
{
    const int H = M->hidden, F = M->expert_ffn, k = M->n_used, E = M->n_exp;
    const float *router = (const float *)L->router.data;
    const int per_t = (E + KS_ROUTER_EXPERTS - 1) / KS_ROUTER_EXPERTS;
    KS_EACH_ITEM(w, n * per_t, it) {
        const int t = it / per_t, e0 = (it % per_t) * KS_ROUTER_EXPERTS;
        const int e1 = e0 + KS_ROUTER_EXPERTS < E ? e0 + KS_ROUTER_EXPERTS : E;
        for (int e = e0; e < e1; e++)
            S->probs[(int64_t)t * E + e] = ks_dot_f32(S->xn + (int64_t)t * H, router + (int64_t)e * H, H);
    }
    if (ks_phase_last(w)) {
        for (int t = 0; t < n; t++)
            ks_moe_select(S->probs + (int64_t)t * E, E, M->norm_topk, S->top_idx + t * k,
                          S->top_w + t * k, k);
        S->n_active = ks_moe_group(S->top_idx, n, k, E, S->counts, S->offsets, S->rows,
                                   S->slot_pos, S->active);
        for (int p = 0; p < n * k; p++) {   /* each pair's activation row, in sorted order */
            memcpy(S->gxq + (int64_t)p * H, S->xq + (int64_t)S->rows[p] * H, H);
            memcpy(S->gxd + (int64_t)p * (H / KS_QK), S->xd + (int64_t)S->rows[p] * (H / KS_QK),
                   sizeof(float) * (H / KS_QK));
            memcpy(S->gxh + (int64_t)p * (H / 16), S->xh + (int64_t)S->rows[p] * (H / 16),
                   sizeof(int16_t) * (H / 16));
        }
        if (routing)
            memcpy(routing, S->top_idx, sizeof(int32_t) * n * k);
    }
    if (!ks_phase_end(w))
        return 0;
    const int nb = F / KS_FFN_BLOCK;
    KS_EACH_ITEM(w, S->n_active * nb, it) {
        const int e = S->active[it / nb], a = S->offsets[e], c = S->counts[e];
        const ks_act x = ks_act_rows(S->gxq, S->gxd, S->gxh, a, H);
        ks_ffn_block(&L->gate, &L->up, e, it % nb, &x, c, S->egate + (int64_t)a * F,
                     S->eup + (int64_t)a * F, S->ehq + (int64_t)a * F, S->ehd + (int64_t)a * (F / KS_QK), S->ehh + (int64_t)a * (F / 16));
    }
    if (!ks_phase_end(w))
        return 0;
    const int per = ks_rows_per_item(H, n, S->nthreads), runs = ks_items_of(H, per);
    KS_EACH_ITEM(w, S->n_active * runs, it) {
        const int e = S->active[it / runs], a = S->offsets[e], c = S->counts[e];
        const int r0 = (it % runs) * per, r1 = r0 + per < H ? r0 + per : H;
        const ks_act h = ks_act_rows(S->ehq, S->ehd, S->ehh, a, F);
        ks_matrix_rows(&L->down, e, &h, c, S->ey + (int64_t)a * H, r0, r1);
    }
    return 1;
}

/* The dense feed-forward phases: gate/up/swiglu/Q8_0 by 32-row blocks (into sq, sd, sh), then
 * down into proj. */
static inline int ks_phases_mlp(ks_walk *w, const ks_model *M, const ks_layer *L,
                                const ks_scratch *S, int n)
{
    const int nb = M->ffn / KS_FFN_BLOCK;
    KS_EACH_ITEM(w, nb, b)
        ks_ffn_block(&L->gate, &L->up, 0, b, &(ks_act){S->xq, S->xd, S->xh}, n, S->gate,
                     S->up, S->sq, S->sd, S->sh);
    if (!ks_phase_end(w))
        return 0;
    const ks_matrix *down = &L->down;
    float *proj = S->proj;
    ks_phase_matmuls(w, &down, &proj, 1, &(ks_act){S->sq, S->sd, S->sh}, n, S->nthreads);
    return 1;
}

/* ---- the pass ----------------------------------------------------------------------------- */

/* Phases a pass over a model of n_layers layers may have: the embeddings, per layer at most
 * 9 (the attention's residual step, q/k/v, attention 2, wo, the feed-forward's residual
 * step, MoE 3), then the output's residual step and product. */
static inline int ks_forward_phases(int n_layers) { return 1 + 9 * n_layers + 2; }

/* What a pass reads: the team's job. */
typedef struct {
    const ks_model *M;
    const ks_kv *kv;
    ks_scratch *S;
    const ks_batch *B;
} ks_forward_job;

/* Row t of x from its token's embedding row, or a visual token's input row. */
static inline void ks_embed_row(const ks_model *M, const ks_scratch *S, const ks_batch *B, int t)
{
    const int H = M->hidden;
    int r = B->n_vis - 1;
    while (r >= 0 && B->vis_rows[r] != t)
        r--;
    if (r >= 0)
        memcpy(S->x + (int64_t)t * H, B->vis_embd + (int64_t)r * H, sizeof(float) * H);
    else
        ks_matrix_dequant_row(&M->tok_embd, 0, B->tokens[t], S->x + (int64_t)t * H);
}

/* One thread's walk through the pass (ks_team_fn). */
static void ks_forward_walk(ks_team *T, int tid, uint32_t pass)
{
    const ks_forward_job *J = T->job;
    const ks_model *M = J->M;
    ks_scratch *S = J->S;
    const ks_batch *B = J->B;
    const int n = B->n, nthreads = S->nthreads;
    float *scratch = S->attn_scratch + tid * S->attn_floats;
    ks_walk walk = {.team = T, .pass = pass, .tid = tid}, *w = &walk;
    int moe_layer = 0;

    KS_EACH_ITEM(w, n, t) {      /* with layer 0's residual step (its attention norm) */
        ks_embed_row(M, S, B, t);
        ks_residual_row(M, S, B, 0, 0, 0, t);
    }
    for (int li = 0; li < M->n_layers; li++) {
        const ks_layer *L = &M->layers[li];
        if (li > 0 && !ks_residual_step(w, M, S, B, li, 0, 0, n))
            goto late;
        if (!ks_phase_end(w))
            goto late;
        ks_phase_qkv(w, M, L, J->kv, li, S, B);
        if (!ks_phase_end(w) || !ks_phases_attention(w, M, J->kv, li, S, B, scratch))
            goto late;
        if (!ks_phase_end(w))
            goto late;
        const ks_matrix *wo = &L->wo;
        float *proj = S->proj;
        ks_phase_matmuls(w, &wo, &proj, 1, &(ks_act){S->sq, S->sd, S->sh}, n, nthreads);
        if (!ks_residual_step(w, M, S, B, li, 1, 0, n) || !ks_phase_end(w))
            goto late;
        if (L->router.data) {
            int32_t *routing = B->routing ? B->routing + (int64_t)moe_layer * n * M->n_used : NULL;
            moe_layer++;
            if (!ks_phases_moe(w, M, L, S, n, routing))
                goto late;
        } else if (!ks_phases_mlp(w, M, L, S, n)) {
            goto late;
        }
    }
    /* logits (or normed rows) of every token, or of the last one only */
    const int first = B->all_logits ? 0 : n - 1, m = n - first;
    if (!ks_residual_step(w, M, S, B, M->n_layers, 0, first, m) || !ks_phase_end(w))
        goto late;
    if (B->hidden) {             /* embeddings: the normed rows, not the output product */
        KS_EACH_ITEM(w, m, i)
            memcpy(B->hidden + (int64_t)i * M->hidden, S->xn + (int64_t)i * M->hidden,
                   sizeof(float) * M->hidden);
        ks_phase_end(w);
        goto late;
    }
    const ks_matrix *out = &M->output;
    float *logits = B->logits;
    ks_phase_matmuls(w, &out, &logits, 1, &(ks_act){S->xq, S->xd, S->xh}, m, nthreads);
    ks_phase_end(w);
late:
    __atomic_store_n(&T->items[tid], w->taken, __ATOMIC_RELAXED);
}

/* Runs the chunk job->B (B->n <= S->max_chunk tokens at KV rows pos0.., rows 0 .. pos0 - 1
 * valid) on the team T (made for ks_forward_walk): stores its KV and writes its logits.
 * Checked by the caller: shapes, token ids, positions. The job and what it points to must
 * stay readable after the pass (a late thread reads them to find that it is late). */
static void ks_forward(ks_team *T, const ks_forward_job *job)
{
    ks_team_run(T, job);
}

#endif /* KS_FORWARD_H */
