"""Embeddings: Kestrel vs llama.cpp, side by side, on the same GGUF file, threads and machine.

    .venv/bin/python bench/embed.py --threads 2            # 1, 16 and 128 inputs
    .venv/bin/python bench/embed.py --threads 2 --quick    # small sizes, a smoke run
    .venv/bin/python bench/embed.py --model PATH.gguf      # a real Qwen3-Embedding GGUF

The default model is random weights of Qwen3-Embedding-0.6B's exact shapes (Qwen3-0.6B with
no output matrix, `pooling_type` LAST, EOS appended to a text), Q8_0, written once into the
cache (common.SHAPES["qwen3-embedding-0.6b"]). A case is a request of N texts (1, 16, 128)
whose lengths are drawn uniformly from 32..512 tokens (fresh random texts each repetition,
the same texts for both engines): Kestrel through `Engine.embed` in-process (the path of the
RPC method and the HTTP routes, without the transport), llama.cpp through llama-cpp-python's
`Llama.embed` with embedding=True and the file's pooling. Both pack several texts into one
pass: llama.cpp up to n_ubatch tokens, Kestrel up to its prefill chunk. Each engine tokenizes
the texts itself (the appended EOS included) and its own token count gives its tokens/s. The
two run alternately (the first one swaps every repetition) and the median of the repetitions
is reported. Both are warmed up once.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

# runnable from a checkout whether or not the package is installed into the venv
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import open_llama, shaped_path
from vs_llamacpp import llamacpp_available

from kestreld.engine.embed import EmbedInput
from kestreld.engine.generate import Engine
from kestreld.model.load import load_model
from kestreld.service.config import default_cache_dir

FULL = ((1, 32, 512), (16, 32, 512), (128, 32, 512))     # (texts, shortest, longest tokens)
QUICK = ((1, 32, 64), (16, 32, 64))
N_BATCH, N_UBATCH = 2048, 512    # llama.cpp server's defaults: texts per decode, per pass


WORDS = ("the of and to in is was for on that with as by at from it an be this are have "
         "which or one had not but what all were when we there can model cache board").split()


def random_texts(rng, tokenizer, n: int, lo: int, hi: int) -> list:
    """n texts of lo..hi tokens (give or take one, before the end-of-text the model appends):
    random words, cut after that many tokens. (Decoding random ids would not do: the text
    tokenizes back into other, more tokens.)"""
    out = []
    for length in rng.integers(lo, hi + 1, n):
        ids = tokenizer.encode(" ".join(rng.choice(WORDS, length)))[:length]
        out.append(tokenizer.decode(ids))
    return out


class Kestrel:
    def __init__(self, path: str, threads: int, max_seq: int):
        self.engine = Engine(load_model(path), max_seq=max_seq, threads=threads)
        self.tokenizer = self.engine.tokenizer

    def embed(self, texts: list) -> tuple:
        """(seconds, tokens, first vector)."""
        t0 = time.perf_counter()
        r = self.engine.embed(EmbedInput(tuple(texts), truncate=True))
        return time.perf_counter() - t0, r.prompt_tokens, r.vectors[0]


class LlamaCpp:
    def __init__(self, path: str, threads: int, max_seq: int):
        # flash attention: llama.cpp's server turns it on for the CPU ("auto"), and without it
        # a batch's attention is a full n_ubatch x n_ubatch product for every head
        self.llm = open_llama(path, True, embedding=True, n_ctx=max_seq, n_batch=N_BATCH,
                              n_ubatch=N_UBATCH, n_threads=threads, n_threads_batch=threads,
                              flash_attn=True, verbose=False)

    def embed(self, texts: list) -> tuple:
        t0 = time.perf_counter()
        vectors, tokens = self.llm.embed(texts, normalize=True, return_count=True)
        return time.perf_counter() - t0, tokens, np.asarray(vectors[0], np.float32)


def fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions (default 3, 1 for 128 texts and with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes: checks the harness works")
    p.add_argument("--model", help="an embedding GGUF (default: the random Qwen3-Embedding-"
                                   "0.6B-shaped Q8_0 file, written once into the cache)")
    args = p.parse_args(argv)
    path = args.model or shaped_path(default_cache_dir(os.environ), "qwen3-embedding-0.6b", "Q8_0")
    max_seq = 1024
    engines = {"kestrel": Kestrel(path, args.threads, max_seq)}
    if llamacpp_available():
        engines["llama.cpp"] = LlamaCpp(path, args.threads, N_BATCH)
    tokenizer = engines["kestrel"].tokenizer
    rng = np.random.default_rng(0)
    warm = random_texts(rng, tokenizer, 4, 32, 128)
    for e in engines.values():
        e.embed(warm)
    if "llama.cpp" in engines:      # the same file, the same vector (a check, not a figure)
        (_, _, a), (_, _, b) = (e.embed(warm[:1]) for e in engines.values())
        print(f"cosine of the two engines' vectors: {float(a @ b):.5f}", file=sys.stderr)
    rows = ["| texts | tokens each | engine | inputs/s | tokens/s | Kestrel / llama.cpp |",
            "|---:|---|---|---:|---:|---:|"]
    for n, lo, hi in (QUICK if args.quick else FULL):
        reps = args.reps or (1 if args.quick or n >= 128 else 3)
        runs = {name: [] for name in engines}
        order = list(engines)
        for _ in range(reps):
            texts = random_texts(rng, tokenizer, n, lo, hi)
            for name in order:
                runs[name].append(engines[name].embed(texts))
            order.reverse()
        rate = {name: (statistics.median(n / r[0] for r in rs),
                       statistics.median(r[1] / r[0] for r in rs)) for name, rs in runs.items()}
        ratio = (rate["kestrel"][1] / rate["llama.cpp"][1] if "llama.cpp" in rate
                 else float("nan"))
        for name, (ips, tps) in rate.items():
            rows.append(f"| {n} | {lo}..{hi} | {name} | {fmt(ips, 2)} | {fmt(tps)} | "
                        f"{fmt(ratio, 2) if name == 'kestrel' else ''} |")
        print(f"{n} texts done", file=sys.stderr)
    print(f"\n{os.path.basename(path)}, threads {args.threads}, the median of "
          f"{args.reps or (1 if args.quick else '3 (128 texts: 1)')} repetitions; llama.cpp "
          f"n_batch {N_BATCH}, n_ubatch {N_UBATCH}, flash attention"
          + ("" if "llama.cpp" in engines else ", llama-cpp-python not installed"))
    print()
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
