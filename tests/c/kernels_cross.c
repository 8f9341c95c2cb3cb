/* Cross-architecture check of the kernel headers (no Python): the same pseudo-random inputs on
 * x86-64 (AVX2 or plain) and aarch64 (NEON, NEON dotprod) must give
 *   - the same quantization, dequantized rows and product bits of every weight type the
 *     kernels compute on, on every path (printed as hashes),
 *   - a SIMD product equal bit for bit to the plain one on this machine (checked here),
 *   - attention outputs equal to within float rounding (printed as values).
 * Build and run: see tests/c/run_cross.sh. */
#include <stdio.h>
#include <stdlib.h>

#include "ks_weights.h"
#include "ks_attention.h"

static uint32_t rng_state = 12345u;
static uint32_t rnd(void) { rng_state = rng_state * 1664525u + 1013904223u; return rng_state >> 8; }
static float rnd_f(void) { return (float)rnd() / 16777216.0f * 2.0f - 1.0f; }   /* [-1, 1) */

static uint64_t fnv(const void *p, size_t n, uint64_t h)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The fp16 scales of one block of each type: their offsets (-1 ends the list); the rest of
 * a block is any bytes: every bit pattern of the codes is a valid block. */
static const int *scale_offsets(int type)
{
    static const int d[] = {0, -1}, dm[] = {0, 2, -1}, q6k[] = {208, -1};
    switch (type) {
    case KS_TYPE_Q4_1: case KS_TYPE_Q4_K: case KS_TYPE_Q5_K: return dm;
    case KS_TYPE_Q6_K: return q6k;
    default: return d;                      /* Q8_0, Q4_0, Q5_0 */
    }
}

static int check_matmul(int type, int n, int m, int k)
{
    const int nb = k / KS_QK, bb = ks_type(type)->block_bytes, nwb = k / ks_type_block(type);
    const int64_t rb = ks_type_row_bytes(type, k);
    uint8_t *w = malloc((size_t)m * rb);
    float *x = malloc(sizeof(float) * n * k), *xd = malloc(sizeof(float) * n * nb);
    int8_t *xq = malloc((size_t)n * k);
    float *out = calloc((size_t)n * m, sizeof(float)), *ref = calloc((size_t)n * m, sizeof(float));
    float *deq = malloc(sizeof(float) * m * k);
    for (int64_t i = 0; i < m * rb; i++) w[i] = (uint8_t)rnd();     /* any byte, -128 too */
    for (int i = 0; i < m * nwb; i++)
        for (const int *o = scale_offsets(type); *o >= 0; o++) {
            uint8_t *p = w + (size_t)i * bb + *o;
            uint16_t h = (uint16_t)(0x2000 + rnd() % 0x1000);   /* fp16 scales ~1e-3..1e-2 */
            if (i % 17 == 3) h = (uint16_t)(rnd() % 0x400);     /* subnormal */
            if (rnd() % 4 == 0) h |= 0x8000;                    /* negative */
            p[0] = h & 0xff; p[1] = h >> 8;
        }
    for (int i = 0; i < n * k; i++) x[i] = rnd_f() * 3.0f;
    for (int t = 0; t < n; t++) ks_quantize_row_q8_0(x + (size_t)t * k, xq + (size_t)t * k, xd + (size_t)t * nb, k);
    const ks_matrix W = {w, rb, 0, type, m, k, 1};
    ks_matrix_rows_plain(&W, 0, xq, xd, n, ref, 0, m);
    ks_set_vnni(0);                         /* the AVX2 tiles, then VNNI where the CPU has it */
    ks_matrix_rows(&W, 0, xq, xd, n, out, 0, m);
    int same = memcmp(out, ref, sizeof(float) * n * m) == 0;
    ks_set_vnni(1);
    ks_matrix_rows(&W, 0, xq, xd, n, out, 0, m);
    same &= memcmp(out, ref, sizeof(float) * n * m) == 0;
    for (int r = 0; r < m; r++) ks_matrix_dequant_row(&W, 0, r, deq + (size_t)r * k);
    uint64_t hq = fnv(xd, sizeof(float) * n * nb, fnv(xq, (size_t)n * k, 14695981039346656037ull));
    printf("quantize n=%d k=%d hash %016llx\n", n, k, (unsigned long long)hq);
    printf("type %d dequant m=%d k=%d hash %016llx\n", type, m, k,
           (unsigned long long)fnv(deq, sizeof(float) * m * k, 14695981039346656037ull));
    printf("type %d matmul n=%d m=%d k=%d hash %016llx simd==plain %s\n", type, n, m, k,
           (unsigned long long)fnv(out, sizeof(float) * n * m, 14695981039346656037ull), same ? "yes" : "NO");
    free(w); free(x); free(xd); free(xq); free(out); free(ref); free(deq);
    return same;
}

