/* Kestrel kernels: the Qwen3-MoE router of one token (no Python here), shared by the
 * per-op moe_route entry point and the fused decode step, so both choose the same experts
 * with the same weights, bit for bit. */
#ifndef KS_MOE_H
#define KS_MOE_H

#include "ks_rows.h"

/* probs (n_exp) holds the router logits; turns them into their softmax, and picks the k most
 * probable experts: idx (k) most probable first (ties: lower index first), w (k) their
 * probabilities, divided by their sum when norm_topk. */
static inline void ks_moe_select(float *probs, int n_exp, int norm_topk, int32_t *idx,
                                 float *w, int k)
{
    float mx = probs[0], s = 0.0f;
    for (int e = 1; e < n_exp; e++)
        if (probs[e] > mx)
            mx = probs[e];
    for (int e = 0; e < n_exp; e++) {
        probs[e] = expf(probs[e] - mx);
        s += probs[e];
    }
    for (int e = 0; e < n_exp; e++)
        probs[e] = probs[e] / s;
    /* repeated selection in the strict order (probability desc, index asc): the j-th pick is
     * the best expert ranked after the (j-1)-th, so no marks are needed */
    float prev_p = 2.0f;
    int prev_e = -1;
    s = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_exp; e++) {
            const float p = probs[e];
            if ((p < prev_p || (p == prev_p && e > prev_e)) && (best < 0 || p > probs[best]))
                best = e;
        }
        idx[j] = best;
        w[j] = probs[best];
        s += probs[best];
        prev_p = probs[best];
        prev_e = best;
    }
    if (norm_topk)
        for (int j = 0; j < k; j++)
            w[j] = w[j] / s;
}

/* The router of one token x (d): logits x . router[e] for every expert of router (n_exp, d),
 * then ks_moe_select. */
static inline void ks_moe_route_row(const float *x, const float *router, int64_t d, int n_exp,
                                    int norm_topk, float *probs, int32_t *idx, float *w, int k)
{
    for (int e = 0; e < n_exp; e++)
        probs[e] = ks_dot_f32(x, router + (int64_t)e * d, d);
    ks_moe_select(probs, n_exp, norm_topk, idx, w, k);
}

#endif /* KS_MOE_H */
