/* Kestrel kernels: Qwen3-MoE's routing (no Python here): the router of one token, the
 * grouping of a chunk's (token, slot) pairs by expert, and the weighted sum of the experts'
 * outputs. The forward pass (ks_forward.h) and the per-op entry points of the tests
 * (moe.pxi) call the same selection, grouping and sum (the forward pass computes the router's
 * dot products itself, in items of experts, before ks_moe_select). */
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
    for (int e = 0; e < n_exp; e++) {
        probs[e] = probs[e] / s;
        if (!(probs[e] >= 0.0f))    /* NaN, from a broken model's logits: still k experts */
            probs[e] = 0.0f;
    }
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

/* Sorts the n*k (token, slot) pairs of top_idx (n, k) by expert (a stable counting sort):
 * expert e owns sorted entries offsets[e] .. offsets[e] + counts[e] - 1, in token order;
 * rows (n*k) holds the token of each sorted entry, slot_pos (n, k) the sorted entry of each
 * pair, active the chosen experts ascending. Returns their number. */
static inline int ks_moe_group(const int32_t *top_idx, int n, int k, int n_exp, int32_t *counts,
                               int32_t *offsets, int32_t *rows, int32_t *slot_pos, int32_t *active)
{
    int n_active = 0;
    int32_t total = 0;
    memset(counts, 0, sizeof(int32_t) * n_exp);
    for (int i = 0; i < n * k; i++)
        counts[top_idx[i]]++;
    for (int e = 0; e < n_exp; e++) {
        offsets[e] = total;
        total += counts[e];
        if (counts[e] > 0)
            active[n_active++] = e;
    }
    memset(counts, 0, sizeof(int32_t) * n_exp);   /* the fill cursor, then the counts again */
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            const int e = top_idx[t * k + j];
            const int32_t p = offsets[e] + counts[e]++;
            rows[p] = t;
            slot_pos[t * k + j] = p;
        }
    return n_active;
}

/* out (d) += sum over j = 0..k-1, in that order, of w[j] * y[slot[j]] (rows of y (.., d)): one
 * token's experts' outputs, weighted by the router. */
static inline void ks_moe_combine_row(float *out, const float *y, const int32_t *slot,
                                      const float *w, int k, int64_t d)
{
    for (int j = 0; j < k; j++)
        ks_add_scaled(out, y + (int64_t)slot[j] * d, w[j], d);
}

#endif /* KS_MOE_H */
