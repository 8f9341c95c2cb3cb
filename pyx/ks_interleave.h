/* Kestrel kernels: interleaved groups of weight rows (no Python here), the layout the
 * products' tiles load as vectors: the loader interleaves a dense matrix into groups of as many
 * rows as the CPU's tiles take (16 with AVX512-VNNI, 8 with AVX2, 4 on aarch64 with sdot), and
 * the MoE experts' copies (ks_expert_copy.h) are made so too.
 *
 * A type's block is a run of fields: fp16_head 2-byte fields, then 4-byte ones (a last 2 bytes
 * are one more field: Q6_K's d). Group g of a matrix interleaved by W rows holds rows g*W ..
 * g*W + W - 1 in the bytes of those W rows; its block b holds each field of the W rows' blocks
 * b side by side: row i's field at offset o of its block sits at g's block b + W * o + i * (the
 * field's size). A field at offset o of the block thus becomes one W-lane vector at W * o (fp16
 * scales, Q5_0's high bits, dwords of codes). Rows past the matrix's end are zero. */
#ifndef KS_INTERLEAVE_H
#define KS_INTERLEAVE_H

#include <string.h>

#include "ks_weights.h"

/* What the 4-byte fields at block offsets lo <= o < hi are xor-ed with (x) in a type's groups
 * of W rows. In the 4-row groups (the NEON dotprod tile's) the codes are stored so that,
 * shifted to the top of a byte, they read as signed q - offset times a power of two, with no
 * offset term:
 *   Q4_0's codes ^ 0x88: each nibble is q ^ 8, a signed (q - 8) at the top (llama.cpp's ARM
 *       repack of Q4_0 stores them so too);
 *   Q5_0's high bits (the dword at 2) inverted: each 5-bit q ^ 16, a signed (q - 16);
 *   Q6_K's high bits (bytes 128..191) ^ 0xAA, the top bit of each pair: each 6-bit q ^ 32, a
 *       signed (q - 32).
 * The same xor undoes it. */
typedef struct {
    uint32_t x;
    int lo, hi;
} ks_il_xor;

static inline ks_il_xor ks_il_code_xor(int type, const int W)
{
    const ks_il_xor none = {0, 0, 0};
    if (W != 4)
        return none;
    switch (type) {
    case KS_TYPE_Q4_0: return (ks_il_xor){0x88888888u, 0, ks_types[type].block_bytes};
    case KS_TYPE_Q5_0: return (ks_il_xor){0xFFFFFFFFu, 2, 6};
    case KS_TYPE_Q6_K: return (ks_il_xor){0xAAAAAAAAu, 128, 192};
    default: return none;
    }
}

#if defined(KS_NEON) || defined(KS_NEON_DOT)
/* The first words - words % 4 words of 4 rows (row i's at src + i * rb) into a 4-row group's
 * word fields at dst (word k of row i at dst + 16 * k + 4 * i), xor-ed as x says for the
 * block offset head + 4 * k, 4 at a time: the 4 rows' next 16 bytes, transposed as 4 x 4
 * words, are the group's next 64. Returns how many it copied. */
static inline int ks_il4_copy_words(uint8_t *dst, const uint8_t *src, int64_t rb, int words,
                                    int head, ks_il_xor x)
{
    int k = 0;
    for (; k + 4 <= words; k += 4) {
        uint32x4_t a[4], t[4];
        for (int i = 0; i < 4; i++)
            a[i] = vld1q_u32((const uint32_t *)(src + i * rb + 4 * k));
        t[0] = vtrn1q_u32(a[0], a[1]);
        t[1] = vtrn2q_u32(a[0], a[1]);
        t[2] = vtrn1q_u32(a[2], a[3]);
        t[3] = vtrn2q_u32(a[2], a[3]);
        for (int j = 0; j < 4; j++) {     /* word k + j of the 4 rows */
            const uint64x2_t lo = vreinterpretq_u64_u32(t[j % 2]);
            const uint64x2_t hi = vreinterpretq_u64_u32(t[j % 2 + 2]);
            const int o = head + 4 * (k + j);
            vst1q_u32((uint32_t *)(dst + 16 * (k + j)),
                      veorq_u32(vreinterpretq_u32_u64(j < 2 ? vtrn1q_u64(lo, hi)
                                                            : vtrn2q_u64(lo, hi)),
                                vdupq_n_u32(o >= x.lo && o < x.hi ? x.x : 0)));
        }
    }
    return k;
}
#endif

