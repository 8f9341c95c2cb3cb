"""Single-thread microbenchmark of the weight x activation products, per weight type:

- decode (n = 1): weight GB/s over three matrices of --decode-gb in all (larger than the
  caches), one after the other, as a decode step reads its layers' matrices;
- prefill (n = 64): GMAC/s on a 4096 x 4096 matrix, with the AVX512-VNNI path on and off
  (the same where the CPU has none);
- decode of a small model's matrices (Q4_0 and Q4_K, the Qwen3-0.6B shape's 196 matrices of
  0.6-1.7 MB, interleaved): weight GB/s with each copy in its own array and with the copies in
  one buffer of huge pages, as the loader places them (kestreld/model/load.py);
- the k-cost curve (`--k-cost-only` runs just it): per type, a product over n = 2, 4, 8, 16
  tokens relative to one token on --k-threads threads (2), over the 1.7B shape's FFN matrices
  (6144 x 2048, 0.4 GB in all, interleaved where the CPU has that): the price of a speculation
  verification pass (kestreld/engine/speculate.py), which reads the weights once for n tokens;

each on the rows as a GGUF file lays them out and, where this CPU has that product, on their
copy interleaved as the loader makes it (ks_interleave.h; 16, 8 or 4 rows a group), one line
after the other: on a new CPU (an RK3588's A76 cores) they say whether `--no-interleave`
should be the default there.

Random codes and scales (speed does not depend on the values). Best and median of --reps.
Run it on a quiet machine, at the highest priority the shell allows, e.g.
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec .venv/bin/python bench/kernels.py'
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ggml_blocks import random_blocks  # tests/: valid blocks of every GGML type
from kestreld.kernels import K, ops
from kestreld.model.load import buffer_views

O = ops()     # the per-op kernels (the test-only module kestreld._kernels_ops)

TYPES = tuple(QT(t) for t in K.compute_types())


def activations(rng, n, k):
    x = rng.standard_normal((n, k)).astype(np.float32)
    xq, xd = np.empty((n, k), np.int8), np.empty((n, k // 32), np.float32)
    O.quantize_q8_0(x, xq, xd, 1)
    return xq, xd


def timed(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def layouts(qt, mats, k):
    """(name, matrices, interleaved) of the rows as the file has them and, where this CPU has
    an interleaved product for the type, of their interleaved copies (made on the spot: the
    VNNI switch decides their width)."""
    yield "rows", mats, False
    group = K.interleaves(int(qt))
    if group:
        yield f"interleaved x{group}", [K.interleave_rows(w, int(qt), k) for w in mats], True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-gb", type=float, default=1.6, help="weight bytes of the decode case")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--k-threads", type=int, default=2, help="threads of the k-cost curve")
    ap.add_argument("--k-cost-only", action="store_true", help="only the k-cost curve")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.k_cost_only:
        print_k_costs(rng, args.k_threads, args.reps)
        return
    k = 8192
    xq, xd = activations(rng, 1, k)
    for qt in TYPES:
        block, size = GGML_QUANT_SIZES[qt]
        rows = int(args.decode_gb * 1e9 / 3 / (k // block * size)) // 8 * 8
        mats = [random_blocks(rng, qt, rows, k) for _ in range(3)]
        out = np.empty((1, rows), np.float32)
        gb = sum(w.nbytes for w in mats) / 1e9
        for layout, ws, il in layouts(qt, mats, k):
            best, med = timed(lambda: [O.matmul(w, int(qt), xq, xd, out, 1, il) for w in ws],
                              args.reps)
            print(f"decode  {qt.name:5} {layout:16} {gb / best:6.2f} GB/s best, {gb / med:6.2f} "
                  f"median ({3 * rows * k / best / 1e9:.2f} GMAC/s)", flush=True)
        mats.clear()    # free them before the next type's
    m = k = 4096
    n = 64
    xq, xd = activations(rng, n, k)
    out = np.empty((n, m), np.float32)
    for qt in TYPES:
        w = random_blocks(rng, qt, m, k)
        for vnni in (True, False):
            on = O.set_matmul_vnni(vnni)
            for layout, (wl,), il in layouts(qt, [w], k):
                best, med = timed(lambda: O.matmul(wl, int(qt), xq, xd, out, 1, il), args.reps)
                print(f"prefill {qt.name:5} n={n} {'vnni' if on else 'simd'} {layout:16} "
                      f"{m * k * n / best / 1e9:6.2f} GMAC/s best, {m * k * n / med / 1e9:6.2f} "
                      f"median", flush=True)
    O.set_matmul_vnni(True)
    for qt in (QT.Q4_0, QT.Q4_K):
        if K.interleaves(int(qt)):
            model_decode(rng, qt, args.reps)
    print_k_costs(rng, args.k_threads, args.reps)


# The k-cost curve's matrix (rows, cols): the 1.7B shape's FFN gate / up; and its token counts
K_COST_SHAPE = (6144, 2048)
K_COST_TOKENS = (1, 2, 4, 8, 16)


def k_cost(ops, rng, qt, threads: int, reps: int, gb: float = 0.4) -> dict:
    """{n: best seconds of the product over n tokens / best over 1 token} for n in
    K_COST_TOKENS, and "one_ms": the one-token product's ms, on matrices of K_COST_SHAPE
    totalling `gb` (more than the caches, as decode reads them), interleaved where this CPU has
    that product; `ops`: a build's per-op kernels (scripts/ab_kernels.py loads two)."""
    m, k = K_COST_SHAPE
    w = random_blocks(rng, qt, m, k)
    il = bool(K.interleaves(int(qt)))
    mats = [K.interleave_rows(w, int(qt), k) if il else w.copy()
            for _ in range(max(1, round(gb * 1e9 / w.nbytes)))]
    best = {}
    for n in K_COST_TOKENS:
        xq, xd = activations(rng, n, k)
        out = np.empty((n, m), np.float32)
        best[n] = timed(lambda: [ops.matmul(wl, int(qt), xq, xd, out, threads, il)
                                 for wl in mats], reps)[0]
    return {n: best[n] / best[1] for n in K_COST_TOKENS} | {"one_ms": best[1] * 1e3}


