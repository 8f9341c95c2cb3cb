/* Kestrel kernels: attention scores, an int8 query against the int8 keys (no Python here).
 *
 * The query is quantized twice over (ks_attn_quantize_query): its scale s = absmax / 127, its
 * codes hi = round(x / s) as a key's, and the rest lo = round((x / s - hi) * KS_ATTN_QLO), so
 * x = s * (hi + lo / KS_ATTN_QLO) to 15 bits: the keys' 8 bits set the scores' precision, the
 * query adds next to nothing (with hi alone, the query's rounding doubled the scores' error and
 * flipped near-tied greedy tokens). A score before the key's scale is then
 *     sc = (float)isum * qd,    isum = KS_ATTN_QLO * (hi . k8) + lo . k8,    qd = s / KS_ATTN_QLO
 * with the dot products exact int32 sums (|isum| <= 255 * hd * 127 * 127 < 2^31 for every head
 * size here). Integers add in any order: every path below gives the same bits however it
 * groups the products, and the float of isum (rounded to nearest above 2^24, on every path) and
 * its product with qd are the only roundings. Byte dot products are what make this fast: a
 * float score cost hd multiply-adds, a conversion of every key to float and a horizontal sum;
 * here it is 2 x hd / 4 byte dot products (the softmax and the values stay float,
 * ks_attn_core.h).
 *
 *   plain C       one key at a time
 *   AVX2          |k| times q with k's sign (maddubs wants one unsigned operand; the products
 *                 are <= 127 * 127, so its pair sums fit 16 bits), madd to int32, 8 keys
 *                 summed across lanes at once
 *   NEON          sdot where the CPU has it (A76), else widening multiplies; 4 keys at once,
 *                 their rows loaded once for every query of the tile
 *   AVX512-VNNI   keys in lanes (ks_attn_keys_t16): a block's keys are transposed once, 16
 *                 keys a vector and 4 bytes of a key a lane, and every query of the work item
 *                 uses them, so 16 scores take 2 x hd / 4 vpdpbusd and no horizontal sums.
 *                 vpdpbusd multiplies unsigned by signed bytes: the keys are stored + 128
 *                 (xor 0x80) and each sum starts at -128 times the sum of the query's codes.
 */
#ifndef KS_ATTN_SCORES_H
#define KS_ATTN_SCORES_H

#include "ks_common.h"
#include "ks_q8.h"          /* KS_HAVE_VNNI, KS_VNNI_FN */

#define KS_ATTN_QLO 254             /* steps of a query's rest (lo) per step of its codes (hi) */

/* x (hd, a multiple of 8) -> the query's codes q8 (2 hd: hi, then lo) and qsum (2: the sums of
 * hi and of lo); returns qd = s / KS_ATTN_QLO (0 for a zero query). Division, then a
 * difference, then a product: no step a compiler may fuse, so every target rounds alike. */
static inline float ks_attn_quantize_query(const float *restrict x, int8_t *restrict q8, int hd,
                                           int32_t *restrict qsum)
{
    const float s = ks_absmax(x, hd) / 127.0f;
    if (s == 0.0f) {
        memset(q8, 0, 2 * (size_t)hd);
        qsum[0] = qsum[1] = 0;
        return 0.0f;
    }
    for (int d = 0; d < hd; d += 8) {
        const ks_v8 v = ks_v8_load(x + d) / s;
        float hi[8];
        ks_v8_round_i8(v, q8 + d);
        ks_f32_of_i8(hi, q8 + d, 8);
        ks_v8_round_i8((v - ks_v8_load(hi)) * (float)KS_ATTN_QLO, q8 + hd + d);
    }
    int32_t shi = 0, slo = 0;
    for (int d = 0; d < hd; d++) {
        shi += q8[d];
        slo += q8[hd + d];
    }
    qsum[0] = shi;
    qsum[1] = slo;
    return s / (float)KS_ATTN_QLO;
}

/* The exact sum of a[d] * b[d] over d < n */
static inline int32_t ks_dot_i8_plain(const int8_t *restrict a, const int8_t *restrict b, int n)
{
    int32_t s = 0;
    for (int d = 0; d < n; d++)
        s += (int32_t)a[d] * b[d];
    return s;
}

#if defined(KS_AVX2)
/* the 8 int32 lanes of p[i] summed, as lane i */
static inline __m256i ks_hsum8_epi32(const __m256i p[8])
{
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                         _mm256_hadd_epi32(p[2], p[3]));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]),
                                         _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* n <= 32 bytes at p (n 16 or 32), zero above */
static inline __m256i ks_load_i8x32(const int8_t *p, int n)
{
    return n == 32 ? _mm256_loadu_si256((const __m256i *)p)
                   : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
}
#endif

/* The exact isum of a query's codes q (2 hd: hi, lo) with key k (hd) */
static inline int32_t ks_attn_isum_plain(const int8_t *restrict q, const int8_t *restrict k,
                                         int hd)
{
    return KS_ATTN_QLO * ks_dot_i8_plain(q, k, hd) + ks_dot_i8_plain(q + hd, k, hd);
}

