/* Kestrel kernels: Q8_0 quantization and the Q8_0 x Q8_0 matrix product (no Python here).
 *
 * Q8_0 (GGUF layout): a row of k values is k/32 blocks of 34 bytes, fp16 scale d (little
 * endian) then 32 int8 q; value = d * q. Activations are quantized to the same blocks but keep
 * their scale as float32 in a separate array xd (n, k/32).
 *
 * The product, for output row r and token t:
 *     out[t, r] = sum over blocks b, in order, of  isum(r, t, b) * (d_w[r, b] * xd[t, b])
 * with isum the exact int32 sum of the 32 products and one fused multiply-add per block
 * (KS_FMADD). Every path computes exactly these float operations in this order, so the SIMD
 * paths are bit-identical to the plain one; they differ only in how isum is computed and in
 * how many (row, token) pairs a tile computes at once, lane by lane.
 */
#ifndef KS_Q8_H
#define KS_Q8_H

#include "ks_common.h"

#define KS_QK 32         /* values per block */
#define KS_QBLOCK 34     /* bytes per weight block */

/* ---- quantization (one path: it is cheap next to the product) ---------------------------- */

/* h (k/16) = the sum of each 16 codes of q (k): the activation sums the products' code offsets
 * and minimums need (|sum| <= 16 * 127 fits int16). */
static inline void ks_q8_half_sums(const int8_t *restrict q, int64_t k, int16_t *restrict h)
{
    for (int64_t i = 0; i < k / 16; i++) {
#if defined(KS_NEON) || defined(KS_NEON_DOT)
        h[i] = vaddlvq_s8(vld1q_s8(q + 16 * i));     /* one add across the vector, widened */
#else
        int32_t s = 0;
        for (int e = 0; e < 16; e++)
            s += q[16 * i + e];
        h[i] = (int16_t)s;
#endif
    }
}

/* x (k) -> q (k) int8, d (k/32): llama.cpp quantize_row_q8_0_ref, with a float32 scale; and
 * h (k/16) = ks_q8_half_sums of q, made here once for every product that reads the row (a
 * work item of a few rows summing the codes again would spend a good part of its time on it);
 * h NULL: no sums. */
static inline void ks_quantize_row_q8_0(const float *restrict x, int8_t *restrict q,
                                        float *restrict d, int16_t *restrict h, int k)
{
    for (int b = 0; b < k / KS_QK; b++) {
        const float *xb = x + b * KS_QK;
        const float db = ks_absmax(xb, KS_QK) / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int j = 0; j < KS_QK; j += 8)
            ks_v8_round_i8(ks_v8_load(xb + j) * id, q + b * KS_QK + j);
        d[b] = db;
    }
    if (h)
        ks_q8_half_sums(q, k, h);
}

/* The sum of the 32 codes of activation block b, from its row's half sums h */
static inline int32_t ks_q8_block_sum(const int16_t *h, int64_t b)
{
    return (int32_t)h[2 * b] + h[2 * b + 1];
}

/* One Q8_0 weight row (k values) -> float. */
static inline void ks_dequantize_row_q8_0(const uint8_t *restrict w, float *restrict out, int k)
{
    for (int b = 0; b < k / KS_QK; b++) {
        const uint8_t *blk = w + b * KS_QBLOCK;
        const float d = ks_fp16_to_f32(ks_load_u16le(blk));
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < KS_QK; j++)
            out[b * KS_QK + j] = d * (float)q[j];
    }
}

/* ---- the product: plain C reference path ------------------------------------------------- */

static inline int32_t ks_dot_block_plain(const int8_t *restrict w, const int8_t *restrict x)
{
    int32_t s = 0;
    for (int j = 0; j < KS_QK; j++)
        s += (int32_t)w[j] * (int32_t)x[j];
    return s;
}

/* A chunk's activations as the products read them: n rows of k values quantized by
 * ks_quantize_row_q8_0, codes q (n, k) int8, scales d (n, k/32) and half sums h (n, k/16). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *h;
} ks_act;

/* The activations from row t of q, d, h, rows of k values. */
static inline ks_act ks_act_rows(const int8_t *q, const float *d, const int16_t *h, int64_t t,
                                 int64_t k)
{
    return (ks_act){q + t * k, d + t * (k / KS_QK), h + t * (k / 16)};
}

/* The parameters of every type's product (ks_rows_fn of ks_weights.h): rows [r0, r1) of
 * out (n, m) = w (m, k) . x (n, k)^T, w rows w_stride bytes apart; and passing them on. */
#define KS_ROWS_PARAMS const uint8_t *w, int64_t w_stride, const ks_act *x, int n, int k, \
                       float *out, int m, int r0, int r1
#define KS_ROWS_ARGS w, w_stride, x, n, k, out, m, r0, r1

/* The plain C product of every weight type, the reference its SIMD paths must equal (it
 * sums the codes itself where its type needs their sum, not reading x->h, so the tests that
 * compare the two check x->h too). For each
 * (row, token) the accumulator starts at 0 and takes, activation block b by block in order,
 * acc = STEP(row, b, x->q block b, its scale, acc): the type's exact integer block sum and its
 * fixed float epilogue (each type's header says it). */
