/* Kestrel kernels: the x86 tiles of Q4_0, Q4_1 and Q5_0, one source for both tile widths
 * (no Python here). ks_q4.h includes it with KS_TW 8 (AVX2) and, where KS_HAVE_VNNI is defined,
 * KS_TW 16 (AVX512-VNNI); KS_MM, KS_TI, KS_TN and the rest are ks_q8.h's width vocabulary.
 *
 * A tile is KS_TW rows x T tokens with lane i of every vector belonging to row i, as in ks_q8.h's
 * tiles: a token's broadcast 4-byte chunk times the rows' matching code bytes adds row i's chunk
 * product into lane i (maddubs pairs on AVX2, one vpdpbusd on AVX512-VNNI), so a block's row sums
 * need no horizontal adds. The rows' packed 16 bytes are transposed as dwords (half the work of
 * transposing 32 unpacked bytes) and the nibbles split after: dword q's low nibbles are values
 * 4q..4q+3, its high nibbles values 16+4q..16+4q+3. The codes are the unsigned q; the sums start
 * at -8 or -16 times xsum (the code offset), so they are isum. On an interleaved group (il,
 * ks_interleave.h) those dwords, the scales and Q5_0's high bits are each one vector as they lie,
 * and the transpose goes. The float side is the per-block fma of ks_q4.h's contract, in order:
 * bit-identical to the plain twin at both widths and on both layouts. */

/* The unsigned codes c of a block of KS_TW rows from its packed bytes as dwords (d[q] lane i =
 * row i's packed bytes 4q..4q+3) and, Q5_0, its rows' high bits (qh lane i = row i's qh): c[q]
 * lane i = row i's values 4q..4q+3 (the low nibbles c[0..3], the high ones c[4..7]). */
KS_TFN void KS_TN(ks_q4x_split)(const int f, const KS_TI d[4], const KS_TI qh, KS_TI c[8])
{
    const KS_TI low = KS_MM(set1_epi8)(15);
    for (int q = 0; q < 4; q++) {
        c[q] = KS_MMSI(and)(d[q], low);
        c[q + 4] = KS_MMSI(and)(KS_MM(srli_epi16)(d[q], 4), low);
    }
    if (f == KS_Q4X_Q5_0)
        for (int q = 0; q < 4; q++) {
            c[q] = KS_MMSI(or)(c[q], KS_TN(ks_q5_bits)(qh, 4 * q));
            c[q + 4] = KS_MMSI(or)(c[q + 4], KS_TN(ks_q5_bits)(qh, 16 + 4 * q));
        }
}

/* The codes of one block of KS_TW rows as the file lays them out (blk[i], packed bytes at
 * blk[i] + Q). Rows i + 4l share a vector, one per 128-bit lane l, so a 4 x 4 dword transpose
 * in each lane gives ks_q4x_split's dwords for all rows. */
KS_TFN void KS_TN(ks_q4x_codes)(const int f, const uint8_t *const blk[KS_TW], const int Q,
                                KS_TI c[8])
{
    KS_TI r[4], t[4];
    for (int i = 0; i < 4; i++)
        r[i] = KS_TN(ks_load_lanes128)(blk, Q, i);
    t[0] = KS_MM(unpacklo_epi32)(r[0], r[1]);
    t[1] = KS_MM(unpackhi_epi32)(r[0], r[1]);
    t[2] = KS_MM(unpacklo_epi32)(r[2], r[3]);
    t[3] = KS_MM(unpackhi_epi32)(r[2], r[3]);
    const KS_TI d[4] = {KS_MM(unpacklo_epi64)(t[0], t[2]), KS_MM(unpackhi_epi64)(t[0], t[2]),
                        KS_MM(unpacklo_epi64)(t[1], t[3]), KS_MM(unpackhi_epi64)(t[1], t[3])};
    KS_TI qh = KS_MMSI(setzero)();
    if (f == KS_Q4X_Q5_0) {
        int32_t h[KS_TW];
        for (int i = 0; i < KS_TW; i++)
            h[i] = (int32_t)ks_load_u32le(blk[i] + 2);
        qh = KS_MMSI(loadu)((const KS_TI *)h);
    }
    KS_TN(ks_q4x_split)(f, d, qh, c);
}

/* The codes of one block of an interleaved group of KS_TW rows (ks_interleave.h: each field of
 * the rows' blocks side by side, at KS_TW times its offset in one row's block), whose dwords
 * are ks_q4x_split's as they lie. */
KS_TFN void KS_TN(ks_q4x_codes_il)(const int f, const uint8_t *blk, const int Q, KS_TI c[8])
{
    KS_TI d[4];
    for (int q = 0; q < 4; q++)
        d[q] = KS_MMSI(loadu)((const KS_TI *)(blk + KS_TW * (Q + 4 * q)));
    const KS_TI qh = f == KS_Q4X_Q5_0 ? KS_MMSI(loadu)((const KS_TI *)(blk + KS_TW * 2))
                                      : KS_MMSI(setzero)();
    KS_TN(ks_q4x_split)(f, d, qh, c);
}

/* res[j * KS_TW + i] = out value of row i, token j < T (T <= KS_TTOKENS); rows >= rv / tokens
 * >= tv repeat the last valid one. il: w is an interleaved group of KS_TW rows (rows >= rv are
 * its padding), not rows w_stride apart. xs: the tile's first token's block sums, nb per
 * token. pf (or NULL): block b prefetches the pf_step bytes at pf + b * pf_step. */
