/* Kestrel kernels: the float kernels of the vision encoder (LayerNorm with bias, GELU, full
 * attention over one image's patches); no Python here.
 *
 * The attention is the online softmax of ks_attention.h run on float K / V: a work item (one
 * head, a tile of queries) copies each block of keys into a zero-padded scratch block and
 * hands it to ks_attn_tile with unit scales, so no N x N score matrix exists and the SIMD
 * paths, tiles and bit-for-bit guarantees are those of the language model's attention.
 */
#ifndef KS_VISION_H
#define KS_VISION_H

#include "ks_attention.h"

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
    return x * ks_v8_select(x < 0.0f, tail, 1.0f - tail);
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

#endif /* KS_VISION_H */
