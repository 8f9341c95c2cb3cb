/* Kestrel kernels: scalar helpers shared by every kernel family (no Python here).
 *
 * Which SIMD path a build takes is decided once, here, from the compiler's target macros:
 *   KS_AVX2       x86-64 with AVX2 (setup.py passes -mavx2 -mfma -mf16c)
 *   KS_NEON_DOT   aarch64 with the sdot instruction (vdotq_s32, Cortex-A76 and later)
 *   KS_NEON       aarch64 without it
 * and the plain C path is always compiled too (it is the reference the SIMD paths must match
 * bit for bit, and the only path elsewhere).
 */
#ifndef KS_COMMON_H
#define KS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#  include <immintrin.h>
#endif
#if defined(__AVX2__)
#  define KS_AVX2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#  include <arm_neon.h>
#  if defined(__ARM_FEATURE_DOTPROD)
#    define KS_NEON_DOT 1
#  else
#    define KS_NEON 1
#  endif
#endif

/* A spinning wait's pause (x86 pause, aarch64 yield): it eases the pipeline and lets a sibling
 * hyperthread run. */
static inline void ks_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* acc + a*b with the one rounding every path uses. Where the CPU has FMA, the plain path
 * calls fmaf (inlined to one instruction) and the SIMD paths use vector FMA; where it has
 * not, nobody fuses. Writing it out keeps -ffp-contract from deciding for us. */
#if defined(__FMA__) || defined(__aarch64__)
#  define KS_HAS_FMA 1
#  define KS_FMADD(a, b, acc) fmaf((a), (b), (acc))
#else
#  define KS_FMADD(a, b, acc) ((a) * (b) + (acc))
#endif

static inline const char *ks_simd_path(void)
{
#if defined(KS_AVX2)
    return "avx2";
#elif defined(KS_NEON_DOT)
    return "neon-dotprod";
#elif defined(KS_NEON)
    return "neon";
#else
    return "plain";
#endif
}

/* IEEE half -> float, exact (every half is a float). Portable bit manipulation. */
static inline float ks_fp16_to_f32_plain(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {                 /* inf / nan */
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {              /* normal */
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {              /* +-0 */
        bits = sign;
    } else {                            /* subnormal: value = man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t ks_load_u16le(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* The hardware conversion where there is one; same value as the plain one. */
static inline float ks_fp16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#else
    return ks_fp16_to_f32_plain(h);
#endif
}

/* roundf (halves away from zero) without a libm call, so loops over it vectorize:
 * x - trunc(x) is exact for every float, so the test against 0.5 is exact too. */
static inline float ks_round_half_away(float x)
{
    float t = truncf(x);
    return fabsf(x - t) >= 0.5f ? t + copysignf(1.0f, x) : t;
}

/* ---- 8 floats as one value: GCC/Clang vector extensions, lowered to one AVX2 register or
 * two NEON registers (two SSE registers on a plain x86-64 build). Hot float loops use these
 * rather than hoping the auto-vectorizer picks the right loop. On aarch64 GCC keeps one that
 * lives across a loop's iterations on the stack, so the attention core carries 4-float
 * vectors there (ks_attention.h). ---- */
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic ignored "-Wpsabi"   /* ks_v8 only passes between static inline functions */
#endif
typedef float ks_v8 __attribute__((vector_size(32)));
typedef int32_t ks_v8i __attribute__((vector_size(32)));
typedef float ks_v8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

#if defined(__clang__)
#  define KS_SHUFFLE2(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#  define KS_SHUFFLE2(a, b, ...) __builtin_shuffle((a), (b), (ks_v8i){__VA_ARGS__})
#endif

static inline ks_v8 ks_v8_load(const float *p) { return *(const ks_v8_unaligned *)p; }
static inline void ks_v8_store(float *p, ks_v8 v) { *(ks_v8_unaligned *)p = v; }

#if defined(KS_NEON) || defined(KS_NEON_DOT)
/* dst[0..8) = the 8 int16 of h (int8 values) as floats, exactly */
static inline void ks_f32x8_of_s16(float *dst, int16x8_t h)
{
#if defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC)
    /* via half floats (exact below 2048): one conversion for 8 lanes, not two */
    const float16x8_t f = vcvtq_f16_s16(h);
    vst1q_f32(dst, vcvt_f32_f16(vget_low_f16(f)));
    vst1q_f32(dst + 4, vcvt_high_f32_f16(f));
#else
    vst1q_f32(dst, vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))));
    vst1q_f32(dst + 4, vcvtq_f32_s32(vmovl_high_s16(h)));
#endif
}
#endif

