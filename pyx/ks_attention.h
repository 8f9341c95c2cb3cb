/* Kestrel kernels: int8 KV store and causal attention over it (no Python here).
 *
 * KV layout, one layer of the arena (per KV head g, position p):
 *     kq (n_kv, max_seq, hd) int8, ks (n_kv, max_seq) float32: k[g, p, :] = ks[g, p] * kq[g, p, :]
 *     vq, vs: the same for V.
 * Attention reads keys in blocks of kv_bs with an online softmax (running max m, running sum l,
 * unnormalized output acc), so its memory does not grow with the context. Each block is
 * converted to float once and then used by every query of the work item: a tile of tokens x
 * the query heads sharing that KV head (GQA). Within a block, queries that see the same keys
 * go in tiles of 4 (scores) and 2 (values) that share each K / V vector loaded, with each
 * query's arithmetic unchanged: tiled or not, the results are the same bits.
 */
#ifndef KS_ATTENTION_H
#define KS_ATTENTION_H

#include "ks_common.h"

#define KS_ATTN_STRIP 16            /* keys / head dims per step of the inner loops */
#define KS_ATTN_TOKENS 16           /* prefill work item: this many tokens x the group's heads */
#define KS_ATTN_SPLIT_MIN 256       /* decode: at least this many keys per split */
#define KS_ATTN_SPLIT_MAX 16        /* decode: at most this many splits per KV head */

/* ---- KV store ------------------------------------------------------------------------------ */

/* x (hd) -> q (hd) int8 with one scale: s = absmax / 127, q = roundf(x / s); returns s. */
static inline float ks_quantize_head(const float *restrict x, int8_t *restrict q, int hd)
{
    const float s = ks_absmax(x, hd) / 127.0f;
    if (s == 0.0f) {
        memset(q, 0, hd);
        return s;
    }
    int d = 0;
    for (; d + 8 <= hd; d += 8)
        ks_v8_round_i8(ks_v8_load(x + d) / s, q + d);
    for (; d < hd; d++)
        q[d] = (int8_t)ks_round_half_away(x[d] / s);
    return s;
}

/* ---- attention core ------------------------------------------------------------------------ */

#define KS_ATTN_QB 4                /* queries per tile that share each K / V load */

/* Keeps a loaded vector in a register: without it GCC folds the load into every FMA that
 * uses it (x86 FMAs take a memory operand), so a K or V vector shared by a tile of queries
 * would be loaded once per query again and the load ports, not the FMAs, would set the pace. */
#if defined(KS_AVX2) && defined(__GNUC__)
#  define KS_IN_REG(v) __asm__("" : "+x"(v))
#else
#  define KS_IN_REG(v) ((void)0)
#endif

static int ks_attn_tiles = 1;   /* 0: every query alone (tests compare the two: same bits) */

/* Turns query tiles on (1) or off (0); returns the new state. */
static inline int ks_set_attn_tiles(int on)
{
    ks_attn_tiles = on != 0;
    return ks_attn_tiles;
}

/* Scratch a work item needs, in floats (see ks_attn_scratch_parts for the parts). */
static inline int64_t ks_attn_scratch_floats(int nq, int hd, int kv_bs)
{
    return 2 * (int64_t)hd * kv_bs + KS_ATTN_QB * (kv_bs + 1) + (int64_t)nq * (2 * hd + 3);
}

/* The arithmetic below is per query; tiles only decide how many queries share the loads of
 * one K or V vector. Every score, weight and output float of a query is computed by the same
 * operations in the same order whatever tile (QB = 1, 2 or 4 queries) it is part of, so the
 * results are bit-identical to the one-query path (tests/test_kernels.py checks it). */

/* sc[u * sc_stride + j] = q_u . k_j for the QB queries q (QB, hd) and keys j < n (n a multiple
 * of 8) of kf (n, hd): each score is the pairwise sum (ks_v8_hsum8) of 8 lane sums, lane e
 * summing q[d] * k[d] over d = e mod 8 in increasing d. 8 / QB keys per step, so that the
 * QB * (8 / QB) lane sums fill 8 registers. */
