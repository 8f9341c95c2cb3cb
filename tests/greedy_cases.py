"""The cases whose greedy ids and logits are compared across machines (x86-64 with AVX2,
aarch64 with and without sdot): SmolLM2-135M Q8_0 on two of the llama.cpp chat prompts, and
the tests' generated Qwen3, Llama and Qwen3-MoE models as Q8_0 GGUF files.

`record(case, path)` computes what one machine says about a case: the model file's sha256 (the
same bytes in, or the comparison means nothing), its greedy ids (decode steps), and the logits
of one prefill over `sequence` (the prompt and the ids recorded on x86-64, so that rows stay
comparable where greedy ids part): their sha256, the last ROWS rows themselves (`rows`, not
recorded), and for each of those rows the TOP_K largest logits, the row's standard deviation
and its top-1 minus top-2 margin.
tests/golden/record_greedy.py writes x86-64's records once; tests/test_same_tokens.py
recomputes them wherever it runs and compares.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

import modelgen
import modelgen_moe
from kestreld.engine.generate import Engine
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.convert import smollm2_q8_0_path
from kestreld.model.load import load_model
from kestreld.service.config import default_cache_dir

GOLDEN = Path(__file__).parent / "golden" / "greedy_x86_64.json"
N_NEW = 24                    # greedy ids per case
ROWS = 32                     # logit rows summarized: the prompt's last 8 and the 24 decode steps
TOP_K = 16                    # logits kept per row

SMOLLM2_PROMPTS = (0, 3)      # indices into smollm2_llamacpp.json's continuations
GENERATED = ("qwen3_tied", "qwen3_untied", "llama")
MOE = ("qwen3moe_norm", "qwen3moe_raw")
CASES = [f"smollm2:{i}" for i in SMOLLM2_PROMPTS] + list(GENERATED) + list(MOE)


def model_path(case: str, root: Path) -> str:
    """The Q8_0 GGUF of `case`: SmolLM2 from the Kestrel cache, else generated under root."""
    if case.startswith("smollm2:"):
        return smollm2_q8_0_path(default_cache_dir(os.environ))
    if case in MOE:
        return str(modelgen_moe.generate(case, root, ("q8_0",), hf=False).gguf["q8_0"])
    return str(modelgen.generate(case, root, tensor_types=("q8_0",)).gguf["q8_0"])


def prompt(case: str) -> list[int]:
    if case.startswith("smollm2:"):
        with open(Path(__file__).parent / "golden" / "smollm2_llamacpp.json") as f:
            return json.load(f)["continuations"][int(case.split(":")[1])]["prompt_ids"]
    if case in MOE:
        return modelgen_moe.prompt_ids(case, 100, seed=3)
    return modelgen.prompt_ids(case, 100, seed=3)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record(case: str, path: str, sequence=None, threads: int = 2) -> dict:
    """One case's record (module docstring). `sequence`: the ids the prefill runs over (default:
    the prompt and this machine's own greedy ids)."""
    ids = prompt(case)
    engine = Engine(load_model(path), max_seq=len(ids) + N_NEW + 8, threads=threads,
                    prefill_chunk=256)
    gen = engine.generate(ids, SamplingOptions(max_tokens=N_NEW, temperature=0.0,
                                               ignore_eos=True)).ids
    engine.kv.truncate(0)
    logits = engine.forward_logits(sequence or ids + gen, 0)
    rows = logits[-ROWS - 1:-1]                     # the rows whose argmax is the next id
    top = np.argsort(-rows, axis=-1, kind="stable")[:, :TOP_K]
    top2 = np.sort(rows, axis=-1)[:, -2:]
    return {"case": case, "model_sha256": sha256_file(path), "greedy_ids": gen,
            "logits_sha256": hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest(),
            "rows": rows, "top_ids": top.tolist(),
            "top_logits": np.take_along_axis(rows, top, axis=-1).tolist(),
            "row_std": rows.std(axis=-1).tolist(),
            "margins": (top2[:, 1] - top2[:, 0]).tolist()}
