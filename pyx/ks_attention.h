/* Kestrel kernels: int8 KV store and causal attention over it (no Python here).
 *
 * KV layout, one layer of the arena (per KV head g, position p):
 *     kq (n_kv, max_seq, hd) int8, ks (n_kv, max_seq) float32: k[g, p, :] = ks[g, p] * kq[g, p, :]
 *     vq, vs: the same for V.
 * Attention reads keys in blocks of kv_bs with an online softmax (running max m, running sum l,
 * unnormalized output acc), so its memory does not grow with the context. A block's scores are
 * exact integer dot products of the int8 query (quantized as a key is) with the int8 keys as
 * they lie (ks_attn_scores.h); its V rows are converted to float once and used by every query
 * of the work item: a tile of tokens x the query heads sharing that KV head (GQA). Within a
 * block, queries that see the same keys go in tiles of up to 4 that share loads (of the
 * block's keys in AVX512's scores, of each V vector in pairs in the values), with each
 * query's arithmetic unchanged: tiled or not, the results are the same bits. The float core
 * (ks_attn_core.h) is compiled for 8-float vectors, for 4-float ones on NEON (where GCC keeps
 * 8-float vectors in memory across loop iterations) and, where the CPU has AVX512, for
 * 16-float ones: the same bits at every width.
 *
 * The order of a query's reductions is fixed by its position alone, so a token's output is the
 * same bits whether it comes in a pass of one token (decode) or many (prefill), in any chunk,
 * on any number of threads: its keys 0 .. p go in segments [c * S, (c + 1) * S) counted from
 * key 0 (S = KS_ATTN_SEGMENT rounded up to kv_bs, whatever the context), each segment's online
 * softmax starts empty, and the segments' states are folded into the query's in segment order
 * by ks_attn_fold. Decode and short passes compute the segments in parallel, one item per
 * (KV head, segment), and fold them afterwards; prefill computes them in turn inside its work
 * item and folds as it goes. Blocks of kv_bs start at multiples of kv_bs in both, and keys
 * past a query's position add exact zeros.
 */
#ifndef KS_ATTENTION_H
#define KS_ATTENTION_H

#include "ks_common.h"
#include "ks_q8.h"          /* KS_HAVE_VNNI, ks_use_vnni */
#include "ks_attn_scores.h"

#define KS_ATTN_STRIP 16            /* keys / head dims per step of the inner loops */
#define KS_ATTN_TOKENS 16           /* prefill work item: this many tokens x the group's heads */
#define KS_ATTN_SEGMENT 256         /* keys per segment (rounded up to whole KV blocks) */
#define KS_ATTN_SPLIT_TOKENS 8      /* passes of up to this many tokens split keys by segment */

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

#define KS_ATTN_QB 4                /* queries per tile that share each key / V load */

/* Keeps a loaded vector in a register: without it GCC folds the load into every FMA that
 * uses it (x86 FMAs take a memory operand), so a V vector shared by a tile of queries
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

/* Scratch a work item needs, in floats (see ks_attn_scratch_parts for the parts; hd is a
 * multiple of 16, so the int8 parts are whole floats). */
static inline int64_t ks_attn_scratch_floats(int nq, int hd, int kv_bs)
{
    return (int64_t)hd * kv_bs / 4 + (int64_t)hd * kv_bs + KS_ATTN_QB * (kv_bs + 1)
           + (int64_t)nq * (2 * hd + hd / 2 + 8);
}

/* r[i] = lane i of ks_v8_hsum8(p) */
static inline void ks_v8_hsum8_to(float r[8], const ks_v8 p[8])
{
    const ks_v8 s = ks_v8_hsum8(p);
    memcpy(r, &s, sizeof s);
}

