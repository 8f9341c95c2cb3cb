/* Kestrel kernels: the attention core (scores, softmax, values, a tile of queries, a range of
 * keys), written once for two vector widths (no Python here). ks_attention.h includes it twice:
 *   KS_AP 1: vectors of 8 floats (ks_v8), one key per vector (AVX2, NEON, plain builds);
 *   KS_AP 2: vectors of 16 floats (ks_v16), two keys per vector, compiled for AVX512 and
 *            taken at run time where the CPU has it (ks_use_vnni).
 * What the includer defines: KS_AV (the vector type), KS_AP (keys per vector), KS_AV_LOAD(p),
 * KS_AV_STORE(p, v), KS_AV_SET1(x), KS_AV_DUP8(p) (the 8 floats at p in every part),
 * KS_AV_PART(v, h) (part h as ks_v8), KS_AV_IN_REG(v) (as KS_IN_REG), KS_AV_SUMS (how many
 * value sums fit the registers: 8 of 16, 16 of 32), KS_AV_MAX(a, b), KS_AV_EXP(x) and
 * KS_AN(name) (the name of this instantiation's function); the end of this file undefines
 * them.
 *
 * The arithmetic is the same for both: a score's lane sums are over d = e mod 8 whatever the
 * width (the wide vector holds two keys' 8 lane sums side by side, so each half is the narrow
 * vector's), a value's output floats and the softmax's exp are each computed alone, and the
 * softmax's sum goes 8 lanes at a time in key order at both widths. So the two give the same
 * bits (tests/test_kernels.py checks it), and tiles of queries do too (the arithmetic below is
 * per query; tiles only decide how many queries share the loads of one K or V vector: every
 * score, weight and output float of a query is computed by the same operations in the same
 * order whatever tile, QB = 1, 2 or 4 queries, it is part of). */

/* sc[u * sc_stride + j] = q_u . k_j for the QB queries q (QB, hd) and keys j < n (n a multiple
 * of 16) of kf (the block's keys, KS_AP to a vector: key j's dims d..d+7 at
 * kf + (j - j % KS_AP) * hd + KS_AP * d + 8 * (j % KS_AP)): each score is the pairwise sum
 * (ks_v8_hsum8) of 8 lane sums, lane e summing q[d] * k[d] over d = e mod 8 in increasing d.
 * 8 / QB key vectors per step, so that the QB * (8 / QB) lane sums fill 8 registers. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_scores)(const int QB, const float *restrict q, const float *restrict kf,
                           int hd, int n, float *restrict sc, int sc_stride)
{
    const int KB = 8 / QB;
    const float *qp[4];
    for (int u = 0; u < QB; u++)
        qp[u] = q + (int64_t)u * hd;
    for (int jb = 0; jb < n; jb += KB * KS_AP) {
        KS_AV p[8] = {{0}};
        const float *kp[8];
        for (int kk = 0; kk < KB; kk++)
            kp[kk] = kf + (int64_t)(jb + kk * KS_AP) * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            KS_AV kv[8];
            for (int kk = 0; kk < KB; kk++) {
                kv[kk] = KS_AV_LOAD(kp[kk] + KS_AP * d);
                if (QB > 1)
                    KS_AV_IN_REG(kv[kk]);
            }
            for (int u = 0; u < QB; u++) {
                KS_AV qv = KS_AV_DUP8(qp[u] + d);
                KS_AV_IN_REG(qv);
                for (int kk = 0; kk < KB; kk++)
                    p[u * KB + kk] += qv * kv[kk];
            }
        }
        for (int h = 0; h < KS_AP; h++) {     /* part h of a vector: keys jb + kk * KS_AP + h */
            ks_v8 ph[8];
            for (int i = 0; i < 8; i++)
                ph[i] = KS_AV_PART(p[i], h);
            const ks_v8 r = ks_v8_hsum8(ph);
            for (int u = 0; u < QB; u++)
                for (int kk = 0; kk < KB; kk++)
                    sc[u * sc_stride + jb + kk * KS_AP + h] = r[u * KB + kk];
        }
    }
}

/* acc_u = acc_u * corr[u] + sum over keys j < n (n even) of w[u * w_stride + j] * v_j for the
 * QB queries (acc (QB, hd)), v = vf (n, hd): per output float, the even keys and the odd keys
 * go into two separate sums, added at the end. Dims go 8 * KS_AP * W at a time (hd a multiple
 * of it), QB * W * 2 <= KS_AV_SUMS sums in registers: enough chains to hide the FMA latency,
 * and each weight broadcast and V vector loaded serves W vectors of dims. */
