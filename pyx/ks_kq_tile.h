/* Kestrel kernels: the x86 tiles of Q4_K, Q5_K and Q6_K, one source for both tile widths (no
 * Python here). ks_kquants.h includes it with KS_TW 8 (AVX2) and, where KS_HAVE_VNNI is
 * defined, KS_TW 16 (AVX512-VNNI); KS_MM, KS_TI, KS_TN and the rest are ks_q8.h's width
 * vocabulary, and the helpers that differ by width (ks_kq_scales, ks_q6k_codes,
 * ks_q6k_block_scales, ks_q6k_isum) stand in ks_kquants.h beside each include.
 *
 * A tile is KS_TW rows x T tokens, lane i of every vector belonging to row i. The rows' 32 code
 * bytes of a block (or block pair; Q6_K's built row by row first) are transposed as dwords, so
 * that a token's broadcast 4-byte chunk times them adds row i's chunk product into lane i: no
 * horizontal adds, and the codes are unsigned, as maddubs and vpdpbusd want them (Q6_K's -32
 * comes in through x's half-block sums). The unpacking, the scales and the float epilogue are
 * spent once per KS_TW rows. On an interleaved group (il, ks_interleave.h) every one of those
 * transposed dword vectors is a field of the group's block, loaded as it lies. The float side
 * is ks_kquants.h's contract per block, in order: bit-identical to the plain twin at both
 * widths and on both layouts. */

/* An interleaved group's n consecutive dword fields from the one at p: the same vectors as
 * ks_load_transposed gives from the rows (lane i = row i's dword). */
KS_TFN void KS_TN(ks_dwords_il)(const uint8_t *p, const int n, KS_TI c[])
{
    for (int q = 0; q < n; q++)
        c[q] = KS_MMSI(loadu)((const KS_TI *)(p + KS_TW * 4 * q));
}

/* Q4_K / Q5_K's lane scales of a superblock from its three scale dwords r[k] (lane i: row i's
 * bytes 4 + 4k .. 7 + 4k) and its d and -dmin: ds[s] = d * sc[s], dm[s] = -(dmin * m[s])
 * (exact products), by ks_kq_scales_mins's bit operations on all the lanes at once. The rows'
 * ks_kq_lane_scales (ks_kquants.h, 8 lanes) and the groups' ks_kq_scales_il share it. */
KS_TFN void KS_TN(ks_kq_unpack_scales)(const KS_TI r[3], const KS_TF d, const KS_TF ndmin,
                                       KS_TF ds[8], KS_TF dm[8])
{
    const KS_TI m6 = KS_MM(set1_epi8)(0x3f), m4 = KS_MM(set1_epi8)(0x0f);
    const KS_TI m30 = KS_MM(set1_epi8)(0x30), byte = KS_MM(set1_epi32)(0xff);
    const KS_TI sc[2] = {KS_MMSI(and)(r[0], m6), KS_MMSI(or)(KS_MMSI(and)(r[2], m4),
                         KS_MMSI(and)(KS_MM(srli_epi32)(r[0], 2), m30))};
    const KS_TI mn[2] = {KS_MMSI(and)(r[1], m6), KS_MMSI(or)(
                         KS_MMSI(and)(KS_MM(srli_epi32)(r[2], 4), m4),
                         KS_MMSI(and)(KS_MM(srli_epi32)(r[1], 2), m30))};
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {   /* byte s % 4 of every lane's dword */
        const int sh = 8 * (s % 4);
        const KS_TI a = KS_MMSI(and)(KS_MM(srli_epi32)(sc[s / 4], sh), byte);
        const KS_TI m = KS_MMSI(and)(KS_MM(srli_epi32)(mn[s / 4], sh), byte);
        ds[s] = KS_MM(mul_ps)(KS_MM(cvtepi32_ps)(a), d);
        dm[s] = KS_MM(mul_ps)(KS_MM(cvtepi32_ps)(m), ndmin);
    }
}

/* ks_kq_scales (ks_kquants.h) on an interleaved group's superblock at g (its d, dmin and
 * scale dwords side by side): the same lane scales, the same float operations. */
