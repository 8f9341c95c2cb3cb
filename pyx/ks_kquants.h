/* Kestrel kernels: GGML's K-quant weight types Q4_K, Q5_K and Q6_K times Q8_0 activations
 * (no Python here).
 *
 * Layouts (ggml-common.h; little endian). A row of k values is k/256 superblocks:
 *   Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128
 *         bytes of 4-bit codes. Sub-block s (values 32s .. 32s+31) has its codes in the low
 *         (s even) or high (s odd) nibbles of bytes 32*(s/2) .. +31; w = d*sc[s]*q - dmin*m[s].
 *   Q5_K, 176 bytes: the same with 32 bytes of fifth bits between the scales and the codes:
 *         bit s of byte e is bit 4 of the code of value e of sub-block s.
 *   Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per
 *         16 values), fp16 d; w = d*sc*(q - 32). Values 128h + 32g + e (half h, group g < 4)
 *         take the low (g < 2) or high nibble of ql[64h + 32*(g&1) + e] and bits 2g, 2g+1 of
 *         qh[32h + e].
 * A 32-value activation block meets one sub-block of Q4_K/Q5_K, or two of Q6_K.
 *
 * The product, for output row r and token t (x = xq[t], xd[t] its Q8_0 blocks), acc starting
 * at 0.0f, over the activation blocks j in order, with s = j % 8 and the superblock of j:
 *   Q4_K, Q5_K:  acc = fma((float)isum_j, (d * (float)sc[s]) * xd[j], acc)
 *                acc = fma((float)xsum_j * xd[j], -(dmin * (float)m[s]), acc)
 *       isum_j = sum of q * x over the block (q the unsigned code), xsum_j = sum of x;
 *       d * sc and dmin * m are exact (11-bit by 6-bit mantissas), so only the products with
 *       xd and the fmas round. The min term's xsum_j * xd[j] belongs to the token: the
 *       SIMD paths make it once per block and token (ks_q8_block_sums), not once per row.
 *   Q6_K:        acc = fma((float)isum_j, d * xd[j], acc)
 *       isum_j = sc[2s] * (sum of (q - 32) * x over values 0..15 of the block)
 *              + sc[2s+1] * (the same over values 16..31), exact in int32.
 * Every path (plain C, AVX2, AVX512-VNNI, NEON, NEON dotprod) computes exactly these float
 * operations in this order; they differ only in how the exact integer sums are formed and in
 * how many (row, token) pairs a tile computes at once, lane by lane. So SIMD == plain bit for
 * bit.
 * (Little endian only, as GGUF files are: the scale words are read four bytes at a time.)
 */
#ifndef KS_KQUANTS_H
#define KS_KQUANTS_H

#include "ks_common.h"
#include "ks_q8.h"

#define KS_QK_K 256          /* values per superblock */
#define KS_Q4K_BYTES 144
#define KS_Q5K_BYTES 176
#define KS_Q6K_BYTES 210

/* The three types, as the template argument of the shared code below (constant at every
 * call, so each type gets its own specialized loops). */
enum { KS_KQ_Q4K, KS_KQ_Q5K, KS_KQ_Q6K };

static inline int ks_kq_bytes(int kind)
{
    return kind == KS_KQ_Q4K ? KS_Q4K_BYTES : kind == KS_KQ_Q5K ? KS_Q5K_BYTES : KS_Q6K_BYTES;
}

/* Whether a decode tile of this type and this many rows prefetches into L2 (ks_prefetch_rows):
 * Q6_K, the K type with the most bytes per value, and any 16-row tile (twice the bytes
 * ahead of an 8-row one: more than L1's miss buffers keep in flight; docs/speed.md, "Decode
 * prefetch"). */
static inline int ks_kq_prefetch_l2(int kind, int rows)
{
    return KS_PREFETCH_L2 && (kind == KS_KQ_Q6K || rows == 16);
}

/* ---- unpacking (shared by the dequantization and every product path) --------------------- */

/* Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks from their 12 packed bytes
 * (bytes 0-3: sc[0..3] and the top bits of sc[4..7]; 4-7: m[0..3] and the top bits of
 * m[4..7]; 8-11: the low nibbles of sc[4..7] | m[4..7] << 4), four bytes at a time, as two
 * 8-byte words: byte s of *sc is sc[s], of *m is m[s]. */
