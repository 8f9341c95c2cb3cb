/* Kestrel kernels: the vision encoder's blocks, one pass for all of them, and their float
 * kernels (LayerNorm with bias, GELU, full attention over one image's patches); no Python here.
 *
 * The attention is the online softmax of ks_attention.h run on float K / V: a work item (one
 * head, a tile of queries) copies each block of keys into a zero-padded scratch block and
 * hands it to ks_attn_tile with unit scales, so no N x N score matrix exists and the SIMD
 * paths, tiles and bit-for-bit guarantees are those of the language model's attention.
 */
#ifndef KS_VISION_H
#define KS_VISION_H

#include "ks_attention.h"
#include "ks_forward.h"      /* the team's phases, row runs and scratch carving it shares */

#define KS_VATTN_KEYS 128           /* keys per online-softmax block */
#define KS_VATTN_QUERIES 64         /* queries per work item: each key block is copied once
                                     * for this many queries */

/* ---- LayerNorm ----------------------------------------------------------------------------- */

/* 8 lane sums of x[i] - mu over d floats, then added pairwise: they vectorize and add less
 * rounding than one running sum. */
static inline float ks_sum_centered(const float *x, float mu, int64_t d, int squared)
{
    ks_v8 acc = ks_v8_set1(0.0f);
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const ks_v8 c = ks_v8_load(x + i) - mu;
        acc += squared ? c * c : c;
    }
    for (; i < d; i++)
        tail += squared ? (x[i] - mu) * (x[i] - mu) : x[i] - mu;
    return ks_v8_hsum(acc) + tail;
}

/* out (d) = (x - mean) / sqrt(var + eps) * w + b, var the biased variance (torch's LayerNorm);
 * out may be x. Two passes (mean, then the centred squares) so the variance does not lose
 * digits to a large mean. */
static inline void ks_layernorm_row(const float *x, const float *w, const float *b, float eps,
                                    float *out, int64_t d)
{
    const float mu = ks_sum_centered(x, 0.0f, d, 0) / (float)d;
    const float inv = 1.0f / sqrtf(ks_sum_centered(x, mu, d, 1) / (float)d + eps);
    for (int64_t i = 0; i < d; i++)
        out[i] = (x[i] - mu) * inv * w[i] + b[i];
}

/* ---- GELU ---------------------------------------------------------------------------------- */

/* 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (torch's gelu_pytorch_tanh), as the
 * equal x * sigmoid(2u): one exp and a division, and no cancellation of 1 + tanh(u) where
 * tanh(u) is near -1 (the negative tail keeps its relative accuracy). */
static inline ks_v8 ks_v8_gelu_tanh(ks_v8 x)
{
    const ks_v8 two_u = x * (1.5957691216057308f + 0.07135481627260025f * x * x);
    return x / (1.0f + ks_v8_exp(-two_u));
}

/* erfc(a) for a >= 0 to a relative 1.2e-7 (before float rounding): the Chebyshev fit of
 * Numerical Recipes' erfcc, t exp(P(t) - a^2) with t = 1 / (1 + a/2). */
static inline ks_v8 ks_v8_erfc_pos(ks_v8 a)
{
    const ks_v8 t = 1.0f / (1.0f + 0.5f * a);
    ks_v8 p = ks_v8_set1(0.17087277f);
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    return t * ks_v8_exp(p - a * a);
}

/* The exact GELU (torch's default "gelu"): 0.5 x (1 + erf(x / sqrt(2))) = x Phi(x), with
 * Phi(x) = erfc(|x| / sqrt(2)) / 2 for x < 0 and 1 minus that for x >= 0. Taking the
 * negative side from erfc keeps its relative accuracy where 1 + erf(x) would cancel. */
static inline ks_v8 ks_v8_gelu_erf(ks_v8 x)
{
    const ks_v8 tail = 0.5f * ks_v8_erfc_pos(ks_v8_abs(x) * 0.7071067811865475f);
    return x * ks_v8_select(ks_v8_lt(x, ks_v8_set1(0.0f)), tail, 1.0f - tail);
}