/* dst[0..n) = the n int8 at src as floats, n a multiple of 8 (exact; spelled out per target:
 * GCC builds the generic conversion of an 8-byte vector lane by lane in general registers) */
static inline void ks_f32_of_i8(float *restrict dst, const int8_t *restrict src, int64_t n)
{
    int64_t e = 0;
#if defined(KS_AVX2)
    for (; e < n; e += 8)
        _mm256_storeu_ps(dst + e, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64((const __m128i *)(src + e)))));
#elif defined(KS_NEON) || defined(KS_NEON_DOT)
    for (; e + 16 <= n; e += 16) {
        const int8x16_t b = vld1q_s8(src + e);
        ks_f32x8_of_s16(dst + e, vmovl_s8(vget_low_s8(b)));
        ks_f32x8_of_s16(dst + e + 8, vmovl_high_s8(b));
    }
    for (; e < n; e += 8)
        ks_f32x8_of_s16(dst + e, vmovl_s8(vld1_s8(src + e)));
#endif
    for (; e < n; e++)
        dst[e] = (float)src[e];
}
static inline ks_v8 ks_v8_set1(float x) { return (ks_v8){x, x, x, x, x, x, x, x}; }

/* mask ? a : b, lane by lane (mask lanes are all ones or zero, as comparisons give) */
static inline ks_v8 ks_v8_select(ks_v8i mask, ks_v8 a, ks_v8 b)
{
    return (ks_v8)((mask & (ks_v8i)a) | (~mask & (ks_v8i)b));
}

/* a < b lane by lane, as all-ones / zero int lanes. GCC lowers a comparison of these 8-float
 * vectors lane by lane in general registers where vectors are 128 bits wide (NEON); the two
 * halves compared by NEON give the same masks. */
static inline ks_v8i ks_v8_lt(ks_v8 a, ks_v8 b)
{
#if defined(KS_NEON) || defined(KS_NEON_DOT)
    float32x4_t h[4];
    memcpy(h, &a, sizeof a);
    memcpy(h + 2, &b, sizeof b);
    const uint32x4_t m[2] = {vcltq_f32(h[0], h[2]), vcltq_f32(h[1], h[3])};
    ks_v8i r;
    memcpy(&r, m, sizeof r);
    return r;
#else
    return a < b;
#endif
}

static inline ks_v8 ks_v8_max(ks_v8 a, ks_v8 b) { return ks_v8_select(ks_v8_lt(b, a), a, b); }

static inline ks_v8 ks_v8_abs(ks_v8 v) { return (ks_v8)((ks_v8i)v & 0x7fffffff); }

static inline float ks_v8_hmax(ks_v8 v)
{
    float r = v[0];
    for (int u = 1; u < 8; u++)
        r = v[u] > r ? v[u] : r;
    return r;
}