#define KS_PLAIN_MATMUL_ROWS(name, STEP)                                                        \
    static void name(KS_ROWS_PARAMS)                                                            \
    {                                                                                           \
        const int nb = k / KS_QK;                                                               \
        for (int r = r0; r < r1; r++) {                                                         \
            const uint8_t *wr = w + (int64_t)r * w_stride;                                      \
            for (int t = 0; t < n; t++) {                                                       \
                const int8_t *xt = x->q + (int64_t)t * k;                                       \
                float acc = 0.0f;                                                               \
                for (int b = 0; b < nb; b++)                                                    \
                    acc = STEP(wr, b, xt + b * KS_QK, x->d[(int64_t)t * nb + b], acc);          \
                out[(int64_t)t * m + r] = acc;                                                  \
            }                                                                                   \
        }                                                                                       \
    }

/* Q8_0: acc = fma(isum, d_w * xd, acc) */
static inline float ks_q8_block_step(const uint8_t *row, int b, const int8_t *x, float xd, float acc)
{
    const uint8_t *blk = row + b * KS_QBLOCK;
    const int32_t isum = ks_dot_block_plain((const int8_t *)(blk + 2), x);
    return KS_FMADD((float)isum, ks_fp16_to_f32_plain(ks_load_u16le(blk)) * xd, acc);
}

KS_PLAIN_MATMUL_ROWS(ks_q8_matmul_rows_plain, ks_q8_block_step)

/* ---- the product: SIMD tiles of R rows x T tokens ------------------------------------------- */

#if defined(KS_AVX2) || defined(KS_NEON_DOT) || defined(KS_NEON)
#define KS_HAVE_SIMD_MATMUL 1
#define KS_PREFILL_TOKEN_BLOCK 32   /* tokens whose activations stay in L2 while rows stream */
#define KS_INLINE static inline __attribute__((always_inline))

#if defined(KS_AVX2)
/* 8 int32 partial sums of w . x for one block. aw = |w|, so maddubs gets its unsigned operand
 * from the weights and any weight byte (even -128) is exact; x is never -128 (our quantizer). */
KS_INLINE __m256i ks_dot_block_avx2(__m256i aw, __m256i w, __m256i x)
{
    const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* (a, b) -> adjacent pair sums, interleaved: [a0+a1, b0+b1, a2+a3, b2+b3, ...] */
KS_INLINE __m256i ks_pairsum_avx2(__m256i a, __m256i b)
{
    const __m256i x = _mm256_blend_epi32(a, b, 0xAA);
    const __m256i y = _mm256_shuffle_epi32(_mm256_blend_epi32(b, a, 0xAA), 0xB1);
    return _mm256_add_epi32(x, y);
}

/* acc + a * b lane by lane, with the one rounding of KS_FMADD (every type's tiles use it) */
KS_INLINE __m256 ks_fmadd_t8(__m256 a, __m256 b, __m256 acc)
{
#if defined(KS_HAS_FMA)
    return _mm256_fmadd_ps(a, b, acc);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), acc);
#endif
}

/* lane k of the result = sum of the 8 lanes of p[k]. Blends where possible: the shuffle port
 * is the bottleneck of the tile (hadd would need twice as many shuffles). */
KS_INLINE __m256i ks_hsum8x8_avx2(const __m256i p[8])
{
    __m256i u[2];
    for (int h = 0; h < 2; h++) {
        const __m256i s0 = ks_pairsum_avx2(p[4 * h], p[4 * h + 1]);
        const __m256i s1 = ks_pairsum_avx2(p[4 * h + 2], p[4 * h + 3]);
        /* [q0, q1, q2, q3 | same for lanes 4-7] of the 4 vectors p[4h..4h+3] */
        u[h] = _mm256_add_epi32(_mm256_blend_epi32(s0, s1, 0xCC),
                                _mm256_shuffle_epi32(_mm256_blend_epi32(s1, s0, 0xCC), 0x4E));
    }
    return _mm256_add_epi32(_mm256_blend_epi32(u[0], u[1], 0xF0),
                            _mm256_permute2x128_si256(u[0], u[1], 0x21));
}

/* 8 x 8 dword transpose of 8 rows' 32-byte blocks r: c[q] lane i = row i's dword q (its bytes
 * 4q .. 4q + 3), so that lane i of every product with a broadcast chunk belongs to row i. */
KS_INLINE void ks_transpose8x8_epi32(const __m256i r[8], __m256i c[8])
{
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {    /* rows 4g..4g+3: dwords q and q + 4 in the two halves */
        u[4 * g + 0] = _mm256_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 1] = _mm256_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 2] = _mm256_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm256_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int q = 0; q < 4; q++) {
        c[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
        c[q + 4] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
    }
}

