"""Grammar engines for constrained sampling, side by side: what one decode step costs.

    .venv/bin/python bench/grammar_engines.py
    .venv/bin/pip install outlines-core      # to compare (Kestrel itself uses llguidance)
    .venv/bin/python bench/grammar_engines.py --decode     # and decode on SmolLM2, 1 thread

For each vocabulary (SmolLM2's real 49,152 tokens; the 151,936-token Qwen3-sized byte-level
vocabulary of bench/common.py) and each grammar (any JSON object; an object of a schema;
a Qwen3 tool call of a function's schema), a fixed answer is tokenized with Kestrel's own
tokenizer and fed token by token. Timed per step: the mask of allowed tokens computed and
applied to a logits row (-inf elsewhere, as the sampler does), then the token committed.
Also timed: building the engine's view of the vocabulary (once per model) and compiling
each grammar (once per request). One thread, nothing else running in the process.

llguidance goes through kestreld/engine/constraint.py itself. outlines-core (when
installed) compiles a JSON schema to a regex and builds an index over the whole
vocabulary; any JSON object is not a regular language, so for that case it gets the
depth-bounded regex of {"type": "object"} (its default depth, 3).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from common import synthetic_qwen_vocab  # noqa: E402
from kestreld.engine.constraint import (JSON_OBJECT_SCHEMA, Constraint,  # noqa: E402
                                        GrammarVocabulary, answer_grammar)
from kestreld.engine.sampler import ResponseFormat  # noqa: E402
from kestreld.model.gguf_file import open_gguf  # noqa: E402
from kestreld.text.tokenizer import Tokenizer  # noqa: E402
from kestreld.text.tools import CLOSE, OPEN, ToolUse  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "languages", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 64},
              "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "languages": {"type": "array", "items": {"enum": ["en", "de", "fr", "zh"]},
                            "maxItems": 4},
              "address": {"type": "object", "additionalProperties": False,
                          "required": ["city", "zip"],
                          "properties": {"city": {"type": "string"},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}'
CASES = {   # name -> (response_format, tools, answer, its JSON schema for outlines-core)
    "json_object": (ResponseFormat("json_object"), None,
                    '{"title": "Kestrel", "tags": ["bird", "falcon"], "size": {"cm": 34.5, '
                    '"wingspan_cm": 76}, "common": true, "note": null}', JSON_OBJECT_SCHEMA),
    "schema": (ResponseFormat("json_schema", PERSON), None,
               '{"name": "Ada Lovelace", "age": 36, "languages": ["en", "fr"], '
               '"address": {"city": "London", "zip": "12345"}}', PERSON),
    "tool_call": (None, ToolUse((WEATHER,), required=True, only="get_weather"),
                  f"{OPEN}\n{CALL_JSON}\n{CLOSE}", ToolUse((WEATHER,)).call_schemas()[0]),
}


class _Fields(dict):
    """GGUF metadata fields for Tokenizer.from_gguf_metadata, from plain values."""

    class _Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    def __init__(self, values: dict):
        super().__init__({k: self._Field(v) for k, v in values.items()})


def qwen3_sized_tokenizer() -> Tokenizer:
    tokens, types, merges = synthetic_qwen_vocab(151936)
    return Tokenizer.from_gguf_metadata(_Fields({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.ggml.bos_token_id": 151643}))


def smollm2_tokenizer() -> Tokenizer:
    from _loader_models import smollm2_gguf
    return Tokenizer.from_gguf_metadata(open_gguf(smollm2_gguf()).fields)


def _summary(steps: list) -> str:
    """The first step apart (nothing cached yet), then the others' median, mean, p90, max."""
    ms = sorted(t * 1e3 for t in steps[1:])
    return (f"first {steps[0] * 1e3:.3f} ms, then median {statistics.median(ms):.3f}, "
            f"mean {statistics.fmean(ms):.3f}, p90 {ms[int(0.9 * (len(ms) - 1))]:.3f}, "
            f"max {ms[-1]:.3f} ({len(steps)} steps)")


