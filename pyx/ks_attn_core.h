/* Kestrel kernels: the attention core (scores of float queries and keys, softmax, values, a
 * tile of queries, a range of keys), written once for three vector widths (no Python here).
 * ks_attention.h includes it once or twice:
 *   vectors of 8 floats (ks_v8), one key each in the float scores (AVX2 and plain builds);
 *   vectors of 4 floats (ks_v4) on NEON, two to a key's 8 lane sums: GCC keeps 8-float
 *            vectors in memory on aarch64 wherever they live across a loop's iterations;
 *   vectors of 16 floats (ks_v16), two keys each in the float scores, compiled for AVX512 and
 *            taken at run time where the CPU has it (ks_use_vnni).
 * The int8 KV's scores are integer (ks_attn_scores.h, through KS_AV_KEYS and KS_AV_SCORES);
 * the float scores here serve the vision tower's float keys (ks_vision.h).
 * What the includer defines: KS_AV (the vector type), KS_AP (keys a vector holds in the
 * float scores: 1 or 2), KS_AH (vectors that hold one key's 8 lane sums: 1 or 2),
 * KS_AV_LOAD(p), KS_AV_STORE(p, v), KS_AV_SET1(x), KS_AV_QLOAD(p) (the 8 / KS_AH query floats
 * at p in each of the KS_AP parts), KS_AV_IN_REG(v) (as KS_IN_REG), KS_AV_SUMS (how many value
 * sums fit the registers), KS_AV_MAX(a, b), KS_AV_EXP(x), KS_AV_HMAX(v) (its largest float),
 * KS_AV_HSUM8(r, p, h) (r[i] = the pairwise sum of key slot i's 8 lane sums, part h, for the
 * 8 slots of p: p[KS_AH * i .. KS_AH * i + KS_AH)), KS_AS (an 8-lane sum) with
 * KS_AS_ZERO, KS_AS_ADD(s, v, c) (adds vector v, the c-th of a 16-float strip, in key order)
 * and KS_AS_HSUM(s) (as ks_v8_hsum), KS_AV_KEYS(kt, k, hd, nj) (prepares a block's nj int8
 * keys k for the integer scores, or nothing), KS_AV_SCORES(QB, q8, qd, qsum, k, kt, hd, qn,
 * qn_pad, sc, stride) (ks_attn_scores.h's scores of QB queries for the block's first qn keys,
 * at least) and KS_AN(name) (the name of this instantiation's function); the end of this file
 * undefines them.
 *
 * The arithmetic is the same for all: integer scores are exact whatever adds them, a float
 * score's lane sums are over d = e mod 8 whatever the width (the wide vector holds two keys'
 * 8 lane sums side by side, the narrow one half of a key's), a value's output floats and the
 * softmax's exp are each computed alone, and the softmax's sum goes 8 lanes at a time in key
 * order at every width. So they give the same bits (tests/test_kernels.py checks 8 against
 * 16, and every width against x86-64's recorded results, as the A76 and the A72 under make
 * test-arm64), and tiles of queries do too (the arithmetic below is per query; tiles only
 * decide how many queries share the loads of one K or V vector: every score, weight and output
 * float of a query is computed by the same operations in the same order whatever tile, QB = 1,
 * 2 or 4 queries, it is part of). */

/* sc[u * sc_stride + j] = q_u . k_j for the QB queries q (QB, hd) and keys j < n (n a multiple
 * of 16) of kf (the block's keys, KS_AP to a vector: key j's dims d..d+7 at
 * kf + (j - j % KS_AP) * hd + KS_AP * d + 8 * (j % KS_AP)): each score is the pairwise sum
 * (ks_v8_hsum8) of 8 lane sums, lane e summing q[d] * k[d] over d = e mod 8 in increasing d.
 * 8 / QB key slots per step, so that the QB * (8 / QB) slots of lane sums fill 8 * KS_AH
 * registers. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_scores)(const int QB, const float *restrict q, const float *restrict kf,
                           int hd, int n, float *restrict sc, int sc_stride)
{
    enum { L = 8 * KS_AP / KS_AH };     /* floats a vector */
    const int KB = 8 / QB;
    const float *qp[4];
    for (int u = 0; u < QB; u++)
        qp[u] = q + (int64_t)u * hd;
    for (int jb = 0; jb < n; jb += KB * KS_AP) {
        KS_AV p[8 * KS_AH] = {{0}};
        const float *kp[8];
        for (int kk = 0; kk < KB; kk++)
            kp[kk] = kf + (int64_t)(jb + kk * KS_AP) * hd;
        for (int64_t d = 0; d < hd; d += 8)
            for (int h = 0; h < KS_AH; h++) {     /* the vector of a key slot's lanes */
                KS_AV kv[8];
                for (int kk = 0; kk < KB; kk++) {
                    kv[kk] = KS_AV_LOAD(kp[kk] + KS_AP * d + L * h);
                    if (QB > 1)
                        KS_AV_IN_REG(kv[kk]);
                }
                for (int u = 0; u < QB; u++) {
                    KS_AV qv = KS_AV_QLOAD(qp[u] + d + L * h);
                    KS_AV_IN_REG(qv);
                    for (int kk = 0; kk < KB; kk++)
                        p[(u * KB + kk) * KS_AH + h] += qv * kv[kk];
                }
            }
        for (int h = 0; h < KS_AP; h++) {     /* part h of a vector: keys jb + kk * KS_AP + h */
            float r[8];
            KS_AV_HSUM8(r, p, h);
            for (int u = 0; u < QB; u++)
                for (int kk = 0; kk < KB; kk++)
                    sc[u * sc_stride + jb + kk * KS_AP + h] = r[u * KB + kk];
        }
    }
}

