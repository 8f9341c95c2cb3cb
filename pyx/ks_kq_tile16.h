/* Kestrel kernels: the 16-row prefill tiles of Q4_K, Q5_K and Q6_K on AVX512-VNNI (no Python
 * here).
 *
 * ks_kq_tile8.h's tile in 512-bit vectors: lane i < 8 belongs to row i and lane 8 + i to row
 * 8 + i, each 256-bit half laid out as the 8-row tile's. The rows' code bytes are loaded two
 * rows to a vector and transposed for both halves at once (ks_transpose16x8_epi32), so a
 * token's broadcast chunk meets 16 rows in one vpdpbusd, and the unpacking, the scales and
 * the float epilogue are spent once per 16 rows. The float side is ks_kquants.h's contract
 * per block, in order: bit-identical to the plain twin. Included by ks_kquants.h where
 * KS_HAVE_VNNI is defined. */

/* a float vector from two 8-lane halves (rows 0-7, rows 8-15) */
KS_VNNI_FN __m512 ks_join16_ps(__m256 lo, __m256 hi)
{
    return _mm512_castsi512_ps(ks_join16(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}

/* Block s (activation block b) of the superblock at off of a tile: its 16 rows' codes, then
 * every token's products and epilogue into acc. ds, dm, sc6, qh: the superblock's per-lane
 * scales and fifth bits; c: Q4_K / Q5_K's transposed code bytes of the block pair, loaded at
 * its even block. */
KS_VNNI_FN void ks_kq_block16_vnni(const int kind, const int T, const int s, int b, int64_t off,
                                   const uint8_t *const wp[16], const int8_t *const xp[],
                                   const float *const dp[], const float *const sp[],
                                   const int16_t *const hp[], const __m512 ds[8],
                                   const __m512 dm[8], const __m512i sc6[4],
                                   const __m512i qh[8], __m512i c[8], __m512 acc[])
{
    __m512i codes[8], sca, scb;
    if (kind == KS_KQ_Q6K) {   /* each row's 32 codes of block s, then transposed */
        __m512i r[8];
        for (int i = 0; i < 8; i++)
            r[i] = ks_join16(ks_q6k_codes_avx2(wp[i] + off, s), ks_q6k_codes_avx2(wp[i + 8] + off, s));
        ks_transpose16x8_epi32(r, codes);
        /* scales 2s, 2s + 1: bytes 2 (s % 2), +1 of dword s / 2, sign-extended */
        const __m512i sw = sc6[s / 2];
        sca = _mm512_srai_epi32(_mm512_slli_epi32(sw, 24 - 16 * (s % 2)), 24);
        scb = _mm512_srai_epi32(_mm512_slli_epi32(sw, 16 - 16 * (s % 2)), 24);
    } else {
        if (s % 2 == 0)
            ks_load16_transposed(wp, off + (kind == KS_KQ_Q5K ? 48 : 16) + 16 * s, c);
        for (int q = 0; q < 8; q++) {
            codes[q] = _mm512_and_si512(s & 1 ? _mm512_srli_epi32(c[q], 4) : c[q], _mm512_set1_epi8(0x0F));
            if (kind == KS_KQ_Q5K) {
                const __m512i hb = s < 4 ? _mm512_slli_epi32(qh[q], 4 - s) : _mm512_srli_epi32(qh[q], s - 4);
                codes[q] = _mm512_or_si512(codes[q], _mm512_and_si512(hb, _mm512_set1_epi8(0x10)));
            }
        }
    }
    for (int j = 0; j < T; j++) {
        const int8_t *xb = xp[j] + b * KS_QK;
        const __m512 dx = _mm512_set1_ps(dp[j][b]);
        if (kind == KS_KQ_Q6K) {
            const __m512i sa = ks_dot_chunks_vnni16(_mm512_set1_epi32(-32 * hp[j][2 * b]), codes, xb, 0, 4);
            const __m512i sbh = ks_dot_chunks_vnni16(_mm512_set1_epi32(-32 * hp[j][2 * b + 1]), codes, xb, 4, 8);
            const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(sa, sca), _mm512_mullo_epi32(sbh, scb));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds[0], dx), acc[j]);
        } else {
            const __m512i isum = ks_dot_chunks_vnni16(_mm512_setzero_si512(), codes, xb, 0, 8);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds[s], dx), acc[j]);
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(sp[j][b]), _mm512_mul_ps(dm[s], dx), acc[j]);
        }
    }
}

/* res[j * 16 + i] = out value for row i, token j < T (a KS_VNNI_TOKENS* constant); rows >= rv /
 * tokens >= tv repeat the last valid one. xs, xh: as in ks_kq_tile8.h. */