static inline __attribute__((always_inline))
void ks_attn_scores(const int QB, const float *restrict q, const float *restrict kf, int hd,
                    int n, float *restrict sc, int sc_stride)
{
    const int KB = 8 / QB;
    const float *qp[4];
    for (int u = 0; u < QB; u++)
        qp[u] = q + (int64_t)u * hd;
    for (int jb = 0; jb < n; jb += KB) {
        ks_v8 p[8] = {{0}};
        const float *kp[8];
        for (int kk = 0; kk < KB; kk++)
            kp[kk] = kf + (int64_t)(jb + kk) * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            ks_v8 kv[8];
            for (int kk = 0; kk < KB; kk++) {
                kv[kk] = ks_v8_load(kp[kk] + d);
                if (QB > 1)
                    KS_IN_REG(kv[kk]);
            }
            for (int u = 0; u < QB; u++) {
                ks_v8 qv = ks_v8_load(qp[u] + d);
                KS_IN_REG(qv);
                for (int kk = 0; kk < KB; kk++)
                    p[u * KB + kk] += qv * kv[kk];
            }
        }
        const ks_v8 r = ks_v8_hsum8(p);
        for (int u = 0; u < QB; u++)
            for (int kk = 0; kk < KB; kk++)
                sc[u * sc_stride + jb + kk] = r[u * KB + kk];
    }
}

/* One query's online-softmax step over a block of qn keys (qn_pad: qn rounded up to 16):
 * sc (qn_pad) raw scores in, weights of the value rows out (0 past qn); updates m, l and
 * returns the factor the query's acc must be scaled by. ks, vs: the block's scales. */
static inline float ks_attn_softmax_block(float *restrict sc, int qn, int qn_pad,
                                          const float *restrict ks, const float *restrict vs,
                                          float *restrict m, float *restrict l)
{
    for (int j = 0; j < qn; j++)
        sc[j] *= ks[j];
    for (int j = qn; j < qn_pad; j++)
        sc[j] = -INFINITY;                  /* weight 0 below */
    ks_v8 vmax = ks_v8_set1(*m);
    for (int j = 0; j < qn_pad; j += 8)
        vmax = ks_v8_max(vmax, ks_v8_load(sc + j));
    const float mx = ks_v8_hmax(vmax);
    const float corr = expf(*m - mx);       /* 0 on the first block (m = -inf) */
    ks_v8 vsum = ks_v8_set1(0.0f);
    for (int j = 0; j < qn_pad; j += 8) {
        const ks_v8 e = ks_v8_exp(ks_v8_load(sc + j) - mx);
        vsum += e;
        ks_v8_store(sc + j, e);
    }
    *l = *l * corr + ks_v8_hsum(vsum);
    *m = mx;
    for (int j = 0; j < qn; j++)
        sc[j] *= vs[j];                     /* weight of value row j */
    return corr;
}

/* acc_u = acc_u * corr[u] + sum over keys j < n (n even) of w[u * w_stride + j] * v_j for the
 * QB queries (acc (QB, hd)), v = vf (n, hd): per output float, the even keys and the odd keys
 * go into two separate sums, added at the end. Dims go 8 * W at a time (hd a multiple of
 * 8 * W), QB * W * 2 <= 8 sums in registers: enough chains to hide the FMA latency. */
static inline __attribute__((always_inline))
void ks_attn_values(const int QB, const int W, float *restrict acc, const float *restrict corr,
                    const float *restrict w, int w_stride, const float *restrict vf, int hd,
                    int n)
{
    const float *wp[4];
    for (int u = 0; u < QB; u++)
        wp[u] = w + (int64_t)u * w_stride;
    for (int ds = 0; ds < hd; ds += 8 * W) {
        ks_v8 ae[4], ao[4];
        for (int u = 0; u < QB; u++)
            for (int c = 0; c < W; c++) {
                ae[u * W + c] = ks_v8_load(acc + (int64_t)u * hd + ds + 8 * c) * corr[u];
                ao[u * W + c] = ks_v8_set1(0.0f);
            }
        const float *ve = vf + ds;
        for (int64_t j = 0; j < n; j += 2, ve += 2 * (int64_t)hd) {
            ks_v8 vv[8];
            for (int c = 0; c < W; c++) {
                vv[2 * c] = ks_v8_load(ve + 8 * c);
                vv[2 * c + 1] = ks_v8_load(ve + hd + 8 * c);
                if (QB > 1) {
                    KS_IN_REG(vv[2 * c]);
                    KS_IN_REG(vv[2 * c + 1]);
                }
            }
            for (int u = 0; u < QB; u++) {
                const float we = wp[u][j], wo = wp[u][j + 1];
                for (int c = 0; c < W; c++) {
                    ae[u * W + c] += we * vv[2 * c];
                    ao[u * W + c] += wo * vv[2 * c + 1];
                }
            }
        }
        for (int u = 0; u < QB; u++)
            for (int c = 0; c < W; c++)
                ks_v8_store(acc + (int64_t)u * hd + ds + 8 * c, ae[u * W + c] + ao[u * W + c]);
    }
}