def print_k_costs(rng, threads: int, reps: int) -> None:
    """The k-cost curve of every type, a table row each."""
    print(f"\nk-cost: a product over n tokens / over one, {threads} threads, "
          f"{K_COST_SHAPE[0]} x {K_COST_SHAPE[1]} matrices, 0.4 GB, best of {reps}")
    print("| type | one token (ms) | " + " | ".join(f"n={n}" for n in K_COST_TOKENS[1:]) + " |")
    print("|---|---:|" + "---:|" * (len(K_COST_TOKENS) - 1))
    for qt in TYPES:
        c = k_cost(O, rng, qt, threads, reps)
        print(f"| {qt.name} | {c['one_ms']:.1f} | "
              + " | ".join(f"{c[n]:.2f}" for n in K_COST_TOKENS[1:]) + " |", flush=True)


# (rows, cols) of one Qwen3-0.6B layer's matrices: q, k, v, o, gate, up, down
LAYER_0_6B = ((2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024),
              (3072, 1024), (1024, 3072))


def model_decode(rng, qt, reps, layers=28):
    """One token through the 0.6B shape's matrices, one after the other: their interleaved
    copies each in its own array, then in one buffer of huge pages."""
    mats = [(K.interleave_rows(random_blocks(rng, qt, m, k), int(qt), k), k) for _ in range(layers)
            for m, k in LAYER_0_6B]
    x = {k: activations(rng, 1, k) for k in {k for _, k in LAYER_0_6B}}
    outs = [np.empty((1, w.shape[0]), np.float32) for w, _ in mats]
    packed = [(v, k) for v, (_, k) in zip(buffer_views([w.shape for w, _ in mats]), mats)]
    for (v, _), (w, _) in zip(packed, mats):
        v[...] = w
    gb = sum(w.nbytes for w, _ in mats) / 1e9
    for layout, ws in (("own arrays", mats), ("one buffer", packed)):
        best, med = timed(lambda: [O.matmul(w, int(qt), *x[k], out, 1, True)
                                   for (w, k), out in zip(ws, outs)], reps)
        print(f"decode  {qt.name:5} 0.6B shape, {layout:10} {gb / best:6.2f} GB/s best, "
              f"{gb / med:6.2f} median", flush=True)


if __name__ == "__main__":
    main()
