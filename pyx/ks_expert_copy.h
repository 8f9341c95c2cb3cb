/* Kestrel kernels: MoE experts' interleaved copies, made as they are first used (no Python
 * here). A stack of experts stays in the map as the file lays it out, so that loading reads none
 * and a request reads only the experts it chooses. Where the CPU has an interleaved product,
 * each expert's groups are copied into their interleaved layout (ks_interleave.h) the first time
 * a product needs them, by the thread whose work item that is; the first thread to come to a
 * group copies it, another that needs it meanwhile waits. Once all of an expert's groups are
 * copied, the whole pages of its rows in the file's map are released: the copy takes their
 * place in memory. ks_matmul.h's ks_matrix_rows calls these; the routing is ks_moe.h's. */
#ifndef KS_EXPERT_COPY_H
#define KS_EXPERT_COPY_H

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ks_interleave.h"
enum { KS_COPY_NONE, KS_COPY_BUSY, KS_COPY_MADE };

/* Drops the whole pages within [p, p + n) from this process (the file's page cache keeps
 * them: a later read faults them back in). */
static inline void ks_release_pages(const uint8_t *p, int64_t n)
{
#ifdef MADV_DONTNEED
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)p + page - 1) / page * page;
    const uintptr_t hi = ((uintptr_t)p + n) / page * page;
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p; (void)n;
#endif
}

/* Expert e's interleaved copy (w->copies), made first where the groups holding rows
 * [r0, r1) are not yet (r0 a multiple of w->copy_rows). */
static inline const uint8_t *ks_expert_copy(const ks_type_ops *t, const ks_matrix *w, int e,
                                            int r0, int r1)
{
    const int W = w->copy_rows, groups = (w->rows + W - 1) / W;
    const int64_t gb = (int64_t)W * w->row_stride;
    uint8_t *il = w->copies + (int64_t)e * w->copy_stride;
    uint8_t *rows = (uint8_t *)ks_matrix_row(w, e, 0);
    for (int g = r0 / W; g * W < r1; g++) {
        uint8_t *state = w->copy_state + (int64_t)e * groups + g;
        uint8_t none = KS_COPY_NONE;
        if (__atomic_load_n(state, __ATOMIC_ACQUIRE) == KS_COPY_MADE)
            continue;
        if (!__atomic_compare_exchange_n(state, &none, KS_COPY_BUSY, 0, __ATOMIC_ACQUIRE,
                                         __ATOMIC_ACQUIRE)) {
            while (__atomic_load_n(state, __ATOMIC_ACQUIRE) != KS_COPY_MADE)
                ks_cpu_relax();
            continue;
        }
        ks_interleave_group(w->type, W, w->cols / t->block, il + g * gb, rows + g * gb, 0,
                            w->rows - g * W < W ? w->rows - g * W : W, 0);
        __atomic_store_n(state, KS_COPY_MADE, __ATOMIC_RELEASE);
        if (__atomic_sub_fetch(w->copy_left + e, 1, __ATOMIC_ACQ_REL) == 0 && w->copy_release)
            ks_release_pages(rows, (int64_t)w->rows * w->row_stride);
    }
    return il;
}

#define KS_EXPERT_GROUP_TOKENS 4     /* an expert's rows go through 4-row groups from here on */

/* The product of ks_matrix_rows on stacked experts' rows without copies (r0 a multiple of 4)
 * through 4-row groups copied for the call, for the NEON dotprod tiles: with a few tokens an
 * expert's rows cost less copied and multiplied in groups than multiplied as rows. The same
 * results (every layout gives the same bits). Returns -1 if the copy's memory cannot be had,
 * else 0. */
static inline int ks_matrix_rows_grouped(const ks_type_ops *t, const ks_matrix *w,
                                         const uint8_t *data, const ks_act *x, int n, float *out,
                                         int r0, int r1)
{
    uint8_t *groups = malloc((size_t)((r1 - r0 + 3) / 4 * 4) * w->row_stride);
    if (groups == NULL)
        return -1;
    for (int r = r0; r < r1; r += 4)
        ks_interleave_group(w->type, 4, w->cols / t->block,
                            groups + (int64_t)(r - r0) * w->row_stride,
                            (uint8_t *)data + r * w->row_stride, 0, r1 - r < 4 ? r1 - r : 4, 0);
    t->rows_il4(groups, w->row_stride, x, n, w->cols, out + r0, w->rows, 0, r1 - r0);
    free(groups);
    return 0;
}

#endif /* KS_EXPERT_COPY_H */
