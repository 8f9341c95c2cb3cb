/* Kestrel kernels: the 16-row prefill tile of Q4_0, Q4_1 and Q5_0 on AVX512-VNNI (no Python
 * here).
 *
 * ks_q4_tile8.h's tile in 512-bit vectors, lane i belonging to row i < 16: the 16 packed bytes
 * of rows i, i + 4, i + 8 and i + 12 share a vector (one per 128-bit lane), so the 4 x 4 dword
 * transpose of each lane puts every row's dword q in its own lane, and a token's broadcast
 * chunk meets 16 rows in one vpdpbusd. The float side is the per-block fma of ks_q4.h's
 * contract, in order: bit-identical to the plain twin. Included by ks_q4.h where KS_HAVE_VNNI
 * is defined. */

/* Lane i's 4 bytes = 16 where bits s..s+3 of lane i's qh are set (ks_q5_bits8 on 16 lanes) */
KS_VNNI_FN __m512i ks_q5_bits16(__m512i qh, const int s)
{
    const char o = (char)(s / 8);
    const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_broadcast_i32x4(_mm_setr_epi8(
        o, o, o, o, 4 + o, 4 + o, 4 + o, 4 + o, 8 + o, 8 + o, 8 + o, 8 + o,
        12 + o, 12 + o, 12 + o, 12 + o)));
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201 << (s % 8))),
                                 _mm512_set1_epi8(16));
}

/* The unsigned codes of one block of 16 rows (blk[i], packed bytes at blk[i] + Q): c[q] lane i
 * = row i's values 4q..4q+3 (the low nibbles c[0..3], the high ones c[4..7]). */
KS_VNNI_FN void ks_q4x_codes16(const int f, const uint8_t *const blk[16], const int Q, __m512i c[8])
{
    const __m512i low = _mm512_set1_epi8(15);
    __m512i r[4], t[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk[i] + Q)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk[i + 4] + Q)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk[i + 8] + Q)), 2);
        r[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk[i + 12] + Q)), 3);
    }
    t[0] = _mm512_unpacklo_epi32(r[0], r[1]);
    t[1] = _mm512_unpackhi_epi32(r[0], r[1]);
    t[2] = _mm512_unpacklo_epi32(r[2], r[3]);
    t[3] = _mm512_unpackhi_epi32(r[2], r[3]);
    const __m512i d[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                          _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
    for (int q = 0; q < 4; q++) {
        c[q] = _mm512_and_si512(d[q], low);
        c[q + 4] = _mm512_and_si512(_mm512_srli_epi16(d[q], 4), low);
    }
    if (f == KS_Q4X_Q5_0) {
        int32_t h[16];
        for (int i = 0; i < 16; i++)
            h[i] = (int32_t)ks_load_u32le(blk[i] + 2);
        const __m512i qh = _mm512_loadu_si512(h);
        for (int q = 0; q < 4; q++) {
            c[q] = _mm512_or_si512(c[q], ks_q5_bits16(qh, 4 * q));
            c[q + 4] = _mm512_or_si512(c[q + 4], ks_q5_bits16(qh, 16 + 4 * q));
        }
    }
}

/* res[j * 16 + i] = out value of row i, token j < T (KS_VNNI_TOKENS or _WIDE); rows >= rv /
 * tokens >= tv repeat the last valid one. xs: the tile's first token's block sums, nb per
 * token. */
KS_VNNI_FN void ks_q4x_tile16_vnni(const int f, const int T, const uint8_t *w, int64_t w_stride,
                                   int rv, const int8_t *x, const float *xd, const int32_t *xs,
                                   int tv, int nb, float *res)
{
    const int B = ks_q4x_block_bytes(f), Q = ks_q4x_qs_offset(f);
    const uint8_t *wp[16];
    const int8_t *xp[KS_VNNI_TOKENS_WIDE];
    const float *dp[KS_VNNI_TOKENS_WIDE];
    const int32_t *sp[KS_VNNI_TOKENS_WIDE];
    ks_tile_inputs(16, T, w, w_stride, rv, x, xd, xs, tv, nb, wp, xp, dp, sp);
    __m512 acc[KS_VNNI_TOKENS_WIDE];
    for (int j = 0; j < T; j++)
        acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk[16];
        __m512i c[8];
        for (int i = 0; i < 16; i++)
            blk[i] = wp[i] + (int64_t)b * B;
        ks_q4x_codes16(f, blk, Q, c);
        const __m512 dw = ks_fp16_lanes16(blk, 0);
        const __m512 dm = f == KS_Q4X_Q4_1 ? ks_fp16_lanes16(blk, 2) : _mm512_setzero_ps();
        for (int j = 0; j < T; j++) {
            const int8_t *xb = xp[j] + b * KS_QK;
            const __m512i s = ks_dot_chunks_vnni16(
                _mm512_set1_epi32(-ks_q4x_code_offset(f) * sp[j][b]), c, xb, 0, 8);
            const __m512 dx = _mm512_set1_ps(dp[j][b]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[j]);
            if (f == KS_Q4X_Q4_1)
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps((float)sp[j][b]), _mm512_mul_ps(dm, dx),
                                         acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        _mm512_storeu_ps(res + 16 * j, acc[j]);
}

/* The product for n > 1 (the contract of the plain twin), in tiles of 16 rows x
 * KS_VNNI_TOKENS_WIDE or KS_VNNI_TOKENS tokens over blocks of KS_PREFILL_TOKEN_BLOCK tokens. */
KS_VNNI_FN void ks_q4x_matmul_rows_vnni(const int f, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK;
    int32_t xs[KS_PREFILL_TOKEN_BLOCK * nb];
    float res[16 * KS_VNNI_TOKENS_WIDE];
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        ks_q4x_block_sums(xh + (int64_t)tb * 2 * nb, (int64_t)(te - tb) * nb, xs);
        for (int r = r0; r < r1; r += 16) {
            const int rv = r1 - r < 16 ? r1 - r : 16;
#define KS_Q4X_TILE16(TT, t, tv) ks_q4x_tile16_vnni(f, TT, w + (int64_t)r * w_stride, w_stride, \
    rv, xq + (int64_t)(t) * k, xd + (int64_t)(t) * nb, xs + ((t) - tb) * nb, tv, nb, res)
            KS_VNNI16_TOKEN_TILES(KS_Q4X_TILE16)
#undef KS_Q4X_TILE16
        }
    }
}