#if defined(KS_NEON) || defined(KS_NEON_DOT)
/* The core on NEON: 4 floats a vector, two to a key's 8 lane sums (lanes 0-3, then 4-7) */
typedef float ks_v4 __attribute__((vector_size(16)));
typedef int32_t ks_v4i __attribute__((vector_size(16)));
typedef float ks_v4_unaligned __attribute__((vector_size(16), aligned(4), may_alias));
typedef struct { ks_v4 lanes[2]; } ks_v4x2;     /* an 8-lane sum: lanes 0-3, lanes 4-7 */
static inline ks_v4i ks_v4_lt(ks_v4 a, ks_v4 b) { return a < b; }
KS_DEFINE_EXP(ks_v4_exp, ks_v4, ks_v4i, ks_v4_lt)

/* r[i] = ks_v8_hsum8's lane i for the 8 slots p[2i] (lanes 0-3), p[2i + 1] (lanes 4-7):
 * ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), by pairwise adds of NEON */
static inline void ks_v4_hsum8(float r[8], const ks_v4 p[16])
{
    for (int i = 0; i < 8; i += 4) {
        float32x4_t half[2];            /* the 4 slots' lanes 0-3 sums, lanes 4-7 sums */
        for (int h = 0; h < 2; h++)
            half[h] = vpaddq_f32(vpaddq_f32(p[2 * i + h], p[2 * i + 2 + h]),
                                 vpaddq_f32(p[2 * i + 4 + h], p[2 * i + 6 + h]));
        vst1q_f32(r + i, vaddq_f32(half[0], half[1]));
    }
}

/* ks_v8_hsum of the 8-lane sum s: ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) */
static inline float ks_v4x2_hsum(ks_v4x2 s)
{
    const float32x4_t t = vaddq_f32(s.lanes[0], s.lanes[1]);
    const float32x4_t u = vpaddq_f32(t, t);
    return vgetq_lane_f32(u, 0) + vgetq_lane_f32(u, 1);
}

#define KS_AV ks_v4
#define KS_AP 1
#define KS_AH 2
#define KS_AV_LOAD(p) (*(const ks_v4_unaligned *)(p))
#define KS_AV_STORE(p, v) (*(ks_v4_unaligned *)(p) = (v))
#define KS_AV_SET1(x) ((ks_v4)vdupq_n_f32(x))
#define KS_AV_QLOAD(p) KS_AV_LOAD(p)
#define KS_AV_IN_REG(v) ((void)0)
#define KS_AV_SUMS 16
#define KS_AV_MAX(a, b) ((ks_v4)vmaxq_f32(a, b))
#define KS_AV_EXP(x) ks_v4_exp(x)
#define KS_AV_HMAX(v) vmaxvq_f32(v)
#define KS_AV_HSUM8(r, p, h) ks_v4_hsum8(r, p)
#define KS_AS ks_v4x2
#define KS_AS_ZERO ((ks_v4x2){{{0}}})
#define KS_AS_ADD(s, v, c) ((s).lanes[(c) % 2] += (v))
#define KS_AS_HSUM(s) ks_v4x2_hsum(s)
#define KS_AV_KEYS(kt, k, hd, nj) ((void)0)
#define KS_AV_SCORES(QB, q8, qd, qsum, k, kt, hd, qn, qn_pad, sc, stride) \
    ((void)(qn_pad), ks_attn_scores_rows(QB, q8, qd, k, hd, qn, sc, stride))
#define KS_AN(name) name
#include "ks_attn_core.h"

