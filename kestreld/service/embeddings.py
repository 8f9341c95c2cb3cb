"""The HTTP embedding routes: OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed`,
and reranking, `POST /v1/rerank` (also `/rerank`) in the shape of llama.cpp's server and Jina.

Each is a thin mapping onto an RPC method, `embed` or `rerank` (service/methods.py): the body
becomes its params map, `Methods.validate` and `Methods.submit` take it from there, and its
result map becomes the route's shape. The vectors are the same float32 values on every
route: JSON numbers print them exactly, base64 holds their bytes.
"""
from __future__ import annotations

import base64
import contextlib
import time

import numpy as np
from aiohttp import web

from ..errors import BadRequest, internal
from .methods import job_result
from .openai import check_model, check_object
from .scheduler import Done

OPENAI_PATHS = ("/v1/embeddings", "/embeddings")     # also without /v1, as OpenAI's others
OLLAMA_PATH = "/api/embed"
RERANK_PATHS = ("/v1/rerank", "/rerank")
PATHS = OPENAI_PATHS + (OLLAMA_PATH,) + RERANK_PATHS
ENCODINGS = ("float", "base64")


def openai_params(body, model_id: str, strict: tuple = ()) -> tuple[dict, str]:
    """An OpenAI embeddings body -> (the RPC `embed` params, encoding_format); `model` as
    openai.check_model takes it."""
    body = check_object(body)
    check_model(body, model_id, strict)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODINGS:
        raise BadRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}, got "
                         f"{str(fmt)[:60]!r}", param="encoding_format")
    if "input" not in body:
        raise BadRequest("input is required", param="input")
    params = {"input": body["input"]}
    if body.get("dimensions") is not None:
        params["dimensions"] = body["dimensions"]
    return params, fmt


def openai_response(result: dict, fmt: str, model_id: str) -> dict:
    """The RPC result map as OpenAI's embeddings list (base64: little-endian float32)."""
    def encoded(v: list):
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if fmt == "base64" else v
    tokens = result["usage"]["prompt_tokens"]
    return {"object": "list", "model": model_id,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                     for i, v in enumerate(result["embeddings"])],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def ollama_params(body, model_id: str, strict: tuple = ()) -> dict:
    """An Ollama /api/embed body -> the RPC `embed` params (Ollama truncates by default;
    its `options` and `keep_alive` change nothing here: one model stays loaded)."""
    body = check_object(body)
    check_model(body, model_id, strict)
    if "input" not in body:
        raise BadRequest("input is required", param="input")
    truncate = body.get("truncate", True)
    params = {"input": body["input"], "truncate": truncate}
    if body.get("dimensions") is not None:
        params["dimensions"] = body["dimensions"]
    return params


def rerank_params(body, model_id: str, strict: tuple = ()) -> dict:
    """A rerank body (llama.cpp's, Jina's: `query`, `documents` as strings or {"text"}
    objects, `top_n`; Kestrel's `instruction`) -> the RPC `rerank` params."""
    body = check_object(body)
    check_model(body, model_id, strict)
    docs = body.get("documents")
    if isinstance(docs, list):
        docs = [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d
                for d in docs]
    params = {"query": body.get("query"), "documents": docs}
    for name in ("top_n", "instruction"):
        if body.get(name) is not None:
            params[name] = body[name]
    return params


def rerank_response(result: dict, model_id: str) -> dict:
    """The RPC result map as llama.cpp's / Jina's rerank answer."""
    tokens = result["usage"]["prompt_tokens"]
    return {"object": "list", "model": model_id, "results": result["results"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def ollama_response(result: dict, model_id: str, total_s: float) -> dict:
    """The RPC result map in Ollama's shape (durations in nanoseconds)."""
    return {"model": model_id, "embeddings": result["embeddings"],
            "total_duration": int(total_s * 1e9), "load_duration": 0,
            "prompt_eval_count": result["usage"]["prompt_tokens"]}


class EmbeddingRoutes:
    """The routes on one HttpApi (service/http.py: its model, its jobs, its reading of a
    JSON body)."""

    def __init__(self, api, read_json):
        self.api = api
        self.read_json = read_json

    def add_to(self, app: web.Application) -> None:
        for path in OPENAI_PATHS:
            app.router.add_post(path, self.openai)
        app.router.add_post(OLLAMA_PATH, self.ollama)
        for path in RERANK_PATHS:
            app.router.add_post(path, self.rerank)

    async def openai(self, request: web.Request) -> web.Response:
        params, fmt = openai_params(await self.read_json(request), self.api.model_id,
                                    self.api.strict_names())
        result = await self._run(request, params)
        return web.json_response(openai_response(result, fmt, self.api.model_id))

    async def ollama(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        params = ollama_params(await self.read_json(request), self.api.model_id,
                               self.api.strict_names())
        result = await self._run(request, params)
        return web.json_response(ollama_response(result, self.api.model_id,
                                                 time.monotonic() - t0))

    async def rerank(self, request: web.Request) -> web.Response:
        params = rerank_params(await self.read_json(request), self.api.model_id,
                               self.api.strict_names())
        result = await self._run(request, params, "rerank")
        return web.json_response(rerank_response(result, self.api.model_id))

    async def _run(self, request: web.Request, params: dict, method: str = "embed") -> dict:
        """The result map of the `embed` (or `rerank`) params once the engine is done (the
        job withdrawn if the client goes away first: HttpApi.job_events)."""
        async with contextlib.aclosing(self.api.job_events(request, method, params)) as events:
            async for ev in events:
                if isinstance(ev, Done):
                    return job_result(ev)
        raise internal(f"{method}: the job ended without a result")