KS_TFN void KS_TN(ks_kq_scales_il)(const int kind, const uint8_t *g, KS_TF ds[8], KS_TF dm[8],
                                   KS_TI sc6[4])
{
    if (kind == KS_KQ_Q6K) {
        ds[0] = KS_TN(ks_fp16_vec)(g + KS_TW * 208);
        KS_TN(ks_dwords_il)(g + KS_TW * 192, 4, sc6);
        return;
    }
    KS_TI r[3];
    KS_TN(ks_dwords_il)(g + KS_TW * 4, 3, r);
    KS_TN(ks_kq_unpack_scales)(r, KS_TN(ks_fp16_vec)(g),
                               KS_TN(ks_negate)(KS_TN(ks_fp16_vec)(g + KS_TW * 2)), ds, dm);
}

/* ks_q6k_codes (ks_kquants.h) on an interleaved group's superblock at g: block s's codes from
 * its ql and qh dwords, which need no transpose. */
KS_TFN void KS_TN(ks_q6k_codes_il)(const uint8_t *g, const int s, KS_TI codes[8])
{
    const int hf = s / 4, q4 = s % 4;
    KS_TI ql[8], qh[8];
    KS_TN(ks_dwords_il)(g + KS_TW * (64 * hf + 32 * (q4 & 1)), 8, ql);
    KS_TN(ks_dwords_il)(g + KS_TW * (128 + 32 * hf), 8, qh);
    const KS_TI m4 = KS_MM(set1_epi8)(0x0F), m30 = KS_MM(set1_epi8)(0x30);
    for (int q = 0; q < 8; q++) {
        const KS_TI lo = KS_MMSI(and)(q4 < 2 ? ql[q] : KS_MM(srli_epi32)(ql[q], 4), m4);
        const KS_TI hi = q4 == 0 ? KS_MM(slli_epi32)(qh[q], 4)
                       : q4 == 1 ? KS_MM(slli_epi32)(qh[q], 2)
                       : q4 == 2 ? qh[q] : KS_MM(srli_epi32)(qh[q], 2);
        codes[q] = KS_MMSI(or)(lo, KS_MMSI(and)(hi, m30));
    }
}

/* Block s (activation block b) of the superblock at off of a tile (of rows wp, or of the
 * interleaved group at w when il): its rows' codes, then every token's products and epilogue
 * into acc. ds, dm, sc6, qh: the superblock's lane scales and fifth bits; c: Q4_K / Q5_K's
 * transposed code bytes of the block pair, loaded at its even block. */
KS_TFN void KS_TN(ks_kq_block)(const int kind, const int il, const int T, const int s, int b,
                               int64_t off, const uint8_t *w, const uint8_t *const wp[KS_TW],
                               const int8_t *const xp[],
                               const float *const dp[], const float *const sp[],
                               const int16_t *const hp[], const KS_TF ds[8], const KS_TF dm[8],
                               const KS_TI sc6[4], const KS_TI qh[8], KS_TI c[8], KS_TF acc[])
{
    KS_TI codes[8], sc[3];
    if (kind == KS_KQ_Q6K) {
        if (il)
            KS_TN(ks_q6k_codes_il)(w + KS_TW * off, s, codes);
        else
            KS_TN(ks_q6k_codes)(wp, off, s, codes);
        KS_TN(ks_q6k_block_scales)(sc6, s, sc);
    } else {
        const int64_t at = off + (kind == KS_KQ_Q5K ? 48 : 16) + 16 * s;
        if (s % 2 == 0 && il)
            KS_TN(ks_dwords_il)(w + KS_TW * at, 8, c);
        else if (s % 2 == 0)
            KS_TN(ks_load_transposed)(wp, at, c);
        for (int q = 0; q < 8; q++) {
            codes[q] = KS_MMSI(and)(s & 1 ? KS_MM(srli_epi32)(c[q], 4) : c[q],
                                    KS_MM(set1_epi8)(0x0F));
            if (kind == KS_KQ_Q5K) {
                const KS_TI hb = s < 4 ? KS_MM(slli_epi32)(qh[q], 4 - s)
                                       : KS_MM(srli_epi32)(qh[q], s - 4);
                codes[q] = KS_MMSI(or)(codes[q], KS_MMSI(and)(hb, KS_MM(set1_epi8)(0x10)));
            }
        }
    }
    for (int j = 0; j < T; j++) {
        const int8_t *xb = xp[j] + b * KS_QK;
        const KS_TF dx = KS_MM(set1_ps)(dp[j][b]);
        if (kind == KS_KQ_Q6K) {
            const KS_TI isum = KS_TN(ks_q6k_isum)(codes, xb, sc, hp[j] + 2 * b);
            acc[j] = KS_TN(ks_fmadd)(KS_MM(cvtepi32_ps)(isum), KS_MM(mul_ps)(ds[0], dx), acc[j]);
        } else {
            const KS_TI isum = KS_TN(ks_dot_chunks)(KS_MMSI(setzero)(), codes, xb, 0, 8, 2);
            acc[j] = KS_TN(ks_fmadd)(KS_MM(cvtepi32_ps)(isum), KS_MM(mul_ps)(ds[s], dx), acc[j]);
            acc[j] = KS_TN(ks_fmadd)(KS_MM(set1_ps)(sp[j][b]), dm[s], acc[j]);
        }
    }
}

