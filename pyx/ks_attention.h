/* Kestrel kernels: int8 KV store and causal attention over it (no Python here).
 *
 * KV layout, one layer of the arena (per KV head g, position p):
 *     kq (n_kv, max_seq, hd) int8, ks (n_kv, max_seq) float32: k[g, p, :] = ks[g, p] * kq[g, p, :]
 *     vq, vs: the same for V.
 * Attention reads keys in blocks of kv_bs with an online softmax (running max m, running sum l,
 * unnormalized output acc), so its memory does not grow with the context. Each block is
 * converted to float once and then used by every query of the work item: a tile of tokens x
 * the query heads sharing that KV head (GQA).
 */
#ifndef KS_ATTENTION_H
#define KS_ATTENTION_H

#include "ks_common.h"

#define KS_ATTN_STRIP 16            /* keys / head dims per step of the inner loops */
#define KS_ATTN_TOKENS 8            /* prefill work item: this many tokens x the group's heads */
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

/* Scratch a work item needs, in floats (see ks_attn_range for the parts). */
static inline int64_t ks_attn_scratch_floats(int nq, int hd, int kv_bs)
{
    return 2 * (int64_t)hd * kv_bs + kv_bs + (int64_t)nq * (2 * hd + 3);
}

/* nq queries of one KV head against keys [k0, k1) of it, updating their online-softmax state.
 *   qs (nq, hd)   queries, already multiplied by the softmax scale
 *   lim (nq)      query i sees keys <= lim[i] (causal)
 *   kq, vq (max_seq, hd), ks, vs (max_seq): this KV head's rows
 *   m, l (nq), acc (nq, hd): running max, running sum, unnormalized output (IN/OUT)
 *   kf, vf (kv_bs, hd), sc (kv_bs): scratch
 * hd is a multiple of KS_ATTN_STRIP and kv_bs a power of two >= KS_ATTN_STRIP (checked by the
 * caller). Keys past every query's limit are never read. */
static void ks_attn_range(int nq, int hd, const float *restrict qs, const int *restrict lim,
                          const int8_t *restrict kq, const float *restrict ks,
                          const int8_t *restrict vq, const float *restrict vs,
                          int k0, int k1, int kv_bs,
                          float *restrict m, float *restrict l, float *restrict acc,
                          float *restrict kf, float *restrict vf, float *restrict sc)
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

        for (int i = 0; i < nq; i++) {
            const int qn = lim[i] + 1 - j0 < nj ? lim[i] + 1 - j0 : nj;
            if (qn <= 0)
                continue;
            const int qn_pad = (qn + S - 1) / S * S;
            const float *q = qs + (int64_t)i * hd;
            /* scores sc[j] = q . k_j, 8 keys at a time, 8 partial sums each */
            for (int jb = 0; jb < qn_pad; jb += 8) {
                ks_v8 p[8] = {{0}};
                const float *kb = kf + (int64_t)jb * hd;
                for (int d = 0; d < hd; d += 8) {
                    const ks_v8 qv = ks_v8_load(q + d);
                    for (int jj = 0; jj < 8; jj++)
                        p[jj] += qv * ks_v8_load(kb + jj * hd + d);
                }
                ks_v8_store(sc + jb, ks_v8_hsum8(p));
            }
            for (int j = 0; j < qn; j++)
                sc[j] *= ks[j0 + j];
            for (int j = qn; j < qn_pad; j++)
                sc[j] = -INFINITY;                  /* weight 0 below */
            ks_v8 vmax = ks_v8_set1(m[i]);
            for (int j = 0; j < qn_pad; j += 8)
                vmax = ks_v8_max(vmax, ks_v8_load(sc + j));
            const float mx = ks_v8_hmax(vmax);
            const float corr = expf(m[i] - mx);     /* 0 on the first block (m = -inf) */
            ks_v8 vsum = ks_v8_set1(0.0f);
            for (int j = 0; j < qn_pad; j += 8) {
                const ks_v8 e = ks_v8_exp(ks_v8_load(sc + j) - mx);
                vsum += e;
                ks_v8_store(sc + j, e);
            }
            l[i] = l[i] * corr + ks_v8_hsum(vsum);
            m[i] = mx;
            for (int j = 0; j < qn; j++)
                sc[j] *= vs[j0 + j];                /* weight of value row j */
            /* acc = acc * corr + sum_j sc[j] * v_j: S dims of acc in registers, two keys in
             * flight (padded keys have weight 0 and zero rows) */
            float *a = acc + (int64_t)i * hd;
            for (int ds = 0; ds < hd; ds += S) {
                ks_v8 ae0 = ks_v8_load(a + ds) * corr, ae1 = ks_v8_load(a + ds + 8) * corr;
                ks_v8 ao0 = ks_v8_set1(0.0f), ao1 = ks_v8_set1(0.0f);
                for (int j = 0; j < qn_pad; j += 2) {
                    const float *ve = vf + (int64_t)j * hd + ds, *vo = ve + hd;
                    ae0 += sc[j] * ks_v8_load(ve);
                    ae1 += sc[j] * ks_v8_load(ve + 8);
                    ao0 += sc[j + 1] * ks_v8_load(vo);
                    ao1 += sc[j + 1] * ks_v8_load(vo + 8);
                }
                ks_v8_store(a + ds, ae0 + ao0);
                ks_v8_store(a + ds + 8, ae1 + ao1);
            }
        }
    }
}

/* Splits the scratch of one work item (ks_attn_scratch_floats floats) into its parts. */
typedef struct {
    float *kf, *vf, *sc, *qs, *m, *l, *acc;
    int *lim;
} ks_attn_scratch;

static inline ks_attn_scratch ks_attn_scratch_parts(float *base, int nq, int hd, int kv_bs)
{
    ks_attn_scratch s;
    s.kf = base;
    s.vf = s.kf + (int64_t)hd * kv_bs;
    s.sc = s.vf + (int64_t)hd * kv_bs;
    s.qs = s.sc + kv_bs;
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
                  0, pos0 + t1, kv_bs, s.m, s.l, s.acc, s.kf, s.vf, s.sc);
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
                  c * split, (c + 1) * split, kv_bs, s.m, s.l, s.acc, s.kf, s.vf, s.sc);
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
