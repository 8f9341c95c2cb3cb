/* Kestrel kernels: the NEON dotprod products on 4-row interleaved groups (no Python here).
 *
 * On an aarch64 CPU with sdot (Cortex-A76 and later) the loader interleaves matrices by 4 rows
 * (ks_interleave.h), so each 4-byte field of a group's block is one 16-byte vector whose lane i is
 * row i's. sdot by lane (vdotq_laneq_s32) multiplies such a vector of codes by one 4-byte chunk
 * of a token's activations and adds row i's chunk product into lane i: a block's 4 row sums
 * come out in the lanes, with no gather of rows and no horizontal adds, and each code vector
 * unpacked serves up to 8 tokens (prefill tiles of 4 rows x 8 tokens; decode 4 x 1). The
 * rows' tiles (ks_q8.h, ks_q4.h, ks_kquants.h) load each row's block, multiply it by whole
 * blocks of activations and add the four partial sums of each (row, token) pair across lanes.
 * llama.cpp repacks Q4_0, Q8_0 and the K types for dotprod ARM cores for the same reason.
 *
 * Code vectors c[q] (q = 0..7): lane i holds row i's values 4q..4q+3 of a 32-value block (a
 * K type's sub-block), so the block's product with a token's 32 activations x is
 * sum over q of sdot(c[q], chunk q of x) (ks_il4_dot). The float epilogue of every tile is
 * its type's (ks_q8.h, ks_q4.h, ks_kquants.h), in order: each result equals the plain twin's
 * bit for bit. The entry points ks_*_matmul_rows_x4 fill ks_weights.h's rows_il4 column. */
#ifndef KS_IL4_NEON_H
#define KS_IL4_NEON_H

#include "ks_q8.h"
#include "ks_q4.h"
#include "ks_kquants.h"

#if defined(KS_NEON_DOT)

#define KS_IL4_TOKENS 8              /* tokens per prefill tile (narrower at the end) */
enum { KS_IL4_Q8_0 = KS_Q4X_Q5_0 + 1 };   /* the 32-value tile's formats: ks_q4.h's, and Q8_0 */

/* acc + the 4 row sums of c[0..3] times the 16 activations x (chunk q of x against c[q]) */
KS_INLINE int32x4_t ks_il4_dot16(int32x4_t acc, const int8x16_t c[4], int8x16_t x)
{
    acc = vdotq_laneq_s32(acc, c[0], x, 0);
    acc = vdotq_laneq_s32(acc, c[1], x, 1);
    acc = vdotq_laneq_s32(acc, c[2], x, 2);
    return vdotq_laneq_s32(acc, c[3], x, 3);
}

/* acc + the 4 row sums of the block's codes c[0..7] times the 32 activations at xb */
KS_INLINE int32x4_t ks_il4_dot(int32x4_t acc, const int8x16_t c[8], const int8_t *xb)
{
    return ks_il4_dot16(ks_il4_dot16(acc, c, vld1q_s8(xb)), c + 4, vld1q_s8(xb + 16));
}

/* The 4 fp16 at p as floats (a group's scale field) */
KS_INLINE float32x4_t ks_il4_fp16(const uint8_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p)));
}

/* ---- Q4_0, Q4_1, Q5_0 and Q8_0: one 32-value block per field run --------------------------- */

/* Lane i's 4 bytes: all ones where bits s..s+3 of lane i's qh are set, else 0 (Q5_0's high bits
 * of the values whose low bits sit in one code dword) */
KS_INLINE uint8x16_t ks_il4_q5_bits(uint8x16_t qh, const int s)
{
    static const uint8_t lane_byte[16] = {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12};
    const uint8x16_t spread = vqtbl1q_u8(qh, vaddq_u8(vld1q_u8(lane_byte),
                                                      vdupq_n_u8((uint8_t)(s / 8))));
    return vtstq_u8(spread, vreinterpretq_u8_u32(vdupq_n_u32(0x08040201u << (s % 8))));
}