static inline void ks_kq_scales_mins(const uint8_t *p, uint64_t *sc, uint64_t *m)
{
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    *sc = (a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    *m = (b & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
}

/* The 32 unsigned codes of sub-block s of a Q4_K (0..15) or Q5_K (0..31) superblock. */
static inline void ks_kq_codes(const int kind, const uint8_t *blk, int s, uint8_t q[32])
{
    const uint8_t *qs = blk + (kind == KS_KQ_Q5K ? 48 : 16) + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int e = 0; e < 32; e++)
        q[e] = (qs[e] >> shift) & 15;
    if (kind == KS_KQ_Q5K)
        for (int e = 0; e < 32; e++)
            q[e] |= ((blk[16 + e] >> s) & 1) << 4;
}

/* The 32 codes minus 32 (-32..31) of activation block c (values 32c..32c+31) of a Q6_K
 * superblock. */
static inline void ks_q6k_codes(const uint8_t *blk, int c, int8_t q[32])
{
    const int h = c / 4, g = c % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (g & 1), *qh = blk + 128 + 32 * h;
    for (int e = 0; e < 32; e++)
        q[e] = (int8_t)((((ql[e] >> (4 * (g / 2))) & 15) | (((qh[e] >> (2 * g)) & 3) << 4)) - 32);
}

/* One row of k values -> float: w = (d*sc)*q - dmin*m (Q4_K, Q5_K), (d*sc)*(q - 32) (Q6_K),
 * as gguf-py computes it in float32. (d*sc)*q is exact (at most 11+6+5 significant bits), so
 * a compiler fusing the multiply and subtract changes no result. */
static inline void ks_kq_dequant_row(const int kind, const uint8_t *restrict row,
                                     float *restrict out, int k)
{
    const int bytes = ks_kq_bytes(kind);
    for (int sb = 0; sb < k / KS_QK_K; sb++, out += KS_QK_K) {
        const uint8_t *blk = row + (int64_t)sb * bytes;
        if (kind == KS_KQ_Q6K) {
            const float d = ks_fp16_to_f32(ks_load_u16le(blk + 208));
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int c = 0; c < 8; c++) {
                int8_t q[32];
                ks_q6k_codes(blk, c, q);
                for (int e = 0; e < 32; e++)
                    out[32 * c + e] = (d * (float)sc[2 * c + e / 16]) * (float)q[e];
            }
            continue;
        }
        const float d = ks_fp16_to_f32(ks_load_u16le(blk));
        const float dmin = ks_fp16_to_f32(ks_load_u16le(blk + 2));
        uint64_t sc, m;
        uint8_t q[32];
        ks_kq_scales_mins(blk + 4, &sc, &m);
        for (int s = 0; s < 8; s++) {
            const float ds = d * (float)(uint8_t)(sc >> 8 * s), dm = dmin * (float)(uint8_t)(m >> 8 * s);
            ks_kq_codes(kind, blk, s, q);
            for (int e = 0; e < 32; e++)
                out[32 * s + e] = ds * (float)q[e] - dm;
        }
    }
}

/* ---- the product: plain C reference path ------------------------------------------------- */

/* One activation block j (32 values: sub-block j % 8 of superblock j / 8) of a row, the
 * plain product's step (KS_PLAIN_MATMUL_ROWS), in the order the header states. */
static inline float ks_kq_block_step(const int kind, const uint8_t *row, int j, const int8_t *xb,
                                     float xd, float acc)
{
    const uint8_t *blk = row + (int64_t)(j / 8) * ks_kq_bytes(kind);
    const int s = j % 8;
    if (kind == KS_KQ_Q6K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        int8_t q[32];
        int32_t sa = 0, sb = 0;
        ks_q6k_codes(blk, s, q);
        for (int e = 0; e < 16; e++) {
            sa += (int32_t)q[e] * xb[e];
            sb += (int32_t)q[e + 16] * xb[e + 16];
        }
        const int32_t isum = sc[2 * s] * sa + sc[2 * s + 1] * sb;
        const float d = ks_fp16_to_f32_plain(ks_load_u16le(blk + 208));
        return KS_FMADD((float)isum, d * xd, acc);
    }
    uint64_t sc, mn;
    uint8_t q[32];
    int32_t isum = 0, xsum = 0;
    ks_kq_scales_mins(blk + 4, &sc, &mn);
    ks_kq_codes(kind, blk, s, q);
    for (int e = 0; e < 32; e++) {
        isum += (int32_t)q[e] * xb[e];
        xsum += xb[e];
    }
    const float d = ks_fp16_to_f32_plain(ks_load_u16le(blk));
    const float dmin = ks_fp16_to_f32_plain(ks_load_u16le(blk + 2));
    const float dsc = d * (float)(uint8_t)(sc >> 8 * s);
    const float dmn = dmin * (float)(uint8_t)(mn >> 8 * s);
    acc = KS_FMADD((float)isum, dsc * xd, acc);
    return KS_FMADD((float)xsum * xd, -dmn, acc);
}

#define KS_KQ_STEP(name, kind) \
    static inline float ks_##name##_step(const uint8_t *row, int j, const int8_t *x, float xd, float acc) \
    { return ks_kq_block_step(kind, row, j, x, xd, acc); }
KS_KQ_STEP(q4k, KS_KQ_Q4K)
KS_KQ_STEP(q5k, KS_KQ_Q5K)
KS_KQ_STEP(q6k, KS_KQ_Q6K)
KS_PLAIN_MATMUL_ROWS(ks_q4k_matmul_rows_plain, ks_q4k_step)
KS_PLAIN_MATMUL_ROWS(ks_q5k_matmul_rows_plain, ks_q5k_step)
KS_PLAIN_MATMUL_ROWS(ks_q6k_matmul_rows_plain, ks_q6k_step)

/* The plain product of a K type by its kind (the fallback of builds without SIMD). */
static inline void ks_kq_matmul_rows_plain(const int kind, KS_ROWS_PARAMS)
{
    (kind == KS_KQ_Q4K ? ks_q4k_matmul_rows_plain : kind == KS_KQ_Q5K ? ks_q5k_matmul_rows_plain
                       : ks_q6k_matmul_rows_plain)(KS_ROWS_ARGS);
}

/* ---- the product: SIMD tiles of R rows x T tokens (R * T == 8 pairs, lane = j * R + i) ----
 * As in ks_q8.h: NEON decode takes 8 x 1 tiles (and asks for the next tile's bytes while it
 * computes), NEON prefill 4 x 2 tiles, so each weight block loaded and unpacked feeds 2
 * tokens. x86 takes the tiles of ks_kq_tile.h, but for AVX2's Q6_K decode (8 x 1 here).
 * The per-block scales of the 8 lanes are unpacked once per superblock. */