def bench_llguidance(tok: Tokenizer, n_vocab: int, logits: np.ndarray) -> None:
    t0 = time.perf_counter()
    vocab = GrammarVocabulary(tok, n_vocab)
    print(f"  llguidance: vocabulary {time.perf_counter() - t0:.2f} s")
    for name, (fmt, tools, answer, _) in CASES.items():
        grammar = answer_grammar(fmt, tools, None)
        t0 = time.perf_counter()
        c = Constraint(vocab, grammar)
        t_compile = time.perf_counter() - t0
        steps = []
        for t in tok.encode(answer):
            t0 = time.perf_counter()
            masked = c.mask(logits)
            c.commit(t)
            steps.append(time.perf_counter() - t0)
            assert np.isfinite(masked[t]), f"llguidance refused token {t} of the answer"
        print(f"    {name:12s} compile {t_compile * 1e3:7.1f} ms; per step {_summary(steps)}")


def bench_outlines(tok: Tokenizer, n_vocab: int, logits: np.ndarray) -> None:
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        print("  outlines-core: not installed (pip install outlines-core)")
        return
    t0 = time.perf_counter()
    skip = tok.eos_ids | tok.control_ids
    by_bytes: dict = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes([i])
        if b and i not in skip:
            by_bytes.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(tok.eos_id, by_bytes)
    print(f"  outlines-core: vocabulary {time.perf_counter() - t0:.2f} s")
    bits = np.empty((1, (n_vocab + 31) // 32), dtype=np.int32)
    for name, (_, _, answer, schema) in CASES.items():
        t0 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(schema))
        if name == "tool_call":
            regex = f"{OPEN}\n{regex}\n{CLOSE}".replace("/", "\\/")
        index = outlines_core.Index(regex, vocab)
        guide = outlines_core.Guide(index)
        t_compile = time.perf_counter() - t0
        steps = []
        for t in tok.encode(answer):
            t0 = time.perf_counter()
            guide.write_mask_into(bits.ctypes.data, bits.size, bits.itemsize)
            allowed = np.unpackbits(bits.view(np.uint8), count=n_vocab, bitorder="little").view(bool)
            masked = np.where(allowed, logits, -np.inf)
            guide.advance(t, return_tokens=False)
            steps.append(time.perf_counter() - t0)
            assert np.isfinite(masked[t]), f"outlines-core refused token {t} of the answer"
        print(f"    {name:12s} index {t_compile * 1e3:7.1f} ms; per step {_summary(steps)}")


def bench_decode(reps: int) -> None:
    """Greedy decode on SmolLM2 (one thread) with and without a schema's grammar: the same
    chat, the same number of tokens (the constrained answer's), runs alternating."""
    from kestreld.engine.generate import Engine
    from kestreld.engine.prompt import ChatInput
    from kestreld.engine.sampler import SamplingOptions
    from kestreld.model.convert import smollm2_q8_0_path
    from kestreld.model.load import load_model
    from kestreld.service.config import default_cache_dir
    engine = Engine(load_model(smollm2_q8_0_path(default_cache_dir(os.environ))), threads=1)
    chat = ChatInput(({"role": "user", "content": "Describe a fictional person as JSON."},))
    fmt = ResponseFormat("json_schema", PERSON)
    engine.run(chat, SamplingOptions(max_tokens=8))                      # warm up
    with_grammar, without = [], []
    for _ in range(reps):
        c = engine.run(chat, SamplingOptions(max_tokens=256, response_format=fmt))
        with_grammar.append(c.decode_ms / c.completion_tokens)
        c0 = engine.run(chat, SamplingOptions(max_tokens=c.completion_tokens, ignore_eos=True))
        without.append(c0.decode_ms / c0.completion_tokens)
    a, b = statistics.median(with_grammar), statistics.median(without)
    print(f"SmolLM2 decode, 1 thread, {c.completion_tokens} tokens x {reps}: "
          f"{b:.2f} ms/token free, {a:.2f} with the schema's grammar (+{a - b:.2f} ms, "
          f"{100 * (a - b) / b:+.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", action="store_true", help="also decode on SmolLM2 with and without")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.decode:
        bench_decode(args.reps)
    for label, make, n_vocab in (("SmolLM2 (49,152 tokens)", smollm2_tokenizer, 49152),
                                 ("Qwen3-sized (151,936 tokens)", qwen3_sized_tokenizer, 151936)):
        tok = make()
        logits = np.random.default_rng(0).normal(size=n_vocab).astype(np.float32)
        print(label)
        bench_llguidance(tok, n_vocab, logits)
        bench_outlines(tok, n_vocab, logits)


if __name__ == "__main__":
    main()
