/* Kestrel kernels: Q4_0, Q4_1 and Q5_0 weights x Q8_0 activations (no Python here).
 *
 * GGML's three 32-value low-bit types (ggml-common.h, gguf-py's quants.py); d and m are fp16,
 * little endian, and every block holds 32 values:
 *     Q4_0  18 bytes: d, qs[16]           w = d * (q - 8)
 *     Q4_1  20 bytes: d, m, qs[16]        w = d * q + m
 *     Q5_0  22 bytes: d, qh[4], qs[16]    w = d * (q - 16)
 * The low 4 bits of value j < 16 are qs[j] & 15, those of value j + 16 are qs[j] >> 4; Q5_0's
 * bit 4 of value j is bit j of qh read as a little-endian uint32.
 *
 * Each weight's integer code is c = q - 8 (Q4_0), q (Q4_1), q - 16 (Q5_0). The product, for
 * output row r and token t (activations: Q8_0 rows xq, float scales xd, see ks_q8.h):
 *     acc = 0.0f; for each block b, in order:
 *         acc = fma((float)isum, d * xd[t, b], acc)        isum = exact int32 sum of c * xq
 *         Q4_1: acc = fma((float)xsum, m * xd[t, b], acc)  xsum = exact int32 sum of the 32 xq
 * with d * xd and m * xd float products and fma KS_FMADD. Every path computes exactly these
 * float operations in this order, so the SIMD paths equal the plain one bit for bit. They differ
 * only in how the exact isum comes out and in how many (row, token) pairs go at once:
 *     plain C and NEON: the signed codes times xq (sdot, or widening multiplies without it);
 *     AVX2 and AVX512-VNNI: maddubs / vpdpbusd want one unsigned operand, so they multiply q
 *     itself and subtract 8 * xsum (Q4_0) or 16 * xsum (Q5_0), exact in int32.
 * |isum| <= 32 * 16 * 127 and |xsum| <= 32 * 127, so both convert to float exactly.
 *
 * The three types share every function here (ks_q4x_*, the format a compile-time constant);
 * ks_weights.h's table holds the per-type entry points at the end of this file.
 */
#ifndef KS_Q4_H
#define KS_Q4_H

#include "ks_common.h"
#include "ks_q8.h"

enum { KS_Q4X_Q4_0, KS_Q4X_Q4_1, KS_Q4X_Q5_0 };   /* the format argument of ks_q4x_* */

static inline int ks_q4x_block_bytes(int f) { return f == KS_Q4X_Q4_0 ? 18 : f == KS_Q4X_Q4_1 ? 20 : 22; }
static inline int ks_q4x_qs_offset(int f) { return f == KS_Q4X_Q4_0 ? 2 : f == KS_Q4X_Q4_1 ? 4 : 6; }
static inline int ks_q4x_code_offset(int f) { return f == KS_Q4X_Q4_0 ? 8 : f == KS_Q4X_Q4_1 ? 0 : 16; }

static inline uint32_t ks_load_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 32 integer codes c of one block, in value order. */
static inline void ks_q4x_codes(int f, const uint8_t *restrict blk, int8_t c[KS_QK])
{
    const uint8_t *qs = blk + ks_q4x_qs_offset(f);
    const uint32_t qh = f == KS_Q4X_Q5_0 ? ks_load_u32le(blk + 2) : 0;
    const int off = ks_q4x_code_offset(f);
    for (int j = 0; j < KS_QK / 2; j++) {
        c[j] = (int8_t)(((qs[j] & 15) | ((qh >> j) & 1) << 4) - off);
        c[j + 16] = (int8_t)(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off);
    }
}

/* xs[i] = the exact sum of the 32 codes of activation block i, for nblocks consecutive
 * blocks, from their half sums xh (ks_quantize_row_q8_0's). */
static inline void ks_q4x_block_sums(const int16_t *restrict xh, int64_t nblocks,
                                     int32_t *restrict xs)
{
    for (int64_t i = 0; i < nblocks; i++)
        xs[i] = ks_q8_block_sum(xh, i);
}

/* One row (k values) -> float: d * c, or for Q4_1 (d * q) + m rounded twice as gguf-py does
 * (the product is formed in double, where it is exact, so no compiler fuses it with the add). */