#if defined(KS_HAVE_SIMD_MATMUL)

/* The min term's factor of each 32-value block of an activation row (nb blocks): the block's
 * sum (from its half sums xh; exact as a float: |sum| <= 32 * 127) times its scale xd. */
static inline void ks_q8_block_sums(const int16_t *restrict xh, const float *restrict xd, int nb,
                                    float *restrict xs)
{
    for (int b = 0; b < nb; b++)
        xs[b] = (float)ks_q8_block_sum(xh, b) * xd[b];
}

/* A tile's rows and its tokens' activations, scales and sums (nb blocks a row); rows >= rv
 * and tokens >= tv repeat the last valid one (their lanes are computed and dropped). xs: the
 * tokens' scaled block sums (Q4_K, Q5_K), or NULL. */
typedef struct {
    const uint8_t *w[8];
    const int8_t *x[8];
    const float *xd[8], *xs[8];
} ks_kq_tile_ptrs;

KS_INLINE void ks_kq_tile_ptrs_of(const int R, const int T, const uint8_t *w, int64_t w_stride,
                                  int rv, const int8_t *x, const float *xd, const float *xs,
                                  int tv, int nb, ks_kq_tile_ptrs *P)
{
    for (int i = 0; i < R; i++)
        P->w[i] = w + (int64_t)(i < rv ? i : rv - 1) * w_stride;
    for (int j = 0; j < T; j++) {
        const int64_t jt = j < tv ? j : tv - 1;
        P->x[j] = x + jt * nb * KS_QK;
        P->xd[j] = xd + jt * nb;
        P->xs[j] = xs ? xs + jt * nb : NULL;
    }
}

#if defined(KS_AVX2)
typedef __m256 ks_f8;            /* 8 float lanes */
#else
typedef float32x4x2_t ks_f8;     /* lanes 0-3, 4-7 */
#endif

/* Per superblock, the float scales each lane takes (lane l: row l % R). Q4_K / Q5_K: ds[s] =
 * d * sc[s] and dm[s] = -(dmin * m[s]), s = 0..7 (exact products). The first 16 bytes of
 * every row's superblock (d, dmin, the 12 scale bytes) are transposed as dwords, so that one
 * vector holds a dword of every lane's row; ks_kq_scales_mins's bit operations then unpack all
 * the lanes at once. */
#if defined(KS_AVX2)
/* r[k] lane l = dword k of the 16 bytes at wp[l % R] + off */
KS_INLINE void ks_transpose8x4_epi32(const int R, const uint8_t *const wp[8], int64_t off,
                                     __m256i r[4])
{
    __m128i v[8];
    __m256i u[4], t[4];
    for (int i = 0; i < R; i++)
        v[i] = _mm_loadu_si128((const __m128i *)(wp[i] + off));
    for (int i = 0; i < 4; i++)      /* rows i and i + 4 */
        u[i] = _mm256_set_m128i(v[(i + 4) % R], v[i % R]);
    for (int i = 0; i < 2; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(u[2 * i], u[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(u[2 * i], u[2 * i + 1]);
    }
    r[0] = _mm256_unpacklo_epi64(t[0], t[2]);
    r[1] = _mm256_unpackhi_epi64(t[0], t[2]);
    r[2] = _mm256_unpacklo_epi64(t[1], t[3]);
    r[3] = _mm256_unpackhi_epi64(t[1], t[3]);
}

/* Defined by ks_kq_tile.h at its KS_TW 8 include below, which has to follow this file's
 * width helpers (ks_kq_scales_t8 calls ks_kq_lane_scales). */
KS_INLINE void ks_kq_unpack_scales_t8(const __m256i r[3], const __m256 d, const __m256 ndmin,
                                      __m256 ds[8], __m256 dm[8]);

KS_INLINE void ks_kq_lane_scales(const int R, const uint8_t *const wp[8], int64_t off,
                                 ks_f8 ds[8], ks_f8 dm[8])
{
    __m256i r[4];
    ks_transpose8x4_epi32(R, wp, off, r);
    const __m256i dh = _mm256_and_si256(r[0], _mm256_set1_epi32(0xffff));
    const __m256i mh = _mm256_srli_epi32(r[0], 16);
    const __m256 d = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(dh),
                                                      _mm256_extracti128_si256(dh, 1)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(mh),
                                                         _mm256_extracti128_si256(mh, 1)));
    ks_kq_unpack_scales_t8(r + 1, d, ks_negate_t8(dmin), ds, dm);
}

/* Q6_K: lane l = d of row l % R */
KS_INLINE ks_f8 ks_q6k_lane_scales(const int R, const uint8_t *const wp[8], int64_t off)
{
    uint16_t h[8];
    for (int i = 0; i < R; i++)
        h[i] = ks_load_u16le(wp[i] + off + 208);
    return _mm256_cvtph_ps(_mm_setr_epi16(h[0 % R], h[1 % R], h[2 % R], h[3 % R], h[4 % R],
                                          h[5 % R], h[6 % R], h[7 % R]));
}
#else
/* The 6-bit scales and mins of 4 lanes, one byte each: byte s % 4 of sc[s / 4] (mn[s / 4])
 * lane l is lane l's sc[s] (m[s]), from the dwords 0-2 of each lane's 12 scale bytes (r[k]
 * lane l: dword k of lane l's row), by ks_kq_scales_mins's bit operations on all the lanes at
 * once. NEON's rows (below) and its interleaved groups (ks_il4_neon.h) share it. */
