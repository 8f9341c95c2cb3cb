"""The engine's forward pass against the two references, for every generated model, loaded
from the Q8_0 GGUF, the F16 GGUF and the HF dir:

- transformers, float32 (the exact model): rel RMS error <= 0.03, margin top-1 >= 99%;
- the float64 reference on the numbers the engine holds (weights rounded through Q8_0, via
  fp16 for the F16 file; int8 KV; Q8_0 activations): rel RMS <= 0.015, top-1 >= 99.5%;

and the ways of feeding a prompt agree: one chunk == chunks == token by token, and greedy
generation is the same whatever the prefill chunk, on a prefix hit, and matches the argmax
of the prefill logits and of transformers where it is decided.

Measured (2,000 tokens, engine on 2 threads): vs transformers 0.013-0.017 with top-1
0.9994-1.0; vs the same-numbers reference 0.004-0.009 (not ~0: Q8_0 activation rounding is
discontinuous, so any last-bit difference upstream redraws it); chunking changes no bit.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from kestreld.engine.generate import Engine
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from metrics import margin_top1_agreement, rel_rms_error
from modelgen import SPECS, prompt_ids

NAMES = list(SPECS)
SOURCES = ("gguf-q8_0", "gguf-f16", "hf")
LONG = {("qwen3_untied", "gguf-q8_0"), ("llama", "hf")}   # 2,000-token prompts; others 256

MAX_REL_VS_TRANSFORMERS = 0.03
MIN_AGREE_VS_TRANSFORMERS = 0.99
MAX_REL_VS_SAME_NUMBERS = 0.015
MIN_AGREE_VS_SAME_NUMBERS = 0.995


def _path(model, source: str) -> str:
    return str(model.hf_dir if source == "hf" else model.gguf[source.removeprefix("gguf-")])


def _engine(loaded, n_tokens: int, prefill_chunk: int) -> Engine:
    return Engine(loaded, max_seq=n_tokens + 64, threads=2, prefill_chunk=prefill_chunk,
                  kv_bs=32, prefix_kv=True, prefix_min=16)


def _logits(engine: Engine, ids) -> np.ndarray:
    engine.kv.truncate(0)
    return engine.forward_logits(ids, 0)


def _engine_logits(zoo, name: str, source: str):
    """(model, prompt ids, the engine's logits over them): 2,000 tokens for LONG, else 256."""
    m = zoo.get(name)
    n = 2000 if (name, source) in LONG else 256
    ids = prompt_ids(name, n, seed=1)
    got = _logits(_engine(load_model(_path(m, source)), n, 256), ids)
    assert got.shape == (n, m.spec.vocab) and np.isfinite(got).all()
    return m, ids, got


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(zoo, hf, name, source):
    m, ids, got = _engine_logits(zoo, name, source)
    exact = hf.logits(name, ids)
    rel = rel_rms_error(got, exact)
    agree, count = margin_top1_agreement(got, exact)
    assert count >= len(ids) // 2, f"only {count} decided positions"
    assert rel <= MAX_REL_VS_TRANSFORMERS, f"{name} {source}: rel RMS {rel:.4f} vs transformers"
    assert agree >= MIN_AGREE_VS_TRANSFORMERS, f"{name} {source}: top-1 {agree:.4f} vs transformers"


@pytest.mark.parametrize("name,source", [
    # as arm64 the 2,000-token float64 reference alone would take 7 of the run's minutes
    pytest.param(name, source, marks=() if (name, source) in LONG else pytest.mark.arm64)
    for name in NAMES for source in SOURCES])
def test_logits_match_the_float64_reference(zoo, name, source):
    m, ids, got = _engine_logits(zoo, name, source)
    held = reference.quantize_weights(m.weights, via_f16=source == "gguf-f16")
    same = reference.forward(held, m.config, ids, kv_int8=True, act_q8=True)
    rel = rel_rms_error(got, same)
    agree, _ = margin_top1_agreement(got, same)
    assert rel <= MAX_REL_VS_SAME_NUMBERS, f"{name} {source}: rel RMS {rel:.4f} vs Q8 reference"
    assert agree >= MIN_AGREE_VS_SAME_NUMBERS, f"{name} {source}: top-1 {agree:.4f} vs Q8 reference"


@pytest.mark.parametrize("name", NAMES)
def test_prefill_chunking_is_invisible(zoo, name):
    """One chunk == chunks of 40 (not a multiple of kv_bs) == one token at a time, bit for bit
    (tests/test_same_bits.py holds every model kind to it at depths past 4,096)."""
    loaded = load_model(_path(zoo.get(name), "gguf-q8_0"))
    n = 300
    ids = prompt_ids(name, n, seed=2)
    one = _logits(_engine(loaded, n, 256), ids)
    chunked = _logits(_engine(loaded, n, 40), ids)
    stepper = _engine(loaded, n, 1)
    stepper.kv.truncate(0)
    by_token = np.concatenate([stepper.forward_logits([t], pos) for pos, t in enumerate(ids)])
    for label, other in (("chunks of 40", chunked), ("token by token", by_token)):
        np.testing.assert_array_equal(other.view(np.uint32), one.view(np.uint32), err_msg=label)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.arm64
def test_packed_sequences_are_each_as_alone(zoo, name):
    """Sequences packed in one pass (embeddings: seq_starts) each see only their own keys at
    RoPE positions 0..: every row's hidden state is the bits of that sequence run alone from
    row 0, with a length of 1, one that is not a multiple of the attention tile and one past
    it; a pack of several length-1 sequences too."""
    loaded = load_model(_path(zoo.get(name), "gguf-q8_0"))
    e = _engine(loaded, 256, 256)
    hidden = loaded.config.hidden
    seqs = [prompt_ids(name, n, seed=3 + n) for n in (37, 1, 16, 50)]
    for pack in (seqs, [s[:1] for s in seqs]):
        starts = np.cumsum([0] + [len(s) for s in pack])
        together = np.zeros((starts[-1], hidden), np.float32)
        e.kv.truncate(0)
        e.forward([t for s in pack for t in s], hidden_out=together,
                  seq_starts=starts[:-1].tolist())
        for s, a in zip(pack, starts):
            alone = np.zeros((len(s), hidden), np.float32)
            e.kv.truncate(0)
            e.forward(s, hidden_out=alone if len(s) > 1 else alone[:1])
            np.testing.assert_array_equal(together[a:a + len(s)].view(np.uint32),
                                          alone.view(np.uint32))


def _greedy(loaded, name: str):
    """(prompt ids, 20 greedy ids after them) on the Q8_0 GGUF."""
    ids = prompt_ids(name, 100, seed=3)
    opts = SamplingOptions(max_tokens=20, temperature=0.0, ignore_eos=True)
    c = _engine(loaded, 200, 256).generate(ids, opts)
    assert len(c.ids) == 20 and c.finish_reason == "length"
    return ids, c.ids


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.arm64
def test_greedy_generation(zoo, name):
    loaded = load_model(_path(zoo.get(name), "gguf-q8_0"))
    ids, gen = _greedy(loaded, name)
    opts = SamplingOptions(max_tokens=20, temperature=0.0, ignore_eos=True)
    for chunk in (32, 1):
        engine = _engine(loaded, 200, chunk)
        assert engine.generate(ids, opts).ids == gen, f"{name}: prefill_chunk={chunk} generates differently"

    hit = engine.generate(ids, opts)            # same prompt again: its KV is reused
    assert hit.cached_tokens >= 16 and hit.ids == gen

    # decoding one token at a time == the argmax of a prefill over the whole sequence
    seq = ids + gen
    prefill = _logits(_engine(loaded, len(seq), 256), seq)[len(ids) - 1:-1]
    np.testing.assert_array_equal(prefill.argmax(-1), gen)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_agrees_with_transformers_where_decided(zoo, hf, name):
    """Teacher-forced on the engine's own tokens, transformers picks the same where it is
    decided (top-1 ahead of top-2 by more than 0.1)."""
    ids, gen = _greedy(load_model(_path(zoo.get(name), "gguf-q8_0")), name)
    exact = hf.logits(name, ids + gen)[len(ids) - 1:-1]
    top2 = np.sort(exact, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 0.1
    assert decided.sum() >= 10
    np.testing.assert_array_equal(np.asarray(gen)[decided], exact.argmax(-1)[decided])
