"""End-to-end: embeddings from the real kestreld serving the generated Qwen3 embedding GGUF
(tests/modelgen_embed.py), through the RPC method `embed` (kestrelctl's Client and the
`kestrelctl embed` command), OpenAI's POST /v1/embeddings (the unmodified openai SDK, which
asks for base64, and httpx for float) and Ollama's POST /api/embed (httpx and the unmodified
ollama client): the same float32 vector on every route, matching transformers' Qwen3Model.
Also the request mapping of service/embeddings.py, a chat model's refusal, and reranking
(POST /v1/rerank, the RPC method rerank) with a generated reranker."""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import ollama
import openai
import pytest

import modelgen_embed
from daemon import REPO, Daemon, daemon_env
from kestreld.errors import BadRequest
from kestreld.protocol import MAX_EMBED_INPUTS
from kestreld.service import embeddings as routes
from kestreld.service.main import model_id

TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "A small board computer runs a language model from its own memory."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return modelgen_embed.generate(tmp_path_factory.mktemp("embed_e2e"), ("q8_0",))


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ke")
    with Daemon(tmp / "k.sock", "--http", "127.0.0.1:0", "--prefill-chunk", "16",
                model=str(model.gguf["q8_0"])) as d:
        d.model_id = model_id(str(model.gguf["q8_0"]))
        yield d


@pytest.fixture(scope="module")
def want(model):
    """transformers' Qwen3Model: the last token's hidden state, normalized, per text."""
    import torch
    from transformers import AutoModel
    torch.set_num_threads(2)
    m = AutoModel.from_pretrained(str(model.hf_dir), dtype=torch.float32).eval()
    out = []
    for text in TEXTS:
        ids = model.tokenizer.tokenizer.encode(text).ids
        with torch.no_grad():
            v = m(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
        out.append(v / np.linalg.norm(v))
    return out


def test_every_route_gives_the_same_vector(daemon, model, want):
    with daemon.client() as c:
        rpc = c.embed(TEXTS)
    vectors = [np.asarray(v, np.float32) for v in rpc["embeddings"]]
    for v, w in zip(vectors, want):
        assert float(v.astype(np.float64) @ w) >= 0.999
    tokens = sum(len(model.tokenizer.tokenizer.encode(t).ids) for t in TEXTS)
    assert rpc["usage"]["prompt_tokens"] == tokens

    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as sdk:
        r = sdk.embeddings.create(model=daemon.model_id, input=TEXTS)     # base64 on the wire
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == tokens
    for d, v in zip(r.data, vectors):
        assert np.array_equal(np.asarray(d.embedding, np.float32), v)

    with httpx.Client(base_url=daemon.http_url, timeout=120) as http:
        f = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"}).json()
        b = http.post("/v1/embeddings", json={"input": TEXTS[0],
                                              "encoding_format": "base64"}).json()
        o = http.post("/api/embed", json={"model": daemon.model_id, "input": TEXTS}).json()
    assert [np.asarray(d["embedding"], np.float32).tolist() for d in f["data"]] == \
        [v.tolist() for v in vectors]
    assert np.array_equal(np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), "<f4"),
                          vectors[0])
    assert o["model"] == daemon.model_id and o["prompt_eval_count"] == tokens
    assert o["total_duration"] > 0
    assert [np.asarray(e, np.float32).tolist() for e in o["embeddings"]] == \
        [v.tolist() for v in vectors]
    # the unmodified ollama client on the same route
    r = ollama.Client(host=daemon.http_url, timeout=120).embed(model=daemon.model_id, input=TEXTS)
    assert [np.asarray(e, np.float32).tolist() for e in r.embeddings] == \
        [v.tolist() for v in vectors]
    assert r.prompt_eval_count == tokens


def test_dimensions_and_ids_through_the_routes(daemon, model):
    ids = model.tokenizer.tokenizer.encode(TEXTS[0]).ids
    with daemon.client() as c:
        full = np.asarray(c.embed(TEXTS[0])["embeddings"][0])
        by_ids = c.embed([ids, ids[:5]])["embeddings"]
    assert np.array_equal(np.asarray(by_ids[0]), full)      # ids as given, the same tokens
    with httpx.Client(base_url=daemon.http_url, timeout=120) as http:
        cut = http.post("/v1/embeddings", json={"input": ids, "dimensions": 8}).json()
        o = http.post("/api/embed", json={"input": TEXTS[0], "dimensions": 8}).json()
    v = np.asarray(cut["data"][0]["embedding"])
    np.testing.assert_allclose(v, full[:8] / np.linalg.norm(full[:8]), rtol=1e-5, atol=1e-7)
    assert o["embeddings"][0] == cut["data"][0]["embedding"]