KS_INLINE void ks_kq_scale_words_neon(const uint32x4_t r[3], uint32x4_t sc[2], uint32x4_t mn[2])
{
    const uint32x4_t m6 = vdupq_n_u32(0x3f3f3f3fu), m4 = vdupq_n_u32(0x0f0f0f0fu);
    const uint32x4_t m30 = vdupq_n_u32(0x30303030u);
    sc[0] = vandq_u32(r[0], m6);
    sc[1] = vorrq_u32(vandq_u32(r[2], m4), vandq_u32(vshrq_n_u32(r[0], 2), m30));
    mn[0] = vandq_u32(r[1], m6);
    mn[1] = vorrq_u32(vandq_u32(vshrq_n_u32(r[2], 4), m4), vandq_u32(vshrq_n_u32(r[1], 2), m30));
}

/* Lane l: byte s of ks_kq_scale_words_neon's words (sc[s] or m[s]) as float, times f's lane
 * l (d: d * sc[s]; -dmin: -(dmin * m[s]), exact products). The byte comes out by one vector
 * operation: a mask (byte 0), a shift (byte 3) or a table lookup (bytes 1, 2; indices past
 * the table give 0). */
KS_INLINE float32x4_t ks_kq_scale_neon(const uint32x4_t words[2], const int s, float32x4_t f)
{
    static const uint8_t byte_of[2][16] = {
        {1, 255, 255, 255, 5, 255, 255, 255, 9, 255, 255, 255, 13, 255, 255, 255},
        {2, 255, 255, 255, 6, 255, 255, 255, 10, 255, 255, 255, 14, 255, 255, 255}};
    const uint32x4_t w = words[s / 4];
    const uint32x4_t b = s % 4 == 0 ? vandq_u32(w, vdupq_n_u32(0xff))
                       : s % 4 == 3 ? vshrq_n_u32(w, 24)
                       : vreinterpretq_u32_u8(vqtbl1q_u8(vreinterpretq_u8_u32(w),
                                                         vld1q_u8(byte_of[s % 4 - 1])));
    return vmulq_f32(vcvtq_f32_u32(b), f);
}

KS_INLINE void ks_kq_lane_scales(const int R, const uint8_t *const wp[8], int64_t off,
                                 ks_f8 ds[8], ks_f8 dm[8])
{
    for (int h = 0; h < 2; h++) {    /* lanes 4h .. 4h + 3: rows (4h + k) % R */
        uint32x4_t v[4];
        for (int k = 0; k < 4; k++)
            v[k] = vreinterpretq_u32_u8(vld1q_u8(wp[(4 * h + k) % R] + off));
        const uint64x2_t t0 = vreinterpretq_u64_u32(vtrn1q_u32(v[0], v[1]));
        const uint64x2_t t1 = vreinterpretq_u64_u32(vtrn2q_u32(v[0], v[1]));
        const uint64x2_t t2 = vreinterpretq_u64_u32(vtrn1q_u32(v[2], v[3]));
        const uint64x2_t t3 = vreinterpretq_u64_u32(vtrn2q_u32(v[2], v[3]));
        const uint32x4_t r0 = vreinterpretq_u32_u64(vtrn1q_u64(t0, t2));   /* dword 0 of each */
        const uint32x4_t r[3] = {vreinterpretq_u32_u64(vtrn1q_u64(t1, t3)),
                                 vreinterpretq_u32_u64(vtrn2q_u64(t0, t2)),
                                 vreinterpretq_u32_u64(vtrn2q_u64(t1, t3))};
        const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vmovn_u32(r0)));
        const float32x4_t ndmin = vnegq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vshrn_n_u32(r0, 16))));
        uint32x4_t sc[2], mn[2];
        ks_kq_scale_words_neon(r, sc, mn);
        for (int s = 0; s < 8; s++) {
            ds[s].val[h] = ks_kq_scale_neon(sc, s, d);
            dm[s].val[h] = ks_kq_scale_neon(mn, s, ndmin);
        }
    }
}

KS_INLINE ks_f8 ks_q6k_lane_scales(const int R, const uint8_t *const wp[8], int64_t off)
{
    uint64_t h[8];
    ks_f8 r;
    for (int i = 0; i < R; i++)
        h[i] = ks_load_u16le(wp[i] + off + 208);
    r.val[0] = vcvt_f32_f16(vreinterpret_f16_u64(vcreate_u64(
        h[0 % R] | h[1 % R] << 16 | h[2 % R] << 32 | h[3 % R] << 48)));
    r.val[1] = vcvt_f32_f16(vreinterpret_f16_u64(vcreate_u64(
        h[4 % R] | h[5 % R] << 16 | h[6 % R] << 32 | h[7 % R] << 48)));
    return r;
}
#endif

#if defined(KS_AVX2)
/* The 32 unsigned codes (0..63, q + 32) of activation block s of the Q6_K superblock blk
 * (16-bit shifts: no other byte's bit lands in the kept ones). */