/* out = gelu(x) over n floats, the erf form if use_erf, else the tanh form (out may be x). */
static inline void ks_gelu(const float *x, float *out, int64_t n, int use_erf)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const ks_v8 v = ks_v8_load(x + i);
        ks_v8_store(out + i, use_erf ? ks_v8_gelu_erf(v) : ks_v8_gelu_tanh(v));
    }
    if (i < n) {                        /* the tail through an 8-float buffer, same formula */
        float t[8] = {0}, o[8];
        memcpy(t, x + i, sizeof(float) * (n - i));
        ks_gelu(t, o, 8, use_erf);
        memcpy(out + i, o, sizeof(float) * (n - i));
    }
}

/* ---- full attention ------------------------------------------------------------------------ */

/* head_dim rounded up to whole strips: the scratch rows are zero-padded to it, which leaves
 * every score and output unchanged (the pads add exact zeros) and lets any head_dim use the
 * strip-wise loops. */
static inline int ks_vattn_padded_hd(int hd)
{
    return (hd + KS_ATTN_STRIP - 1) / KS_ATTN_STRIP * KS_ATTN_STRIP;
}

/* Scratch a work item needs, in floats: K and V blocks, the tile's scores and factors, unit
 * scales, then the queries' scaled rows, accumulators and softmax state. */
static inline int64_t ks_vattn_scratch_floats(int hd)
{
    const int64_t hp = ks_vattn_padded_hd(hd);
    return 2 * hp * KS_VATTN_KEYS + KS_ATTN_QB * (KS_VATTN_KEYS + 1) + KS_VATTN_KEYS
         + KS_VATTN_QUERIES * (2 * hp + 2);
}

/* rows [r0, r1) of head h of x (n, heads, hd) -> dst (r1 - r0 rows of hp floats), each row
 * times mul and zero past hd; rows from `valid` on (relative to r0) are all zero. */
static inline void ks_vattn_load_rows(float *restrict dst, const float *restrict x, int heads,
                                      int hd, int hp, int h, int r0, int r1, int valid,
                                      float mul)
{
    for (int r = 0; r < r1 - r0; r++) {
        float *d = dst + (int64_t)r * hp;
        int e = 0;
        if (r < valid) {
            const float *s = x + ((int64_t)(r0 + r) * heads + h) * hd;
            for (; e < hd; e++)
                d[e] = s[e] * mul;
        }
        for (; e < hp; e++)
            d[e] = 0.0f;
    }
}

/* Work item: queries [t0, t1) (at most KS_VATTN_QUERIES) of head h against all n keys.
 * q, k, v, out (n, heads, hd); out row = softmax_j(scale * q . k_j) . v_j. */
