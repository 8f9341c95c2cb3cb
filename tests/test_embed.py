"""engine/embed.py and the embedding models' loading: a generated Qwen3 embedding model
(tests/modelgen_embed.py) as GGUF Q8_0, Q4_0 and as a sentence-transformers HF directory,
against transformers' Qwen3Model (the last hidden state of the pooled token, normalized)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import modelgen_embed
import reference
from kestreld.engine.embed import EmbedInput
from kestreld.engine.generate import Engine
from kestreld.errors import BadRequest, NotEmbeddingModel, PromptTooLong
from kestreld.model.load import load_model

TEXTS = ("The quick brown fox jumps over the lazy dog near the river bank.",
         "Caches keep keys and values for every token that was already seen. " * 6,
         "def forward(self, x):\n    return self.norm(x + self.attn(x))\n",
         "A small board computer runs a language model from its own memory.")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return modelgen_embed.generate(tmp_path_factory.mktemp("embed"), ("q8_0", "q4_0"))


@pytest.fixture(scope="module")
def qwen3model(model):
    """transformers' Qwen3Model on the HF directory (float32, eager attention)."""
    import torch
    from transformers import AutoModel
    torch.set_num_threads(2)
    m = AutoModel.from_pretrained(str(model.hf_dir), dtype=torch.float32,
                                  attn_implementation="eager").eval()

    def hidden(ids) -> np.ndarray:
        with torch.no_grad():
            return m(torch.tensor([list(ids)])).last_hidden_state[0].double().numpy()
    return hidden


def engine(path, prefill_chunk: int = 16, **kw) -> Engine:
    return Engine(load_model(str(path)), max_seq=512, threads=2, prefill_chunk=prefill_chunk,
                  **kw)


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def cosine(a, b) -> float:
    return float(unit(a) @ unit(b))


def hf_ids(model, text: str) -> list:
    """The ids sentence-transformers feeds: tokenizer.json with its post-processor."""
    return model.tokenizer.tokenizer.encode(text).ids


def test_the_files_say_last_pooling_and_end_of_text(model):
    end = model.tokenizer.tokenizer.token_to_id(modelgen_embed.END)
    for path in (model.gguf["q8_0"], model.hf_dir):
        loaded = load_model(str(path))
        assert loaded.config.pooling == "last" and loaded.config.tied_embeddings
        assert loaded.tokenizer.suffix_ids == (end,)
        assert loaded.weights.output is loaded.weights.tok_embd   # no output matrix in the files


@pytest.mark.parametrize("source", ["q8_0", "hf"])
def test_last_pooling_matches_transformers(model, qwen3model, source):
    e = engine(model.hf_dir if source == "hf" else model.gguf[source])
    got = e.embed(EmbedInput(TEXTS))
    assert len(got.vectors) == len(TEXTS)
    for text, v in zip(TEXTS, got.vectors):
        ids = hf_ids(model, text)
        assert ids[-1] == model.tokenizer.tokenizer.token_to_id(modelgen_embed.END)
        assert v.dtype == np.float32 and abs(np.linalg.norm(v) - 1) < 1e-5
        want = qwen3model(ids)[-1]
        assert cosine(v, want) >= 0.999, (text[:20], cosine(v, want))
    assert got.prompt_tokens == sum(len(hf_ids(model, t)) for t in TEXTS)
    # a text's vector is its own: the texts are far apart
    assert cosine(got.vectors[0], got.vectors[1]) < 0.99


def test_four_bit_within_its_own_error(model):
    """As test_quant_kernels measures a type: Kestrel's distance to the float weights' vector
    is at most the float64 reference's on the type's numbers, plus 0.005."""
    qtype = gguf.GGMLQuantizationType.Q4_0
    held = {k: (gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype) if w.ndim == 2
                else w) for k, w in model.weights.items()}
    got = engine(model.gguf["q4_0"]).embed(EmbedInput(TEXTS)).vectors
    for text, v in zip(TEXTS, got):
        ids = hf_ids(model, text)
        exact = unit(reference.forward(model.weights, model.config, ids, normed_rows=True)[-1])
        same = unit(reference.forward(held, model.config, ids, normed_rows=True)[-1])
        own, ours = np.linalg.norm(same - exact), np.linalg.norm(unit(v) - exact)
        print(f"Q4_0 {len(ids)} tokens: distance {ours:.4f}, the type's own {own:.4f}")
        assert ours <= own + 0.005