static inline void ks_q4x_dequant_row(int f, const uint8_t *restrict row, float *restrict out,
                                      int k)
{
    int8_t c[KS_QK];
    for (int b = 0; b < k / KS_QK; b++) {
        const uint8_t *blk = row + (int64_t)b * ks_q4x_block_bytes(f);
        const float d = ks_fp16_to_f32(ks_load_u16le(blk));
        float *o = out + (int64_t)b * KS_QK;
        ks_q4x_codes(f, blk, c);
        if (f == KS_Q4X_Q4_1) {
            const float m = ks_fp16_to_f32(ks_load_u16le(blk + 2));
            for (int j = 0; j < KS_QK; j++)
                o[j] = (float)((double)d * c[j]) + m;
        } else {
            for (int j = 0; j < KS_QK; j++)
                o[j] = d * (float)c[j];
        }
    }
}

/* ---- the product: plain C reference path ------------------------------------------------- */

/* One activation block b of a row (the plain product's step, KS_PLAIN_MATMUL_ROWS):
 * acc = fma(isum, d * xd, acc), then for Q4_1 acc = fma(xsum, m * xd, acc). */
static inline float ks_q4x_block_step(int f, const uint8_t *row, int b, const int8_t *x,
                                      float xd, float acc)
{
    const uint8_t *blk = row + (int64_t)b * ks_q4x_block_bytes(f);
    int8_t c[KS_QK];
    ks_q4x_codes(f, blk, c);
    const float d = ks_fp16_to_f32_plain(ks_load_u16le(blk));
    acc = KS_FMADD((float)ks_dot_block_plain(c, x), d * xd, acc);
    if (f == KS_Q4X_Q4_1) {
        int32_t xsum = 0;
        for (int e = 0; e < KS_QK; e++)
            xsum += x[e];
        const float mn = ks_fp16_to_f32_plain(ks_load_u16le(blk + 2));
        acc = KS_FMADD((float)xsum, mn * xd, acc);
    }
    return acc;
}

#define KS_Q4X_STEP(fmt) \
    static inline float ks_q4x_step_##fmt(const uint8_t *row, int b, const int8_t *x, float xd, float acc) \
    { return ks_q4x_block_step(KS_Q4X_##fmt, row, b, x, xd, acc); }
KS_Q4X_STEP(Q4_0)
KS_Q4X_STEP(Q4_1)
KS_Q4X_STEP(Q5_0)
KS_PLAIN_MATMUL_ROWS(ks_q4_0_matmul_rows_plain, ks_q4x_step_Q4_0)
KS_PLAIN_MATMUL_ROWS(ks_q4_1_matmul_rows_plain, ks_q4x_step_Q4_1)
KS_PLAIN_MATMUL_ROWS(ks_q5_0_matmul_rows_plain, ks_q4x_step_Q5_0)

/* ---- the product: SIMD tiles of R rows x T tokens ------------------------------------------- */

#if defined(KS_HAVE_SIMD_MATMUL)

/* Whether the SIMD paths need each activation block's xsum: for Q4_1's offset always; on x86
 * also for the 8 * xsum / 16 * xsum that turn the unsigned products into isum. */
#if defined(KS_AVX2)
#define KS_Q4X_NEEDS_XSUM(f) 1
#else
#define KS_Q4X_NEEDS_XSUM(f) ((f) == KS_Q4X_Q4_1)
#endif

#if defined(KS_AVX2)
/* The unsigned q (0..15, Q5_0 0..31) of two blocks a and b side by side (one 128-bit half
 * each): lo = [a's values 0..15 | b's 0..15], hi = [a's 16..31 | b's 16..31]. The packed bytes
 * of both go in one register, so a block costs no shuffle to unpack. */
KS_INLINE void ks_q4x_pair_avx2(const int f, const uint8_t *a, const uint8_t *b, __m256i *lo,
                                __m256i *hi)
{
    const int Q = ks_q4x_qs_offset(f);
    const __m256i qs = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + Q))),
        _mm_loadu_si128((const __m128i *)(b + Q)), 1);
    const __m256i low = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(qs, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), low);
    if (f == KS_Q4X_Q5_0) {
        /* byte j of a half = byte j / 8 of its block's qh (bits 0..15 for lo, 16..31 for hi);
         * 16 where bit j % 8 of it is set */
        const __m256i qh = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_set1_epi32((int)ks_load_u32le(a + 2))),
            _mm_set1_epi32((int)ks_load_u32le(b + 2)), 1);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i sixteen = _mm256_set1_epi8(16);
        const __m256i s0 = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
        const __m256i s1 = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(s0, bit), bit), sixteen));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(s1, bit), bit), sixteen));
    }
}