#else
/* The core at the baseline width: 8 floats a vector, one key each in the float scores */
#define KS_AV ks_v8
#define KS_AP 1
#define KS_AH 1
#define KS_AV_LOAD(p) ks_v8_load(p)
#define KS_AV_STORE(p, v) ks_v8_store(p, v)
#define KS_AV_SET1(x) ks_v8_set1(x)
#define KS_AV_QLOAD(p) ks_v8_load(p)
#define KS_AV_IN_REG(v) KS_IN_REG(v)
#define KS_AV_SUMS 8
#define KS_AV_MAX(a, b) ks_v8_max(a, b)
#define KS_AV_EXP(x) ks_v8_exp(x)
#define KS_AV_HMAX(v) ks_v8_hmax(v)
#define KS_AV_HSUM8(r, p, h) ks_v8_hsum8_to(r, p)
#define KS_AS ks_v8
#define KS_AS_ZERO ks_v8_set1(0.0f)
#define KS_AS_ADD(s, v, c) ((s) += (v))
#define KS_AS_HSUM(s) ks_v8_hsum(s)
#define KS_AV_KEYS(kt, k, hd, nj) ((void)0)
#define KS_AV_SCORES(QB, q8, qd, qsum, k, kt, hd, qn, qn_pad, sc, stride) \
    ((void)(qn_pad), ks_attn_scores_rows(QB, q8, qd, k, hd, qn, sc, stride))
#define KS_AN(name) name
#include "ks_attn_core.h"
#endif

#if defined(KS_HAVE_VNNI)
/* The core on AVX512 CPUs: 16 floats a vector (two keys in the float scores) and the
 * keys-in-lanes integer scores, the same bits. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
typedef float ks_v16 __attribute__((vector_size(64)));
typedef float ks_v16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t ks_v16i __attribute__((vector_size(64)));
static inline ks_v16i ks_v16_lt(ks_v16 a, ks_v16 b) { return a < b; }
KS_DEFINE_EXP(ks_v16_exp, ks_v16, ks_v16i, ks_v16_lt)

/* part h (floats 8h .. 8h + 7) of v */
static inline ks_v8 ks_v16_part(ks_v16 v, int h)
{
    return (ks_v8)_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), h);
}

/* r[i] = ks_v8_hsum8's lane i over part h of the 8 vectors p */
static inline void ks_v16_hsum8(float r[8], const ks_v16 p[8], int h)
{
    ks_v8 ph[8];
    for (int i = 0; i < 8; i++)
        ph[i] = ks_v16_part(p[i], h);
    ks_v8_hsum8_to(r, ph);
}

static inline float ks_v16_hmax(ks_v16 v)
{
    return ks_v8_hmax(ks_v8_max(ks_v16_part(v, 0), ks_v16_part(v, 1)));
}

#define KS_AV ks_v16
#define KS_AP 2
#define KS_AH 1
#define KS_AV_LOAD(p) (*(const ks_v16_unaligned *)(p))
#define KS_AV_STORE(p, v) (*(ks_v16_unaligned *)(p) = (v))
#define KS_AV_SET1(x) ((ks_v16)_mm512_set1_ps(x))
#define KS_AV_QLOAD(p) \
    ((ks_v16)_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(p)))))
#define KS_AV_IN_REG(v) __asm__("" : "+v"(v))
#define KS_AV_SUMS 16
#define KS_AV_MAX(a, b) ((ks_v16)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define KS_AV_EXP(x) ks_v16_exp(x)
#define KS_AV_HMAX(v) ks_v16_hmax(v)
#define KS_AV_HSUM8(r, p, h) ks_v16_hsum8(r, p, h)
#define KS_AS ks_v8
#define KS_AS_ZERO ks_v8_set1(0.0f)
#define KS_AS_ADD(s, v, c) ((s) += ks_v16_part(v, 0), (s) += ks_v16_part(v, 1))
#define KS_AS_HSUM(s) ks_v8_hsum(s)
#define KS_AV_KEYS(kt, k, hd, nj) (ks_attn_t16_fits(hd) ? ks_attn_keys_t16(kt, k, hd, nj) : (void)0)
#define KS_AV_SCORES(QB, q8, qd, qsum, k, kt, hd, qn, qn_pad, sc, stride)                   \
    (ks_attn_t16_fits(hd) ? ks_attn_scores_t16(QB, q8, qd, qsum, kt, hd, qn_pad, sc, stride) \
                          : ks_attn_scores_rows(QB, q8, qd, k, hd, qn, sc, stride))
