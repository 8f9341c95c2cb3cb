/* The work of one weight x activation product on aarch64, as executed instructions: run by
 * bench/arm64_insns.sh under qemu-user, which counts them (speed itself needs a board).
 *
 *   arm64_insns TYPE LAYOUT N     TYPE a GGML type id, LAYOUT 0 (no product: the baseline),
 *                                 1 (rows as the file lays them out), 2 (4-row interleaved
 *                                 groups); N tokens
 *
 * One product of M x K weights (random bytes: the values change no instruction) by N tokens'
 * activations, through ks_weights.h's table, as the forward pass calls it. */
#include <stdio.h>
#include <stdlib.h>

#include "ks_interleave.h"

enum { M = 64, K = 2048 };

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    const int type = atoi(argv[1]), layout = atoi(argv[2]), n = atoi(argv[3]);
    const ks_type_ops *t = ks_type(type);
    if (t == NULL || t->rows == NULL || (layout == 2 && ks_il_rows(type) != 4))
        return 2;
    const int64_t rb = ks_type_row_bytes(type, K);
    uint8_t *w = malloc((size_t)(M * rb)), *il = malloc((size_t)(M * rb));
    int8_t *xq = malloc((size_t)n * K);
    float *xd = malloc(sizeof(float) * n * (K / 32)), *out = malloc(sizeof(float) * n * M);
    int16_t *xh = malloc(sizeof(int16_t) * n * (K / 16));
    srand(1);
    for (int64_t i = 0; i < M * rb; i++)
        w[i] = (uint8_t)rand();
    for (int i = 0; i < n * K; i++)
        xq[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < n * (K / 32); i++)
        xd[i] = 0.01f;
    for (int i = 0; i < n * (K / 16); i++)
        xh[i] = 0;
    ks_interleave_rows(type, w, M, K, il);
    const ks_act x = {xq, xd, xh};
    if (layout == 1)
        t->rows(w, rb, &x, n, K, out, M, 0, M);
    else if (layout == 2)
        t->rows_il4(il, rb, &x, n, K, out, M, 0, M);
    printf("%d\n", layout ? (int)(out[0] != out[0]) : 0);   /* keeps the product */
    return 0;
}