KS_INLINE __m256i ks_q6k_codes_avx2(const uint8_t *blk, const int s)
{
    const int hf = s / 4, g = s % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
    const __m256i hi = g == 0 ? _mm256_slli_epi16(qh, 4) : g == 1 ? _mm256_slli_epi16(qh, 2)
                     : g == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

/* Q6_K (the only type AVX2 takes through ks_kq_tile, for decode): lane j * R + i, the exact
 * isum of row i, token j for block s of the superblock at off (activation block b). */
KS_INLINE __m256 ks_q6k_isum_avx2(const int R, const int T, const uint8_t *const wp[8],
                                  int64_t off, const int s, const int8_t *const xp[8], int b)
{
    __m256i q[8], sc[8], xv[8], o[8], p[8];
    for (int j = 0; j < T; j++)
        xv[j] = _mm256_loadu_si256((const __m256i *)(xp[j] + b * KS_QK));
    const int hf = s / 4, g = s % 4;
    /* picks int16 scale 2g of a 128-bit lane into the low lane, 2g + 1 into the high */
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * g)),
                                          _mm_set1_epi16((short)(0x0100 + 0x0404 * g)));
    for (int i = 0; i < R; i++) {
        const uint8_t *blk = wp[i] + off;
        q[i] = ks_q6k_codes_avx2(blk, s);
        /* the 8 int16 scales of this half in both 128-bit lanes, then the two of block s */
        const __m128i s8 = _mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * hf));
        sc[i] = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8)), pick);
    }
    /* (q - 32) * x pair sums as q*x - 32*x in int16 (|.| <= 2 * 63 * 128), then the
     * sub-blocks' scales in the pairwise add to int32 */
    for (int j = 0; j < T; j++)
        o[j] = _mm256_maddubs_epi16(_mm256_set1_epi8(32), xv[j]);
    for (int j = 0; j < T; j++)
        for (int i = 0; i < R; i++)
            p[j * R + i] = _mm256_madd_epi16(
                _mm256_sub_epi16(_mm256_maddubs_epi16(q[i], xv[j]), o[j]), sc[i]);
    return _mm256_cvtepi32_ps(ks_hsum8x8_avx2(p));
}

#else /* NEON: lanes 0-3 and 4-7 are two int32x4 / float32x4; R >= 4, so each half has one token */

/* 4 int32 partial sums of w . x over 16 values */
KS_INLINE int32x4_t ks_dot16_neon(int8x16_t w, int8x16_t x)
{
#if defined(KS_NEON_DOT)
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else
    return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x))), vmull_high_s8(w, x));
#endif
}

/* is[0], is[1]: lanes 0-3, 4-7 of the isums of block s (as ks_q6k_isum_avx2 for Q6_K on AVX2) */
KS_INLINE void ks_kq_isum(const int kind, const int R, const int T, const uint8_t *const wp[8],
                          int64_t off, const int s, const int8_t *const xp[8], int b,
                          float32x4_t is[2])
{
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    int8x16_t w0[8], w1[8], x0[8], x1[8];
    int32x4_t p[8];
    for (int j = 0; j < T; j++) {
        x0[j] = vld1q_s8(xp[j] + b * KS_QK);
        x1[j] = vld1q_s8(xp[j] + b * KS_QK + 16);
    }
    if (kind == KS_KQ_Q6K) {
        const int hf = s / 4, g = s % 4;
        /* bits 2g, 2g+1 of qh to bits 4, 5 (a negative count shifts right) */
        const int8x16_t hshift = vdupq_n_s8((int8_t)(4 - 2 * g));
        const uint8x16_t m30 = vdupq_n_u8(0x30);
        int32_t sa[8], sb[8];
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = wp[i] + off;
            const uint8_t *ql = blk + 64 * hf + 32 * (g & 1), *qh = blk + 128 + 32 * hf;
            uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16);
            l0 = g < 2 ? vandq_u8(l0, m4) : vshrq_n_u8(l0, 4);
            l1 = g < 2 ? vandq_u8(l1, m4) : vshrq_n_u8(l1, 4);
            const uint8x16_t h0 = vandq_u8(vshlq_u8(vld1q_u8(qh), hshift), m30);
            const uint8x16_t h1 = vandq_u8(vshlq_u8(vld1q_u8(qh + 16), hshift), m30);
            w0[i] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l0, h0)), vdupq_n_s8(32));
            w1[i] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l1, h1)), vdupq_n_s8(32));
            sa[i] = ((const int8_t *)blk)[192 + 2 * s];
            sb[i] = ((const int8_t *)blk)[193 + 2 * s];
        }
        for (int j = 0; j < T; j++)
            for (int i = 0; i < R; i++)
                p[j * R + i] = vmlaq_n_s32(vmulq_n_s32(ks_dot16_neon(w0[i], x0[j]), sa[i]),
                                           ks_dot16_neon(w1[i], x1[j]), sb[i]);
    } else {
        const int qoff = kind == KS_KQ_Q5K ? 48 : 16;
        for (int i = 0; i < R; i++) {
            const uint8_t *qs = wp[i] + off + qoff + 32 * (s / 2);
            uint8x16_t q0 = vld1q_u8(qs), q1 = vld1q_u8(qs + 16);
            q0 = s & 1 ? vshrq_n_u8(q0, 4) : vandq_u8(q0, m4);
            q1 = s & 1 ? vshrq_n_u8(q1, 4) : vandq_u8(q1, m4);
            if (kind == KS_KQ_Q5K) {
                const uint8x16_t bit = vdupq_n_u8((uint8_t)(1 << s)), m16 = vdupq_n_u8(0x10);
                q0 = vorrq_u8(q0, vandq_u8(vtstq_u8(vld1q_u8(wp[i] + off + 16), bit), m16));
                q1 = vorrq_u8(q1, vandq_u8(vtstq_u8(vld1q_u8(wp[i] + off + 32), bit), m16));
            }
            w0[i] = vreinterpretq_s8_u8(q0);
            w1[i] = vreinterpretq_s8_u8(q1);
        }
        for (int j = 0; j < T; j++)
            for (int i = 0; i < R; i++)
                p[j * R + i] = ks_dot_block_neon(w0[i], w1[i], x0[j], x1[j]);
    }
    is[0] = vcvtq_f32_s32(ks_hsum4x4_neon(p[0], p[1], p[2], p[3]));
    is[1] = vcvtq_f32_s32(ks_hsum4x4_neon(p[4], p[5], p[6], p[7]));
}