#define KS_AN(name) name##_wide
#include "ks_attn_core.h"
#pragma GCC pop_options
#endif

/* ks_attn_range at the widest vectors the CPU has (the same bits at every width) */
static void ks_attn_range_any(int nq, int hd, const int8_t *q8, const float *qd,
                              const int32_t *qsum, const int *lim, const int8_t *kq,
                              const float *ks, const int8_t *vq, const float *vs, int k0, int k1,
                              int kv_bs, float *m, float *l, float *acc, int8_t *kt, float *vf,
                              float *sc, float *corr)
{
#if defined(KS_HAVE_VNNI)
    if (ks_use_vnni()) {
        ks_attn_range_wide(nq, hd, q8, qd, qsum, lim, kq, ks, vq, vs, k0, k1, kv_bs, m, l, acc,
                           kt, vf, sc, corr);
        return;
    }
#endif
    ks_attn_range(nq, hd, q8, qd, qsum, lim, kq, ks, vq, vs, k0, k1, kv_bs, m, l, acc, kt, vf,
                  sc, corr);
}

/* Splits the scratch of one work item (ks_attn_scratch_floats floats) into its parts: a block's
 * keys as ks_attn_range wants them and its values as float, their scores, the queries' codes,
 * scales and code sums, a segment's state (m, l, acc) and the state folded over the segments
 * so far (fm, fl, facc). */
typedef struct {
    int8_t *kt, *q8;
    float *vf, *sc, *corr, *qd, *m, *l, *acc, *fm, *fl, *facc;
    int32_t *qsum;
    int *lim;
} ks_attn_scratch;

static inline ks_attn_scratch ks_attn_scratch_parts(float *base, int nq, int hd, int kv_bs)
{
    ks_attn_scratch s;
    s.kt = (int8_t *)base;
    s.vf = base + (int64_t)hd * kv_bs / 4;
    s.sc = s.vf + (int64_t)hd * kv_bs;
    s.corr = s.sc + KS_ATTN_QB * kv_bs;
    s.q8 = (int8_t *)(s.corr + KS_ATTN_QB);
    s.qd = s.corr + KS_ATTN_QB + (int64_t)nq * hd / 2;
    s.acc = s.qd + nq;
    s.facc = s.acc + (int64_t)nq * hd;
    s.m = s.facc + (int64_t)nq * hd;
    s.l = s.m + nq;
    s.fm = s.l + nq;
    s.fl = s.fm + nq;
    s.qsum = (int32_t *)(s.fl + nq);   /* int32 and float have the same size on every target */
    s.lim = (int *)(s.fl + 3 * nq);
    return s;
}

/* Keys per segment: depends only on kv_bs, never on the context, n or the thread count. */
static inline int ks_attn_segment_len(int kv_bs)
{
    return (KS_ATTN_SEGMENT + kv_bs - 1) / kv_bs * kv_bs;
}

/* Segments of a context of ctx keys */
static inline int ks_attn_segments(int ctx, int kv_bs)
{
    const int seg = ks_attn_segment_len(kv_bs);
    return (ctx + seg - 1) / seg;
}

/* Empties the online-softmax state of nq queries (m, l (nq), acc (nq, hd)). */
static inline void ks_attn_clear(float *m, float *l, float *acc, int nq, int hd)
{
    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * hd);
}

/* Folds one query's state over a segment (mc, lc, accc (hd)) into its state over the segments
 * before it (m, l, acc (hd), IN/OUT). Every path folds with this, in segment order. A segment
 * with none of the query's keys (mc = -inf) changes nothing; the first one is taken exactly
 * (exp(0) = 1, and the empty state's terms are 0). */