/* The codes of block blk of a group: Q8_0's as they lie; Q4_0's (q - 8) * 16 from its codes
 * ^ 0x88 (ks_il_code_xor); Q5_0's (q - 16) * 8: each nibble shifted in under its high bit,
 * stored inverted (ks_il_code_xor), so that the 5 bits are q ^ 16, q - 16 read as signed;
 * Q4_1's unsigned q. From the 4 dwords of packed nibbles (low nibbles values 4q..4q+3, high
 * ones 16+4q..16+4q+3). */
KS_INLINE void ks_b32_codes_il4(const int f, const uint8_t *blk, int8x16_t c[8])
{
    if (f == KS_IL4_Q8_0) {
        for (int q = 0; q < 8; q++)
            c[q] = vld1q_s8((const int8_t *)blk + 4 * (2 + 4 * q));
        return;
    }
    const int Q = ks_q4x_qs_offset(f);
    const uint8x16_t high = vdupq_n_u8(0xF0);
    if (f == KS_Q4X_Q4_0) {
        for (int q = 0; q < 4; q++) {
            const int8x16_t d = vld1q_s8((const int8_t *)blk + 4 * (Q + 4 * q));
            c[q] = vshlq_n_s8(d, 4);
            c[q + 4] = vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(d), high));
        }
        return;
    }
    if (f == KS_Q4X_Q5_0) {
        const uint8x16_t qh = vld1q_u8(blk + 4 * 2);
        for (int q = 0; q < 4; q++) {
            const uint8x16_t d = vld1q_u8(blk + 4 * (Q + 4 * q));
            c[q] = vreinterpretq_s8_u8(vsriq_n_u8(ks_il4_q5_bits(qh, 4 * q), vshlq_n_u8(d, 4), 1));
            c[q + 4] = vreinterpretq_s8_u8(vsriq_n_u8(ks_il4_q5_bits(qh, 16 + 4 * q),
                                                      vandq_u8(d, high), 1));
        }
        return;
    }
    for (int q = 0; q < 4; q++) {
        const uint8x16_t d = vld1q_u8(blk + 4 * (Q + 4 * q));
        c[q] = vreinterpretq_s8_u8(vandq_u8(d, vdupq_n_u8(15)));
        c[q + 4] = vreinterpretq_s8_u8(vshrq_n_u8(d, 4));
    }
}

/* res[j * 4 + i] = out value of the group g's row i, token j < T (tokens >= tv repeat the last
 * valid one), by ks_q8.h's / ks_q4.h's epilogue. xs (Q4_1): the tile's first token's block
 * sums, nb per token, which its m term takes. Q4_0's and Q5_0's codes come 16 and 8 times over
 * (ks_b32_codes_il4), and so their sums: the fixed-point conversion's fraction bits divide them
 * back exactly. pf (or NULL): block b prefetches its own bytes in the group at pf (the next
 * group, as the one at g lies). */
KS_INLINE void ks_b32_tile_il4(const int f, const int T, const uint8_t *g, const int8_t *x,
                               const float *xd, const int32_t *xs, int tv, int nb, float *res,
                               const uint8_t *pf)
{
    const int B = f == KS_IL4_Q8_0 ? KS_QBLOCK : ks_q4x_block_bytes(f);
    const int8_t *xp[KS_IL4_TOKENS];
    const float *dp[KS_IL4_TOKENS];
    const int32_t *sp[KS_IL4_TOKENS];
    ks_tile_inputs(0, T, NULL, 0, 0, x, xd, xs, tv, nb, NULL, xp, dp, sp);
    float32x4_t acc[KS_IL4_TOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (int64_t)b * 4 * B;
        int8x16_t c[8];
        if (pf)     /* a constant 4 * B bytes: unrolled, no loop */
            ks_prefetch_rows(pf + (int64_t)b * 4 * B, 4 * B, KS_PREFETCH_L2);
        ks_b32_codes_il4(f, blk, c);
        const float32x4_t dw = ks_il4_fp16(blk);
        const float32x4_t dm = f == KS_Q4X_Q4_1 ? ks_il4_fp16(blk + 4 * 2) : vdupq_n_f32(0.0f);
        for (int j = 0; j < T; j++) {
            const int32x4_t s = ks_il4_dot(vdupq_n_s32(0), c, xp[j] + b * KS_QK);
            const float dx = dp[j][b];
            const float32x4_t sf = f == KS_Q4X_Q4_0   ? vcvtq_n_f32_s32(s, 4)
                                 : f == KS_Q4X_Q5_0 ? vcvtq_n_f32_s32(s, 3)
                                                    : vcvtq_f32_s32(s);
            acc[j] = vfmaq_f32(acc[j], sf, vmulq_n_f32(dw, dx));
            if (f == KS_Q4X_Q4_1)
                acc[j] = vfmaq_f32(acc[j], vdupq_n_f32((float)sp[j][b]), vmulq_n_f32(dm, dx));
        }
    }
    for (int j = 0; j < T; j++)
        vst1q_f32(res + 4 * j, acc[j]);
}