static inline float ks_v8_hsum(ks_v8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* lane k of the result = the sum of the lanes of p[k]: three rounds of pairwise adds */
static inline ks_v8 ks_v8_hsum8(const ks_v8 p[8])
{
    ks_v8 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = KS_SHUFFLE2(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + KS_SHUFFLE2(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = KS_SHUFFLE2(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + KS_SHUFFLE2(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return KS_SHUFFLE2(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + KS_SHUFFLE2(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* max |x[i]| over n floats. In vector registers: fmaxf in a loop does not vectorize (NaN
 * rules) and may even be a libm call. */
static inline float ks_absmax(const float *x, int n)
{
    ks_v8 m = ks_v8_set1(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        m = ks_v8_max(m, ks_v8_abs(ks_v8_load(x + i)));
    float r = ks_v8_hmax(m);
    for (; i < n; i++)
        r = fabsf(x[i]) > r ? fabsf(x[i]) : r;
    return r;
}

/* q[0..8) = (int8) ks_round_half_away(v) lane by lane, for |v| <= 127.5: trunc through int32 is
 * exact there, so this equals the scalar rounding. NEON's fcvtas rounds half away from zero
 * itself (GCC would build the generic code's comparisons and 8 stores lane by lane). */
static inline void ks_v8_round_i8(ks_v8 v, int8_t *q)
{
#if defined(KS_NEON) || defined(KS_NEON_DOT)
    float32x4_t h[2];
    memcpy(h, &v, sizeof v);
    const int16x8_t w = vcombine_s16(vmovn_s32(vcvtaq_s32_f32(h[0])),
                                     vmovn_s32(vcvtaq_s32_f32(h[1])));
    vst1_s8(q, vmovn_s16(w));
#else
    const ks_v8i ti = __builtin_convertvector(v, ks_v8i);
    const ks_v8 frac = v - __builtin_convertvector(ti, ks_v8);
    const ks_v8i away = (ks_v8i)(ks_v8_abs(frac) >= 0.5f);     /* all ones where it rounds */
    const ks_v8i r = ti + (away & ((ks_v8i)(v < 0.0f) | 1));   /* +-1 in v's direction */
    for (int u = 0; u < 8; u++)
        q[u] = (int8_t)r[u];
#endif
}

/* exp(x) for softmax weights and SiLU: Cephes polynomial, about 2 ulp on [-87, 88], exactly 0
 * below -87 (and for -inf), exp(88) above 88. Defined by KS_DEFINE_EXP for a float vector type
 * V, the int32 vector type VI of its width and its lane comparison LT (a < b), so that every
 * width computes the same bits. */
#define KS_VSELECT(V, VI, mask, a, b) ((V)(((VI)(mask) & (VI)(a)) | (~(VI)(mask) & (VI)(b))))
#define KS_DEFINE_EXP(name, V, VI, LT)                                                        \
    static inline V name(V x)                                                                 \
    {                                                                                         \
        const V hi = (V){0} + 88.0f, lo = (V){0} - 87.0f;                                     \
        V xc = KS_VSELECT(V, VI, LT(x, lo), lo, x);                                           \
        xc = KS_VSELECT(V, VI, LT(hi, xc), hi, xc);                                           \
        /* n = round(x / ln2) by the 1.5 * 2^23 trick */                                      \
        const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                  \
        const V r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;                             \
        V p = (V){0} + 1.9875691500e-4f;                                                      \
        p = p * r + 1.3981999507e-3f;                                                         \
        p = p * r + 8.3334519073e-3f;                                                         \
        p = p * r + 4.1665795894e-2f;                                                         \
        p = p * r + 1.6666665459e-1f;                                                         \
        p = p * r + 5.0000001201e-1f;                                                         \
        p = p * r * r + r + 1.0f;                                                             \
        const VI e = (__builtin_convertvector(n, VI) + 127) << 23;                            \
        return KS_VSELECT(V, VI, LT(x, lo), (V){0}, p * (V)e);                                \
    }
KS_DEFINE_EXP(ks_v8_exp, ks_v8, ks_v8i, ks_v8_lt)

/* out = gate * sigmoid(gate) * up over n floats (out may be gate). */
static inline void ks_swiglu(const float *gate, const float *up, float *out, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const ks_v8 g = ks_v8_load(gate + i);
        ks_v8_store(out + i, g / (1.0f + ks_v8_exp(-g)) * ks_v8_load(up + i));
    }
    if (i < n) {                        /* the tail through an 8-float buffer, same formula */
        float g[8] = {0}, u[8] = {0}, o[8];
        memcpy(g, gate + i, sizeof(float) * (n - i));
        memcpy(u, up + i, sizeof(float) * (n - i));
        ks_swiglu(g, u, o, 8);
        memcpy(out + i, o, sizeof(float) * (n - i));
    }
}

#endif /* KS_COMMON_H */