static void ks_vattn_item(const float *q, const float *k, const float *v, float *out, int n,
                          int heads, int hd, float scale, int h, int t0, int t1, float *scratch)
{
    enum { KB = KS_VATTN_KEYS, S = KS_ATTN_STRIP };
    const int hp = ks_vattn_padded_hd(hd), nq = t1 - t0;
    float *kf = scratch, *vf = kf + (int64_t)hp * KB, *sc = vf + (int64_t)hp * KB;
    float *corr = sc + KS_ATTN_QB * KB, *ones = corr + KS_ATTN_QB, *qs = ones + KB;
    float *acc = qs + (int64_t)KS_VATTN_QUERIES * hp, *m = acc + (int64_t)KS_VATTN_QUERIES * hp;
    float *l = m + KS_VATTN_QUERIES;

    ks_vattn_load_rows(qs, q, heads, hd, hp, h, t0, t1, nq, scale);
    memset(acc, 0, sizeof(float) * nq * hp);
    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int j = 0; j < KB; j++)
        ones[j] = 1.0f;             /* K / V are float: the int8 path's scales are all 1 */
    for (int j0 = 0; j0 < n; j0 += KB) {
        const int nj = n - j0 < KB ? n - j0 : KB;
        const int nj_pad = (nj + S - 1) / S * S;        /* zero rows up to a whole strip */
        ks_vattn_load_rows(kf, k, heads, hd, hp, h, j0, j0 + nj_pad, nj, 1.0f);
        ks_vattn_load_rows(vf, v, heads, hd, hp, h, j0, j0 + nj_pad, nj, 1.0f);
        for (int i = 0; i < nq;) {
            const int64_t o = (int64_t)i * hp;
            if (nq - i >= 4) {
                ks_attn_tile(4, hp, qs + o, nj, kf, ones, vf, ones, KB, m + i, l + i, acc + o,
                             sc, corr);
                i += 4;
            } else if (nq - i >= 2) {
                ks_attn_tile(2, hp, qs + o, nj, kf, ones, vf, ones, KB, m + i, l + i, acc + o,
                             sc, corr);
                i += 2;
            } else {
                ks_attn_tile(1, hp, qs + o, nj, kf, ones, vf, ones, KB, m + i, l + i, acc + o,
                             sc, corr);
                i += 1;
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        float *dst = out + ((int64_t)(t0 + i) * heads + h) * hd;
        const float inv = 1.0f / l[i];
        for (int e = 0; e < hd; e++)
            dst[e] = acc[(int64_t)i * hp + e] * inv;
    }
}

/* ---- the blocks' pass ---------------------------------------------------------------------- */

/* One block of the vision tower (kestreld/vision/encoder.py's VisionBlock): pre-norm
 * attention and MLP, LayerNorms and linears with bias. */
typedef struct {
    const float *norm1_w, *norm1_b, *norm2_w, *norm2_b;   /* (hidden) */
    ks_matrix qkv, proj, fc1, fc2;     /* (3 hidden, hidden): q, k, v rows; (hidden, hidden);
                                        * (ffn, hidden); (hidden, ffn) */
    const float *qkv_b, *proj_b, *fc1_b, *fc2_b;          /* (rows) of each */
} ks_vblock;

/* The tower's blocks and where DeepStack takes their output. */
typedef struct {
    int depth, hidden, n_heads, ffn;
    float eps, scale;                  /* LayerNorm epsilon; attention's 1/sqrt(head_dim) */
    const ks_vblock *blocks;           /* (depth) */
    int n_deep;
    const int32_t *deep_after;         /* (n_deep): the block whose output is feature j */
} ks_vtower;

/* One image's pass over n patches: the residual stream and every buffer of the blocks. */
typedef struct {
    int n, nthreads;
    float *x;                          /* (n, hidden): in, the embedded patches; out, the
                                        * last block's output */
    const float *rope_cos, *rope_sin;  /* (n, head_dim/2): each patch's 2-D rotation */
    float *deep;                       /* (n_deep, n, hidden): x after block deep_after[j] */
    float *xn;                         /* (n, hidden) a LayerNorm's output */
    int8_t *xq;                        /* (n, hidden) Q8_0 of xn or of the attention output */
    float *xd;                         /* (n, hidden/32) */
    int16_t *xh;                       /* (n, hidden/16) its half sums */
    float *qkv;                        /* (n, 3 hidden) */
    float *q, *k, *v, *att;            /* (n, heads, head_dim) */
    float *y;                          /* (n, hidden) proj or fc2 output */
    float *h;                          /* (n, ffn) gelu(fc1) */
    int8_t *hq;                        /* (n, ffn) its Q8_0 */
    float *hd;                         /* (n, ffn/32) */
    int16_t *hh;                       /* (n, ffn/16) */
    float *attn_scratch;               /* nthreads * attn_floats: each thread's own */
    int64_t attn_floats;
} ks_vpass;

typedef struct {
    const ks_vtower *V;
    ks_vpass *P;
} ks_vision_job;

/* Lays out P's buffers over `base` (NULL: just measure; 64-byte aligned) for n patches on
 * nthreads threads; returns the bytes they take. */
static int64_t ks_vpass_layout(ks_vpass *P, char *base, const ks_vtower *V, int n, int nthreads)
{
    const int64_t H = V->hidden, F = V->ffn, N = n;
    int64_t off = 0;
    P->n = n;
    P->nthreads = nthreads;
    P->attn_floats = ks_vattn_scratch_floats(V->hidden / V->n_heads);
    P->xn = ks_carve(base, &off, N * H, 4);
    ks_carve_q8(base, &off, N, H, &P->xq, &P->xd, &P->xh);
    P->qkv = ks_carve(base, &off, N * 3 * H, 4);
    P->q = ks_carve(base, &off, N * H, 4);
    P->k = ks_carve(base, &off, N * H, 4);
    P->v = ks_carve(base, &off, N * H, 4);
    P->att = ks_carve(base, &off, N * H, 4);
    P->y = ks_carve(base, &off, N * H, 4);
    P->h = ks_carve(base, &off, N * F, 4);
    ks_carve_q8(base, &off, N, F, &P->hq, &P->hd, &P->hh);
    P->attn_scratch = ks_carve(base, &off, (int64_t)nthreads * P->attn_floats, 4);
    return off;
}

/* Phases a pass over a tower of `depth` blocks has: the first LayerNorm, then 9 per block. */
static inline int ks_vision_phases(int depth) { return 1 + 9 * depth; }

/* Row t of x -> xn = LayerNorm(x) * w + b, and its Q8_0. */
static inline void ks_vnorm_row(const ks_vtower *V, const ks_vpass *P, int t, const float *w,
                                const float *b)
{
    const int64_t H = V->hidden;
    ks_layernorm_row(P->x + t * H, w, b, V->eps, P->xn + t * H, H);
    ks_quantize_row_q8_0(P->xn + t * H, P->xq + t * H, P->xd + t * (H / KS_QK), P->xh + t * (H / 16),
                         (int)H);
}

/* A phase of out (n, W.rows) = W . x (Q8_0) + bias, by row runs. */
static inline void ks_vphase_linear(ks_walk *w, const ks_matrix *W, const float *bias,
                                    const ks_act *x, int n, float *out, int nthreads)
{
    const int per = ks_rows_per_item(W->rows, n, nthreads), m = W->rows;
    KS_EACH_ITEM(w, ks_items_of(m, per), it) {
        const int r0 = it * per, r1 = r0 + per < m ? r0 + per : m;
        ks_matrix_rows(W, 0, x, n, out, r0, r1);
        for (int t = 0; t < n; t++)
            for (int r = r0; r < r1; r++)
                out[(int64_t)t * m + r] += bias[r];
    }
}

/* Item (t, j) of the heads phase, j < 3 heads: query head j, key head j - heads (both
 * rotated by patch t's tables) or value head j - 2 heads, from the qkv rows to q, k or v. */
static inline void ks_vhead_item(const ks_vtower *V, const ks_vpass *P, int t, int j)
{
    const int nh = V->n_heads, hd = V->hidden / nh, which = j / nh, h = j % nh;
    float *dst = (which == 0 ? P->q : which == 1 ? P->k : P->v) + ((int64_t)t * nh + h) * hd;
    memcpy(dst, P->qkv + (int64_t)t * 3 * V->hidden + (int64_t)j * hd, sizeof(float) * hd);
    if (which < 2)
        ks_rope_row(dst, P->rope_cos + (int64_t)t * (hd / 2), P->rope_sin + (int64_t)t * (hd / 2),
                    hd, 1);
}

/* Rows [b*32, b*32 + 32) of gelu(fc1 . x + bias) for every patch, and their Q8_0 block b. */
static inline void ks_vfc1_block(const ks_vblock *B, const ks_vpass *P, int b)
{
    const int F = B->fc1.rows, r0 = b * KS_QK;
    ks_matrix_rows(&B->fc1, 0, &(ks_act){P->xq, P->xd, P->xh}, P->n, P->h, r0, r0 + KS_QK);
    for (int t = 0; t < P->n; t++) {
        float *ht = P->h + (int64_t)t * F + r0;
        for (int r = 0; r < KS_QK; r++)
            ht[r] += B->fc1_b[r0 + r];
        ks_gelu(ht, ht, KS_QK, 0);
        ks_quantize_row_q8_0(ht, P->hq + (int64_t)t * F + r0, P->hd + (int64_t)t * (F / KS_QK) + b,
                             P->hh + (int64_t)t * (F / 16) + 2 * b, KS_QK);
    }
}

/* Row t after a block's MLP: x += fc2's output; x -> DeepStack feature j where this block
 * feeds one; the next block's first LayerNorm. */
static inline void ks_vblock_end_row(const ks_vtower *V, const ks_vpass *P, int bi, int t)
{
    const int64_t H = V->hidden;
    float *x = P->x + t * H;
    ks_add_scaled(x, P->y + t * H, 1.0f, H);
    for (int j = 0; j < V->n_deep; j++)
        if (V->deep_after[j] == bi)
            memcpy(P->deep + ((int64_t)j * P->n + t) * H, x, sizeof(float) * H);
    if (bi + 1 < V->depth)
        ks_vnorm_row(V, P, t, V->blocks[bi + 1].norm1_w, V->blocks[bi + 1].norm1_b);
}

/* One thread's walk through an image's pass (ks_team_fn). Per block:
 *   LN1 -> qkv -> heads (copy, 2-D RoPE) -> attention -> its Q8_0 -> proj; x += it, LN2
 *   -> fc1, GELU, Q8_0 by 32-row blocks -> fc2; x += it, DeepStack copy, the next LN1. */
static void ks_vision_walk(ks_team *T, int tid, uint32_t pass)
{
    const ks_vision_job *J = T->job;
    const ks_vtower *V = J->V;
    ks_vpass *P = J->P;
    const int n = P->n, H = V->hidden, nh = V->n_heads, hd = H / nh, nthreads = P->nthreads;
    const int n_tiles = (n + KS_VATTN_QUERIES - 1) / KS_VATTN_QUERIES;
    float *scratch = P->attn_scratch + tid * P->attn_floats;
    ks_walk walk = {.team = T, .pass = pass, .tid = tid}, *w = &walk;

    KS_EACH_ITEM(w, n, t)
        ks_vnorm_row(V, P, t, V->blocks[0].norm1_w, V->blocks[0].norm1_b);
    for (int bi = 0; bi < V->depth; bi++) {
        const ks_vblock *B = &V->blocks[bi];
        if (!ks_phase_end(w))
            return;
        ks_vphase_linear(w, &B->qkv, B->qkv_b, &(ks_act){P->xq, P->xd, P->xh}, n, P->qkv, nthreads);
        if (!ks_phase_end(w))
            return;
        KS_EACH_ITEM(w, n * 3 * nh, it)
            ks_vhead_item(V, P, it / (3 * nh), it % (3 * nh));
        if (!ks_phase_end(w))
            return;
        /* an item's head is it / n_tiles: consecutive items read the same head's keys */
        KS_EACH_ITEM(w, nh * n_tiles, it) {
            const int t0 = (it % n_tiles) * KS_VATTN_QUERIES;
            ks_vattn_item(P->q, P->k, P->v, P->att, n, nh, hd, V->scale, it / n_tiles, t0,
                          t0 + KS_VATTN_QUERIES < n ? t0 + KS_VATTN_QUERIES : n, scratch);
        }
        if (!ks_phase_end(w))
            return;
        KS_EACH_ITEM(w, n, t)
            ks_quantize_row_q8_0(P->att + (int64_t)t * H, P->xq + (int64_t)t * H,
                                 P->xd + (int64_t)t * (H / KS_QK), P->xh + (int64_t)t * (H / 16), H);
        if (!ks_phase_end(w))
            return;
        ks_vphase_linear(w, &B->proj, B->proj_b, &(ks_act){P->xq, P->xd, P->xh}, n, P->y, nthreads);
        if (!ks_phase_end(w))
            return;
        KS_EACH_ITEM(w, n, t) {
            ks_add_scaled(P->x + (int64_t)t * H, P->y + (int64_t)t * H, 1.0f, H);
            ks_vnorm_row(V, P, t, B->norm2_w, B->norm2_b);
        }
        if (!ks_phase_end(w))
            return;
        KS_EACH_ITEM(w, V->ffn / KS_QK, b)
            ks_vfc1_block(B, P, b);
        if (!ks_phase_end(w))
            return;
        ks_vphase_linear(w, &B->fc2, B->fc2_b, &(ks_act){P->hq, P->hd, P->hh}, n, P->y, nthreads);
        if (!ks_phase_end(w))
            return;
        KS_EACH_ITEM(w, n, t)
            ks_vblock_end_row(V, P, bi, t);
    }
    ks_phase_end(w);
}

/* Runs every block of the tower over the image of job->P on the team T (made for
 * ks_vision_walk, ks_vision_phases(depth) phases): P->x becomes the last block's output and
 * P->deep the DeepStack blocks'. Checked by the caller: shapes; the job and what it points
 * to must stay readable until T is freed (a late thread reads them to find that it is late). */
static void ks_vision_blocks(ks_team *T, const ks_vision_job *job)
{
    ks_team_run(T, job);
}

#endif /* KS_VISION_H */