static void check_attention(int n, int pos0, int n_heads, int n_kv, int hd, int kv_bs)
{
    const int max_seq = pos0 + n, G = n_heads / n_kv;
    int8_t *kq = malloc((size_t)n_kv * max_seq * hd), *vq = malloc((size_t)n_kv * max_seq * hd);
    float *ks = malloc(sizeof(float) * n_kv * max_seq), *vs = malloc(sizeof(float) * n_kv * max_seq);
    float *row = malloc(sizeof(float) * hd);
    float *q = malloc(sizeof(float) * n * n_heads * hd), *out = malloc(sizeof(float) * n * n_heads * hd);
    for (int g = 0; g < n_kv; g++)
        for (int p = 0; p < max_seq; p++) {
            for (int d = 0; d < hd; d++) row[d] = rnd_f() * 2.0f;
            ks[g * max_seq + p] = ks_quantize_head(row, kq + ((size_t)g * max_seq + p) * hd, hd);
            for (int d = 0; d < hd; d++) row[d] = rnd_f();
            vs[g * max_seq + p] = ks_quantize_head(row, vq + ((size_t)g * max_seq + p) * hd, hd);
        }
    for (int i = 0; i < n * n_heads * hd; i++) q[i] = rnd_f();
    const float scale = 1.0f / sqrtf((float)hd);
    if (n == 1) {
        const int split = ks_attn_split_len(pos0 + 1, kv_bs), nsplit = (pos0 + split) / split;
        float *parts = malloc(sizeof(float) * n_kv * nsplit * ks_attn_part_floats(G, hd));
        float *scratch = malloc(sizeof(float) * ks_attn_scratch_floats(G, hd, kv_bs));
        for (int it = 0; it < n_kv * nsplit; it++)
            ks_attn_decode_item(q, kq, ks, vq, vs, parts + it * ks_attn_part_floats(G, hd), n_heads,
                                n_kv, hd, max_seq, pos0, scale, kv_bs, split, it % nsplit,
                                it / nsplit, scratch);
        for (int h = 0; h < n_heads; h++)
            ks_attn_decode_merge(parts, out, n_heads, n_kv, hd, nsplit, h);
        free(parts); free(scratch);
    } else {
        float *scratch = malloc(sizeof(float) * ks_attn_scratch_floats(KS_ATTN_TOKENS * G, hd, kv_bs));
        for (int t0 = 0; t0 < n; t0 += KS_ATTN_TOKENS)
            for (int g = 0; g < n_kv; g++)
                ks_attn_prefill_item(q, kq, ks, vq, vs, out, n_heads, n_kv, hd, max_seq, pos0,
                                     scale, kv_bs, t0, t0 + KS_ATTN_TOKENS < n ? t0 + KS_ATTN_TOKENS : n,
                                     g, scratch);
        free(scratch);
    }
    printf("attention n=%d pos0=%d heads=%d/%d hd=%d kv_bs=%d:", n, pos0, n_heads, n_kv, hd, kv_bs);
    for (int i = 0; i < n * n_heads * hd; i += (n * n_heads * hd) / 5 + 1) printf(" %.7e", out[i]);
    printf("\n");
    free(kq); free(vq); free(ks); free(vs); free(row); free(q); free(out);
}

int main(void)
{
    int ok = 1;
    printf("path %s\n", ks_simd_path());
    for (int i = 0; i < KS_N_TYPES; i++) {
        const int type = ks_types[i].type;
        if (!ks_type_supported(type))
            continue;                       /* MoE routers' F32: float dot products, not here */
        ok &= check_matmul(type, 1, 67, 2048);
        ok &= check_matmul(type, 3, 33, 256);
        ok &= check_matmul(type, 37, 130, 512);
    }
    check_attention(1, 900, 4, 2, 64, 32);
    check_attention(19, 40, 6, 2, 128, 16);
    return ok ? 0 : 1;
}