/* ---- Q4_K, Q5_K and Q6_K: 256-value superblocks ------------------------------------------- */

/* The codes of activation block s of the group's superblock sbk: Q4_K / Q5_K's unsigned q of
 * sub-block s; Q6_K's 4 * (q - 32): the low nibble to bits 2-5, under the pair of high bits,
 * stored ^ 2 (ks_il_code_xor), at bits 6-7. */
KS_INLINE void ks_kq_codes_il4(const int kind, const uint8_t *sbk, const int s, int8x16_t c[8])
{
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    if (kind == KS_KQ_Q6K) {
        const int h = s / 4, g = s % 4;
        for (int q = 0; q < 8; q++) {
            const uint8x16_t l = vld1q_u8(sbk + 4 * (64 * h + 32 * (g & 1) + 4 * q));
            const uint8x16_t hb = vld1q_u8(sbk + 4 * (128 + 32 * h + 4 * q));
            const uint8x16_t nib = g < 2 ? vshlq_n_u8(l, 4) : vandq_u8(l, vmvnq_u8(m4));
            const uint8x16_t top = g == 0 ? vshlq_n_u8(hb, 6) : g == 1 ? vshlq_n_u8(hb, 4)
                                 : g == 2 ? vshlq_n_u8(hb, 2) : hb;   /* bits 2g, 2g+1 */
            c[q] = vreinterpretq_s8_u8(vsriq_n_u8(top, nib, 2));
        }
        return;
    }
    const int qoff = kind == KS_KQ_Q5K ? 48 : 16;
    for (int q = 0; q < 8; q++) {
        const uint8x16_t d = vld1q_u8(sbk + 4 * (qoff + 32 * (s / 2) + 4 * q));
        uint8x16_t v = s & 1 ? vshrq_n_u8(d, 4) : vandq_u8(d, m4);
        if (kind == KS_KQ_Q5K)
            v = vorrq_u8(v, vandq_u8(vtstq_u8(vld1q_u8(sbk + 4 * (16 + 4 * q)),
                                              vdupq_n_u8((uint8_t)(1 << s))), vdupq_n_u8(0x10)));
        c[q] = vreinterpretq_s8_u8(v);
    }
}

/* Q6_K: the int8 scales of block s's two halves (sc[2s], sc[2s+1]) of each lane's row */
KS_INLINE void ks_q6k_scales_il4(const uint8_t *sbk, const int s, int32x4_t *sa, int32x4_t *sb)
{
    const int32x4_t v = vld1q_s32((const int32_t *)(sbk + 4 * (192 + 4 * (s / 2))));
    const int byte = 2 * (s % 2);            /* of the lanes' dword; sign-extended below */
    *sa = vshrq_n_s32(vshlq_s32(v, vdupq_n_s32(24 - 8 * byte)), 24);
    *sb = vshrq_n_s32(vshlq_s32(v, vdupq_n_s32(16 - 8 * byte)), 24);
}

/* res[j * 4 + i] = out value of the group g's row i, token j < T (tokens >= tv repeat the last
 * valid one), over nsb superblocks, by ks_kquants.h's epilogue. xs (Q4_K, Q5_K): the tile's
 * first token's scaled block sums (ks_q8_block_sums), nsb * 8 per token. pf (or NULL):
 * superblock sb prefetches its own bytes in the group at pf (the next group), an eighth per
 * block. */