KS_VNNI_FN void ks_kq_tile16_vnni(const int kind, const int T, const uint8_t *w, int64_t w_stride,
                                  int rv, const int8_t *x, const float *xd, const float *xs,
                                  const int16_t *xh, int tv, int nsb, float *res)
{
    const int bytes = ks_kq_bytes(kind), nb = nsb * 8;
    const uint8_t *wp[16];
    const int8_t *xp[KS_VNNI_TOKENS_WIDE];
    const float *dp[KS_VNNI_TOKENS_WIDE], *sp[KS_VNNI_TOKENS_WIDE];
    const int16_t *hp[KS_VNNI_TOKENS_WIDE];
    ks_tile_inputs(16, T, w, w_stride, rv, x, xd, NULL, tv, nb, wp, xp, dp, NULL);
    for (int j = 0; j < T; j++) {     /* the sums each type needs */
        const int64_t jt = j < tv ? j : tv - 1;
        sp[j] = xs ? xs + jt * nb : NULL;
        hp[j] = xh ? xh + jt * 2 * nb : NULL;
    }
    __m512 acc[KS_VNNI_TOKENS_WIDE];
    for (int j = 0; j < T; j++)
        acc[j] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t off = (int64_t)sb * bytes;
        __m512 ds[8], dm[8];
        __m512i sc6[4], qh[8], c[8];
        if (kind == KS_KQ_Q6K) {    /* d, and the 16 int8 scales: dword e / 4, byte e % 4 */
            ds[0] = ks_join16_ps(ks_q6k_lane_scales(8, wp, off), ks_q6k_lane_scales(8, wp + 8, off));
            __m256i lo[4], hi[4];
            ks_transpose8x4_epi32(8, wp, off + 192, lo);
            ks_transpose8x4_epi32(8, wp + 8, off + 192, hi);
            for (int e = 0; e < 4; e++)
                sc6[e] = ks_join16(lo[e], hi[e]);
        } else {
            ks_f8 dsl[8], dml[8], dsh[8], dmh[8];
            ks_kq_lane_scales(8, wp, off, dsl, dml);
            ks_kq_lane_scales(8, wp + 8, off, dsh, dmh);
            for (int s = 0; s < 8; s++) {
                ds[s] = ks_join16_ps(dsl[s], dsh[s]);
                dm[s] = ks_join16_ps(dml[s], dmh[s]);
            }
        }
        if (kind == KS_KQ_Q5K)
            ks_load16_transposed(wp, off + 16, qh);
        /* Q6_K's blocks fully unrolled (its code building has constants for each); the others
         * by pairs (the two nibbles of one code byte), which keeps the loop small enough for
         * the decoded-instruction cache (measured faster than unrolling all 8) */
        if (kind == KS_KQ_Q6K) {
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++)
                ks_kq_block16_vnni(kind, T, s, sb * 8 + s, off, wp, xp, dp, sp, hp, ds, dm, sc6,
                                   qh, c, acc);
        } else {
#pragma GCC unroll 1
            for (int pr = 0; pr < 4; pr++)
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++)
                    ks_kq_block16_vnni(kind, T, 2 * pr + hh, sb * 8 + 2 * pr + hh, off, wp, xp,
                                       dp, sp, hp, ds, dm, sc6, qh, c, acc);
        }
    }
    for (int j = 0; j < T; j++)
        _mm512_storeu_ps(res + 16 * j, acc[j]);
}

/* The product for n > 1 (the contract of the plain twin), in tiles of 16 rows x
 * KS_VNNI_TOKENS_WIDE or KS_VNNI_TOKENS tokens over blocks of KS_PREFILL_TOKEN_BLOCK tokens. */
KS_VNNI_FN void ks_kq_matmul_rows_vnni(const int kind, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, nsb = k / KS_QK_K, q6 = kind == KS_KQ_Q6K;
    /* Q4_K, Q5_K: the block sums of a token block; Q6_K reads xh */
    float xs[q6 ? 1 : KS_PREFILL_TOKEN_BLOCK * nb], res[16 * KS_VNNI_TOKENS_WIDE];
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        if (!q6)
            for (int t = tb; t < te; t++)
                ks_q8_block_sums(xh + (int64_t)t * 2 * nb, nb, xs + (t - tb) * nb);
        for (int r = r0; r < r1; r += 16) {
            const int rv = r1 - r < 16 ? r1 - r : 16;
#define KS_KQ_TILE16(TT, t, tv) ks_kq_tile16_vnni(kind, TT, w + (int64_t)r * w_stride, w_stride, \
    rv, xq + (int64_t)(t) * k, xd + (int64_t)(t) * nb, q6 ? NULL : xs + ((t) - tb) * nb,      \
    q6 ? xh + (int64_t)(t) * 2 * nb : NULL, tv, nsb, res)
            KS_VNNI16_TOKEN_TILES(KS_KQ_TILE16)
#undef KS_KQ_TILE16
        }
    }
}
