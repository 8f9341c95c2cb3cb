/* Kestrel kernels: the AVX2 prefill tile of Q4_0, Q4_1 and Q5_0 (no Python here; AVX512-VNNI
 * CPUs take the 16-row tile of ks_q4_tile16.h).
 *
 * A tile is 8 rows x KS_Q4_T8_TOKENS tokens with lane i of every vector belonging to row i, as in
 * ks_q8.h's: a broadcast 4-byte chunk of a token times the rows' matching code bytes adds row
 * i's chunk product into lane i, so a block's 8 row sums need no horizontal adds. The packed
 * 16 bytes of the rows are transposed (8 rows x 4 dwords: half the work of transposing 32
 * unpacked bytes), and the nibbles are split after: dword q's low nibbles are values
 * 4q..4q+3, its high nibbles values 16+4q..16+4q+3. The codes are the unsigned q; the sums
 * start at -8 or -16 times xsum (the code offset), so they are isum. The float side is the
 * per-block fma of ks_q4.h's contract, in order: bit-identical to the plain twin. */

#define KS_Q4_T8_TOKENS 8       /* unpacking costs more than Q8_0's transpose: 8 tokens share it
                                 * (though 16 registers do not hold them all) */

/* res[j * 8 + i] = out value of row i, token j; rows and tokens as ks_tile_inputs. xs: the
 * tile's first token's block sums, nb per token. */
KS_INLINE void ks_q4x_tile_avx2(const int f, const uint8_t *w, int64_t w_stride, int rv,
                                const int8_t *x, const float *xd, const int32_t *xs, int tv,
                                int nb, float res[8 * KS_Q4_T8_TOKENS])
{
    enum { T = KS_Q4_T8_TOKENS };
    const int B = ks_q4x_block_bytes(f), Q = ks_q4x_qs_offset(f);
    const uint8_t *wp[8];
    const int8_t *xp[T];
    const float *dp[T];
    const int32_t *sp[T];
    ks_tile_inputs(8, T, w, w_stride, rv, x, xd, xs, tv, nb, wp, xp, dp, sp);
    __m256 acc[T];
    for (int j = 0; j < T; j++)
        acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk[8];
        __m256i c[8];
        uint16_t h[8], hm[8];
        for (int i = 0; i < 8; i++) {
            blk[i] = wp[i] + (int64_t)b * B;
            h[i] = ks_load_u16le(blk[i]);
            hm[i] = f == KS_Q4X_Q4_1 ? ks_load_u16le(blk[i] + 2) : 0;
        }
        ks_q4x_codes8(f, blk, Q, c);
        const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(
            h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
        const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi16(
            hm[0], hm[1], hm[2], hm[3], hm[4], hm[5], hm[6], hm[7]));
        for (int j = 0; j < T; j++) {
            const int8_t *xb = xp[j] + b * KS_QK;
            __m256i s = _mm256_set1_epi32(-ks_q4x_code_offset(f) * sp[j][b]);
            s = ks_dot_chunks_avx2(s, c, xb, 0, 8, f == KS_Q4X_Q5_0 ? 4 : 8);   /* codes <= 31, <= 15 */
            const __m256 dx = _mm256_set1_ps(dp[j][b]);
            acc[j] = ks_fmadd_avx2(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[j]);
            if (f == KS_Q4X_Q4_1)
                acc[j] = ks_fmadd_avx2(_mm256_set1_ps((float)sp[j][b]), _mm256_mul_ps(dm, dx),
                                       acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        _mm256_storeu_ps(res + 8 * j, acc[j]);
}

/* The product for n > 1 (the contract of the plain twin), in tiles of 8 rows x T tokens over
 * blocks of KS_PREFILL_TOKEN_BLOCK tokens. */
KS_INLINE void ks_q4x_matmul_rows_avx2(const int f, KS_ROWS_PARAMS)
{
    enum { T = KS_Q4_T8_TOKENS };
    const int nb = k / KS_QK;
    int32_t xs[KS_PREFILL_TOKEN_BLOCK * nb];
    float res[8 * T];
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        ks_q4x_block_sums(xh + (int64_t)tb * 2 * nb, (int64_t)(te - tb) * nb, xs);
        for (int r = r0; r < r1; r += 8) {
            const int rv = r1 - r < 8 ? r1 - r : 8;
            for (int t = tb; t < te; t += T) {
                const int tv = te - t < T ? te - t : T;
                ks_q4x_tile_avx2(f, w + (int64_t)r * w_stride, w_stride, rv,
                                 xq + (int64_t)t * k, xd + (int64_t)t * nb, xs + (t - tb) * nb,
                                 tv, nb, res);
                ks_q8_store_tile(8, T, res, out, m, r, rv, t, tv);
            }
        }
    }
}