/* lane v of the result = the sum of lanes 0-3 of p[v], lane v + 4 that of its lanes 4-7. */
KS_INLINE __m256i ks_hsum4x2_avx2(const __m256i p[4])
{
    const __m256i s0 = ks_pairsum_avx2(p[0], p[1]), s1 = ks_pairsum_avx2(p[2], p[3]);
    return _mm256_add_epi32(_mm256_blend_epi32(s0, s1, 0xCC),
                            _mm256_shuffle_epi32(_mm256_blend_epi32(s1, s0, 0xCC), 0x4E));
}

/* The per-width helpers of ks_q4_tile.h's codes. Lane i's 4 bytes = 16 where bits s..s+3 of
 * lane i's qh are set (Q5_0's bit 4 of the values whose low bits sit in one transposed dword). */
KS_INLINE __m256i ks_q5_bits_t8(__m256i qh, const int s)
{
    const char o = (char)(s / 8);
    const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(
        o, o, o, o, 4 + o, 4 + o, 4 + o, 4 + o, 8 + o, 8 + o, 8 + o, 8 + o,
        12 + o, 12 + o, 12 + o, 12 + o, o, o, o, o, 4 + o, 4 + o, 4 + o, 4 + o,
        8 + o, 8 + o, 8 + o, 8 + o, 12 + o, 12 + o, 12 + o, 12 + o));
    const __m256i bit = _mm256_set1_epi32(0x08040201 << (s % 8));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(16));
}

/* The 16 bytes at p[i + 4l] + off in 128-bit lane l (l < 2) */
KS_INLINE __m256i ks_load_lanes128_t8(const uint8_t *const p[8], int64_t off, int i)
{
    const __m128i lo = _mm_loadu_si128((const __m128i *)(p[i] + off));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                   _mm_loadu_si128((const __m128i *)(p[i + 4] + off)), 1);
}

#else
/* The block's 32 codes c as two int8x16 (values 0..15, 16..31). */
KS_INLINE void ks_q4x_codes_neon(const int f, const uint8_t *blk, int8x16_t *c0, int8x16_t *c1)
{
    const uint8x16_t qs = vld1q_u8(blk + ks_q4x_qs_offset(f));
    uint8x16_t lo = vandq_u8(qs, vdupq_n_u8(15)), hi = vshrq_n_u8(qs, 4);
    if (f == KS_Q4X_Q5_0) {
        /* byte j of a half = byte j / 8 of its 16 qh bits, tested for bit j % 8; then
         * c = low bits - 16 where bit 4 is clear */
        const uint8x16_t qh = vreinterpretq_u8_u32(vdupq_n_u32(ks_load_u32le(blk + 2)));
        const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
        const uint8x16_t sixteen = vdupq_n_u8(16);
        const uint8x16_t s0 = vtstq_u8(vqtbl1q_u8(qh, vcombine_u8(vdup_n_u8(0), vdup_n_u8(1))), bit);
        const uint8x16_t s1 = vtstq_u8(vqtbl1q_u8(qh, vcombine_u8(vdup_n_u8(2), vdup_n_u8(3))), bit);
        lo = vsubq_u8(lo, vbicq_u8(sixteen, s0));
        hi = vsubq_u8(hi, vbicq_u8(sixteen, s1));
    } else if (f == KS_Q4X_Q4_0) {
        lo = vsubq_u8(lo, vdupq_n_u8(8));
        hi = vsubq_u8(hi, vdupq_n_u8(8));
    }
    *c0 = vreinterpretq_s8_u8(lo);
    *c1 = vreinterpretq_s8_u8(hi);
}

