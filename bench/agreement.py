"""Kestrel's next-token choices against llama.cpp's on the same 4-bit GGUF files.

    .venv/bin/python bench/agreement.py [--models smollm2:Q4_K_M,smollm2:Q4_0,...]

The files are llama.cpp's own: its quantizer (`llama_model_quantize`, from llama-cpp-python)
makes the Q4_K_M and Q4_0 mixes from the Q8_0 files (bench/common.py), so every tensor has the
type `llama-quantize` gives it. Each engine computes the logits of every position of the same
token sequences (teacher forcing: real English text for SmolLM2, random ids for the
random-weight shapes). At each position where llama.cpp's top-1 leads its top-2 by more than
--margin (the choice is clear), Kestrel's top-1 must be the same token; the script prints the
agreement, the logits' relative RMS difference, and exits 1 if any clear choice differs.
Outside CI: it needs llama-cpp-python (bench/README.md). Threads: 2.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import open_llama  # noqa: E402
from vs_llamacpp import model_path  # noqa: E402

DEFAULT_MODELS = "smollm2:Q4_K_M,smollm2:Q4_0,qwen3-0.6b:Q4_K_M,qwen3moe:Q4_K_M"
TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wiped the great "
    "lens with a soft cloth, trimmed the wick and lit the lamp, and then he sat by the window "
    "with his logbook, writing down the ships that passed, the weather and the state of the sea.",
    "To make bread you need flour, water, salt and yeast. Mix them into a dough, knead it for "
    "ten minutes until it is smooth, and let it rise in a warm place for an hour. Shape the "
    "loaf, let it rise again, and bake it in a hot oven until the crust is brown.",
    "Photosynthesis is the process by which green plants use sunlight to turn carbon dioxide "
    "and water into sugar and oxygen. It takes place mostly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n",
    "<|im_start|>user\nWhat is the capital of France, and why is it famous?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris. It is famous for the Eiffel Tower, "
    "the Louvre museum, its cafes and its long history as a centre of art and learning.",
]


def sequences(engine, spec: str, n_random: int, length: int) -> list:
    """Token sequences: the texts for SmolLM2 (real weights), random ids for the shapes."""
    if spec.startswith("smollm2"):
        return [engine.tokenize(t) for t in TEXTS]
    rng = np.random.default_rng(4242)
    return [rng.integers(0, engine.vocab_size, length).tolist() for _ in range(n_random)]


def llama_logits(llm, ids: list) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(spec: str, args) -> dict:
    from kestreld.engine.generate import Engine
    from kestreld.model.load import load_model
    path = model_path(spec, args.cache)
    model = load_model(path)
    engine = Engine(model, max_seq=args.max_seq, threads=args.threads)
    llm = open_llama(path, True, n_threads=args.threads, n_threads_batch=args.threads,
                     n_ctx=args.max_seq, n_batch=512, n_ubatch=512, logits_all=True, seed=0,
                     verbose=False)
    clear = agree = agree_all = total = 0
    err = ref = 0.0
    worst = []
    for ids in sequences(engine, spec, args.random_sequences, args.length):
        ours = engine.forward_logits(ids)
        theirs = llama_logits(llm, ids)
        top2 = np.sort(theirs, axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        same = ours.argmax(axis=1) == theirs.argmax(axis=1)
        is_clear = margin > args.margin
        clear += int(is_clear.sum())
        agree += int((same & is_clear).sum())
        agree_all += int(same.sum())
        total += len(ids)
        worst += [float(m) for m in margin[~same]]
        err += float(((ours - theirs) ** 2).sum())
        ref += float((theirs ** 2).sum())
    engine.close()
    return {"spec": spec, "types": model.weights.type_shares(), "positions": total,
            "clear": clear, "agree_clear": agree, "agree_all": agree_all,
            "max_margin_differing": max(worst, default=0.0), "rel_rms": (err / ref) ** 0.5}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--margin", type=float, default=0.5,
                   help="llama.cpp's top1 - top2 logit lead above which a choice is clear")
    p.add_argument("--random-sequences", type=int, default=4)
    p.add_argument("--length", type=int, default=96, help="tokens per random sequence")
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/kestrel"))
    args = p.parse_args(argv)
    rows, ok = [], True
    for spec in args.models.split(","):
        r = compare(spec, args)
        ok &= r["agree_clear"] == r["clear"]
        shares = ", ".join(f"{t} {s:.0%}" for t, s in r["types"].items())
        rows.append(f"| {spec} | {shares} | {r['positions']} | {r['agree_all'] / r['positions']:.1%} "
                    f"| {r['agree_clear']}/{r['clear']} | {r['max_margin_differing']:.3f} "
                    f"| {r['rel_rms']:.4f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"\nKestrel vs llama.cpp, same GGUF, {args.threads} threads; clear: llama.cpp's "
          f"top-1 leads by > {args.margin}")
    print("| file | weight types | positions | same top-1 | same where clear | largest lead "
          "where they differ | logits rel RMS |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