/* c[q] lane i = dword q of the 32 bytes at wp[i] + off (ks_transpose8x8_epi32) */
KS_INLINE void ks_load_transposed_t8(const uint8_t *const wp[8], int64_t off, __m256i c[8])
{
    __m256i r[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_si256((const __m256i *)(wp[i] + off));
    ks_transpose8x8_epi32(r, c);
}

/* A token's 4-byte chunk at p in every dword lane. */
KS_INLINE __m256i ks_bcast_chunk(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc + the exact products of u[q] (unsigned bytes; lane i: row i's 4 bytes of chunk q) with
 * x's chunk q broadcast, for q0 <= q < q1 (a multiple of g): row i's sums in lane i. The
 * maddubs pair sums of g chunks are added in int16 before widening, which is exact while
 * 2g * (largest code) * 127 < 2^15 (|x| <= 127): g = 2 for codes <= 63, 4 for <= 31, 8 for
 * <= 15. ks_dot_chunks_t16 is its one-instruction-per-chunk twin on 16 rows. The scaled form
 * widens with the int16 pair sc instead of 1 (each lane's int16 halves hold its row's scale), so
 * the products come out times a per-row scale at no extra multiply. */
KS_INLINE __m256i ks_dot_chunks_scaled_avx2(__m256i acc, const __m256i *u, const int8_t *x,
                                            int q0, int q1, const int g, __m256i sc)
{
    for (int q = q0; q < q1; q += g) {
        __m256i p = _mm256_maddubs_epi16(u[q], ks_bcast_chunk(x + 4 * q));
        for (int e = 1; e < g; e++)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[q + e], ks_bcast_chunk(x + 4 * (q + e))));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
    }
    return acc;
}

KS_INLINE __m256i ks_dot_chunks_t8(__m256i acc, const __m256i *u, const int8_t *x, int q0,
                                     int q1, const int g)
{
    return ks_dot_chunks_scaled_avx2(acc, u, x, q0, q1, g, _mm256_set1_epi16(1));
}

/* ---- the transposed tiles, written once for two widths ------------------------------------
 * The x86 tiles of Q4_0's family and of the K types (ks_q4_tile.h, ks_kq_tile.h) are
 * each one source, included once per tile width KS_TW: 8 rows in 256-bit vectors (AVX2), and
 * 16 rows in 512-bit vectors where the CPU has AVX512-VNNI. In that source KS_MM(op) is
 * _mm256_op or _mm512_op, KS_TI / KS_TF the integer / float vector, KS_TN(name) the width's
 * function name_t8 or name_t16 (helpers that differ by more than the vector size are written
 * per width under those names), and KS_TFN, KS_TTOKENS, KS_T_TOKEN_TILES the width's
 * KS_T8_* or KS_T16_*. Every op gives the same bits lane by lane at both widths. */
#define KS_TCAT_(a, b, c) a##b##c
#define KS_TCAT(a, b, c) KS_TCAT_(a, b, c)
#define KS_TBITS KS_TCAT(KS_T, KS_TW, _BITS)
#define KS_TI KS_TCAT(__m, KS_TBITS, i)
#define KS_TF KS_TCAT(__m, KS_TBITS, )
#define KS_MM(op) KS_TCAT(_mm, KS_TBITS, _##op)
#define KS_MMSI(op) KS_TCAT(KS_MM(op##_si), KS_TBITS, )
#define KS_TN(name) KS_TCAT(name, _t, KS_TW)
#define KS_TFN KS_TCAT(KS_T, KS_TW, _FN)
#define KS_TTOKENS KS_TCAT(KS_T, KS_TW, _TOKENS)
#define KS_T_TOKEN_TILES KS_TCAT(KS_T, KS_TW, _TOKEN_TILES)

#define KS_PRAGMA_(x) _Pragma(#x)
#define KS_PRAGMA(x) KS_PRAGMA_(x)      /* a pragma whose arguments are macros */

#define KS_T8_BITS 256
#define KS_T8_FN KS_INLINE
#define KS_T8_TOKENS 8          /* an unpacked block feeds 8 tokens (it spills registers, but
                                 * the unpacking is the dearer part) */
#define KS_T8_KQ_PAIRS 4        /* ks_kq_tile.h's unrolling */

#define KS_T8_TOKEN_TILES(TILE) KS_TOKEN_TILES(8, KS_T8_TOKENS, TILE)