#endif

/* res[j * R + i] = out value for row i, token j of the tile; R x T is 8 x 1 (decode; the only
 * tile AVX2 takes here) or 4 x 2 (NEON prefill); rows and tokens as ks_tile_inputs. xs: the tile's first token's block sums, nb per token (used
 * where KS_Q4X_NEEDS_XSUM). pf (or NULL): block b prefetches
 * pf + b * pf_step, pf_step bytes (see ks_prefetch_rows). */
KS_INLINE void ks_q4x_tile(const int f, const int R, const int T, const uint8_t *w,
                           int64_t w_stride, int rv, const int8_t *x, const float *xd,
                           const int32_t *xs, int tv, int nb, float res[8],
                           const uint8_t *pf, int64_t pf_step)
{
    const int B = ks_q4x_block_bytes(f);
    const uint8_t *wp[8];
    const int8_t *xp[8];
    const float *dp[8];
    const int32_t *sp[8];
    ks_tile_inputs(R, T, w, w_stride, rv, x, xd, xs, tv, nb, wp, xp, dp, sp);
#if defined(KS_AVX2)
    /* decode, 8 x 1: vector v holds rows v and v + 4, the token's block in both halves */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i lo[4], hi[4], p[4];
        uint16_t h[8], hm[8];
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, 0);
        for (int i = 0; i < R; i++) {
            h[i] = ks_load_u16le(wp[i] + (int64_t)b * B);
            hm[i] = f == KS_Q4X_Q4_1 ? ks_load_u16le(wp[i] + (int64_t)b * B + 2) : 0;
        }
        for (int v = 0; v < 4; v++)
            ks_q4x_pair_avx2(f, wp[v] + (int64_t)b * B, wp[v + 4] + (int64_t)b * B, &lo[v], &hi[v]);
        const __m256i x0 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(xp[0] + b * KS_QK)));
        const __m256i x1 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(xp[0] + b * KS_QK + 16)));
        /* q <= 31 and |x| <= 127: maddubs' pair sums, and the sum of two, stay below 2^15 */
        for (int v = 0; v < 4; v++)
            p[v] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[v], x0),
                                                      _mm256_maddubs_epi16(hi[v], x1)), ones);
        __m256i isum = ks_hsum4x2_avx2(p);
        const __m256i xsum = _mm256_setr_epi32(sp[0 / R][b], sp[1 / R][b], sp[2 / R][b],
                                               sp[3 / R][b], sp[4 / R][b], sp[5 / R][b],
                                               sp[6 / R][b], sp[7 / R][b]);
        if (f == KS_Q4X_Q4_0)
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(xsum, 3));
        else if (f == KS_Q4X_Q5_0)
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(xsum, 4));
        const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(
            h[0 % R], h[1 % R], h[2 % R], h[3 % R], h[4 % R], h[5 % R], h[6 % R], h[7 % R]));
        const __m256 dx = _mm256_setr_ps(dp[0 / R][b], dp[1 / R][b], dp[2 / R][b], dp[3 / R][b],
                                         dp[4 / R][b], dp[5 / R][b], dp[6 / R][b], dp[7 / R][b]);
        acc = ks_fmadd_t8(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx), acc);
        if (f == KS_Q4X_Q4_1) {
            const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi16(
                hm[0 % R], hm[1 % R], hm[2 % R], hm[3 % R],
                hm[4 % R], hm[5 % R], hm[6 % R], hm[7 % R]));
            acc = ks_fmadd_t8(_mm256_cvtepi32_ps(xsum), _mm256_mul_ps(dm, dx), acc);
        }
    }
    _mm256_storeu_ps(res, acc);
