"""Qwen3-30B-A3B at its real size: Kestrel and llama.cpp on one ~18 GB Q4_K_M file.

    .venv/bin/python bench/moe30b.py --threads 2        # `make bench-30b`; outside CI

The file has Qwen3-30B-A3B's exact shapes (48 layers, hidden 2048, 32 query / 4 KV heads of
128, 128 experts of 768 with top-8, vocab 151,936, untied output) in llama.cpp's Q4_K_M mix
(Q6_K for the output matrix and for attn_v / ffn_down_exps of the layers llama.cpp gives
more bits, Q4_K elsewhere), with random valid blocks, written once into the cache directly
(common.write_qwen3_shaped_gguf: one tensor at a time, no 60 GB float file first). Speed
does not depend on the weights' values; random routers spread tokens over all experts.

Each engine runs in a fresh process of its own, one after the other (both would not fit in
memory together): load (to a ready engine, the file already in the page cache: it is read
once before the first engine), RSS, a prefill of 512 random tokens, 128 decode steps, RSS,
then a second prefill of 512 other random tokens. Kestrel maps the file, copies its dense
matrices into interleaved groups at load and each expert when a request first chooses it
(the first prefill pays for the copies of the experts it chooses, the second for few);
llama.cpp (llama-cpp-python, repacking on) copies all the weights it repacks at load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import rss_mb, shaped_path
from vs_llamacpp import KestrelRunner, LlamaCppRunner, fmt, llamacpp_available, random_prompt

from kestreld.service.config import default_cache_dir

ENGINES = ("kestrel", "llama.cpp")


def read_through(path: str, chunk: int = 64 << 20) -> float:
    """Reads the file once (into the page cache); seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def probe(engine: str, path: str, args) -> dict:
    """In this process: load, prefill, decode; the figures as a dict."""
    t0 = time.perf_counter()
    if engine == "kestrel":
        runner = KestrelRunner(path, args.threads, args.max_seq)
    else:
        runner = LlamaCppRunner(path, args.threads, args.max_seq, args.prefill, True, True)
    out = {"load_s": time.perf_counter() - t0, "rss_load_mb": rss_mb()}
    rng = np.random.default_rng(5)
    ids = random_prompt(rng, args.prefill, runner.vocab)
    out["prefill_tps"] = args.prefill / runner.prefill(ids)
    out["decode_tps"] = (args.decode - 1) / runner.decode(random_prompt(rng, 16, runner.vocab),
                                                          args.decode)
    out["rss_end_mb"] = rss_mb()
    out["prefill_again_tps"] = args.prefill / runner.prefill(random_prompt(rng, args.prefill,
                                                                           runner.vocab))
    return out


def run_probe(engine: str, path: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", engine, "--model", path,
           "--threads", str(args.threads), "--prefill", str(args.prefill),
           "--decode", str(args.decode), "--max-seq", str(args.max_seq)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict, file_gb: float, args) -> str:
    k, ll = results.get("kestrel", {}), results.get("llama.cpp", {})
    nan = float("nan")
    rows = [f"| Qwen3-30B-A3B-shaped Q4_K_M ({file_gb:.1f} GB) | Kestrel | llama.cpp | "
            "Kestrel / llama.cpp |", "|---|---:|---:|---:|"]
    for key, label, digits in (("load_s", "load to ready, s", 2),
                               ("rss_load_mb", "RSS after load, MB", 0),
                               ("prefill_tps", f"prefill {args.prefill}, tok/s", 1),
                               ("decode_tps", f"decode {args.decode}, tok/s", 2),
                               ("rss_end_mb", "RSS after both, MB", 0),
                               ("prefill_again_tps", f"then another prefill {args.prefill}, "
                                                     "tok/s", 1)):
        a, b = k.get(key, nan), ll.get(key, nan)
        rows.append(f"| {label} | {fmt(a, digits)} | {fmt(b, digits)} | {fmt(a / b, 2)} |")
    return "\n".join(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--probe", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.model, args)), flush=True)
        return 0
    engines = [e for e in args.engines.split(",") if e in ENGINES]
    if "llama.cpp" in engines and not llamacpp_available():
        engines.remove("llama.cpp")
    t0 = time.perf_counter()
    path = shaped_path(default_cache_dir(os.environ), "qwen3-30b-a3b", "Q4_K_M")
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e9:.2f} GB (ready in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(f"read once into the page cache in {read_through(path):.0f} s", file=sys.stderr)
    results = {}
    for engine in engines:
        results[engine] = run_probe(engine, path, args)
        print(f"{engine}: {results[engine]}", file=sys.stderr)
    print(f"\nthreads {args.threads}, one process per engine, the file in the page cache before "
          f"the first; llama.cpp with flash attention and its repacking\n")
    print(table(results, size / 1e9, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