/* Rows i0 .. i1 - 1 of a group (W rows of nb blocks) between the rows' layout, row i at
 * rows + (i - i0) * rb, and the interleaved one at il; back: il -> rows, else rows -> il (the
 * group's other rows then zero: rows past the matrix's end). The 4-byte fields, most of a
 * block, go as words in loops of their own (on NEON a whole 4-row group's by transposes): a
 * load at start-up copies every dense matrix so, and the NEON products copy the experts they
 * multiply. */
static inline void ks_interleave_group(int type, const int W, int nb, uint8_t *il,
                                       uint8_t *rows, int i0, int i1, int back)
{
    const ks_type_ops *t = &ks_types[type];
    const int B = t->block_bytes, head = 2 * t->fp16_head, words = (B - head) / 4;
    const int64_t rb = (int64_t)nb * B;
    const ks_il_xor x = ks_il_code_xor(type, W);
    if (!back && (i0 > 0 || i1 < W))
        memset(il, 0, (size_t)W * rb);
    for (int b = 0; b < nb; b++) {
        uint8_t *g = il + (int64_t)b * W * B;
        int k0 = 0;     /* words already copied (and xor-ed) for every row */
#if defined(KS_NEON) || defined(KS_NEON_DOT)
        if (!back && W == 4 && i0 == 0 && i1 == 4)
            k0 = ks_il4_copy_words(g + 4 * head, rows + (int64_t)b * B + head, rb, words, head,
                                   x);
#endif
        for (int i = i0; i < i1; i++) {
            uint8_t *r = rows + (i - i0) * rb + (int64_t)b * B;
#define KS_IL_FIELD(o, size) (back ? memcpy(r + (o), g + W * (o) + (size) * i, size) \
                                   : memcpy(g + W * (o) + (size) * i, r + (o), size))
            for (int o = 0; o < head; o += 2)
                KS_IL_FIELD(o, 2);
            uint8_t *gw = g + W * head + 4 * i, *rw = r + head;   /* the words */
            for (int k = k0; k < words; k++)
                memcpy(back ? rw + 4 * k : gw + 4 * W * k, back ? gw + 4 * W * k : rw + 4 * k, 4);
            for (int o = x.lo < head + 4 * k0 ? head + 4 * k0 : x.lo; o + 4 <= x.hi; o += 4) {
                uint8_t *f = back ? r + o : g + W * o + 4 * i;
                uint32_t v;
                memcpy(&v, f, 4);
                v ^= x.x;
                memcpy(f, &v, 4);
            }
            if ((B - head) % 4)
                KS_IL_FIELD(B - 2, 2);
#undef KS_IL_FIELD
        }
    }
}

/* The rows per group in which matrices of this type are interleaved on this CPU: 16 where
 * the AVX512-VNNI product on such groups runs, 8 where the AVX2 one does, 4 where the NEON
 * dotprod one does, 0 if none. */
static inline int ks_il_rows(int type)
{
    const ks_type_ops *t = ks_type(type);
    if (t == NULL)
        return 0;
    return t->rows_il16 != NULL && ks_use_vnni() ? 16 : t->rows_il8 != NULL ? 8
           : t->rows_il4 != NULL ? 4 : 0;
}

/* dst := src (rows x cols of type `type`, rows as GGUF lays them out) interleaved by
 * W = ks_il_rows(type) > 0: dst holds ceil(rows / W) groups of W rows' bytes. */
static inline void ks_interleave_rows(int type, const uint8_t *src, int rows, int cols,
                                      uint8_t *dst)
{
    const ks_type_ops *t = ks_type(type);
    const int nb = cols / t->block, W = ks_il_rows(type);
    const int64_t gb = (int64_t)W * nb * t->block_bytes;
    for (int g = 0; g * W < rows; g++)
        ks_interleave_group(type, W, nb, dst + g * gb, (uint8_t *)src + g * gb, 0,
                            rows - g * W < W ? rows - g * W : W, 0);
}

/* The product on groups of W interleaved rows of the type on this CPU (ks_il_rows). */
static inline ks_rows_fn ks_il_product(const ks_type_ops *t, int W)
{
    return W == 16 ? t->rows_il16 : W == 8 ? t->rows_il8 : W == 4 ? t->rows_il4 : NULL;
}

#endif /* KS_INTERLEAVE_H */