/* The tile of QB queries starting at qs, acc, m, l, all with qn > 0 keys of the block
 * (kf, vf (kv_bs, hd); ks, vs its scales); sc (QB, kv_bs), corr (QB): scratch. */
static inline __attribute__((always_inline))
void ks_attn_tile(const int QB, int hd, const float *restrict qs, int qn, const float *restrict kf,
                  const float *restrict ks, const float *restrict vf, const float *restrict vs,
                  int kv_bs, float *restrict m, float *restrict l, float *restrict acc,
                  float *restrict sc, float *restrict corr)
{
    const int qn_pad = (qn + KS_ATTN_STRIP - 1) / KS_ATTN_STRIP * KS_ATTN_STRIP;
    ks_attn_scores(QB, qs, kf, hd, qn_pad, sc, kv_bs);
    for (int u = 0; u < QB; u++)
        corr[u] = ks_attn_softmax_block(sc + u * kv_bs, qn, qn_pad, ks, vs, m + u, l + u);
    /* values in pairs of queries: 4 V loads and 4 weight broadcasts per 8 FMAs */
    for (int u = 0; u + 1 < QB; u += 2)
        ks_attn_values(2, 2, acc + (int64_t)u * hd, corr + u, sc + u * kv_bs, kv_bs, vf, hd,
                       qn_pad);
    if (QB == 1 && hd % 32 == 0)
        ks_attn_values(1, 4, acc, corr, sc, kv_bs, vf, hd, qn_pad);
    else if (QB == 1)           /* hd an odd multiple of 16 */
        ks_attn_values(1, 2, acc, corr, sc, kv_bs, vf, hd, qn_pad);
}

/* nq queries of one KV head against keys [k0, k1) of it, updating their online-softmax state.
 *   qs (nq, hd)   queries, already multiplied by the softmax scale
 *   lim (nq)      query i sees keys <= lim[i] (causal)
 *   kq, vq (max_seq, hd), ks, vs (max_seq): this KV head's rows
 *   m, l (nq), acc (nq, hd): running max, running sum, unnormalized output (IN/OUT)
 *   kf, vf (kv_bs, hd), sc (KS_ATTN_QB, kv_bs), corr (KS_ATTN_QB): scratch
 * Queries go in tiles of 4 (or 2) consecutive ones that see the same number of keys of the
 * block (all of it, except near the diagonal), else one by one. hd is a multiple of
 * KS_ATTN_STRIP and kv_bs a power of two >= KS_ATTN_STRIP (checked by the caller). Keys past
 * every query's limit are never read. */