static inline void ks_attn_fold(float *restrict m, float *restrict l, float *restrict acc,
                                float mc, float lc, const float *restrict accc, int hd)
{
    if (mc == -INFINITY)
        return;
    const float mx = fmaxf(*m, mc);
    /* one of the two is exp(0) = 1 exactly */
    const float a = *m == mx ? 1.0f : expf(*m - mx), b = mc == mx ? 1.0f : expf(mc - mx);
    *l = KS_FMADD(lc, b, *l * a);
    for (int d = 0; d < hd; d++)
        acc[d] = KS_FMADD(accc[d], b, acc[d] * a);
    *m = mx;
}

/* A query row (hd) times the softmax scale, quantized for the integer scores
 * (ks_attn_quantize_query): once per pass and head, before the work items (each of which
 * reads it, a decode step's in every segment). */
static inline void ks_attn_quantize_row(const float *q, float scale, int hd, int8_t *q8,
                                        float *qd, int32_t *qsum)
{
    float x[hd];
    for (int d = 0; d < hd; d++)
        x[d] = q[d] * scale;
    *qd = ks_attn_quantize_query(x, q8, hd, qsum);
}

/* Copies the quantized queries (q8 (n, n_heads, 2 hd), qd (n, n_heads), qsum (n, n_heads, 2))
 * of tokens [t0, t1) x heads [h0, h0 + G) into the item's scratch and sets their limits. */
static inline void ks_attn_begin(const ks_attn_scratch *s, const int8_t *q8, const float *qd,
                                 const int32_t *qsum, int n_heads, int hd, int t0, int t1,
                                 int h0, int G, int pos0)
{
    int i = 0;
    for (int t = t0; t < t1; t++)
        for (int h = h0; h < h0 + G; h++, i++) {
            const int64_t r = (int64_t)t * n_heads + h;
            memcpy(s->q8 + (int64_t)2 * i * hd, q8 + 2 * r * hd, 2 * (size_t)hd);
            s->qd[i] = qd[r];
            s->qsum[2 * i] = qsum[2 * r];
            s->qsum[2 * i + 1] = qsum[2 * r + 1];
            s->lim[i] = pos0 + t;
        }
}

/* Prefill work item: tokens [t0, t1) x the G query heads of KV head g, over their keys from
 * KV row kfirst (their sequence's first: 0, or a packed sequence's) to their own, segment by
 * segment; writes out (n, n_heads, hd). q8, qd, qsum: the chunk's queries as
 * ks_attn_quantize_row leaves them (ks_attn_begin). kq etc. point at the layer (n_kv,
 * max_seq, ...).
 * Segments and blocks are counted from kfirst, so a sequence's results are the same bits
 * wherever in the arena it starts. */
static void ks_attn_prefill_item(const int8_t *q8, const float *qd, const int32_t *qsum,
                                 const int8_t *kq, const float *ks, const int8_t *vq,
                                 const float *vs, float *out, int n_heads, int n_kv, int hd,
                                 int max_seq, int pos0, int kfirst, int kv_bs, int t0, int t1,
                                 int g, float *scratch)
{
    const int G = n_heads / n_kv, nq = (t1 - t0) * G, seg = ks_attn_segment_len(kv_bs);
    const ks_attn_scratch s = ks_attn_scratch_parts(scratch, nq, hd, kv_bs);
    const int64_t kvo = (int64_t)g * max_seq + kfirst;
    const int ctx = pos0 - kfirst + t1;
    ks_attn_begin(&s, q8, qd, qsum, n_heads, hd, t0, t1, g * G, G, pos0 - kfirst);
    ks_attn_clear(s.fm, s.fl, s.facc, nq, hd);
    for (int k0 = 0; k0 < ctx; k0 += seg) {
        ks_attn_clear(s.m, s.l, s.acc, nq, hd);
        ks_attn_range_any(nq, hd, s.q8, s.qd, s.qsum, s.lim, kq + kvo * hd, ks + kvo,
                          vq + kvo * hd, vs + kvo, k0, k0 + seg < ctx ? k0 + seg : ctx, kv_bs,
                          s.m, s.l, s.acc, s.kt, s.vf, s.sc, s.corr);
        for (int i = 0; i < nq; i++)
            ks_attn_fold(s.fm + i, s.fl + i, s.facc + (int64_t)i * hd, s.m[i], s.l[i],
                         s.acc + (int64_t)i * hd, hd);
    }
    int i = 0;
    for (int t = t0; t < t1; t++)
        for (int h = g * G; h < g * G + G; h++, i++) {
            float *o = out + ((int64_t)t * n_heads + h) * hd;
            const float inv = 1.0f / s.fl[i];
            for (int d = 0; d < hd; d++)
                o[d] = s.facc[(int64_t)i * hd + d] * inv;
        }
}