KS_INLINE void ks_kq_tile_il4(const int kind, const int T, const uint8_t *g, const int8_t *x,
                              const float *xd, const float *xs, int tv, int nsb, float *res,
                              const uint8_t *pf)
{
    const int bytes = ks_kq_bytes(kind);
    ks_kq_tile_ptrs P;
    ks_kq_tile_ptrs_of(0, T, NULL, 0, 0, x, xd, xs, tv, nsb * 8, &P);
    float32x4_t acc[KS_IL4_TOKENS];
    for (int j = 0; j < T; j++)
        acc[j] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *sbk = g + (int64_t)sb * 4 * bytes;
        /* Q4_K / Q5_K: the packed scales and mins, made into each block's floats as it comes
         * (16 vectors held through the superblock would spill); Q6_K: d in d for all blocks */
        uint32x4_t sc[2], mn[2];
        const float32x4_t d = ks_il4_fp16(sbk + 4 * (kind == KS_KQ_Q6K ? 208 : 0));
        const float32x4_t ndmin = kind == KS_KQ_Q6K ? d : vnegq_f32(ks_il4_fp16(sbk + 4 * 2));
        if (kind != KS_KQ_Q6K) {
            const uint32x4_t r[3] = {vld1q_u32((const uint32_t *)(sbk + 4 * 4)),
                                     vld1q_u32((const uint32_t *)(sbk + 4 * 8)),
                                     vld1q_u32((const uint32_t *)(sbk + 4 * 12))};
            ks_kq_scale_words_neon(r, sc, mn);
        }
        /* unrolled: each block's offsets and shifts become constants */
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const int b = sb * 8 + s;
            int8x16_t c[8];
            int32x4_t sc_lo = vdupq_n_s32(0), sc_hi = vdupq_n_s32(0);
            if (pf)
                ks_prefetch_rows(pf + (int64_t)sb * 4 * bytes + s * (4 * bytes / 8), 4 * bytes / 8,
                                 ks_kq_prefetch_l2(kind, 4));
            ks_kq_codes_il4(kind, sbk, s, c);
            const float32x4_t ds = kind == KS_KQ_Q6K ? d : ks_kq_scale_neon(sc, s, d);
            const float32x4_t dm = kind == KS_KQ_Q6K ? d : ks_kq_scale_neon(mn, s, ndmin);
            if (kind == KS_KQ_Q6K)
                ks_q6k_scales_il4(sbk, s, &sc_lo, &sc_hi);
            for (int j = 0; j < T; j++) {
                const int8_t *xb = P.x[j] + b * KS_QK;
                const float dx = P.xd[j][b];
                if (kind == KS_KQ_Q6K) {
                    /* sc[2s] * (the sum over values 0..15) + sc[2s+1] * (over 16..31) */
                    const int32x4_t lo = ks_il4_dot16(vdupq_n_s32(0), c, vld1q_s8(xb));
                    const int32x4_t hi = ks_il4_dot16(vdupq_n_s32(0), c + 4, vld1q_s8(xb + 16));
                    const int32x4_t isum = vmlaq_s32(vmulq_s32(lo, sc_lo), hi, sc_hi);
                    /* the codes' factor 4 goes in the conversion's 2 fraction bits, exactly */
                    acc[j] = vfmaq_f32(acc[j], vcvtq_n_f32_s32(isum, 2), vmulq_n_f32(ds, dx));
                } else {
                    const int32x4_t isum = ks_il4_dot(vdupq_n_s32(0), c, xb);
                    acc[j] = vfmaq_f32(acc[j], vcvtq_f32_s32(isum), vmulq_n_f32(ds, dx));
                    acc[j] = vfmaq_n_f32(acc[j], dm, P.xs[j][b]);
                }
            }
        }
    }
    for (int j = 0; j < T; j++)
        vst1q_f32(res + 4 * j, acc[j]);
}

/* ---- the products (KS_ROWS_PARAMS; r0 a multiple of 4, row r's group at w + r * w_stride) -- */