/* acc_u = acc_u * corr[u] + sum over keys j < n (n even) of w[u * w_stride + j] * v_j for the
 * QB queries (acc (QB, hd)), v = vf (n, hd): per output float, the even keys and the odd keys
 * go into two separate sums, added at the end. Dims go 8 * KS_AP / KS_AH * W at a time (hd a multiple
 * of it), QB * W * 2 <= KS_AV_SUMS sums in registers: enough chains to hide the FMA latency,
 * and each weight broadcast and V vector loaded serves W vectors of dims. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_values)(const int QB, const int W, float *restrict acc,
                           const float *restrict corr, const float *restrict w, int w_stride,
                           const float *restrict vf, int hd, int n)
{
    enum { L = 8 * KS_AP / KS_AH };     /* floats a vector */
    const float *wp[4];
    for (int u = 0; u < QB; u++)
        wp[u] = w + (int64_t)u * w_stride;
    for (int ds = 0; ds < hd; ds += L * W) {
        KS_AV ae[KS_AV_SUMS / 2], ao[KS_AV_SUMS / 2];
        for (int u = 0; u < QB; u++)
            for (int c = 0; c < W; c++) {
                ae[u * W + c] = KS_AV_LOAD(acc + (int64_t)u * hd + ds + L * c) * corr[u];
                ao[u * W + c] = KS_AV_SET1(0.0f);
            }
        const float *ve = vf + ds;
        for (int64_t j = 0; j < n; j += 2, ve += 2 * (int64_t)hd) {
            KS_AV vv[KS_AV_SUMS];
            for (int c = 0; c < W; c++) {
                vv[2 * c] = KS_AV_LOAD(ve + L * c);
                vv[2 * c + 1] = KS_AV_LOAD(ve + hd + L * c);
                if (QB > 1) {
                    KS_AV_IN_REG(vv[2 * c]);
                    KS_AV_IN_REG(vv[2 * c + 1]);
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
                KS_AV_STORE(acc + (int64_t)u * hd + ds + L * c, ae[u * W + c] + ao[u * W + c]);
    }
}

/* One query's online-softmax step over a block of qn keys (qn_pad: qn rounded up to 16):
 * sc (qn_pad) raw scores in, weights of the value rows out (0 past qn); updates m, l and
 * returns the factor the query's acc must be scaled by. ks, vs: the block's scales. The sum
 * of the weights goes 8 lanes at a time in key order at every width. */
static inline __attribute__((always_inline))
float KS_AN(ks_attn_softmax_block)(float *restrict sc, int qn, int qn_pad,
                                   const float *restrict ks, const float *restrict vs,
                                   float *restrict m, float *restrict l)
{
    enum { L = 8 * KS_AP / KS_AH };     /* floats a vector */
    for (int j = 0; j < qn; j++)
        sc[j] *= ks[j];
    for (int j = qn; j < qn_pad; j++)
        sc[j] = -INFINITY;                  /* weight 0 below */
    KS_AV vmax = KS_AV_SET1(*m);
    for (int j = 0; j < qn_pad; j += L)
        vmax = KS_AV_MAX(vmax, KS_AV_LOAD(sc + j));
    const float mx = KS_AV_HMAX(vmax);
    /* 0 on the first block (m = -inf); exp(0) = 1 exactly, so a max that stays costs no exp */
    const float corr = mx == *m ? 1.0f : expf(*m - mx);
    KS_AS vsum = KS_AS_ZERO;
    for (int j = 0; j < qn_pad; j += KS_ATTN_STRIP)
        for (int c = 0; c < KS_ATTN_STRIP / L; c++) {
            const KS_AV e = KS_AV_EXP(KS_AV_LOAD(sc + j + L * c) - mx);
            KS_AS_ADD(vsum, e, c);
            KS_AV_STORE(sc + j + L * c, e);
        }
    *l = *l * corr + KS_AS_HSUM(vsum);
    *m = mx;
    for (int j = 0; j < qn; j++)
        sc[j] *= vs[j];                     /* weight of value row j */
    return corr;
}

/* ks_attn_values with the most dims a pass (W <= w_max) that hd and the registers allow */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_values_fit)(const int QB, const int w_max, float *restrict acc,
                               const float *restrict corr, const float *restrict w,
                               int w_stride, const float *restrict vf, int hd, int n)
{
    enum { L = 8 * KS_AP / KS_AH };     /* floats a vector */
    if (w_max >= 8 && hd % (8 * L) == 0)
        KS_AN(ks_attn_values)(QB, 8, acc, corr, w, w_stride, vf, hd, n);
    else if (w_max >= 4 && hd % (4 * L) == 0)
        KS_AN(ks_attn_values)(QB, 4, acc, corr, w, w_stride, vf, hd, n);
    else if (w_max >= 2 && hd % (2 * L) == 0)
        KS_AN(ks_attn_values)(QB, 2, acc, corr, w, w_stride, vf, hd, n);
    else
        KS_AN(ks_attn_values)(QB, 1, acc, corr, w, w_stride, vf, hd, n);
}

/* The softmax and values of a tile of QB queries whose raw scores for the block's first qn
 * keys are in sc (QB, kv_bs): updates their m, l, acc; vf (kv_bs, hd) the block's V rows as
 * float, ks, vs its scales; corr (QB): scratch. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_weigh)(const int QB, int hd, int qn, const float *restrict ks,
                          const float *restrict vf, const float *restrict vs, int kv_bs,
                          float *restrict m, float *restrict l, float *restrict acc,
                          float *restrict sc, float *restrict corr)
{
    const int qn_pad = (qn + KS_ATTN_STRIP - 1) / KS_ATTN_STRIP * KS_ATTN_STRIP;
    for (int u = 0; u < QB; u++)
        corr[u] = KS_AN(ks_attn_softmax_block)(sc + u * kv_bs, qn, qn_pad, ks, vs, m + u,
                                               l + u);
    /* values in pairs of queries: 2 V loads and 2 weight broadcasts per 4 FMAs, fewer with W */
    for (int u = 0; u + 1 < QB; u += 2)
        KS_AN(ks_attn_values_fit)(2, KS_AV_SUMS / 4, acc + (int64_t)u * hd, corr + u,
                                  sc + u * kv_bs, kv_bs, vf, hd, qn_pad);
    if (QB == 1)
        KS_AN(ks_attn_values_fit)(1, KS_AV_SUMS / 2, acc, corr, sc, kv_bs, vf, hd, qn_pad);
}