def test_the_same_vector_as_llama_cpp_on_the_same_file(model):
    """llama.cpp with embedding=True and the file's pooling (last, EOS appended)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(model.gguf["q8_0"]), embedding=True, n_ctx=512,
                          n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    got = engine(model.gguf["q8_0"]).embed(EmbedInput(TEXTS)).vectors
    for text, v in zip(TEXTS, got):
        theirs, count = llm.embed(text, normalize=True, return_count=True)
        assert count == len(hf_ids(model, text))           # the same tokens, EOS included
        assert cosine(v, theirs) >= 0.999


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_option_mean_and_cls(model, qwen3model, pooling):
    e = engine(model.gguf["q8_0"], pooling=pooling)
    got = e.embed(EmbedInput(TEXTS[:2])).vectors
    for text, v in zip(TEXTS, got):
        h = qwen3model(hf_ids(model, text))
        want = h.mean(axis=0) if pooling == "mean" else h[0]
        assert cosine(v, want) >= 0.999


def test_dimensions_keep_the_first_values_renormalized(model):
    e = engine(model.gguf["q8_0"])
    full = e.embed(EmbedInput(TEXTS[:1])).vectors[0]
    cut = e.embed(EmbedInput(TEXTS[:1], dimensions=16)).vectors[0]
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-7)
    with pytest.raises(BadRequest, match="dimensions must be in 1..64"):
        e.embed(EmbedInput(TEXTS[:1], dimensions=65))


def test_ids_inputs_and_prefix_reuse_give_the_same_bits(model):
    e = engine(model.gguf["q8_0"])
    ids = hf_ids(model, TEXTS[1])
    first = e.embed(EmbedInput((TEXTS[1],)))
    again = e.embed(EmbedInput((tuple(ids),)))           # ids as given: the same tokens
    assert first.cached_tokens == 0 and again.cached_tokens == len(ids) - 1
    assert np.array_equal(first.vectors[0].view(np.uint32), again.vectors[0].view(np.uint32))


class CountedForward:
    """The engine's forward pass, counting its calls (each is one pass over the weights)."""

    def __init__(self, forward):
        self.forward, self.calls = forward, 0

    def __getattr__(self, name):
        return getattr(self.forward, name)

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.forward(*args, **kw)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_short_inputs_share_a_pass_with_the_same_bits_as_alone(model, pooling):
    """Inputs that fit one chunk together go in one pass, each vector the bits it has when
    its input is sent alone; an input longer than the chunk still runs in its own passes."""
    e = engine(model.gguf["q8_0"], prefill_chunk=64, pooling=pooling)
    counted = e.embedder.forward = CountedForward(e.embedder.forward)
    texts = (TEXTS[0], TEXTS[3], TEXTS[2], TEXTS[1], TEXTS[0])   # 20, 21, 23, 121, 20 tokens
    together = e.embed(EmbedInput(texts)).vectors
    assert counted.calls == (1 if pooling == "cls" else 4)      # 64 together, 121 in 2, 20
    for text, v in zip(texts, together):
        alone = engine(model.gguf["q8_0"], prefill_chunk=64, pooling=pooling)
        want = alone.embed(EmbedInput((text,))).vectors[0]
        np.testing.assert_array_equal(v.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("pooling,chunk", [("last", 16), ("last", 256), ("mean", 256),
                                           ("cls", 256)])
def test_a_chat_prefix_survives_embeddings(model, pooling, chunk):
    """The arena holds a conversation; after embeddings that share part of it and that do
    not, one at a time or packed in a pass, its keys are the same and its next tokens'
    logits the same bits as without them."""
    rng = np.random.default_rng(3)
    chat = [int(i) for i in rng.integers(0, 500, 120)]
    more = [int(i) for i in rng.integers(0, 500, 20)]
    plain = engine(model.gguf["q8_0"])
    busy = engine(model.gguf["q8_0"], prefill_chunk=chunk, pooling=pooling)
    for e in (plain, busy):
        e.forward_logits(chat, 0)
    busy.embed(EmbedInput((tuple(chat[:50] + [7, 8, 9]), tuple(chat[:30]), tuple(chat[:10]))))
    busy.embed(EmbedInput((tuple(chat[:50] + [7, 8, 9]), TEXTS[0], tuple(chat[:10]))))
    assert busy.kv.keys == tuple(chat)
    want = plain.forward_logits(more, len(chat))
    got = busy.forward_logits(more, len(chat))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_chat_model_is_refused_unless_pooling_is_given(zoo):
    path = zoo.get("qwen3_tied").gguf["q8_0"]
    with pytest.raises(NotEmbeddingModel, match="--pooling last"):
        engine(path).embed(EmbedInput(("hello",)))
    v = engine(path, pooling="last").embed(EmbedInput(("hello",))).vectors[0]
    assert v.shape == (64,) and abs(np.linalg.norm(v) - 1) < 1e-5


def test_limits_and_truncation(model):
    e = engine(model.gguf["q8_0"])
    long = tuple(range(1, 500)) * 2
    with pytest.raises(PromptTooLong, match="max_seq=512"):
        e.embed(EmbedInput((long,)))
    assert e.embed(EmbedInput((long,), truncate=True)).prompt_tokens == 512
    with pytest.raises(BadRequest, match="input 1 is empty"):
        e.embed(EmbedInput(("a", ())))
    assert e.kv.cache_len == 512            # the failed request left the arena as it was
