"""Where a forward pass spends its time: wall time per kernel, for decode and one prefill chunk.

    .venv/bin/python bench/profile_forward.py --model qwen3-0.6b --threads 1
    .venv/bin/python bench/profile_forward.py --model smollm2 --prefill 256

Wraps every function of kestreld._kernels with a timer (the wrapper adds ~0.3 us per call,
so tiny kernels look slightly slower than they are) and prints the totals, largest first.
Decode is one DecodeStep.step per token (all layers in C, MoE included): it shows as one line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np

# runnable from a checkout whether or not the package is installed into the venv
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import qwen3_shaped_q8_0_path

from kestreld.service.config import default_cache_dir
from kestreld.engine import forward as fwd
from kestreld.model.convert import smollm2_q8_0_path


def instrument(totals: dict) -> None:
    """Replace the kernels module's functions, as forward.py sees them, by timed wrappers."""
    k = fwd.K

    class Timed:
        def __getattr__(self, name):
            f = getattr(k, name)

            def timed(*a, **kw):
                t0 = time.perf_counter()
                r = f(*a, **kw)
                totals[name][0] += time.perf_counter() - t0
                totals[name][1] += 1
                return r
            return timed
    fwd.K = Timed()


class TimedStep:
    """A DecodeStep whose `step` calls are timed (the whole decode step is one call)."""

    def __init__(self, step, totals: dict):
        self._step, self._totals = step, totals

    def step(self, *a):
        t0 = time.perf_counter()
        self._step.step(*a)
        self._totals["DecodeStep.step"][0] += time.perf_counter() - t0
        self._totals["DecodeStep.step"][1] += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["smollm2", "qwen3-0.6b"], default="qwen3-0.6b")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens")
    p.add_argument("--depth", type=int, default=16, help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=8, help="decode steps")
    args = p.parse_args()
    cache = default_cache_dir(os.environ)
    path = smollm2_q8_0_path(cache) if args.model == "smollm2" else qwen3_shaped_q8_0_path(cache)
    from kestreld.engine.generate import Engine
    from kestreld.model.load import load_model
    model = load_model(path)
    chunk = max(256, args.prefill)
    eng = Engine(model, max_seq=max(1024, args.depth + args.steps + chunk + 2),
                 threads=args.threads, prefill_chunk=chunk)
    tr = eng.forward
    rng = np.random.default_rng(0)
    ids = rng.integers(256, 20000, size=args.depth + max(args.steps, args.prefill) + 1).tolist()
    for p0 in range(0, max(args.depth, 1), chunk):     # fill the cache (and warm up)
        tr(ids[p0:min(max(args.depth, 1), p0 + chunk)])
    totals = defaultdict(lambda: [0.0, 0])
    instrument(totals)
    tr.decode_step = TimedStep(tr.decode_step, totals)
    t0 = time.perf_counter()
    if args.prefill:
        tr(ids[args.depth:args.depth + args.prefill])
        what, count = f"prefill {args.prefill} @ {args.depth}", args.prefill
    else:
        for i in range(args.steps):
            tr([ids[i]])
        what, count = f"decode x{args.steps} @ {args.depth}", args.steps
    wall = time.perf_counter() - t0
    print(f"{args.model} {what}, threads {args.threads}: {wall * 1e3:.1f} ms, "
          f"{count / wall:.1f} tok/s")
    inside = sum(v[0] for v in totals.values())
    for name, (sec, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:22s} {sec * 1e3:9.2f} ms {100 * sec / wall:5.1f}%  {calls:6d} calls")
    print(f"  {'(python, outside)':22s} {(wall - inside) * 1e3:9.2f} ms {100 * (wall - inside) / wall:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