static void ks_attn_range(int nq, int hd, const float *restrict qs, const int *restrict lim,
                          const int8_t *restrict kq, const float *restrict ks,
                          const int8_t *restrict vq, const float *restrict vs,
                          int k0, int k1, int kv_bs,
                          float *restrict m, float *restrict l, float *restrict acc,
                          float *restrict kf, float *restrict vf, float *restrict sc,
                          float *restrict corr)
{
    enum { S = KS_ATTN_STRIP };
    int top = -1;
    for (int i = 0; i < nq; i++)
        top = lim[i] > top ? lim[i] : top;
    const int kend = k1 < top + 1 ? k1 : top + 1;
    for (int j0 = k0; j0 < kend; j0 += kv_bs) {
        const int nj = kend - j0 < kv_bs ? kend - j0 : kv_bs;
        const int nj_pad = (nj + S - 1) / S * S;
        /* the block as float (K, V rows); rows past nj are zero so whole strips can be used */
        for (int64_t e = 0; e < (int64_t)nj * hd; e++) {
            kf[e] = (float)kq[(int64_t)j0 * hd + e];
            vf[e] = (float)vq[(int64_t)j0 * hd + e];
        }
        for (int64_t e = (int64_t)nj * hd; e < (int64_t)nj_pad * hd; e++)
            kf[e] = vf[e] = 0.0f;

        for (int i = 0; i < nq;) {
            int qn[KS_ATTN_QB] = {0};
            const int avail = nq - i < KS_ATTN_QB ? nq - i : KS_ATTN_QB;
            for (int u = 0; u < avail; u++)
                qn[u] = lim[i + u] + 1 - j0 < nj ? lim[i + u] + 1 - j0 : nj;
            if (qn[0] <= 0) {
                i++;
                continue;
            }
            int qb = 1;       /* how many of the next queries see exactly qn[0] keys */
            while (ks_attn_tiles && qb < avail && qn[qb] == qn[0])
                qb++;
            qb = qb >= 4 ? 4 : qb >= 2 ? 2 : 1;
            const int64_t o = (int64_t)i * hd;
            if (qb == 4)
                ks_attn_tile(4, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i, l + i,
                             acc + o, sc, corr);
            else if (qb == 2)
                ks_attn_tile(2, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i, l + i,
                             acc + o, sc, corr);
            else
                ks_attn_tile(1, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i, l + i,
                             acc + o, sc, corr);
            i += qb;
        }
    }
}

/* Splits the scratch of one work item (ks_attn_scratch_floats floats) into its parts. */
typedef struct {
    float *kf, *vf, *sc, *corr, *qs, *m, *l, *acc;
    int *lim;
} ks_attn_scratch;

static inline ks_attn_scratch ks_attn_scratch_parts(float *base, int nq, int hd, int kv_bs)
{
    ks_attn_scratch s;
    s.kf = base;
    s.vf = s.kf + (int64_t)hd * kv_bs;
    s.sc = s.vf + (int64_t)hd * kv_bs;
    s.corr = s.sc + KS_ATTN_QB * kv_bs;
    s.qs = s.corr + KS_ATTN_QB;
    s.acc = s.qs + (int64_t)nq * hd;
    s.m = s.acc + (int64_t)nq * hd;
    s.l = s.m + nq;
    s.lim = (int *)(s.l + nq);   /* int and float have the same size on every target */
    return s;
}

/* Loads the queries of tokens [t0, t1) x heads [h0, h0 + G) as qs (scaled), sets their limits
 * and an empty softmax state. */
static inline void ks_attn_begin(const ks_attn_scratch *s, const float *q, int n_heads, int hd,
                                 int t0, int t1, int h0, int G, int pos0, float scale)
{
    int i = 0;
    for (int t = t0; t < t1; t++)
        for (int h = h0; h < h0 + G; h++, i++) {
            const float *qr = q + ((int64_t)t * n_heads + h) * hd;
            for (int d = 0; d < hd; d++) {
                s->qs[(int64_t)i * hd + d] = qr[d] * scale;
                s->acc[(int64_t)i * hd + d] = 0.0f;
            }
            s->lim[i] = pos0 + t;
            s->m[i] = -INFINITY;
            s->l[i] = 0.0f;
        }
}

/* Prefill work item: tokens [t0, t1) x the G query heads of KV head g, over all their keys;
 * writes out (n, n_heads, hd). kq etc. point at the layer (n_kv, max_seq, ...). */