/* Floats of partial state per (KV head, segment) for nq = n x G queries: m, l and acc. */
static inline int64_t ks_attn_part_floats(int nq, int hd)
{
    return (int64_t)nq * (hd + 2);
}

/* Split work item, for decode and passes of up to KS_ATTN_SPLIT_TOKENS tokens: the n tokens'
 * G query heads of KV head g against segment c of the keys; the state goes to part
 * (ks_attn_part_floats(n * G, hd) floats: m, l, acc, query i = t * G + head within the group).
 * A short pass has one prefill item per KV head, too few to keep every thread busy when the
 * model has few KV heads; split by segment, a long context gives every thread work. */
static void ks_attn_split_item(const int8_t *q8, const float *qd, const int32_t *qsum,
                               const int8_t *kq, const float *ks, const int8_t *vq,
                               const float *vs, float *part, int n_heads, int n_kv, int hd,
                               int max_seq, int pos0, int n, int kv_bs, int c, int g,
                               float *scratch)
{
    const int G = n_heads / n_kv, nq = n * G, seg = ks_attn_segment_len(kv_bs);
    const ks_attn_scratch s = ks_attn_scratch_parts(scratch, nq, hd, kv_bs);
    const int64_t kvo = (int64_t)g * max_seq;
    ks_attn_begin(&s, q8, qd, qsum, n_heads, hd, 0, n, g * G, G, pos0);
    ks_attn_clear(s.m, s.l, s.acc, nq, hd);
    ks_attn_range_any(nq, hd, s.q8, s.qd, s.qsum, s.lim, kq + kvo * hd, ks + kvo, vq + kvo * hd,
                      vs + kvo, c * seg, (c + 1) * seg, kv_bs, s.m, s.l, s.acc, s.kt, s.vf, s.sc,
                      s.corr);
    memcpy(part, s.m, sizeof(float) * nq);
    memcpy(part + nq, s.l, sizeof(float) * nq);
    memcpy(part + 2 * nq, s.acc, sizeof(float) * nq * hd);
}

/* After the split items: out (n, n_heads, hd) row (t, h) from the n_seg segments' states of
 * its KV head, folded in segment order (as the prefill item folds them: the same bits).
 * parts (n_kv, n_seg, ks_attn_part_floats(n * G, hd)). */
static void ks_attn_split_merge(const float *parts, float *out, int n_heads, int n_kv, int hd,
                                int n, int n_seg, int t, int h)
{
    const int G = n_heads / n_kv, g = h / G, nq = n * G, i = t * G + h % G;
    const int64_t pf = ks_attn_part_floats(nq, hd);
    const float *p0 = parts + (int64_t)g * n_seg * pf;
    float *o = out + ((int64_t)t * n_heads + h) * hd;
    float m, l;
    ks_attn_clear(&m, &l, o, 1, hd);
    for (int c = 0; c < n_seg; c++) {
        const float *p = p0 + c * pf;
        ks_attn_fold(&m, &l, o, p[i], p[nq + i], p + 2 * nq + (int64_t)i * hd, hd);
    }
    const float inv = 1.0f / l;
    for (int d = 0; d < hd; d++)
        o[d] *= inv;
}

#endif /* KS_ATTENTION_H */