/* The tile of QB float queries starting at qs, acc, m, l, all with qn > 0 keys of the block
 * (kf (as ks_attn_scores reads it), vf (kv_bs, hd); ks, vs its scales); sc (QB, kv_bs),
 * corr (QB): scratch. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_tile)(const int QB, int hd, const float *restrict qs, int qn,
                         const float *restrict kf, const float *restrict ks,
                         const float *restrict vf, const float *restrict vs, int kv_bs,
                         float *restrict m, float *restrict l, float *restrict acc,
                         float *restrict sc, float *restrict corr)
{
    const int qn_pad = (qn + KS_ATTN_STRIP - 1) / KS_ATTN_STRIP * KS_ATTN_STRIP;
    KS_AN(ks_attn_scores)(QB, qs, kf, hd, qn_pad, sc, kv_bs);
    KS_AN(ks_attn_weigh)(QB, hd, qn, ks, vf, vs, kv_bs, m, l, acc, sc, corr);
}

/* The same for QB int8 queries (their codes q8 (QB, 2 hd), scales qd and code sums qsum
 * (QB, 2): ks_attn_quantize_query) against the block's int8 K rows k (kt: KS_AV_KEYS' form
 * of them). */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_tile_i8)(const int QB, int hd, const int8_t *restrict q8,
                            const float *restrict qd, const int32_t *restrict qsum, int qn,
                            const int8_t *restrict k, const int8_t *restrict kt,
                            const float *restrict ks, const float *restrict vf,
                            const float *restrict vs, int kv_bs, float *restrict m,
                            float *restrict l, float *restrict acc, float *restrict sc,
                            float *restrict corr)
{
    const int qn_pad = (qn + KS_ATTN_STRIP - 1) / KS_ATTN_STRIP * KS_ATTN_STRIP;
    KS_AV_SCORES(QB, q8, qd, qsum, k, kt, hd, qn, qn_pad, sc, kv_bs);
    KS_AN(ks_attn_weigh)(QB, hd, qn, ks, vf, vs, kv_bs, m, l, acc, sc, corr);
}