static void ks_attn_prefill_item(const float *q, const int8_t *kq, const float *ks,
                                 const int8_t *vq, const float *vs, float *out,
                                 int n_heads, int n_kv, int hd, int max_seq, int pos0,
                                 float scale, int kv_bs, int t0, int t1, int g, float *scratch)
{
    const int G = n_heads / n_kv, nq = (t1 - t0) * G;
    const ks_attn_scratch s = ks_attn_scratch_parts(scratch, nq, hd, kv_bs);
    const int64_t kvo = (int64_t)g * max_seq;
    ks_attn_begin(&s, q, n_heads, hd, t0, t1, g * G, G, pos0, scale);
    ks_attn_range(nq, hd, s.qs, s.lim, kq + kvo * hd, ks + kvo, vq + kvo * hd, vs + kvo,
                  0, pos0 + t1, kv_bs, s.m, s.l, s.acc, s.kf, s.vf, s.sc, s.corr);
    int i = 0;
    for (int t = t0; t < t1; t++)
        for (int h = g * G; h < g * G + G; h++, i++) {
            float *o = out + ((int64_t)t * n_heads + h) * hd;
            const float inv = 1.0f / s.l[i];
            for (int d = 0; d < hd; d++)
                o[d] = s.acc[(int64_t)i * hd + d] * inv;
        }
}

/* Decode: keys per split for a context of ctx keys. Depends only on ctx and kv_bs, never on
 * the thread count, so results do not change with it. */
static inline int ks_attn_split_len(int ctx, int kv_bs)
{
    int len = (ctx + KS_ATTN_SPLIT_MAX - 1) / KS_ATTN_SPLIT_MAX;
    if (len < KS_ATTN_SPLIT_MIN)
        len = KS_ATTN_SPLIT_MIN;
    return (len + kv_bs - 1) / kv_bs * kv_bs;
}

/* Floats of partial state per (KV head, split): m, l and acc of the group's G heads. */
static inline int64_t ks_attn_part_floats(int G, int hd)
{
    return (int64_t)G * (hd + 2);
}

/* Decode work item: the single token's G query heads of KV head g against keys
 * [c * split, (c + 1) * split); the state goes to part (G * (hd + 2) floats: m, l, acc). */
static void ks_attn_decode_item(const float *q, const int8_t *kq, const float *ks,
                                const int8_t *vq, const float *vs, float *part,
                                int n_heads, int n_kv, int hd, int max_seq, int pos0,
                                float scale, int kv_bs, int split, int c, int g, float *scratch)
{
    const int G = n_heads / n_kv;
    const ks_attn_scratch s = ks_attn_scratch_parts(scratch, G, hd, kv_bs);
    const int64_t kvo = (int64_t)g * max_seq;
    ks_attn_begin(&s, q, n_heads, hd, 0, 1, g * G, G, pos0, scale);
    ks_attn_range(G, hd, s.qs, s.lim, kq + kvo * hd, ks + kvo, vq + kvo * hd, vs + kvo,
                  c * split, (c + 1) * split, kv_bs, s.m, s.l, s.acc, s.kf, s.vf, s.sc, s.corr);
    memcpy(part, s.m, sizeof(float) * G);
    memcpy(part + G, s.l, sizeof(float) * G);
    memcpy(part + 2 * G, s.acc, sizeof(float) * G * hd);
}

/* Decode: out (1, n_heads, hd) row h from the nsplit partial states of its KV head, merged
 * in split order. parts (n_kv, nsplit, G * (hd + 2)). */
static void ks_attn_decode_merge(const float *parts, float *out, int n_heads, int n_kv, int hd,
                                 int nsplit, int h)
{
    const int G = n_heads / n_kv, g = h / G, i = h % G;
    const int64_t pf = ks_attn_part_floats(G, hd);
    const float *p0 = parts + (int64_t)g * nsplit * pf;
    float mx = -INFINITY;
    for (int c = 0; c < nsplit; c++)
        mx = fmaxf(mx, p0[c * pf + i]);
    float *o = out + (int64_t)h * hd;
    float lsum = 0.0f;
    for (int d = 0; d < hd; d++)
        o[d] = 0.0f;
    for (int c = 0; c < nsplit; c++) {
        const float *p = p0 + c * pf;
        const float w = expf(p[i] - mx);    /* 0 for a split with no keys (m = -inf) */
        lsum += p[G + i] * w;
        for (int d = 0; d < hd; d++)
            o[d] += p[2 * G + (int64_t)i * hd + d] * w;
    }
    const float inv = 1.0f / lsum;
    for (int d = 0; d < hd; d++)
        o[d] *= inv;
}

#endif /* KS_ATTENTION_H */
