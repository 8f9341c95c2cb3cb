"""engine/rerank.py: a generated Qwen3-Reranker-style GGUF (tests/modelgen_embed.py: llama.cpp's
layout, pooling RANK, cls.output.weight, a rerank template) against transformers'
Qwen3ForCausalLM on the same weights: the score is softmax over the two answer tokens'
logits at the prompt's last position."""
from __future__ import annotations

import numpy as np
import pytest

import modelgen_embed
from kestreld.engine.embed import EmbedInput
from kestreld.engine.generate import Engine
from kestreld.engine.rerank import DEFAULT_INSTRUCTION, QWEN3_TEMPLATE, RerankInput
from kestreld.errors import BadRequest, NotEmbeddingModel
from kestreld.model.load import load_model

QUERY = "Where does the kestrel build its nest?"
DOCS = ("The kestrel nests in holes in trees, cliffs and old buildings.",
        "def forward(self, x):\n    return self.norm(x + self.attn(x))\n",
        "Caches keep keys and values for every token that was already seen.",
        "A small board computer runs a language model from its own memory.")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return modelgen_embed.generate_reranker(tmp_path_factory.mktemp("rerank"))


@pytest.fixture(scope="module")
def want(model):
    """transformers: sigmoid(logit yes - logit no) at each prompt's last token."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    m = AutoModelForCausalLM.from_pretrained(str(model.hf_dir), dtype=torch.float32).eval()
    yes, no = modelgen_embed.RERANK_TOKENS
    out = []
    for doc in DOCS:
        text = modelgen_embed.RERANK_TEMPLATE.format(query=QUERY, document=doc)
        ids = model.tokenizer.tokenizer.encode(text).ids
        with torch.no_grad():
            logits = m(torch.tensor([ids])).logits[0, -1].double().numpy()
        out.append(1.0 / (1.0 + np.exp(logits[no] - logits[yes])))
    return np.array(out)


def test_the_gguf_says_rank_and_holds_the_head_and_template(model):
    loaded = load_model(str(model.gguf["q8_0"]))
    assert loaded.config.pooling == "rank" and loaded.rank_head.shape == (2, 64)
    assert loaded.rerank_template == modelgen_embed.RERANK_TEMPLATE


def test_scores_match_transformers(model, want):
    e = Engine(load_model(str(model.gguf["q8_0"])), max_seq=512, threads=2, prefill_chunk=16)
    r = e.reranker.run(RerankInput(QUERY, DOCS, top_n=2))
    got = np.array(r.scores)
    print("scores", np.round(got, 4), "transformers", np.round(want, 4))
    assert np.abs(got - want).max() < 0.02
    assert r.best() == sorted(enumerate(r.scores), key=lambda p: -p[1])[:2]
    assert r.prompt_tokens > 0 and r.cached_tokens > 0     # the shared prefix was reused
    with pytest.raises(NotEmbeddingModel, match="a reranker"):
        e.embed(EmbedInput(("a",)))


def test_scores_match_llama_cpp_on_the_same_file(model):
    """llama.cpp reads the file as a reranker the same way: its first output (the "yes" row
    of cls.output.weight, softmaxed against "no") is our score."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(model.gguf["q8_0"]), embedding=True, n_ctx=512,
                          n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    e = Engine(load_model(str(model.gguf["q8_0"])), max_seq=512, threads=2)
    ours = e.reranker.run(RerankInput(QUERY, DOCS)).scores
    for doc, score in zip(DOCS, ours):
        text = modelgen_embed.RERANK_TEMPLATE.format(query=QUERY, document=doc)
        theirs = np.asarray(llm.embed(text, normalize=False)).ravel()[:2]
        assert abs(theirs.sum() - 1) < 1e-5 and abs(theirs[0] - score) < 0.02, (theirs, score)


def test_a_model_that_does_not_rerank_says_why(zoo):
    path = zoo.get("qwen3_tied").gguf["q8_0"]
    with pytest.raises(NotEmbeddingModel, match="no reranker"):
        Engine(load_model(str(path)), max_seq=256).reranker.run(RerankInput("q", ("d",)))
    e = Engine(load_model(str(path)), max_seq=256, pooling="rank")
    with pytest.raises(NotEmbeddingModel, match="no \"yes\" and \"no\" tokens"):
        e.reranker.run(RerankInput("q", ("d",)))
    assert "{query}" in QWEN3_TEMPLATE and "{document}" in QWEN3_TEMPLATE


def test_an_instruction_goes_into_the_prompt(model):
    """The file's template here has no instruction: a request with one is refused. Qwen3-
    Reranker's own template (the one used without a file's) takes the request's, its default
    otherwise; a file's template with the default written in (as llama.cpp's converter
    writes it) has it replaced."""
    e = Engine(load_model(str(model.gguf["q8_0"])), max_seq=512, threads=2)
    with pytest.raises(BadRequest, match="no instruction"):
        e.reranker.run(RerankInput(QUERY, DOCS, instruction="Find the code"))
    e.reranker.template = QWEN3_TEMPLATE
    plain = e.reranker.run(RerankInput(QUERY, DOCS))
    same = e.reranker.run(RerankInput(QUERY, DOCS, instruction=DEFAULT_INSTRUCTION))
    code = e.reranker.run(RerankInput(QUERY, DOCS, instruction="Find the code"))
    assert same.scores == plain.scores and code.scores != plain.scores
    assert code.prompt_tokens < plain.prompt_tokens         # a shorter instruction
    e.reranker.template = QWEN3_TEMPLATE.replace("{instruction}", DEFAULT_INSTRUCTION)
    again = e.reranker.run(RerankInput(QUERY, DOCS, instruction="Find the code"))
    assert again.scores == code.scores