/* res[j * KS_TW + i] = out value for row i, token j < T (T <= KS_TTOKENS); rows >= rv / tokens
 * >= tv repeat the last valid one. il: w is an interleaved group of KS_TW rows (rows >= rv are
 * its padding), not rows w_stride apart. xs: the tokens' scaled block sums (Q4_K, Q5_K);
 * xh[t * 2nb + 2b + h]: the sum of half h of block b (Q6_K). pf (or NULL): superblock sb
 * prefetches the pf_step bytes at pf + sb * pf_step. */
KS_TFN void KS_TN(ks_kq_tile)(const int kind, const int il, const int T, const uint8_t *w,
                              int64_t w_stride,
                              int rv, const int8_t *x, const float *xd, const float *xs,
                              const int16_t *xh, int tv, int nsb, float *res, const uint8_t *pf,
                              int64_t pf_step)
{
    const int bytes = ks_kq_bytes(kind), nb = nsb * 8;
    const uint8_t *wp[KS_TW];
    const int8_t *xp[KS_TTOKENS];
    const float *dp[KS_TTOKENS], *sp[KS_TTOKENS];
    const int16_t *hp[KS_TTOKENS];
    ks_tile_inputs(KS_TW, T, w, w_stride, rv, x, xd, NULL, tv, nb, wp, xp, dp, NULL);
    for (int j = 0; j < T; j++) {     /* the sums each type needs */
        const int64_t jt = j < tv ? j : tv - 1;
        sp[j] = xs ? xs + jt * nb : NULL;
        hp[j] = xh ? xh + jt * 2 * nb : NULL;
    }
    KS_TF acc[KS_TTOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = KS_MM(setzero_ps)();
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t off = (int64_t)sb * bytes;
        KS_TF ds[8], dm[8];
        KS_TI sc6[4], qh[8], c[8];
        if (il)
            KS_TN(ks_kq_scales_il)(kind, w + KS_TW * off, ds, dm, sc6);
        else
            KS_TN(ks_kq_scales)(kind, wp, off, ds, dm, sc6);
        if (kind == KS_KQ_Q5K && il)
            KS_TN(ks_dwords_il)(w + KS_TW * (off + 16), 8, qh);
        else if (kind == KS_KQ_Q5K)
            KS_TN(ks_load_transposed)(wp, off + 16, qh);
/* an eighth of the superblock's slice per block: spread requests */
#define KS_KQ_PREFETCH(s) if (pf) ks_prefetch_rows(pf + sb * pf_step + (s) * (pf_step / 8), \
                                    pf_step / 8, ks_kq_prefetch_l2(kind, KS_TW))
        /* Q6_K's blocks fully unrolled (its code building has constants for each); the others
         * by pairs (the two nibbles of one code byte), the pairs unrolled KS_T*_KQ_PAIRS
         * times: all 8 blocks on 8 rows; on 16 rows a loop of pairs, since all 8 unrolled
         * would outgrow the decoded-instruction cache */
        if (kind == KS_KQ_Q6K) {
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                KS_KQ_PREFETCH(s);
                KS_TN(ks_kq_block)(kind, il, T, s, sb * 8 + s, off, w, wp, xp, dp, sp, hp, ds,
                                   dm, sc6, qh, c, acc);
            }
        } else {
            KS_PRAGMA(GCC unroll KS_TCAT(KS_T, KS_TW, _KQ_PAIRS))
            for (int pr = 0; pr < 4; pr++)
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++) {
                    KS_KQ_PREFETCH(2 * pr + hh);
                    KS_TN(ks_kq_block)(kind, il, T, 2 * pr + hh, sb * 8 + 2 * pr + hh, off, w,
                                       wp, xp, dp, sp, hp, ds, dm, sc6, qh, c, acc);
                }
        }
    }