/* Decode in 4 x 1 tiles, each prefetching the next group's blocks as it goes (as the rows'
 * decode tiles do); prefill in tiles of 4 rows x 8 tokens (x 4, 2 or 1 for the last few:
 * KS_TOKEN_TILES, which prefetches as decode does in a pass of a few tokens) over blocks of
 * KS_PREFILL_TOKEN_BLOCK tokens. kind: a ks_kquants.h kind (kq), else a 32-value
 * format. */
KS_INLINE void ks_il4_matmul_rows(const int kq, const int kind, KS_ROWS_PARAMS)
{
    const int nb = k / KS_QK, tblock = n == 1 ? 1 : KS_PREFILL_TOKEN_BLOCK;
    /* the token block's activation block sums: int (Q4_1), float and scaled (Q4_K, Q5_K), as
     * the rows' products take them */
    const int sums = kq ? kind != KS_KQ_Q6K : kind == KS_Q4X_Q4_1;
    int32_t xsi[!kq && sums ? tblock * nb : 1];
    float xsf[kq && sums ? tblock * nb : 1], res[4 * KS_IL4_TOKENS];
#define KS_IL4_TILE(T, t, tv, pf)                                                                \
    (kq ? ks_kq_tile_il4(kind, T, w + (int64_t)r * w_stride, x->q + (int64_t)(t) * k,          \
                         x->d + (int64_t)(t) * nb, sums ? xsf + ((t) - tb) * nb : NULL, tv,    \
                         nb / 8, res, pf)                                                       \
        : ks_b32_tile_il4(kind, T, w + (int64_t)r * w_stride, x->q + (int64_t)(t) * k,         \
                          x->d + (int64_t)(t) * nb, sums ? xsi + ((t) - tb) * nb : NULL, tv, nb, \
                          res, pf))
    for (int tb = 0; tb < n; tb += tblock) {
        const int te = tb + tblock < n ? tb + tblock : n;
        if (sums && kq)
            ks_q8_block_sums(x->h + (int64_t)tb * 2 * nb, x->d + (int64_t)tb * nb, (te - tb) * nb,
                             xsf);
        else if (sums)
            ks_q4x_block_sums(x->h + (int64_t)tb * 2 * nb, (int64_t)(te - tb) * nb, xsi);
        for (int r = r0; r < r1; r += 4) {
            const int rv = r1 - r < 4 ? r1 - r : 4;
            if (n == 1) {
                const uint8_t *next = r + 4 < m ? w + (int64_t)(r + 4) * w_stride : NULL;
                KS_IL4_TILE(1, tb, 1, next);
                ks_q8_store_tile(4, 1, res, out, m, r, rv, 0, 1);
                continue;
            }
            const uint8_t *pf = n <= KS_PREFETCH_TOKENS && r + 4 < m
                                ? w + (int64_t)(r + 4) * w_stride : NULL;
            KS_TOKEN_TILES(4, KS_IL4_TOKENS, KS_IL4_TILE)
        }
    }
#undef KS_IL4_TILE
}

static void ks_q4_0_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(0, KS_Q4X_Q4_0, KS_ROWS_ARGS); }
static void ks_q4_1_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(0, KS_Q4X_Q4_1, KS_ROWS_ARGS); }
static void ks_q5_0_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(0, KS_Q4X_Q5_0, KS_ROWS_ARGS); }
static void ks_q8_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(0, KS_IL4_Q8_0, KS_ROWS_ARGS); }
static void ks_q4k_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(1, KS_KQ_Q4K, KS_ROWS_ARGS); }
static void ks_q5k_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(1, KS_KQ_Q5K, KS_ROWS_ARGS); }
static void ks_q6k_matmul_rows_x4(KS_ROWS_PARAMS)
{ ks_il4_matmul_rows(1, KS_KQ_Q6K, KS_ROWS_ARGS); }

#define KS_NEON_IL_ROWS(fn) fn       /* a type's product on 4-row groups, for ks_weights.h */
#else
#define KS_NEON_IL_ROWS(fn) NULL
#endif

#endif /* KS_IL4_NEON_H */