#else /* NEON: lanes 0-3 and 4-7 are two float32x4; R >= 4, so each half has one token */
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        int8x16_t w0[8], w1[8];
        uint64_t h[8], hm[8];
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, 0);
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = wp[i] + (int64_t)b * B;
            ks_q4x_codes_neon(f, blk, &w0[i], &w1[i]);
            h[i] = ks_load_u16le(blk);
            hm[i] = f == KS_Q4X_Q4_1 ? ks_load_u16le(blk + 2) : 0;
        }
        float32x4_t isum[2];
        ks_tile_isums_neon(R, T, w0, w1, xp, b, isum);
        const float32x4_t is0 = isum[0], is1 = isum[1];
        const float dx0 = dp[0 / R][b], dx1 = dp[4 / R][b];
        const float32x4_t dw0 = ks_f16x4_neon(h[0 % R], h[1 % R], h[2 % R], h[3 % R]);
        const float32x4_t dw1 = ks_f16x4_neon(h[4 % R], h[5 % R], h[6 % R], h[7 % R]);
        acc0 = vfmaq_f32(acc0, is0, vmulq_n_f32(dw0, dx0));
        acc1 = vfmaq_f32(acc1, is1, vmulq_n_f32(dw1, dx1));
        if (f == KS_Q4X_Q4_1) {
            const float32x4_t dm0 = ks_f16x4_neon(hm[0 % R], hm[1 % R], hm[2 % R], hm[3 % R]);
            const float32x4_t dm1 = ks_f16x4_neon(hm[4 % R], hm[5 % R], hm[6 % R], hm[7 % R]);
            acc0 = vfmaq_f32(acc0, vdupq_n_f32((float)sp[0 / R][b]), vmulq_n_f32(dm0, dx0));
            acc1 = vfmaq_f32(acc1, vdupq_n_f32((float)sp[4 / R][b]), vmulq_n_f32(dm1, dx1));
        }
    }
    vst1q_f32(res, acc0);
    vst1q_f32(res + 4, acc1);
#endif
}

#if defined(KS_AVX2)
/* ---- x86: ks_q4_tile.h's tiles on transposed codes, 8 rows on AVX2 (prefill), 16 on
 * AVX512-VNNI (prefill and decode) ----------------------------------------------------------- */
#define KS_TW 8
#include "ks_q4_tile.h"
#undef KS_TW
/* the products on 8-row interleaved groups (ks_interleave.h), decode included */
static void ks_q4_0_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t8(KS_Q4X_Q4_0, 1, KS_ROWS_ARGS); }
static void ks_q4_1_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t8(KS_Q4X_Q4_1, 1, KS_ROWS_ARGS); }
static void ks_q5_0_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t8(KS_Q4X_Q5_0, 1, KS_ROWS_ARGS); }
#if defined(KS_HAVE_VNNI)
/* ks_q5_bits_t8 on 16 lanes */
KS_VNNI_FN __m512i ks_q5_bits_t16(__m512i qh, const int s)
{
    const char o = (char)(s / 8);
    const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_broadcast_i32x4(_mm_setr_epi8(
        o, o, o, o, 4 + o, 4 + o, 4 + o, 4 + o, 8 + o, 8 + o, 8 + o, 8 + o,
        12 + o, 12 + o, 12 + o, 12 + o)));
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201 << (s % 8))),
                                 _mm512_set1_epi8(16));
}

/* The 16 bytes at p[i + 4l] + off in 128-bit lane l (l < 4) */
KS_VNNI_FN __m512i ks_load_lanes128_t16(const uint8_t *const p[16], int64_t off, int i)
{
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[i] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[i + 4] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[i + 8] + off)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[i + 12] + off)), 3);
}

#define KS_TW 16
#include "ks_q4_tile.h"
#undef KS_TW
#endif
#endif

#endif /* KS_HAVE_SIMD_MATMUL */

/* ---- the per-type entry points (the signature and meaning of ks_q8_matmul_rows) ----------- */

#if defined(KS_HAVE_VNNI)
KS_VNNI_TARGET static void ks_q4_0_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q4_0, 0, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q4_1_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q4_1, 0, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q5_0_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q5_0, 0, KS_ROWS_ARGS); }
/* the same on 16-row interleaved groups (ks_interleave.h) */
KS_VNNI_TARGET static void ks_q4_0_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q4_0, 1, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q4_1_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q4_1, 1, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q5_0_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_q4x_matmul_rows_t16(KS_Q4X_Q5_0, 1, KS_ROWS_ARGS); }
#endif