static inline __attribute__((always_inline))
void KS_AN(ks_attn_values)(const int QB, const int W, float *restrict acc,
                           const float *restrict corr, const float *restrict w, int w_stride,
                           const float *restrict vf, int hd, int n)
{
    enum { L = 8 * KS_AP };     /* floats a vector */
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
    enum { L = 8 * KS_AP };
    for (int j = 0; j < qn; j++)
        sc[j] *= ks[j];
    for (int j = qn; j < qn_pad; j++)
        sc[j] = -INFINITY;                  /* weight 0 below */
    KS_AV vmax = KS_AV_SET1(*m);
    for (int j = 0; j < qn_pad; j += L)
        vmax = KS_AV_MAX(vmax, KS_AV_LOAD(sc + j));
    ks_v8 vmax8 = KS_AV_PART(vmax, 0);
    for (int h = 1; h < KS_AP; h++)
        vmax8 = ks_v8_max(vmax8, KS_AV_PART(vmax, h));
    const float mx = ks_v8_hmax(vmax8);
    const float corr = expf(*m - mx);       /* 0 on the first block (m = -inf) */
    ks_v8 vsum = ks_v8_set1(0.0f);
    for (int j = 0; j < qn_pad; j += L) {
        const KS_AV e = KS_AV_EXP(KS_AV_LOAD(sc + j) - mx);
        for (int h = 0; h < KS_AP; h++)
            vsum += KS_AV_PART(e, h);
        KS_AV_STORE(sc + j, e);
    }
    *l = *l * corr + ks_v8_hsum(vsum);
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
    enum { L = 8 * KS_AP };
    if (w_max >= 8 && hd % (8 * L) == 0)
        KS_AN(ks_attn_values)(QB, 8, acc, corr, w, w_stride, vf, hd, n);
    else if (w_max >= 4 && hd % (4 * L) == 0)
        KS_AN(ks_attn_values)(QB, 4, acc, corr, w, w_stride, vf, hd, n);
    else if (w_max >= 2 && hd % (2 * L) == 0)
        KS_AN(ks_attn_values)(QB, 2, acc, corr, w, w_stride, vf, hd, n);
    else
        KS_AN(ks_attn_values)(QB, 1, acc, corr, w, w_stride, vf, hd, n);
}

/* The tile of QB queries starting at qs, acc, m, l, all with qn > 0 keys of the block
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
static void KS_AN(ks_attn_range)(int nq, int hd, const float *restrict qs,
                                 const int *restrict lim, const int8_t *restrict kq,
                                 const float *restrict ks, const int8_t *restrict vq,
                                 const float *restrict vs, int k0, int k1, int kv_bs,
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
        /* the block as float: V rows as they are, K rows KS_AP to a vector (ks_attn_scores);
           rows past nj are zero so whole strips can be used */
        for (int64_t e = 0; e < (int64_t)nj * hd; e += 8)
            ks_v8_store(vf + e, ks_v8_of_i8(vq + (int64_t)j0 * hd + e));
        for (int j = 0; j < nj; j++) {
            const int8_t *kr = kq + (int64_t)(j0 + j) * hd;
            float *kd = kf + (int64_t)(j - j % KS_AP) * hd + 8 * (j % KS_AP);
            for (int d = 0; d < hd; d += 8)
                ks_v8_store(kd + KS_AP * d, ks_v8_of_i8(kr + d));
        }
        for (int64_t e = (int64_t)nj * hd; e < (int64_t)nj_pad * hd; e++)
            vf[e] = 0.0f;
        for (int j = nj; j < nj_pad; j++) {
            float *kd = kf + (int64_t)(j - j % KS_AP) * hd + 8 * (j % KS_AP);
            for (int d = 0; d < hd; d += 8)
                for (int e = 0; e < 8; e++)
                    kd[KS_AP * d + e] = 0.0f;
        }

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
                KS_AN(ks_attn_tile)(4, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i,
                                    l + i, acc + o, sc, corr);
            else if (qb == 2)
                KS_AN(ks_attn_tile)(2, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i,
                                    l + i, acc + o, sc, corr);
            else
                KS_AN(ks_attn_tile)(1, hd, qs + o, qn[0], kf, ks + j0, vf, vs + j0, kv_bs, m + i,
                                    l + i, acc + o, sc, corr);
            i += qb;
        }
    }
}

/* the parameters go with this instantiation */
#undef KS_AV
#undef KS_AP
#undef KS_AV_LOAD
#undef KS_AV_STORE
#undef KS_AV_SET1
#undef KS_AV_DUP8
#undef KS_AV_PART
#undef KS_AV_IN_REG
#undef KS_AV_SUMS
#undef KS_AV_MAX
#undef KS_AV_EXP
#undef KS_AN