/* 8 fp16 values at p[i] + off -> float lanes */
KS_INLINE __m256 ks_fp16_lanes_t8(const uint8_t *const p[8], int64_t off)
{
    uint16_t h[8];
    for (int i = 0; i < 8; i++)
        h[i] = ks_load_u16le(p[i] + off);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* The 8 fp16 at p as floats (an interleaved group's scales, ks_interleave.h) */
KS_INLINE __m256 ks_fp16_vec_t8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* -x, by its sign bit (zeros too) */
KS_INLINE __m256 ks_negate_t8(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
#else
/* 4 int32 partial sums of w . x for one block (two 16-byte halves). */
KS_INLINE int32x4_t ks_dot_block_neon(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1)
{
#if defined(KS_NEON_DOT)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1);
#else
    int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
    s = vpadalq_s16(s, vmull_high_s8(w0, x0));
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
    return vpadalq_s16(s, vmull_high_s8(w1, x1));
#endif
}

/* lane k of the result = sum of the 4 lanes of p[k] */
KS_INLINE int32x4_t ks_hsum4x4_neon(int32x4_t p0, int32x4_t p1, int32x4_t p2, int32x4_t p3)
{
    return vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
}

/* A tile's exact block sums as floats (lanes 0-3 in is[0], 4-7 in is[1]; lane = j * R + i):
 * the R rows' codes w0, w1 (values 0..15, 16..31 of block b) against the T tokens' Q8_0
 * block b. Every 32-value type's NEON tile shares this. */
KS_INLINE void ks_tile_isums_neon(const int R, const int T, const int8x16_t w0[8],
                                  const int8x16_t w1[8], const int8_t *const xp[8], int b,
                                  float32x4_t is[2])
{
    int8x16_t x0[8], x1[8];
    int32x4_t p[8];
    for (int j = 0; j < T; j++) {
        x0[j] = vld1q_s8(xp[j] + b * KS_QK);
        x1[j] = vld1q_s8(xp[j] + b * KS_QK + 16);
    }
    for (int j = 0; j < T; j++)
        for (int i = 0; i < R; i++)
            p[j * R + i] = ks_dot_block_neon(w0[i], w1[i], x0[j], x1[j]);
    is[0] = vcvtq_f32_s32(ks_hsum4x4_neon(p[0], p[1], p[2], p[3]));
    is[1] = vcvtq_f32_s32(ks_hsum4x4_neon(p[4], p[5], p[6], p[7]));
}

/* Four fp16 scales as floats, in one conversion. */
KS_INLINE float32x4_t ks_f16x4_neon(uint64_t h0, uint64_t h1, uint64_t h2, uint64_t h3)
{
    return vcvt_f32_f16(vreinterpret_f16_u64(vcreate_u64(h0 | h1 << 16 | h2 << 32 | h3 << 48)));
}
#endif

/* Asks for the n bytes at p in cache (a hint: never faults, changes no result). Decode reads
 * each weight once: a single thread's demand misses alone keep too few lines in flight to
 * stream from DRAM at full speed. The decode tile asks, block by block, for its slice of the
 * next tile, so the requests are spread over the computation (all of the next tile up front
 * stalls on the fill buffers). to_l2: into L2 only (prefetcht1), for the types with the most
 * bytes per value (Q8_0, Q6_K), whose tiles consume bytes faster than L1's few miss buffers
 * bring them from DRAM; else into L1. KS_PREFETCH_L2: on for x86, off on NEON (not tried on
 * the A76 yet). The figures: docs/speed.md, "Decode prefetch: into L2 for Q8_0 and Q6_K". */
#if defined(KS_AVX2)
#define KS_PREFETCH_L2 1
#else
#define KS_PREFETCH_L2 0
#endif
KS_INLINE void ks_prefetch_rows(const uint8_t *p, int64_t n, const int to_l2)
{
    for (int64_t o = 0; o < n; o += 64) {
        if (to_l2)
            __builtin_prefetch(p + o, 0, 2);
        else
            __builtin_prefetch(p + o, 0, 3);
    }
}

/* A tile's R rows (wp) and T tokens (activations xp, scales dp and, with xs, block sums sp);
 * rows >= rv / tokens >= tv repeat the last valid one, so edges need no second loop. */
KS_INLINE void ks_tile_inputs(const int R, const int T, const uint8_t *w, int64_t w_stride,
                              int rv, const int8_t *x, const float *xd, const int32_t *xs,
                              int tv, int nb, const uint8_t **wp, const int8_t **xp,
                              const float **dp, const int32_t **sp)
{
    for (int i = 0; i < R; i++)
        wp[i] = w + (int64_t)(i < rv ? i : rv - 1) * w_stride;
    for (int j = 0; j < T; j++) {
        const int64_t jt = j < tv ? j : tv - 1;
        xp[j] = x + jt * nb * KS_QK;
        dp[j] = xd + jt * nb;
        if (xs)
            sp[j] = xs + jt * nb;
    }
}

/* res[j * R + i] = out value for row i, token j of the tile; R x T is 8 x 1 or 4 x 2. Rows >= rv
 * / tokens >= tv repeat the last valid one (their lanes are computed and dropped), so edges
 * need no second loop. pf (or NULL): block b prefetches pf + b * pf_step, pf_step bytes. */
KS_INLINE void ks_q8_tile(const int R, const int T, const uint8_t *w, int64_t w_stride, int rv,
                          const int8_t *x, const float *xd, int tv, int nb, float res[8],
                          const uint8_t *pf, int64_t pf_step)
{
    const uint8_t *wp[8];
    const int8_t *xp[8];
    const float *dp[8];
    ks_tile_inputs(R, T, w, w_stride, rv, x, xd, NULL, tv, nb, wp, xp, dp, NULL);
#if defined(KS_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i wv[8], aw[8], xv[8], p[8];
        uint16_t h[8];
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, KS_PREFETCH_L2);
        for (int i = 0; i < R; i++) {
            wv[i] = _mm256_loadu_si256((const __m256i *)(wp[i] + b * KS_QBLOCK + 2));
            aw[i] = _mm256_sign_epi8(wv[i], wv[i]);
            h[i] = ks_load_u16le(wp[i] + b * KS_QBLOCK);
        }
        for (int j = 0; j < T; j++)
            xv[j] = _mm256_loadu_si256((const __m256i *)(xp[j] + b * KS_QK));
        for (int j = 0; j < T; j++)
            for (int i = 0; i < R; i++)
                p[j * R + i] = ks_dot_block_avx2(aw[i], wv[i], xv[j]);
        const __m256 isum = _mm256_cvtepi32_ps(ks_hsum8x8_avx2(p));
        const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(
            h[0 % R], h[1 % R], h[2 % R], h[3 % R], h[4 % R], h[5 % R], h[6 % R], h[7 % R]));
        const __m256 dx = _mm256_setr_ps(dp[0 / R][b], dp[1 / R][b], dp[2 / R][b], dp[3 / R][b],
                                         dp[4 / R][b], dp[5 / R][b], dp[6 / R][b], dp[7 / R][b]);
        acc = ks_fmadd_t8(isum, _mm256_mul_ps(dw, dx), acc);
    }
    _mm256_storeu_ps(res, acc);
#else /* NEON: lanes 0-3 and 4-7 are two float32x4; R >= 4, so each half has one token */
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, KS_PREFETCH_L2);
        int8x16_t w0[8], w1[8];
        uint64_t h[8];
        float32x4_t is[2];
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = wp[i] + b * KS_QBLOCK;
            w0[i] = vld1q_s8((const int8_t *)(blk + 2));
            w1[i] = vld1q_s8((const int8_t *)(blk + 18));
            h[i] = ks_load_u16le(blk);
        }
        ks_tile_isums_neon(R, T, w0, w1, xp, b, is);
        /* the fp16 scales of lanes 0-3 and 4-7, converted together */
        const float32x4_t dw0 = ks_f16x4_neon(h[0 % R], h[1 % R], h[2 % R], h[3 % R]);
        const float32x4_t dw1 = ks_f16x4_neon(h[4 % R], h[5 % R], h[6 % R], h[7 % R]);
        acc0 = vfmaq_f32(acc0, is[0], vmulq_n_f32(dw0, dp[0 / R][b]));
        acc1 = vfmaq_f32(acc1, is[1], vmulq_n_f32(dw1, dp[4 / R][b]));
    }
    vst1q_f32(res, acc0);
    vst1q_f32(res + 4, acc1);
