/* Kestrel kernels: the 8-row tiles of Q4_K, Q5_K and Q6_K on AVX2 (no Python here).
 *
 * Included by ks_kquants.h for x86 (all but Q6_K decode; AVX512-VNNI CPUs take the 16-row
 * tiles of ks_kq_tile16.h). A tile is 8 rows x T tokens, lane i of every vector belonging
 * to row i. The rows' 32 code bytes of a block (or block pair; Q6_K's built row by row first)
 * are transposed as 8 x 8 dwords, so that a token's broadcast 4-byte chunk times them adds row
 * i's chunk product into lane i: no horizontal adds, and the codes are unsigned, as maddubs
 * wants them (Q6_K's -32 comes in as -32 * the half-block's sum of x, and its scales go into
 * maddwd's pairwise adds: vpmulld takes the multiply port twice). The float side is
 * ks_kquants.h's contract per block, in order: bit-identical. */

#define KS_KQ_T8_TOKENS 8       /* the unpacked block feeds 8 tokens (spilling, but faster than 4) */

/* res[j * 8 + i] = out value for row i, token j; rows >= rv / tokens >= tv repeat the last
 * valid one. xs: the tokens' block sums (Q4_K, Q5_K); xh[t * 2nb + 2b + h]: the sum of half h
 * of block b (Q6_K). pf: as in ks_kq_tile. */
KS_INLINE void ks_kq_tile_avx2(const int kind, const int T, const uint8_t *w, int64_t w_stride,
                               int rv, const int8_t *x, const float *xd, const float *xs,
                               const int16_t *xh, int tv, int nsb, float *res,
                               const uint8_t *pf, int64_t pf_step)
{
    const int bytes = ks_kq_bytes(kind);
    ks_kq_tile_ptrs P;
    ks_kq_tile_ptrs_of(8, T, w, w_stride, rv, x, xd, xs, xh, tv, nsb * 8, &P);
    const uint8_t *const *wp = P.w;
    const int8_t *const *xp = P.x;
    const float *const *dp = P.xd, *const *sp = P.xs;
    const int16_t *const *hp = P.xh;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[KS_KQ_T8_TOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t off = (int64_t)sb * bytes;
        ks_f8 ds[8], dm[8];
        __m256i sc6[4], qh[8], c[8];
        if (kind == KS_KQ_Q6K) {    /* d, and the 16 int8 scales: dword e / 4, byte e % 4 */
            ds[0] = ks_q6k_lane_scales(8, wp, off);
            ks_transpose8x4_epi32(8, wp, off + 192, sc6);
        } else {
            ks_kq_lane_scales(8, wp, off, ds, dm);
        }
        if (kind == KS_KQ_Q5K)
            ks_load8_transposed(wp, off + 16, qh);
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const int b = sb * 8 + s;
            __m256i codes[8];
            if (pf)
                ks_prefetch_rows(pf + sb * pf_step + s * (pf_step / 8), pf_step / 8,
                                 ks_kq_prefetch_l2(kind));
            __m256i sca, scb, sab;   /* Q6_K: block s's two scales, and the pair of both */
            if (kind == KS_KQ_Q6K) {   /* each row's 32 codes of block s, then transposed */
                __m256i r[8];
                for (int i = 0; i < 8; i++)
                    r[i] = ks_q6k_codes_avx2(wp[i] + off, s);
                ks_transpose8x8_epi32(r, codes);
                /* scales 2s, 2s + 1: bytes 2 (s % 2), +1 of dword s / 2, sign-extended */
                const __m256i sw = sc6[s / 2];
                sca = _mm256_srai_epi32(_mm256_slli_epi32(sw, 24 - 16 * (s % 2)), 24);
                scb = _mm256_srai_epi32(_mm256_slli_epi32(sw, 16 - 16 * (s % 2)), 24);
                /* as int16 pairs: (a, a), (b, b) and (a, b) */
                const __m256i lo = _mm256_set1_epi32(0xffff);
                sab = _mm256_or_si256(_mm256_and_si256(sca, lo), _mm256_slli_epi32(scb, 16));
                sca = _mm256_or_si256(_mm256_and_si256(sca, lo), _mm256_slli_epi32(sca, 16));
                scb = _mm256_or_si256(_mm256_and_si256(scb, lo), _mm256_slli_epi32(scb, 16));
            } else {
                const int qoff = kind == KS_KQ_Q5K ? 48 : 16;
                if (s % 2 == 0)
                    ks_load8_transposed(wp, off + qoff + 16 * s, c);
                for (int q = 0; q < 8; q++) {
                    codes[q] = _mm256_and_si256(s & 1 ? _mm256_srli_epi32(c[q], 4) : c[q], m4);
                    if (kind == KS_KQ_Q5K) {
                        const __m256i hb = s < 4 ? _mm256_slli_epi32(qh[q], 4 - s)
                                                 : _mm256_srli_epi32(qh[q], s - 4);
                        codes[q] = _mm256_or_si256(codes[q], _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
                    }
                }
            }
            for (int j = 0; j < T; j++) {
                const int8_t *xb = xp[j] + b * KS_QK;
                const __m256 dx = _mm256_set1_ps(dp[j][b]);
                if (kind == KS_KQ_Q6K) {
                    /* sca * (q . x) + scb * (...) in the pairwise adds, then the -32 offset as
                     * 32 * (sca * half sum a + scb * half sum b): one more pairwise add */
                    int32_t hh;
                    memcpy(&hh, hp[j] + 2 * b, 4);
                    const __m256i dot = ks_dot_chunks_scaled_avx2(
                        ks_dot_chunks_scaled_avx2(_mm256_setzero_si256(), codes, xb, 0, 4, 2, sca),
                        codes, xb, 4, 8, 2, scb);
                    const __m256i isum = _mm256_sub_epi32(dot, _mm256_slli_epi32(
                        _mm256_madd_epi16(sab, _mm256_set1_epi32(hh)), 5));
                    acc[j] = ks_fmadd_avx2(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ds[0], dx), acc[j]);
                } else {
                    const __m256i isum = ks_dot_chunks_avx2(_mm256_setzero_si256(), codes, xb, 0, 8, 2);
                    acc[j] = ks_fmadd_avx2(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ds[s], dx), acc[j]);
                    acc[j] = ks_fmadd_avx2(_mm256_set1_ps(sp[j][b]), _mm256_mul_ps(dm[s], dx), acc[j]);
                }
            }
        }
    }
    for (int j = 0; j < T; j++)
        _mm256_storeu_ps(res + 8 * j, acc[j]);
}