def test_bad_requests_get_clear_errors_and_the_daemon_serves_on(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=120) as http:
        for body, words in (({"input": []}, "not empty"),
                            ({"input": [1, "a"]}, "token ids"),
                            ({"input": ["a", [1]]}, "only strings"),
                            ({"input": "a", "dimensions": 0}, "dimensions"),
                            ({"input": "a", "dimensions": 65}, "1..64"),
                            ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                            ({"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, "at most 2048")):
            r = http.post("/v1/embeddings", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
        other = http.post("/v1/embeddings", json={"input": "a", "model": "other"})
        assert other.status_code == 200 and other.json()["model"] != "other"   # as chat's
        long = {"input": [7] * 600}
        r = http.post("/v1/embeddings", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/api/embed", json=long)              # Ollama truncates by default
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 512
        assert http.post("/api/embed", json={**long, "truncate": False}).status_code == 400
        assert http.post("/v1/embeddings", json={"input": "still here"}).status_code == 200


def test_kestrelctl_embed_prints_one_json_line_per_text(daemon):
    out = subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", daemon.socket,
                          "embed", *TEXTS, "--dimensions", "4"], cwd=REPO, env=daemon_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(x["index"], x["text"]) for x in lines] == list(enumerate(TEXTS))
    assert all(len(x["embedding"]) == 4 and abs(np.linalg.norm(x["embedding"]) - 1) < 1e-5
               for x in lines)


def test_a_chat_model_says_why_it_does_not_embed(tmp_path):
    with Daemon(tmp_path / "k.sock") as d:                  # SmolLM2: no pooling in its file
        out = subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", d.socket, "embed",
                              "hello"], cwd=REPO, env=daemon_env(), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 12 and "not_embedding_model" in out.stderr
        assert "--pooling last|mean|cls" in out.stderr
        assert d.client().generate(prompt="Hi", max_tokens=2).usage["completion_tokens"] == 2


def test_request_mapping():
    assert routes.openai_params({"input": "a", "dimensions": 3, "model": "m"}, "m") == (
        {"input": "a", "dimensions": 3}, "float")
    assert routes.ollama_params({"model": "m:latest", "input": ["a"]}, "m") == {
        "input": ["a"], "truncate": True}
    with pytest.raises(BadRequest, match="input is required"):
        routes.openai_params({}, "m")
    result = {"embeddings": [[0.5, -0.25]], "usage": {"prompt_tokens": 3, "cached_tokens": 0}}
    r = routes.openai_response(result, "base64", "m")
    assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    decoded = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == [0.5, -0.25]
    assert routes.ollama_response(result, "m", 0.5)["total_duration"] == 500_000_000


def test_status_and_show_say_how_the_model_pools(daemon):
    with daemon.client() as c:
        assert c.status()["model"]["pooling"] == "last"
    out = subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", daemon.socket, "show"],
                         cwd=REPO, env=daemon_env(), capture_output=True, text=True, timeout=120)
    assert "yes (last pooling)" in out.stdout, out.stdout + out.stderr


def test_rerank_through_rpc_and_http(tmp_path):
    """A Qwen3-Reranker-style GGUF served: POST /v1/rerank (and /rerank) in llama.cpp's and
    Jina's shape, and the RPC method rerank, give the same ranking."""
    model = modelgen_embed.generate_reranker(tmp_path)
    query, docs = "Where does the kestrel nest?", TEXTS + ["Kestrels nest in old buildings."]
    with Daemon(tmp_path / "k.sock", "--http", "127.0.0.1:0",
                model=str(model.gguf["q8_0"])) as d:
        mid = model_id(str(model.gguf["q8_0"]))
        with d.client() as c:
            rpc = c.rerank(query, docs)
        with httpx.Client(base_url=d.http_url, timeout=120) as http:
            r = http.post("/v1/rerank", json={"model": mid, "query": query, "documents": docs,
                                              "top_n": 2}).json()
            jina = http.post("/rerank", json={"query": query,
                                              "documents": [{"text": t} for t in docs]}).json()
            bad = http.post("/v1/rerank", json={"query": query, "documents": []})
            # this file's rerank template has no instruction to replace (test_rerank.py)
            told = http.post("/v1/rerank", json={"query": query, "documents": docs,
                                                 "instruction": "Find the code"})
            typo = http.post("/v1/rerank", json={"query": query, "documents": docs,
                                                 "instruction": 3})
            embed = http.post("/v1/embeddings", json={"input": "a"})
        out = subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", d.socket, "rerank",
                              query, *docs, "--top-n", "2"], cwd=REPO, env=daemon_env(),
                             capture_output=True, text=True, timeout=120)
        told_ctl = subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", d.socket,
                                   "rerank", query, *docs, "--instruction", "Find the code"],
                                  cwd=REPO, env=daemon_env(), capture_output=True, text=True,
                                  timeout=120)
    scores = [x["relevance_score"] for x in rpc["results"]]
    assert sorted(x["index"] for x in rpc["results"]) == [0, 1, 2]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert r["results"] == rpc["results"][:2] and jina["results"] == rpc["results"]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [{k: x[k] for k in ("index", "relevance_score")} for x in lines] == r["results"]
    assert [x["document"] for x in lines] == [docs[x["index"]] for x in r["results"]]
    assert r["usage"]["prompt_tokens"] == rpc["usage"]["prompt_tokens"] > 0
    assert bad.status_code == 400 and "documents" in bad.json()["error"]["message"]
    assert told.status_code == 400 and "no instruction" in told.json()["error"]["message"]
    assert typo.status_code == 400 and "instruction" in typo.json()["error"]["message"]
    assert told_ctl.returncode != 0 and "no instruction" in told_ctl.stderr
    assert embed.status_code == 400 and "a reranker" in embed.json()["error"]["message"]