#endif
}

KS_INLINE void ks_q8_store_tile(const int R, const int T, const float *res, float *out,
                                int m, int r, int rv, int t, int tv)
{
    for (int j = 0; j < T && j < tv; j++) {
        float *o = out + (int64_t)(t + j) * m + r;
        if (rv >= R)     /* a whole tile's row: a copy of known size, made inline */
            memcpy(o, res + j * R, sizeof(float) * R);
        else
            for (int i = 0; i < rv; i++)
                o[i] = res[j * R + i];
    }
}

/* The tiles of rows r .. r + rv - 1 over the token block [tb, te) of a product's loop (out,
 * m, res and pf in scope): TILE(T, t, tv, pf) computes the tile of tokens t .. t + tv - 1 into
 * res, T a constant in each call so that each width gets its own specialized loops. WIDE
 * tokens while that many are left, then the narrowest of 8, 4, 2, 1 that holds the rest (or
 * 8 of it), so a pass of a few tokens (speculation's verification) computes few padded
 * lanes: a tile computes each token's lanes alone, so every width gives the same bits. The
 * block's first tile passes pf on (the next rows, NULL: none), as decode's tile does: a pass
 * of a few tokens reads its weights once, as decode does, and is as memory-bound. */
#define KS_TOKEN_TILES(R, WIDE, TILE)                                                           \
    for (int t = tb, T; t < te; t += T) {                                                       \
        const int left = te - t;                                                                \
        const uint8_t *tpf = t == tb ? pf : NULL;                                               \
        T = left >= (WIDE) ? (WIDE) : left > 4 ? 8 : left > 2 ? 4 : left;                      \
        const int tv = left < T ? left : T;                                                     \
        if (T == (WIDE))                                                                        \
            TILE((WIDE), t, tv, tpf);                                                           \
        else if ((WIDE) > 8 && T == 8)                                                          \
            TILE(8, t, tv, tpf);                                                                \
        else if ((WIDE) > 4 && T == 4)                                                          \
            TILE(4, t, tv, tpf);                                                                \
        else if (T == 2)                                                                        \
            TILE(2, t, tv, tpf);                                                                \
        else                                                                                    \
            TILE(1, t, tv, tpf);                                                                \
        ks_q8_store_tile(R, T, res, out, m, r, rv, t, tv);                                      \
    }

/* Tokens of a pass whose products prefetch their next rows, as decode's do: up to a
 * speculation's largest draft and then some (KS_TOKEN_TILES) */
#define KS_PREFETCH_TOKENS 16

#if defined(KS_AVX2)
#define KS_Q8_T8_TOKENS 4    /* tokens per transposed AVX2 prefill tile */

/* The AVX2 prefill tile: 8 rows x T <= 4 tokens, res[j * 8 + i] = out value of row i, token
 * j; rows >= rv / tokens >= tv repeat the last valid one. As in the VNNI tile, the 8 rows'
 * blocks are transposed as dwords once per block for all T tokens, so lane i of every
 * product is row i and a block's 8 exact row sums need no horizontal adds (which take about
 * half the work of a 4 x 2 tile). maddubs takes |w| unsigned and x with w's sign (x is
 * never -128), so every pair sum fits int16. Same fma(isum, dw * dx, acc) per block. pf (or
 * NULL): block b prefetches the pf_step bytes at pf + b * pf_step. */
