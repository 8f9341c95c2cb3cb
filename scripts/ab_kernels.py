"""A/B of two builds of the kernels in one process: which of two changes to pyx/ is faster.

On a shared VM the same product, timed a minute apart, can run much slower (the host's
other work; docs/speed.md, "The x86 tiles"), so two builds benchmarked one after the other
compare the host's moods more than the code. This loads both compiled modules
(`kestreld/_kernels*.so` of two checkouts) into one process and times them alternately, call
by call, on the same weights and activations; the best time of each over the rounds is what
the code can do.

    git worktree add /tmp/base HEAD                                             # the base,
    (cd /tmp/base && $OLDPWD/.venv/bin/python setup.py -q build_ext --inplace -j 2)  # built
    make build                                                                  # the change

(not `make -C /tmp/base build VENV=...`: the venv's editable install would move to /tmp/base)
    .venv/bin/python scripts/ab_kernels.py /tmp/base . --types Q4_K,Q6_K

Products per type, one thread: prefill (64 tokens x a 4096 x 4096 matrix, GMAC/s) and decode
(one token x 0.4 GB of rows or `--decode-mb`, GB/s). `--no-vnni` takes the AVX2 paths on a VNNI CPU.
`--attention` times attention instead, on `--threads` threads, over one layer's int8 KV of the
Qwen3-0.6B and SmolLM2 head layouts: decode at depths 256 to 8000 and prefill chunks of 256 at
depths 0 and 3840. Not a benchmark against llama.cpp (bench/ has those): a tool for deciding a
kernel change.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from ggml_blocks import random_blocks  # tests/: valid blocks of every GGML type


def load_build(tag: str, tree: str):
    """The per-op kernels of the checkout at tree, as a module of its own: its test-only
    kestreld._kernels_ops, or in a checkout older than that module, kestreld._kernels."""
    found = [(name, os.path.join(tree, "kestreld", name + suffix))
             for name in ("_kernels_ops", "_kernels")
             for suffix in importlib.machinery.EXTENSION_SUFFIXES
             if os.path.exists(os.path.join(tree, "kestreld", name + suffix))]
    if not found:
        sys.exit(f"no kestreld/_kernels_ops module for this Python in {tree}: build it there "
                 "first (KESTREL_TEST_KERNELS=1 python setup.py build_ext --inplace)")
    loader = importlib.machinery.ExtensionFileLoader(f"{tag}.{found[0][0]}", found[0][1])
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def activations(K, rng, n: int, k: int):
    x = rng.standard_normal((n, k)).astype(np.float32)
    xq, xd = np.empty((n, k), np.int8), np.empty((n, k // 32), np.float32)
    K.quantize_q8_0(x, xq, xd, 1)
    return xq, xd


def best_of(builds: dict, run, rounds: int) -> dict:
    """The best time of run(K) per build, the builds taking turns (who goes first swaps)."""
    best = {tag: float("inf") for tag in builds}
    order = list(builds)
    for r in range(rounds):
        for tag in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            run(builds[tag])
            best[tag] = min(best[tag], time.perf_counter() - t)
    return best


ATTENTION_LAYOUTS = {"qwen3-0.6b": (16, 8, 128), "smollm2": (9, 3, 64)}   # heads, KV heads, hd


def attention_ab(builds: dict, rounds: int, nthreads: int) -> None:
    """Attention of both builds on the same KV and queries: decode and prefill chunks."""
    rng = np.random.default_rng(0)
    for name, (nh, nkv, hd) in ATTENTION_LAYOUTS.items():
        max_seq = 8192
        kq = rng.integers(-127, 128, (nkv, max_seq, hd), dtype=np.int8)
        vq = rng.integers(-127, 128, (nkv, max_seq, hd), dtype=np.int8)
        ks = (rng.random((nkv, max_seq), dtype=np.float32) * 0.02).astype(np.float32)
        vs = (rng.random((nkv, max_seq), dtype=np.float32) * 0.02).astype(np.float32)
        for n, pos0 in ((1, 255), (1, 1023), (1, 3999), (1, 7999), (256, 0), (256, 3840)):
            q = rng.standard_normal((n, nh, hd)).astype(np.float32)
            out = np.empty_like(q)
            best = best_of(builds, lambda K: K.attention(q, kq, ks, vq, vs, pos0, hd ** -0.5, 32,
                                                         out, nthreads), rounds)
            case = f"decode @ {pos0 + 1}" if n == 1 else f"prefill {n} @ {pos0}"
            print(f"{name:10s} {case:18s} A {best['A'] * 1e3:8.3f} ms  B {best['B'] * 1e3:8.3f} ms"
                  f"  B/A {best['A'] / best['B']:.3f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="checkout of build A (the base)")
    ap.add_argument("b", help="checkout of build B (the change)")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rounds", type=int, default=13)
    ap.add_argument("--no-vnni", action="store_true", help="the AVX2 paths on a VNNI CPU")
    ap.add_argument("--decode-mb", type=float, default=400,
                    help="the decode rows' size: 400 streams from memory, a few MB stay in cache")
    ap.add_argument("--attention", action="store_true", help="time attention, not products")
    ap.add_argument("--threads", type=int, default=2, help="attention's threads")
    args = ap.parse_args(argv)
    builds = {"A": load_build("build_a", args.a), "B": load_build("build_b", args.b)}
    for K in builds.values():
        K.set_matmul_vnni(not args.no_vnni)
    if args.attention:
        attention_ab(builds, args.rounds, args.threads)
        return 0
    rng = np.random.default_rng(0)
    k = m = 4096
    for name in args.types.split(","):
        qt = QT[name]
        block, size = GGML_QUANT_SIZES[qt]
        w = random_blocks(rng, qt, m, k)
        xq, xd = activations(builds["A"], rng, 64, k)
        out = np.empty((64, m), np.float32)
        pre = best_of(builds, lambda K: K.matmul(w, int(qt), xq, xd, out, 1), args.rounds)
        rows = max(16, int(args.decode_mb * 1e6 / (k // block * size)) // 16 * 16)
        wd = random_blocks(rng, qt, rows, k)
        x1q, x1d = activations(builds["A"], rng, 1, k)
        o1 = np.empty((1, rows), np.float32)
        dec = best_of(builds, lambda K: K.matmul(wd, int(qt), x1q, x1d, o1, 1), args.rounds)
        print(f"{name:5s} prefill 64: A {64 * m * k / pre['A'] / 1e9:6.1f}  "
              f"B {64 * m * k / pre['B'] / 1e9:6.1f} GMAC/s  B/A {pre['A'] / pre['B']:.2f}   "
              f"decode: A {wd.nbytes / dec['A'] / 1e9:5.1f}  B {wd.nbytes / dec['B'] / 1e9:5.1f} GB/s  "
              f"B/A {dec['A'] / dec['B']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