#undef KS_KQ_PREFETCH
    for (int j = 0; j < T; j++)
        KS_MM(storeu_ps)(res + KS_TW * j, acc[j]);
}

/* The product (the contract of the plain twin), on rows as the file lays them out (il 0) or
 * on groups of KS_TW interleaved rows (il 1: r0 a multiple of KS_TW, row r's group at
 * w + r * w_stride): decode in KS_TW x 1 tiles, prefetching the next; prefill in tiles of
 * KS_TW rows x up to KS_TTOKENS tokens over blocks of KS_PREFILL_TOKEN_BLOCK tokens
 * (KS_TOKEN_TILES: a few tokens prefetch as decode does). */
KS_TFN void KS_TN(ks_kq_matmul_rows)(const int kind, const int il, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, nsb = k / KS_QK_K, tblock = n == 1 ? 1 : KS_PREFILL_TOKEN_BLOCK;
    const int q6 = kind == KS_KQ_Q6K;
    /* Q4_K, Q5_K: the scaled block sums of a token block; Q6_K reads x->h */
    float xs[q6 ? 1 : tblock * nb], res[KS_TW * KS_TTOKENS];
    for (int tb = 0; tb < n; tb += tblock) {
        const int te = tb + tblock < n ? tb + tblock : n;
        if (!q6)
            for (int t = tb; t < te; t++)
                ks_q8_block_sums(x->h + (int64_t)t * 2 * nb, x->d + (int64_t)t * nb, nb,
                                 xs + (t - tb) * nb);
        for (int r = r0; r < r1; r += KS_TW) {
            const int rv = r1 - r < KS_TW ? r1 - r : KS_TW;
            const uint8_t *next = r + KS_TW < m ? w + (int64_t)(r + KS_TW) * w_stride : NULL;
            if (n == 1) {
                KS_TN(ks_kq_tile)(kind, il, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d,
                                  q6 ? NULL : xs, q6 ? x->h : NULL, 1, nsb, res, next,
                                  KS_TW * w_stride / nsb);
                ks_q8_store_tile(KS_TW, 1, res, out, m, r, rv, 0, 1);
                continue;
            }
            const uint8_t *pf = n <= KS_PREFETCH_TOKENS ? next : NULL;
#define KS_KQ_TILE(TT, t, tv, tpf) KS_TN(ks_kq_tile)(kind, il, TT, w + (int64_t)r * w_stride,    \
    w_stride, rv, x->q + (int64_t)(t) * k, x->d + (int64_t)(t) * nb,                          \
    q6 ? NULL : xs + ((t) - tb) * nb, q6 ? x->h + (int64_t)(t) * 2 * nb : NULL, tv, nsb, res, \
    tpf, KS_TW * w_stride / nsb)
            KS_T_TOKEN_TILES(KS_KQ_TILE)
#undef KS_KQ_TILE
        }
    }
}