#if defined(KS_NEON) || defined(KS_NEON_DOT)
/* acc + the 16 products a . b, 4 to a lane: sdot, or widening multiplies (two products a
 * 16-bit lane: <= 2 * 127 * 127 fits) */
static inline int32x4_t ks_attn_dot16_neon(int32x4_t acc, int8x16_t a, int8x16_t b)
{
#if defined(KS_NEON_DOT)
    return vdotq_s32(acc, a, b);
#else
    return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b));
#endif
}

/* part[u][h] lane kk += the dot product of query u's codes h (hi, lo) with key kk over NC
 * 16-byte chunks: 4 keys' rows at k (rows hd apart), the queries' at q (2 hd apart per code
 * set). The keys' chunks are loaded once for every query and code set. */
static inline __attribute__((always_inline))
void ks_attn_iscores4_neon(const int QB, const int NC, const int8_t *restrict q,
                           const int8_t *restrict k, int hd, int32x4_t part[][2])
{
    int8x16_t kv[4][4];
    for (int kk = 0; kk < 4; kk++)
        for (int c = 0; c < NC; c++)
            kv[kk][c] = vld1q_s8(k + (int64_t)kk * hd + 16 * c);
    for (int u = 0; u < QB; u++)
        for (int h = 0; h < 2; h++) {
            const int8_t *qr = q + (int64_t)(2 * u + h) * hd;
            int32x4_t p[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int c = 0; c < NC; c++) {
                const int8x16_t qv = vld1q_s8(qr + 16 * c);
                for (int kk = 0; kk < 4; kk++)
                    p[kk] = ks_attn_dot16_neon(p[kk], kv[kk][c], qv);
            }
            part[u][h] = vaddq_s32(part[u][h],
                                   vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3])));
        }
}
#endif

/* sc[u * sc_stride + j] = (float)isum(q_u, k_j) * qd[u] for the QB queries' codes q8 (QB,
 * 2 hd) and the key rows j < n of k (n, hd); hd a multiple of 16. Reads no key row past n. */
static inline __attribute__((always_inline))
void ks_attn_scores_rows(const int QB, const int8_t *restrict q8, const float *restrict qd,
                         const int8_t *restrict k, int hd, int n, float *restrict sc,
                         int sc_stride)
{
    int j = 0;
#if defined(KS_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    for (; j + 8 <= n; j += 8)
        for (int u = 0; u < QB; u++) {
            __m256i part[2];
            for (int h = 0; h < 2; h++) {               /* hi, then lo */
                const int8_t *qr = q8 + (int64_t)(2 * u + h) * hd;
                __m256i p[8];
                for (int kk = 0; kk < 8; kk++) {
                    const int8_t *kr = k + (int64_t)(j + kk) * hd;
                    p[kk] = _mm256_setzero_si256();
                    for (int d = 0; d < hd; d += 32) {
                        const int w = hd - d < 32 ? hd - d : 32;
                        const __m256i kv = ks_load_i8x32(kr + d, w);
                        const __m256i qv = ks_load_i8x32(qr + d, w);
                        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(kv, kv),
                                                                   _mm256_sign_epi8(qv, kv));
                        p[kk] = _mm256_add_epi32(p[kk], _mm256_madd_epi16(pairs, ones));
                    }
                }
                part[h] = ks_hsum8_epi32(p);
            }
            const __m256i isum = _mm256_add_epi32(
                _mm256_mullo_epi32(part[0], _mm256_set1_epi32(KS_ATTN_QLO)), part[1]);
            _mm256_storeu_ps(sc + (int64_t)u * sc_stride + j,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(qd[u])));
        }
#elif defined(KS_NEON) || defined(KS_NEON_DOT)
    for (; j + 4 <= n; j += 4) {
        int32x4_t part[4][2];                       /* QB <= 4 */
        for (int u = 0; u < QB; u++)
            part[u][0] = part[u][1] = vdupq_n_s32(0);
        for (int d0 = 0; d0 < hd; d0 += 64) {       /* 64 dims: 4 keys' chunks in 16 registers */
            const int8_t *k0 = k + (int64_t)j * hd + d0, *q0 = q8 + d0;
            switch (hd - d0 < 64 ? (hd - d0) / 16 : 4) {
            case 1: ks_attn_iscores4_neon(QB, 1, q0, k0, hd, part); break;
            case 2: ks_attn_iscores4_neon(QB, 2, q0, k0, hd, part); break;
            case 3: ks_attn_iscores4_neon(QB, 3, q0, k0, hd, part); break;
            default: ks_attn_iscores4_neon(QB, 4, q0, k0, hd, part); break;
            }
        }
        for (int u = 0; u < QB; u++) {
            const int32x4_t isum = vmlaq_n_s32(part[u][1], part[u][0], KS_ATTN_QLO);
            vst1q_f32(sc + (int64_t)u * sc_stride + j,
                      vmulq_f32(vcvtq_f32_s32(isum), vdupq_n_f32(qd[u])));
        }
    }
