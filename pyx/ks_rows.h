/* Kestrel kernels: the per-row float kernels (dot product, RMSNorm, RoPE, scaled add), shared
 * by the per-op Python entry points, the forward pass and the MoE routing (no Python here). */
#ifndef KS_ROWS_H
#define KS_ROWS_H

#include "ks_common.h"

/* a . b over d floats. 8 partial sums: they vectorize and add less rounding than one sum. */
static inline float ks_dot_f32(const float *a, const float *b, int64_t d)
{
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int j = 0; j < 8; j++)
            part[j] += a[i + j] * b[i + j];
    for (; i < d; i++)
        part[0] += a[i] * b[i];
    float s = 0.0f;
    for (int j = 0; j < 8; j++)
        s += part[j];
    return s;
}

/* out (d) = x / sqrt(mean(x^2) + eps) * w; out may be x. */
static inline void ks_rmsnorm_row(const float *x, const float *w, float eps, float *out, int64_t d)
{
    const float inv = 1.0f / sqrtf(ks_dot_f32(x, x, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++)
        out[i] = x[i] * inv * w[i];
}

/* Rotates one head row (hd) in place with the position's tables ct, st (hd/2).
 * neox: pairs (x[i], x[i + hd/2]); else pairs (x[2i], x[2i+1]). */
static inline void ks_rope_row(float *row, const float *ct, const float *st, int64_t hd, int neox)
{
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float c = ct[i], s = st[i];
        float *p0 = neox ? row + i : row + 2 * i;
        float *p1 = neox ? row + i + half : row + 2 * i + 1;
        const float x0 = *p0, x1 = *p1;
        /* the fused form spelled out: left to the compiler, x86-64 and aarch64 contract
           these into FMAs differently, and the last bit differs between the machines */
        *p0 = KS_FMADD(x0, c, -(x1 * s));
        *p1 = KS_FMADD(x0, s, x1 * c);
    }
}

/* x (d) += w * y: one rounding per element (KS_FMADD), so w = 1 is exactly x + y. */
static inline void ks_add_scaled(float *x, const float *y, float w, int64_t d)
{
    for (int64_t i = 0; i < d; i++)
        x[i] = KS_FMADD(w, y[i], x[i]);
}

#endif /* KS_ROWS_H */