KS_INLINE void ks_q8_tile_t8(const int T, const uint8_t *w, int64_t w_stride, int rv,
                             const int8_t *x, const float *xd, int tv, int nb,
                             float res[8 * KS_Q8_T8_TOKENS], const uint8_t *pf, int64_t pf_step)
{
    const uint8_t *wp[8];
    const int8_t *xp[KS_Q8_T8_TOKENS];
    const float *dp[KS_Q8_T8_TOKENS];
    ks_tile_inputs(8, T, w, w_stride, rv, x, xd, NULL, tv, nb, wp, xp, dp, NULL);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[KS_Q8_T8_TOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i c[8], a[8];
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, KS_PREFETCH_L2);
        ks_load_transposed_t8(wp, b * KS_QBLOCK + 2, c);
        for (int q = 0; q < 8; q++)
            a[q] = _mm256_abs_epi8(c[q]);
        const __m256 dw = ks_fp16_lanes_t8(wp, b * KS_QBLOCK);
        for (int j = 0; j < T; j++) {
            const int8_t *xb = xp[j] + b * KS_QK;
            __m256i s = _mm256_setzero_si256();
            for (int q = 0; q < 8; q++) {
                const __m256i xv = ks_bcast_chunk(xb + 4 * q);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(a[q], _mm256_sign_epi8(xv, c[q])), ones));
            }
            const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(dp[j][b]));
            acc[j] = ks_fmadd_t8(_mm256_cvtepi32_ps(s), d, acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        _mm256_storeu_ps(res + 8 * j, acc[j]);
}
#endif


#if defined(KS_AVX2) && defined(__GNUC__)
/* ---- products with AVX512-VNNI (runtime-dispatched; the build's baseline stays AVX2) -------
 * A tile of 16 rows x up to 32 tokens in 512-bit vectors. The rows' 32-byte blocks are
 * transposed as dwords (rows i and 8 + i in the two halves of one vector), so lane i of every
 * vector belongs to row i: vpdpbusd with a broadcast 4-byte chunk of a token then adds row i's
 * chunk product into lane i, and a block's 16 exact row sums come out with no horizontal adds.
 * 16 rows a vector rather than the AVX2 tile's 8 halve the unpacking, broadcasts and float
 * work per product (docs/speed.md, "The x86 tiles", has the figures). vpdpbusd multiplies
 * unsigned by signed bytes: the weights are flipped to w + 128 (xor 0x80) and the sum starts
 * at -128 * sum(x) of the block, so it is exact. The float side is the same
 * fma(isum, dw * dx, acc) per block, in order: bit-identical. The K types' and Q4_0 family's
 * 16-row tiles (ks_kq_tile.h, ks_q4_tile.h) share the helpers below. */
#define KS_HAVE_VNNI 1
#define KS_VNNI_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f")))
/* Tokens per tile: a whole token block where one is left, so each block of 16 rows is
 * unpacked once per token block (the unpacking, not the products, is what these tiles spend
 * most on); the rest of a chunk in narrower ones (KS_T16_TOKEN_TILES). */
#define KS_VNNI_TOKENS_WIDE KS_PREFILL_TOKEN_BLOCK

static int ks_vnni_state = -1;   /* -1 unknown; set once (racing threads write the same value) */

static inline int ks_use_vnni(void)
{
    if (ks_vnni_state < 0) {
        __builtin_cpu_init();
        ks_vnni_state = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    }
    return ks_vnni_state;
}

/* Turns the VNNI paths off (0) or back on where the CPU has them (1); returns the state. */
static inline int ks_set_vnni(int on)
{
    ks_vnni_state = -1;
    if (!on || !ks_use_vnni())
        ks_vnni_state = 0;
    return ks_vnni_state;
}

/* Lane i < 8 of every vector belongs to row i, lane 8 + i to row 8 + i, each 256-bit half
 * laid out as the AVX2 8-row tiles'. */
#define KS_VNNI_FN KS_VNNI_TARGET static inline __attribute__((always_inline))

#define KS_T16_BITS 512
#define KS_T16_FN KS_VNNI_FN
#define KS_T16_TOKENS KS_VNNI_TOKENS_WIDE
#define KS_T16_KQ_PAIRS 1

/* A whole token block's tile while one is left, then narrow ones (KS_TOKEN_TILES) */
#define KS_T16_TOKEN_TILES(TILE) KS_TOKEN_TILES(16, KS_VNNI_TOKENS_WIDE, TILE)

/* r[i] holds row i's 8 dwords in its low half and row 8 + i's in its high half; c[q] lane i
 * = dword q of row i, i < 16: ks_transpose8x8_epi32 done on both halves at once */
KS_VNNI_FN void ks_transpose16x8_epi32(const __m512i r[8], __m512i c[8])
{
    __m512i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* per half: the low 128 bits of u[q] and u[4 + q], then the high ones */
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int q = 0; q < 4; q++) {
        c[q] = _mm512_permutex2var_epi64(u[q], lo, u[4 + q]);
        c[q + 4] = _mm512_permutex2var_epi64(u[q], hi, u[4 + q]);
    }
}

