"""Single-thread speed of the weight x activation products, per weight type (rough: a kernel
microbenchmark, not an engine one; bench/vs_llamacpp.py measures the engine).

    decode   n = 1 over a matrix larger than the last-level cache: weight GB/s read
    prefill  n = 64 tokens over a (4096, 4096) matrix: GMAC/s

Each figure is the best of --repeat runs. The weights are gguf-py's quantization of random
values, tiled to the size wanted (the kernels' speed does not depend on the values).

    python bench/kernels.py [--types q4_0,q4_1,q5_0,q8_0] [--decode-mb 1200] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import kestreld._kernels as K

K_COLS = 4096


def weights(qtype: GGMLQuantizationType, rows: int) -> np.ndarray:
    """(rows, row bytes) uint8: 256 quantized random rows repeated."""
    base = gguf.quants.quantize(np.random.default_rng(0).standard_normal(
        (256, K_COLS)).astype(np.float32), qtype)
    return np.ascontiguousarray(np.tile(base, (rows // 256, 1)))


def activations(n: int):
    x = np.random.default_rng(1).standard_normal((n, K_COLS)).astype(np.float32)
    xq, xd = np.empty((n, K_COLS), np.int8), np.empty((n, K_COLS // 32), np.float32)
    K.quantize_q8_0(x, xq, xd, 1)
    return xq, xd


def best_seconds(w, qtype, xq, xd, threads: int, repeat: int) -> float:
    out = np.empty((len(xq), len(w)), np.float32)
    K.matmul(w, int(qtype), xq, xd, out, threads)          # warm: pages, caches, branch state
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        K.matmul(w, int(qtype), xq, xd, out, threads)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="q4_0,q4_1,q5_0,q8_0")
    ap.add_argument("--decode-mb", type=int, default=1200,
                    help="Q8_0-equivalent size of the decode matrix (MB); every type gets the same shape")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = args.decode_mb * 2**20 // (K_COLS // 32 * 34) // 256 * 256
    print(f"[{K.simd_path()}] threads {args.threads}; decode ({rows}, {K_COLS}), "
          f"prefill 64 x (4096, {K_COLS})")
    for name in args.types.split(","):
        qtype = GGMLQuantizationType[name.upper()]
        w = weights(qtype, rows)
        s = best_seconds(w, qtype, *activations(1), args.threads, args.repeat)
        gbs = w.nbytes / s / 1e9
        del w
        w = weights(qtype, 4096)
        s64 = best_seconds(w, qtype, *activations(64), args.threads, args.repeat)
        block, size = GGML_QUANT_SIZES[qtype]
        print(f"{name:5} {size * 8 / block:.1f} bits/weight: decode {gbs:6.2f} GB/s "
              f"({rows * K_COLS / s / 1e9:6.2f} G weights/s), prefill "
              f"{4096 * K_COLS * 64 / s64 / 1e9:6.1f} GMAC/s")


if __name__ == "__main__":
    main()