/* nq queries of one KV head against keys [k0, k1) of it, updating their online-softmax state.
 *   q8 (nq, 2 hd), qd (nq), qsum (nq, 2)   queries (times the softmax scale) as int8 codes,
 *                 their scales and code sums (ks_attn_quantize_query)
 *   lim (nq)      query i sees keys <= lim[i] (causal)
 *   kq, vq (max_seq, hd), ks, vs (max_seq): this KV head's rows
 *   m, l (nq), acc (nq, hd): running max, running sum, unnormalized output (IN/OUT)
 *   kt (kv_bs, hd) int8, vf (kv_bs, hd), sc (KS_ATTN_QB, kv_bs), corr (KS_ATTN_QB): scratch
 * Queries go in tiles of 4 (or 2) consecutive ones that see the same number of keys of the
 * block (all of it, except near the diagonal), else one by one. hd is a multiple of
 * KS_ATTN_STRIP and kv_bs a power of two >= KS_ATTN_STRIP (checked by the caller). Keys past
 * every query's limit are never read. */
static void KS_AN(ks_attn_range)(int nq, int hd, const int8_t *restrict q8,
                                 const float *restrict qd, const int32_t *restrict qsum,
                                 const int *restrict lim, const int8_t *restrict kq,
                                 const float *restrict ks, const int8_t *restrict vq,
                                 const float *restrict vs, int k0, int k1, int kv_bs,
                                 float *restrict m, float *restrict l, float *restrict acc,
                                 int8_t *restrict kt, float *restrict vf, float *restrict sc,
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
        const int8_t *kb = kq + (int64_t)j0 * hd;
        /* the block's V rows as float (rows past nj zero, so whole strips can be used), and
           the next block's keys: each key's K and V rows are asked for as this block's V row
           of the same index is converted, so the requests go out spread over the block (a
           long context's KV is read once per token, like the weights, and the blocks are too
           short for the hardware prefetcher to get ahead) */
        const int next_n = kend - j0 - kv_bs < kv_bs ? kend - j0 - kv_bs : kv_bs;
        for (int j = 0; j < nj; j++) {
            if (j < next_n) {
                ks_prefetch_rows((const uint8_t *)(kb + (int64_t)(kv_bs + j) * hd), hd, 0);
                ks_prefetch_rows((const uint8_t *)(vq + (int64_t)(j0 + kv_bs + j) * hd), hd, 0);
            }
            ks_f32_of_i8(vf + (int64_t)j * hd, vq + (int64_t)(j0 + j) * hd, hd);
        }
        for (int64_t e = (int64_t)nj * hd; e < (int64_t)nj_pad * hd; e++)
            vf[e] = 0.0f;
        KS_AV_KEYS(kt, kb, hd, nj);

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
#define KS_ATTN_TILE(QB) KS_AN(ks_attn_tile_i8)(QB, hd, q8 + 2 * o, qd + i, qsum + 2 * i,   \
                                             qn[0], kb, kt, ks + j0, vf, vs + j0, kv_bs, m + i, \
                                             l + i, acc + o, sc, corr)
            if (qb == 4)
                KS_ATTN_TILE(4);
            else if (qb == 2)
                KS_ATTN_TILE(2);
            else
                KS_ATTN_TILE(1);
#undef KS_ATTN_TILE
            i += qb;
        }
    }
}

/* the parameters go with this instantiation */
#undef KS_AV
#undef KS_AP
#undef KS_AH
#undef KS_AV_LOAD
#undef KS_AV_STORE
#undef KS_AV_SET1
#undef KS_AV_QLOAD
#undef KS_AV_IN_REG
#undef KS_AV_SUMS
#undef KS_AV_MAX
#undef KS_AV_EXP
#undef KS_AV_HMAX
#undef KS_AV_HSUM8
#undef KS_AS
#undef KS_AS_ZERO
#undef KS_AS_ADD
#undef KS_AS_HSUM
#undef KS_AV_KEYS
#undef KS_AV_SCORES
#undef KS_AN
