"""Speed with other work on the cores: Kestrel and llama.cpp, quiet and beside busy processes.

    .venv/bin/python bench/contention.py                      # `make bench-contention`
    .venv/bin/python bench/contention.py --threads 2,1 --models smollm2:Q4_K_M

A board runs other things beside the daemon. Each busy process here is a one-line spinning
loop started apart (`setsid`: its own session, so its own scheduler group, at normal
priority), as an unrelated service would be. For each thread count (default: every core,
and one fewer), each engine loads the same GGUF once; then, repetition after repetition,
the conditions (quiet, 1 busy, 2 busy) and the engines alternate. Cases: decode at context
depth 16 and 4000 (the context is prefilled while the machine is quiet: Kestrel's request
reuses it through its prefix cache, llama.cpp continues its own context), and a cold
prefill of 512 tokens. Reported: the median tok/s, the fraction of the quiet speed kept,
and the cores the engine's process got meanwhile (its CPU time over the wall time: both
engines run in this process, one at a time), which says how much of the loss is the share
the scheduler gave and how much is work lost in the engine.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vs_llamacpp import (KestrelRunner, LlamaCppRunner, fmt, llamacpp_available, median,
                         model_path, random_prompt)

from kestreld.service.config import default_cache_dir

CONDITIONS = (("quiet", 0), ("1 busy", 1), ("2 busy", 2))
SPIN = "while True: pass"
SETTLE_S = 0.3          # the scheduler places the new processes before a measurement starts


@contextmanager
def busy(n: int):
    """n spinning processes, each in a session (scheduler group) of its own."""
    procs = [subprocess.Popen(["setsid", sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        if n:
            time.sleep(SETTLE_S)
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


class KestrelDecode(KestrelRunner):
    """Decode after a context prefilled beforehand, kept by the engine's prefix cache."""

    def prepare(self, ids: list) -> None:
        self._ids = ids
        self._run_cached(ids, 1, expect_hit=False)

    def _run_cached(self, ids: list, n: int, expect_hit: bool):
        from kestreld.engine.sampler import SamplingOptions
        c = self.engine.generate(ids, SamplingOptions(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
        assert c.completion_tokens == n
        # a context shorter than the prefix rule's minimum is prefilled again (not timed)
        hit = expect_hit and len(ids) - 1 >= self.engine.prefix.min_match
        assert (c.cached_tokens >= len(ids) - 1) == hit, c.cached_tokens
        return c

    def decode_prepared(self, n: int) -> float:
        """Seconds of the n-1 decode steps after the prepared context (one token recomputed)."""
        return self._run_cached(self._ids, n, expect_hit=True).decode_ms / 1e3


def cases(args) -> list:
    """(name, kind, tokens, depth)."""
    return [(f"decode {args.decode_tokens} @ {d}", "decode", args.decode_tokens, d)
            for d in args.depths] + [(f"prefill {args.prefill}", "prefill", args.prefill, 0)]


def measure(runner, case, rng) -> tuple:
    """(tok/s, cores used) of one run of case on runner, the busy processes already running."""
    _, kind, tokens, _ = case
    cpu0, wall0 = os.times(), time.perf_counter()
    if kind == "prefill":
        tps = tokens / runner.prefill(random_prompt(rng, tokens, runner.vocab))
    else:
        tps = (tokens - 1) / runner.decode_prepared(tokens)
    cpu1, wall = os.times(), time.perf_counter() - wall0
    return tps, (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall


def bench(path: str, threads: int, args, have_llamacpp: bool) -> dict:
    """{case: {condition: {engine: [(tok/s, cores)]}}} at one thread count."""
    n_batch = max(args.prefill, max(args.depths))
    runners = [KestrelDecode(path, threads, args.max_seq)]
    if have_llamacpp:
        runners.append(LlamaCppRunner(path, threads, args.max_seq, n_batch, True, True))
    all_cases = cases(args)
    out = {c[0]: {cond: {r.name: [] for r in runners} for cond, _ in CONDITIONS} for c in all_cases}
    warm = np.random.default_rng(0)
    for r in runners:
        r.prefill(random_prompt(warm, 64, r.vocab))
    for rep in range(args.reps):
        conditions = CONDITIONS if rep % 2 == 0 else CONDITIONS[::-1]
        for cond, n_busy in conditions:
            for ci, case in enumerate(all_cases):
                order = runners if (rep + ci) % 2 == 0 else runners[::-1]
                for r in order:
                    rng = np.random.default_rng(1000 * rep + 10 * ci + n_busy)
                    if case[1] == "decode":
                        r.prepare(random_prompt(rng, case[3], r.vocab))
                    with busy(n_busy):
                        tps, cores = measure(r, case, rng)
                    out[case[0]][cond][r.name].append((tps, cores))
                    print(f"  threads {threads} rep {rep + 1}/{args.reps} {cond:7s} {case[0]:18s} "
                          f"{r.name:9s} {tps:8.1f} tok/s {cores:5.2f} cores", file=sys.stderr,
                          flush=True)
    return out


def medians(runs: list) -> tuple:
    """(median tok/s, median cores) of [(tok/s, cores)]."""
    return median([t for t, _ in runs]), median([c for _, c in runs])


def table(results: dict) -> str:
    """Markdown: median tok/s per condition, the fraction of quiet kept and the median cores
    the process got, both engines."""
    rows = ["| model | threads | case | engine | quiet tok/s (cores) | 1 busy tok/s (kept, cores) "
            "| 2 busy tok/s (kept, cores) |", "|---|---:|---|---|---:|---:|---:|"]
    for (model, threads), by_case in results.items():
        for case, by_cond in by_case.items():
            for engine in by_cond["quiet"]:
                quiet, quiet_cores = medians(by_cond["quiet"][engine])
                cells = [f"{fmt(quiet)} ({quiet_cores:.2f})"]
                for cond in ("1 busy", "2 busy"):
                    v, cores = medians(by_cond[cond][engine])
                    cells.append(f"{fmt(v)} ({fmt(100 * v / quiet, 0)}%, {cores:.2f})")
                rows.append(f"| {model} | {threads} | {case} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_args(argv=None):
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default=",".join(str(t) for t in sorted({cores, max(1, cores - 1)},
                                                                        reverse=True)),
                   help="comma list of thread counts, for both engines (default: all cores, "
                        "and one fewer)")
    p.add_argument("--models", default="smollm2", help="comma list of NAME[:FTYPE] as in "
                   "vs_llamacpp.py (default smollm2, Q8_0)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--depths", default="16,4000", help="decode context depths (default 16,4000)")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--max-seq", type=int, default=4608)
    args = p.parse_args(argv)
    args.depths = [int(d) for d in args.depths.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    have_llamacpp = llamacpp_available()
    cache = default_cache_dir(os.environ)
    results = {}
    for name in args.models.split(","):
        path = model_path(name, cache)
        for threads in args.threads:
            results[(name, threads)] = bench(path, threads, args, have_llamacpp)
    print(f"\n{len(os.sched_getaffinity(0))} cores; busy processes: `setsid python -c "
          f"'{SPIN}'`; median of {args.reps}; llama.cpp with flash attention and its repacking")
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