#endif
    for (; j < n; j++)
        for (int u = 0; u < QB; u++)
            sc[(int64_t)u * sc_stride + j] =
                (float)ks_attn_isum_plain(q8 + (int64_t)2 * u * hd, k + (int64_t)j * hd, hd)
                * qd[u];
}

#if defined(KS_HAVE_VNNI)
/* Whether ks_attn_keys_t16 / ks_attn_scores_t16 take a head size (else the rows above do) */
static inline int ks_attn_t16_fits(int hd) { return hd % 64 == 0; }

/* kt = the keys j < nj of k (nj, hd) transposed for ks_attn_scores_t16, in strips of 16 keys
 * (rows past nj zero): strip s's dword group g (key bytes 4g .. 4g + 3) is the 64 bytes at
 * kt + s * 16 * hd + 64 * g, lane i key 16 s + i, each byte + 128. hd a multiple of 64: 16
 * rows' 64-byte chunks are one 16 x 16 dword transpose. */
KS_VNNI_FN void ks_attn_keys_t16(int8_t *restrict kt, const int8_t *restrict k, int hd, int nj)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int s = 0; s * 16 < nj; s++) {
        int8_t *o = kt + (int64_t)s * 16 * hd;
        for (int c = 0; c < hd; c += 64) {
            __m512i r[16], t[16];
            for (int i = 0; i < 16; i++)
                r[i] = s * 16 + i < nj
                     ? _mm512_loadu_si512(k + (int64_t)(s * 16 + i) * hd + c)
                     : _mm512_setzero_si512();
            /* in each 128-bit lane L: t[4a + e] = dword 4 L + e of rows 4a .. 4a + 3 */
            for (int a = 0; a < 8; a++) {
                t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
                t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
            }
            for (int a = 0; a < 4; a++) {
                r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
                r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
                r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
                r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
            }
            /* lane L of r[e], r[4 + e], r[8 + e], r[12 + e] side by side: group c / 4 + 4 L + e */
            for (int e = 0; e < 4; e++) {
                const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
                const __m512i x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
                const __m512i x2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
                const __m512i x3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
                const __m512i w[4] = {_mm512_shuffle_i32x4(x0, x2, 0x88),
                                      _mm512_shuffle_i32x4(x0, x2, 0xDD),
                                      _mm512_shuffle_i32x4(x1, x3, 0x88),
                                      _mm512_shuffle_i32x4(x1, x3, 0xDD)};
                for (int L = 0; L < 4; L++)
                    _mm512_storeu_si512(o + 64 * (c / 4 + 4 * L + e), _mm512_xor_si512(w[L], flip));
            }
        }
    }
}

/* ks_attn_scores_rows' scores from kt (ks_attn_keys_t16) for keys j < n, n a multiple of 16;
 * qsum (QB, 2): the sums of each query's hi and lo codes. Two strips at a time where there are
 * two: 2 x 2 x QB independent sums hide vpdpbusd's latency. */
KS_VNNI_FN void ks_attn_scores_t16(const int QB, const int8_t *restrict q8,
                                   const float *restrict qd, const int32_t *restrict qsum,
                                   const int8_t *restrict kt, int hd, int n, float *restrict sc,
                                   int sc_stride)
{
    for (int j = 0; j < n;) {
        const int ns = j + 32 <= n ? 2 : 1;
        __m512i acc[2][4][2];
        for (int s = 0; s < ns; s++)
            for (int u = 0; u < QB; u++)
                for (int h = 0; h < 2; h++)
                    acc[s][u][h] = _mm512_set1_epi32(-128 * qsum[2 * u + h]);
        for (int g = 0; g < hd / 4; g++) {
            __m512i qv[4][2];
            for (int u = 0; u < QB; u++)
                for (int h = 0; h < 2; h++) {
                    int32_t q4;
                    memcpy(&q4, q8 + (int64_t)(2 * u + h) * hd + 4 * g, 4);
                    qv[u][h] = _mm512_set1_epi32(q4);
                }
            for (int s = 0; s < ns; s++) {
                const __m512i kv = _mm512_loadu_si512(kt + (int64_t)(j + 16 * s) * hd + 64 * g);
                for (int u = 0; u < QB; u++)
                    for (int h = 0; h < 2; h++)
                        acc[s][u][h] = _mm512_dpbusd_epi32(acc[s][u][h], kv, qv[u][h]);
            }
        }
        for (int s = 0; s < ns; s++)
            for (int u = 0; u < QB; u++) {
                const __m512i isum = _mm512_add_epi32(
                    _mm512_mullo_epi32(acc[s][u][0], _mm512_set1_epi32(KS_ATTN_QLO)),
                    acc[s][u][1]);
                _mm512_storeu_ps(sc + (int64_t)u * sc_stride + j + 16 * s,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(qd[u])));
            }
        j += 16 * ns;
    }
}
#endif

#endif /* KS_ATTN_SCORES_H */