KS_TFN void KS_TN(ks_q4x_tile)(const int f, const int il, const int T, const uint8_t *w,
                               int64_t w_stride, int rv, const int8_t *x, const float *xd,
                               const int32_t *xs, int tv, int nb, float *res, const uint8_t *pf,
                               int64_t pf_step)
{
    const int B = ks_q4x_block_bytes(f), Q = ks_q4x_qs_offset(f);
    const uint8_t *wp[KS_TW];
    const int8_t *xp[KS_TTOKENS];
    const float *dp[KS_TTOKENS];
    const int32_t *sp[KS_TTOKENS];
    ks_tile_inputs(KS_TW, T, w, w_stride, rv, x, xd, xs, tv, nb, wp, xp, dp, sp);
    KS_TF acc[KS_TTOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = KS_MM(setzero_ps)();
    for (int b = 0; b < nb; b++) {
        KS_TI c[8];
        KS_TF dw, dm = KS_MM(setzero_ps)();
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, KS_PREFETCH_L2);
        if (il) {
            const uint8_t *blk = w + (int64_t)b * KS_TW * B;
            KS_TN(ks_q4x_codes_il)(f, blk, Q, c);
            dw = KS_TN(ks_fp16_vec)(blk);
            if (f == KS_Q4X_Q4_1)
                dm = KS_TN(ks_fp16_vec)(blk + KS_TW * 2);
        } else {
            const uint8_t *blk[KS_TW];
            for (int i = 0; i < KS_TW; i++)
                blk[i] = wp[i] + (int64_t)b * B;
            KS_TN(ks_q4x_codes)(f, blk, Q, c);
            dw = KS_TN(ks_fp16_lanes)(blk, 0);
            if (f == KS_Q4X_Q4_1)
                dm = KS_TN(ks_fp16_lanes)(blk, 2);
        }
        for (int j = 0; j < T; j++) {
            const int8_t *xb = xp[j] + b * KS_QK;
            const KS_TI s = KS_TN(ks_dot_chunks)(               /* codes <= 31, <= 15 */
                KS_MM(set1_epi32)(-ks_q4x_code_offset(f) * sp[j][b]), c, xb, 0, 8,
                f == KS_Q4X_Q5_0 ? 4 : 8);
            const KS_TF dx = KS_MM(set1_ps)(dp[j][b]);
            acc[j] = KS_TN(ks_fmadd)(KS_MM(cvtepi32_ps)(s), KS_MM(mul_ps)(dw, dx), acc[j]);
            if (f == KS_Q4X_Q4_1)
                acc[j] = KS_TN(ks_fmadd)(KS_MM(set1_ps)((float)sp[j][b]), KS_MM(mul_ps)(dm, dx),
                                         acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        KS_MM(storeu_ps)(res + KS_TW * j, acc[j]);
}

/* The product (the contract of the plain twin), on rows as the file lays them out (il 0) or
 * on groups of KS_TW interleaved rows (il 1: r0 a multiple of KS_TW, row r's group at
 * w + r * w_stride): decode in KS_TW x 1 tiles, prefetching the next (taken at 16 rows; AVX2's
 * decode of file rows goes to ks_q4.h's 8 x 1 tile with horizontal sums before it gets here);
 * prefill in tiles of KS_TW rows x up to KS_TTOKENS tokens over blocks of
 * KS_PREFILL_TOKEN_BLOCK tokens (KS_TOKEN_TILES: a few tokens prefetch as decode does). */
KS_TFN void KS_TN(ks_q4x_matmul_rows)(const int f, const int il, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, tblock = n == 1 ? 1 : KS_PREFILL_TOKEN_BLOCK;
    int32_t xs[tblock * nb];
    float res[KS_TW * KS_TTOKENS];
    for (int tb = 0; tb < n; tb += tblock) {
        const int te = tb + tblock < n ? tb + tblock : n;
        ks_q4x_block_sums(x->h + (int64_t)tb * 2 * nb, (int64_t)(te - tb) * nb, xs);
        for (int r = r0; r < r1; r += KS_TW) {
            const int rv = r1 - r < KS_TW ? r1 - r : KS_TW;
            const uint8_t *next = r + KS_TW < m ? w + (int64_t)(r + KS_TW) * w_stride : NULL;
            if (n == 1) {
                KS_TN(ks_q4x_tile)(f, il, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d,
                                   xs, 1, nb, res, next, KS_TW * w_stride / nb);
                ks_q8_store_tile(KS_TW, 1, res, out, m, r, rv, 0, 1);
                continue;
            }
            const uint8_t *pf = n <= KS_PREFETCH_TOKENS ? next : NULL;
#define KS_Q4X_TILE(TT, t, tv, tpf) KS_TN(ks_q4x_tile)(f, il, TT, w + (int64_t)r * w_stride,     \
    w_stride, rv, x->q + (int64_t)(t) * k, x->d + (int64_t)(t) * nb, xs + ((t) - tb) * nb, tv, \
    nb, res, tpf, KS_TW * w_stride / nb)
            KS_T_TOKEN_TILES(KS_Q4X_TILE)
#undef KS_Q4X_TILE
        }
    }
}