#endif

/* res[j * R + i] = out value for row i, token j of the tile; R x T is 8 x 1 or (NEON prefill)
 * 4 x 2 (AVX2: Q6_K, 8 x 1 only). Rows >= rv / tokens >= tv repeat the last valid one (their
 * lanes are computed and dropped).
 * xs: the tokens' scaled block sums (ks_q8_block_sums; Q4_K, Q5_K). pf (or NULL): superblock sb
 * prefetches the pf_step bytes at pf + sb * pf_step, an eighth per block. */
KS_INLINE void ks_kq_tile(const int kind, const int R, const int T, const uint8_t *w,
                          int64_t w_stride, int rv, const int8_t *x, const float *xd,
                          const float *xs, int tv, int nsb, float res[8], const uint8_t *pf,
                          int64_t pf_step)
{
    const int bytes = ks_kq_bytes(kind);
    ks_kq_tile_ptrs P;
    ks_kq_tile_ptrs_of(R, T, w, w_stride, rv, x, xd, xs, tv, nsb * 8, &P);
    const uint8_t *const *wp = P.w;
    const int8_t *const *xp = P.x;
    const float *const *dp = P.xd;
#if defined(KS_AVX2)
    __m256 acc = _mm256_setzero_ps();
#else
    float32x4_t acc[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
#endif
    for (int sb = 0; sb < nsb; sb++) {
        const int64_t off = (int64_t)sb * bytes;
        ks_f8 ds[8], dm[8];      /* lane scales per block s; Q6_K: d in ds[0] for every s */
        if (kind == KS_KQ_Q6K)
            ds[0] = ks_q6k_lane_scales(R, wp, off);
        else
            ks_kq_lane_scales(R, wp, off, ds, dm);
        /* unrolled: each block's offsets, shifts and shuffle controls become constants */
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const int b = sb * 8 + s;
            const ks_f8 d = ds[kind == KS_KQ_Q6K ? 0 : s];
            if (pf)      /* an eighth of the superblock's slice per block: spread requests */
                ks_prefetch_rows(pf + sb * pf_step + s * (pf_step / 8), pf_step / 8,
                                 ks_kq_prefetch_l2(kind, R));
#if defined(KS_AVX2)      /* Q6_K only */
            const __m256 isum = ks_q6k_isum_avx2(R, T, wp, off, s, xp, b);
            const __m256 dx = _mm256_setr_ps(dp[0 / R][b], dp[1 / R][b], dp[2 / R][b], dp[3 / R][b],
                                             dp[4 / R][b], dp[5 / R][b], dp[6 / R][b], dp[7 / R][b]);
            acc = ks_fmadd_t8(isum, _mm256_mul_ps(d, dx), acc);
#else
            float32x4_t is[2];
            ks_kq_isum(kind, R, T, wp, off, s, xp, b, is);
            for (int h = 0; h < 2; h++) {
                const float dx = dp[4 * h / R][b];
                acc[h] = vfmaq_f32(acc[h], is[h], vmulq_n_f32(d.val[h], dx));
                if (kind != KS_KQ_Q6K)   /* fma(xsum * dx, dm, acc) */
                    acc[h] = vfmaq_n_f32(acc[h], dm[s].val[h],
                                         P.xs[4 * h / R][b]);
            }
#endif
        }
    }
#if defined(KS_AVX2)
    _mm256_storeu_ps(res, acc);
#else
    vst1q_f32(res, acc[0]);
    vst1q_f32(res + 4, acc[1]);
#endif
}

#if defined(KS_AVX2)
/* ---- x86: ks_kq_tile.h's tiles on transposed codes, 8 rows on AVX2, 16 on AVX512-VNNI, and
 * the helpers in which the two widths differ ------------------------------------------------ */

/* A superblock's lane scales: Q4_K / Q5_K's ds[s], dm[s] (ks_kq_lane_scales); Q6_K's d in
 * ds[0] and its 16 int8 scales in sc6 (scale e: byte e % 4 of dword e / 4 of every lane). */
KS_INLINE void ks_kq_scales_t8(const int kind, const uint8_t *const wp[8], int64_t off,
                               __m256 ds[8], __m256 dm[8], __m256i sc6[4])
{
    if (kind == KS_KQ_Q6K) {
        ds[0] = ks_q6k_lane_scales(8, wp, off);
        ks_transpose8x4_epi32(8, wp, off + 192, sc6);
    } else {
        ks_kq_lane_scales(8, wp, off, ds, dm);
    }
}

/* Q6_K: each row's 32 codes of block s, transposed */
KS_INLINE void ks_q6k_codes_t8(const uint8_t *const wp[8], int64_t off, const int s,
                               __m256i codes[8])
{
    __m256i r[8];
    for (int i = 0; i < 8; i++)
        r[i] = ks_q6k_codes_avx2(wp[i] + off, s);
    ks_transpose8x8_epi32(r, codes);
}