/* The 256-bit a in the low half, b in the high half */
KS_VNNI_FN __m512i ks_join16(__m256i a, __m256i b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* c[q] lane i = dword q of the 32 bytes at wp[i] + off, i < 16 */
KS_VNNI_FN void ks_load_transposed_t16(const uint8_t *const wp[16], int64_t off, __m512i c[8])
{
    __m512i r[8];
    for (int i = 0; i < 8; i++)
        r[i] = ks_join16(_mm256_loadu_si256((const __m256i *)(wp[i] + off)),
                         _mm256_loadu_si256((const __m256i *)(wp[i + 8] + off)));
    ks_transpose16x8_epi32(r, c);
}

/* ks_dot_chunks_t8 on 16 rows in one instruction per chunk (vpdpbusd: unsigned u times
 * signed x), the chunks alternating between two sums, so that consecutive vpdpbusd do not wait
 * on each other's result (its latency is several cycles) */
KS_VNNI_FN __m512i ks_dot_chunks_t16(__m512i acc, const __m512i *u, const int8_t *x, int q0,
                                     int q1, const int g)
{
    (void)g;    /* AVX2's int16 grouping: vpdpbusd widens every product itself */
    __m512i odd = _mm512_setzero_si512();
    for (int q = q0; q < q1; q++) {
        int32_t v;
        memcpy(&v, x + 4 * q, 4);
        if ((q - q0) % 2)
            odd = _mm512_dpbusd_epi32(odd, u[q], _mm512_set1_epi32(v));
        else
            acc = _mm512_dpbusd_epi32(acc, u[q], _mm512_set1_epi32(v));
    }
    return _mm512_add_epi32(acc, odd);
}

KS_VNNI_FN __m512 ks_fmadd_t16(__m512 a, __m512 b, __m512 acc) { return _mm512_fmadd_ps(a, b, acc); }

/* 16 fp16 values at p[i] + off -> float lanes */
KS_VNNI_FN __m512 ks_fp16_lanes_t16(const uint8_t *const p[16], int64_t off)
{
    uint16_t h[16];
    for (int i = 0; i < 16; i++)
        h[i] = ks_load_u16le(p[i] + off);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* The 16 fp16 at p as floats (an interleaved group's scales, ks_interleave.h) */
KS_VNNI_FN __m512 ks_fp16_vec_t16(const uint8_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* ks_negate_t8 on 16 lanes (in integers: xor_ps is AVX512DQ's) */
KS_VNNI_FN __m512 ks_negate_t16(__m512 x)
{
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32((int)0x80000000u)));
}

/* res[j * 16 + i] = out value of row i, token j < T (<= KS_VNNI_TOKENS_WIDE); rows >= rv /
 * tokens >= tv repeat the last valid one. xs[t * nb + b] = -128 * (sum of token t's block b).
 * il: w is an interleaved group of 16 rows (ks_interleave.h; rows >= rv are its padding): a block's
 * 16 scales and its 8 dwords of codes are each one vector as they lie. pf (or NULL): block b
 * prefetches the pf_step bytes at pf + b * pf_step. */
KS_VNNI_FN void ks_q8_tile16_vnni(const int il, const int T, const uint8_t *w, int64_t w_stride,
                                  int rv, const int8_t *x, const float *xd, const int32_t *xs,
                                  int tv, int nb, float *res, const uint8_t *pf, int64_t pf_step)
{
    const uint8_t *wp[16];
    const int8_t *xp[KS_VNNI_TOKENS_WIDE];
    const float *dp[KS_VNNI_TOKENS_WIDE];
    const int32_t *sp[KS_VNNI_TOKENS_WIDE];
    ks_tile_inputs(16, T, w, w_stride, rv, x, xd, xs, tv, nb, wp, xp, dp, sp);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[KS_VNNI_TOKENS_WIDE];
    for (int j = 0; j < T; j++)
        acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i c[8];
        __m512 dw;
        if (pf)
            ks_prefetch_rows(pf + b * pf_step, pf_step, KS_PREFETCH_L2);
        if (il) {
            const uint8_t *blk = w + (int64_t)b * 16 * KS_QBLOCK;
            for (int q = 0; q < 8; q++)
                c[q] = _mm512_loadu_si512((const void *)(blk + 16 * (2 + 4 * q)));
            dw = ks_fp16_vec_t16(blk);
        } else {
            ks_load_transposed_t16(wp, b * KS_QBLOCK + 2, c);
            dw = ks_fp16_lanes_t16(wp, b * KS_QBLOCK);
        }
        for (int q = 0; q < 8; q++)
            c[q] = _mm512_xor_si512(c[q], flip);
        for (int j = 0; j < T; j++) {
            const int8_t *xb = xp[j] + b * KS_QK;
            const __m512 isum = _mm512_cvtepi32_ps(
                ks_dot_chunks_t16(_mm512_set1_epi32(sp[j][b]), c, xb, 0, 8, 1));
            acc[j] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(dp[j][b])), acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        _mm512_storeu_ps(res + 16 * j, acc[j]);
}

/* The Q8_0 product on AVX512-VNNI CPUs (ks_weights.h's table takes it over ks_q8_matmul_rows
 * there), on rows (il 0) or on 16-row interleaved groups (il 1, r0 a multiple of 16): decode
 * (n == 1) in 16 x 1 tiles too, which need none of the 8 x 1 tile's horizontal sums
 * (docs/speed.md, "The x86 tiles"). */
KS_VNNI_FN void ks_q8_matmul_rows_t16(const int il, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, tblock = n == 1 ? 1 : KS_PREFILL_TOKEN_BLOCK;
    int32_t xs[tblock * nb];
    float res[16 * KS_VNNI_TOKENS_WIDE];
    for (int tb = 0; tb < n; tb += tblock) {
        const int te = tb + tblock < n ? tb + tblock : n;
        for (int t = tb; t < te; t++)
            for (int b = 0; b < nb; b++)
                xs[(t - tb) * nb + b] = -128 * ks_q8_block_sum(x->h + (int64_t)t * 2 * nb, b);
        for (int r = r0; r < r1; r += 16) {
            const int rv = r1 - r < 16 ? r1 - r : 16;
            if (n == 1) {      /* decode: no prefetch, which only slows this tile there */
                ks_q8_tile16_vnni(il, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d, xs, 1,
                                  nb, res, NULL, 0);
                ks_q8_store_tile(16, 1, res, out, m, r, rv, 0, 1);
                continue;
            }
            const uint8_t *pf = n <= KS_PREFETCH_TOKENS && r + 16 < m
                                ? w + (int64_t)(r + 16) * w_stride : NULL;
#define KS_Q8_TILE16(TT, t, tv, tpf) ks_q8_tile16_vnni(il, TT, w + (int64_t)r * w_stride,       \
    w_stride, rv, x->q + (int64_t)(t) * k, x->d + (int64_t)(t) * nb, xs + ((t) - tb) * nb, tv, \
    nb, res, tpf, 16 * w_stride / nb)
            KS_T16_TOKEN_TILES(KS_Q8_TILE16)
#undef KS_Q8_TILE16
        }
    }
}
KS_VNNI_TARGET static void ks_q8_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_q8_matmul_rows_t16(0, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q8_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_q8_matmul_rows_t16(1, KS_ROWS_ARGS); }
#endif

/* Same contract as ks_q8_matmul_rows_plain. Decode (n == 1): tiles of 8 rows; prefill: the
 * transposed 8-row x 4-token tiles on AVX2 (narrower at the end: KS_TOKEN_TILES), tiles of 4
 * rows x 2 tokens on NEON, so each weight block loaded feeds several tokens and each
 * activation block several rows. AVX512-VNNI CPUs
 * take ks_q8_matmul_rows_vnni instead (ks_weights.h's table); an interleaved matrix goes to
 * ks_q8_matmul_rows_x16 (AVX512-VNNI) or ks_il4_neon.h's ks_q8_matmul_rows_x4 (NEON with sdot). */
static void ks_q8_matmul_rows(KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK;
    float res[8 * 4];       /* a tile's: 8 x 1 in decode, 8 x KS_Q8_T8_TOKENS or 4 x 2 */
    if (n == 1) {
        for (int r = r0; r < r1; r += 8) {
            const int rv = r1 - r < 8 ? r1 - r : 8;
            /* the next tile of this matrix (an MoE expert's ends here), a slice per block */
            const uint8_t *next = r + 8 < m ? w + (int64_t)(r + 8) * w_stride : NULL;
            ks_q8_tile(8, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d, 1, nb, res,
                       next, 8 * w_stride / nb);
            ks_q8_store_tile(8, 1, res, out, m, r, rv, 0, 1);
        }
        return;
    }
#if defined(KS_AVX2)
    enum { R = 8 };
#else
    enum { R = 4, T = 2 };
#endif
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        for (int r = r0; r < r1; r += R) {
            const int rv = r1 - r < R ? r1 - r : R;
#if defined(KS_AVX2)
            const uint8_t *pf = n <= KS_PREFETCH_TOKENS && r + R < m
                                ? w + (int64_t)(r + R) * w_stride : NULL;
#define KS_Q8_TILE8(TT, t, tv, tpf) ks_q8_tile_t8(TT, w + (int64_t)r * w_stride, w_stride, rv,  \
    x->q + (int64_t)(t) * k, x->d + (int64_t)(t) * nb, tv, nb, res, tpf, R * w_stride / nb)
            KS_TOKEN_TILES(R, KS_Q8_T8_TOKENS, KS_Q8_TILE8)
#undef KS_Q8_TILE8
#else
            for (int t = tb; t < te; t += T) {
                const int tv = te - t < T ? te - t : T;
                ks_q8_tile(R, T, w + (int64_t)r * w_stride, w_stride, rv,
                           x->q + (int64_t)t * k, x->d + (int64_t)t * nb, tv, nb, res, NULL, 0);
                ks_q8_store_tile(R, T, res, out, m, r, rv, t, tv);
            }
#endif
        }
    }
}
#else
static void ks_q8_matmul_rows(KS_ROWS_PARAMS)
{
    ks_q8_matmul_rows_plain(KS_ROWS_ARGS);
}
#endif

#if defined(KS_AVX2)
#define KS_AVX2_ROWS(fn) fn         /* a type's AVX2-only product, for ks_weights.h's table */
#else
#define KS_AVX2_ROWS(fn) NULL
#endif

#if defined(KS_HAVE_VNNI)
#define KS_VNNI_ROWS(fn) fn         /* a type's VNNI product, for ks_weights.h's table */
#else
#define KS_VNNI_ROWS(fn) NULL
static inline int ks_use_vnni(void) { return 0; }
static inline int ks_set_vnni(int on) { (void)on; return 0; }
#endif

#endif /* KS_Q8_H */