/* The product (the contract of the plain twin): decode in 8 x 1 tiles (prefetching the
 * next), prefill in 8 x KS_KQ_T8_TOKENS. */
KS_INLINE void ks_kq_matmul_rows_avx2(const int kind, KS_ROWS_PARAMS)
{
    enum { T = KS_KQ_T8_TOKENS };
    const int nb = k / KS_QK, nsb = k / KS_QK_K, tblock = n == 1 ? 1 : KS_PREFILL_TOKEN_BLOCK;
    const int q6 = kind == KS_KQ_Q6K;
    float xs[q6 ? 1 : tblock * nb], res[8 * T];    /* Q4_K, Q5_K: block sums; Q6_K reads xh */
    for (int tb = 0; tb < n; tb += tblock) {
        const int te = tb + tblock < n ? tb + tblock : n;
        if (!q6)
            for (int t = tb; t < te; t++)
                ks_q8_block_sums(xh + (int64_t)t * 2 * nb, nb, xs + (t - tb) * nb);
        for (int r = r0; r < r1; r += 8) {
            const int rv = r1 - r < 8 ? r1 - r : 8;
            if (n == 1) {
                const uint8_t *next = r + 8 < m ? w + (int64_t)(r + 8) * w_stride : NULL;
                ks_kq_tile_avx2(kind, 1, w + (int64_t)r * w_stride, w_stride, rv, xq, xd,
                                q6 ? NULL : xs, q6 ? xh : NULL, 1, nsb, res, next,
                                8 * w_stride / nsb);
                ks_q8_store_tile(8, 1, res, out, m, r, rv, 0, 1);
                continue;
            }
            for (int t = tb; t < te; t += T) {
                const int tv = te - t < T ? te - t : T;
                ks_kq_tile_avx2(kind, T, w + (int64_t)r * w_stride, w_stride, rv,
                                xq + (int64_t)t * k, xd + (int64_t)t * nb,
                                q6 ? NULL : xs + (t - tb) * nb,
                                q6 ? xh + (int64_t)t * 2 * nb : NULL, tv, nsb, res, NULL, 0);
                ks_q8_store_tile(8, T, res, out, m, r, rv, t, tv);
            }
        }
    }
}