/* Q6_K block s's scales a = 2s and b = 2s + 1 (bytes 2 (s % 2), +1 of dword s / 2, sign-extended)
 * as the int16 pairs (a, a), (b, b) and (a, b) */
KS_INLINE void ks_q6k_block_scales_t8(const __m256i sc6[4], const int s, __m256i sc[3])
{
    const __m256i sw = sc6[s / 2], lo = _mm256_set1_epi32(0xffff);
    const __m256i a = _mm256_srai_epi32(_mm256_slli_epi32(sw, 24 - 16 * (s % 2)), 24);
    const __m256i b = _mm256_srai_epi32(_mm256_slli_epi32(sw, 16 - 16 * (s % 2)), 24);
    sc[0] = _mm256_or_si256(_mm256_and_si256(a, lo), _mm256_slli_epi32(a, 16));
    sc[1] = _mm256_or_si256(_mm256_and_si256(b, lo), _mm256_slli_epi32(b, 16));
    sc[2] = _mm256_or_si256(_mm256_and_si256(a, lo), _mm256_slli_epi32(b, 16));
}

/* Q6_K: every lane's exact isum with the token block xb (h: its two half sums). a * (q . x) +
 * b * (...) in maddubs' pairwise adds (vpmulld would take the multiply port twice), then the
 * -32 offset as 32 * (a * half sum 0 + b * half sum 1): one more pairwise add. */
KS_INLINE __m256i ks_q6k_isum_t8(const __m256i codes[8], const int8_t *xb, const __m256i sc[3],
                                 const int16_t *h)
{
    int32_t hh;
    memcpy(&hh, h, 4);
    const __m256i dot = ks_dot_chunks_scaled_avx2(
        ks_dot_chunks_scaled_avx2(_mm256_setzero_si256(), codes, xb, 0, 4, 2, sc[0]),
        codes, xb, 4, 8, 2, sc[1]);
    return _mm256_sub_epi32(
        dot, _mm256_slli_epi32(_mm256_madd_epi16(sc[2], _mm256_set1_epi32(hh)), 5));
}

#define KS_TW 8
#include "ks_kq_tile.h"
#undef KS_TW

/* the products on 8-row interleaved groups (ks_interleave.h), decode included */
static void ks_q4k_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t8(KS_KQ_Q4K, 1, KS_ROWS_ARGS); }
static void ks_q5k_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t8(KS_KQ_Q5K, 1, KS_ROWS_ARGS); }
static void ks_q6k_matmul_rows_x8(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t8(KS_KQ_Q6K, 1, KS_ROWS_ARGS); }

#if defined(KS_HAVE_VNNI)
/* a float vector from two 8-lane halves (rows 0-7, rows 8-15) */
KS_VNNI_FN __m512 ks_join16_ps(__m256 lo, __m256 hi)
{
    return _mm512_castsi512_ps(ks_join16(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}

/* ks_kq_scales_t8 on 16 rows: each half's lanes as the 8-row tile's */
KS_VNNI_FN void ks_kq_scales_t16(const int kind, const uint8_t *const wp[16], int64_t off,
                                 __m512 ds[8], __m512 dm[8], __m512i sc6[4])
{
    __m256 dsl[8], dml[8], dsh[8], dmh[8];
    __m256i lo[4], hi[4];
    ks_kq_scales_t8(kind, wp, off, dsl, dml, lo);
    ks_kq_scales_t8(kind, wp + 8, off, dsh, dmh, hi);
    if (kind == KS_KQ_Q6K) {
        ds[0] = ks_join16_ps(dsl[0], dsh[0]);
        for (int e = 0; e < 4; e++)
            sc6[e] = ks_join16(lo[e], hi[e]);
    } else {
        for (int s = 0; s < 8; s++) {
            ds[s] = ks_join16_ps(dsl[s], dsh[s]);
            dm[s] = ks_join16_ps(dml[s], dmh[s]);
        }
    }
}

/* ks_q6k_codes_t8 on 16 rows (rows i and 8 + i in the halves of one vector) */
KS_VNNI_FN void ks_q6k_codes_t16(const uint8_t *const wp[16], int64_t off, const int s,
                                 __m512i codes[8])
{
    __m512i r[8];
    for (int i = 0; i < 8; i++)
        r[i] = ks_join16(ks_q6k_codes_avx2(wp[i] + off, s), ks_q6k_codes_avx2(wp[i + 8] + off, s));
    ks_transpose16x8_epi32(r, codes);
}

/* Q6_K block s's scales 2s and 2s + 1, sign-extended int32 */
KS_VNNI_FN void ks_q6k_block_scales_t16(const __m512i sc6[4], const int s, __m512i sc[3])
{
    sc[0] = _mm512_srai_epi32(_mm512_slli_epi32(sc6[s / 2], 24 - 16 * (s % 2)), 24);
    sc[1] = _mm512_srai_epi32(_mm512_slli_epi32(sc6[s / 2], 16 - 16 * (s % 2)), 24);
}

/* Q6_K: every lane's exact isum, the -32 offset as each half's start (-32 * its x sum) */
KS_VNNI_FN __m512i ks_q6k_isum_t16(const __m512i codes[8], const int8_t *xb, const __m512i sc[3],
                                   const int16_t *h)
{
    const __m512i sa = ks_dot_chunks_t16(_mm512_set1_epi32(-32 * h[0]), codes, xb, 0, 4, 1);
    const __m512i sb = ks_dot_chunks_t16(_mm512_set1_epi32(-32 * h[1]), codes, xb, 4, 8, 1);
    return _mm512_add_epi32(_mm512_mullo_epi32(sa, sc[0]), _mm512_mullo_epi32(sb, sc[1]));
}

#define KS_TW 16
#include "ks_kq_tile.h"
#undef KS_TW

/* one VNNI function per type (an always-inline body is specialized only where it is inlined) */
KS_VNNI_TARGET static void ks_q4k_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q4K, 0, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q5k_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q5K, 0, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q6k_matmul_rows_vnni(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q6K, 0, KS_ROWS_ARGS); }
/* the same on 16-row interleaved groups (ks_interleave.h) */
KS_VNNI_TARGET static void ks_q4k_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q4K, 1, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q5k_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q5K, 1, KS_ROWS_ARGS); }
KS_VNNI_TARGET static void ks_q6k_matmul_rows_x16(KS_ROWS_PARAMS)
{ ks_kq_matmul_rows_t16(KS_KQ_Q6K, 1, KS_ROWS_ARGS); }
#endif
#endif /* KS_AVX2 */