/* Same contract as the plain products (KS_PLAIN_MATMUL_ROWS). Decode (n == 1): tiles of 8 rows
 * with horizontal sums, prefetching the next tile as ks_q8.h does; prefill: ks_q4_tile.h's
 * 8-row tiles on AVX2, tiles of 4 rows x 2 tokens on NEON. AVX512-VNNI CPUs take the per-type
 * *_vnni entry points above instead (ks_weights.h's table), ks_q4_tile.h's 16-row tiles for
 * decode too (no horizontal sums; docs/speed.md, "The x86 tiles"). An interleaved matrix goes
 * to the *_x8 / *_x16 entry points, ks_q4_tile.h's tiles for both, or on NEON with sdot to
 * ks_il4_neon.h's *_x4. */
static inline __attribute__((always_inline))
void ks_q4x_matmul_rows(const int f, KS_ROWS_PARAMS)
{
#if defined(KS_HAVE_SIMD_MATMUL)
    const int nb = k / KS_QK;
    float res[8];
    if (n == 1) {
        int32_t xs[nb];
        if (KS_Q4X_NEEDS_XSUM(f))
            ks_q4x_block_sums(x->h, nb, xs);
        for (int r = r0; r < r1; r += 8) {
            const int rv = r1 - r < 8 ? r1 - r : 8;
            /* the next tile of this matrix (an MoE expert's ends here), a slice per block */
            const uint8_t *next = r + 8 < m ? w + (int64_t)(r + 8) * w_stride : NULL;
            ks_q4x_tile(f, 8, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d, xs, 1, nb,
                        res, next, 8 * w_stride / nb);
            ks_q8_store_tile(8, 1, res, out, m, r, rv, 0, 1);
        }
        return;
    }
#if defined(KS_AVX2)
    ks_q4x_matmul_rows_t8(f, 0, KS_ROWS_ARGS);
#else
    int32_t xs[KS_PREFILL_TOKEN_BLOCK * nb];
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        if (KS_Q4X_NEEDS_XSUM(f))
            ks_q4x_block_sums(x->h + (int64_t)tb * 2 * nb, (int64_t)(te - tb) * nb, xs);
        for (int r = r0; r < r1; r += 4) {
            const int rv = r1 - r < 4 ? r1 - r : 4;
            for (int t = tb; t < te; t += 2) {
                const int tv = te - t < 2 ? te - t : 2;
                ks_q4x_tile(f, 4, 2, w + (int64_t)r * w_stride, w_stride, rv, x->q + (int64_t)t * k,
                            x->d + (int64_t)t * nb, xs + (t - tb) * nb, tv, nb, res, NULL, 0);
                ks_q8_store_tile(4, 2, res, out, m, r, rv, t, tv);
            }
        }
    }
#endif
#else
    (f == KS_Q4X_Q4_0 ? ks_q4_0_matmul_rows_plain : f == KS_Q4X_Q4_1 ? ks_q4_1_matmul_rows_plain
                      : ks_q5_0_matmul_rows_plain)(KS_ROWS_ARGS);
#endif
}

static void ks_q4_0_dequant_row(const uint8_t *row, float *out, int k) { ks_q4x_dequant_row(KS_Q4X_Q4_0, row, out, k); }
static void ks_q4_1_dequant_row(const uint8_t *row, float *out, int k) { ks_q4x_dequant_row(KS_Q4X_Q4_1, row, out, k); }
static void ks_q5_0_dequant_row(const uint8_t *row, float *out, int k) { ks_q4x_dequant_row(KS_Q4X_Q5_0, row, out, k); }
static void ks_q4_0_matmul_rows(KS_ROWS_PARAMS) { ks_q4x_matmul_rows(KS_Q4X_Q4_0, KS_ROWS_ARGS); }
static void ks_q4_1_matmul_rows(KS_ROWS_PARAMS) { ks_q4x_matmul_rows(KS_Q4X_Q4_1, KS_ROWS_ARGS); }
static void ks_q5_0_matmul_rows(KS_ROWS_PARAMS) { ks_q4x_matmul_rows(KS_Q4X_Q5_0, KS_ROWS_ARGS); }

#endif /* KS_Q4_H */