/* Same contract as ks_kq_matmul_rows_plain. AVX2: ks_kq_tile.h's 8-row tiles, but for Q6_K
 * decode: its codes are built per row, so one token pays a transpose per block that the 8 x 1
 * tile with horizontal sums avoids. NEON: decode in 8 x 1 tiles, prefill in 4 x 2. AVX512-VNNI
 * CPUs take the *_vnni entry points above instead (ks_weights.h's table), ks_kq_tile.h's
 * 16-row tiles for decode too (unpacking and float work once per 16 rows). The figures:
 * docs/speed.md, "The x86 tiles". An interleaved matrix goes to the *_x8 / *_x16 entry
 * points, ks_kq_tile.h's tiles for both (Q6_K's codes need no transpose there); on NEON with
 * sdot, to ks_il4_neon.h's *_x4. */
KS_INLINE void ks_kq_matmul_rows(const int kind, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, nsb = k / KS_QK_K, sums = kind != KS_KQ_Q6K;
    float res[8];
#if defined(KS_AVX2)
    if (n > 1 || kind != KS_KQ_Q6K) {
        ks_kq_matmul_rows_t8(kind, 0, KS_ROWS_ARGS);
        return;
    }
#endif
    if (n == 1) {
        float xs[nb];
        if (sums)
            ks_q8_block_sums(x->h, x->d, nb, xs);
        for (int r = r0; r < r1; r += 8) {
            const int rv = r1 - r < 8 ? r1 - r : 8;
            /* the next tile of this matrix (an MoE expert's ends here), a slice per superblock */
            const uint8_t *next = r + 8 < m ? w + (int64_t)(r + 8) * w_stride : NULL;
            ks_kq_tile(kind, 8, 1, w + (int64_t)r * w_stride, w_stride, rv, x->q, x->d,
                       sums ? xs : NULL, 1, nsb, res, next, 8 * w_stride / nsb);
            ks_q8_store_tile(8, 1, res, out, m, r, rv, 0, 1);
        }
        return;
    }
#if !defined(KS_AVX2)
    float xs[KS_PREFILL_TOKEN_BLOCK * nb];
    for (int tb = 0; tb < n; tb += KS_PREFILL_TOKEN_BLOCK) {
        const int te = tb + KS_PREFILL_TOKEN_BLOCK < n ? tb + KS_PREFILL_TOKEN_BLOCK : n;
        if (sums)
            for (int t = tb; t < te; t++)
                ks_q8_block_sums(x->h + (int64_t)t * 2 * nb, x->d + (int64_t)t * nb, nb,
                                 xs + (t - tb) * nb);
        for (int r = r0; r < r1; r += 4) {
            const int rv = r1 - r < 4 ? r1 - r : 4;
            for (int t = tb; t < te; t += 2) {
                const int tv = te - t < 2 ? te - t : 2;
                ks_kq_tile(kind, 4, 2, w + (int64_t)r * w_stride, w_stride, rv,
                           x->q + (int64_t)t * k, x->d + (int64_t)t * nb,
                           sums ? xs + (t - tb) * nb : NULL, tv, nsb, res, NULL, 0);
                ks_q8_store_tile(4, 2, res, out, m, r, rv, t, tv);
            }
        }
    }
#endif
}
#else
static inline void ks_kq_matmul_rows(const int kind, KS_ROWS_PARAMS)
{
    ks_kq_matmul_rows_plain(kind, KS_ROWS_ARGS);
}
#endif

/* ---- the entry points of each type (ks_weights.h's table holds them) --------------------- */

#define KS_KQ_ENTRY_POINTS(name, kind)                                                         \
    static inline void ks_##name##_dequant_row(const uint8_t *row, float *out, int k)         \
    { ks_kq_dequant_row(kind, row, out, k); }                                                  \
    static void ks_##name##_matmul_rows(KS_ROWS_PARAMS)                                        \
    { ks_kq_matmul_rows(kind, KS_ROWS_ARGS); }

KS_KQ_ENTRY_POINTS(q4k, KS_KQ_Q4K)
KS_KQ_ENTRY_POINTS(q5k, KS_KQ_Q5K)
KS_KQ_ENTRY_POINTS(q6k, KS_KQ_Q6K)

#endif /* KS_KQUANTS_H */
