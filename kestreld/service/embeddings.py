"""The HTTP embedding routes: OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed`,
and reranking, `POST /v1/rerank` (also `/rerank`) in the shape of llama.cpp's server and Jina.

Each is a thin mapping onto an RPC method, `embed` or `rerank` (service/methods.py): the body
becomes its params map, `Methods.validate` and `Methods.submit` take it from there, and its
result map becomes the route's shape. The vectors are the same float32 values on every
route: JSON numbers print them exactly, base64 holds their bytes.
"""
from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from aiohttp import web

from ..errors import BadRequest
from .methods import job_result
from .scheduler import Done, Failed

OPENAI_PATH = "/v1/embeddings"
OLLAMA_PATH = "/api/embed"
RERANK_PATHS = ("/v1/rerank", "/rerank")
PATHS = (OPENAI_PATH, OLLAMA_PATH) + RERANK_PATHS
ENCODINGS = ("float", "base64")


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(body: dict, model_id: str, suffixes: tuple = ("",)) -> None:
    """`model`, when given, must name the daemon's model (Ollama's may end in a tag)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {type(model).__name__}", param="model")
    if model not in tuple(model_id + s for s in suffixes):
        raise BadRequest(f"model {model[:100]!r} is not served here: this daemon serves "
                         f"{model_id!r}", param="model")


def openai_params(body, model_id: str) -> tuple[dict, str]:
    """An OpenAI embeddings body -> (the RPC `embed` params, encoding_format)."""
    body = _object(body)
    _check_model(body, model_id)
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


def ollama_params(body, model_id: str) -> dict:
    """An Ollama /api/embed body -> the RPC `embed` params (Ollama truncates by default;
    its `options` and `keep_alive` change nothing here: one model stays loaded)."""
    body = _object(body)
    _check_model(body, model_id, ("", ":latest"))
    if "input" not in body:
        raise BadRequest("input is required", param="input")
    truncate = body.get("truncate", True)
    params = {"input": body["input"], "truncate": truncate}
    if body.get("dimensions") is not None:
        params["dimensions"] = body["dimensions"]
    return params


def rerank_params(body, model_id: str) -> dict:
    """A rerank body (llama.cpp's, Jina's: `query`, `documents` as strings or {"text"}
    objects, `top_n`) -> the RPC `rerank` params."""
    body = _object(body)
    _check_model(body, model_id)
    docs = body.get("documents")
    if isinstance(docs, list):
        docs = [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d
                for d in docs]
    params = {"query": body.get("query"), "documents": docs}
    if body.get("top_n") is not None:
        params["top_n"] = body["top_n"]
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
    """The two routes on one HttpApi (service/http.py: its state and methods, the conn_id
    of its jobs, its reading of a JSON body)."""

    def __init__(self, api, conn_id: int, read_json):
        self.api = api
        self.conn_id = conn_id
        self.read_json = read_json

    def add_to(self, app: web.Application) -> None:
        app.router.add_post(OPENAI_PATH, self.openai)
        app.router.add_post(OLLAMA_PATH, self.ollama)
        for path in RERANK_PATHS:
            app.router.add_post(path, self.rerank)

    async def openai(self, request: web.Request) -> web.Response:
        params, fmt = openai_params(await self.read_json(request), self.api.model_id)
        result = await self._run(request, params)
        return web.json_response(openai_response(result, fmt, self.api.model_id))

    async def ollama(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        params = ollama_params(await self.read_json(request), self.api.model_id)
        result = await self._run(request, params)
        return web.json_response(ollama_response(result, self.api.model_id,
                                                 time.monotonic() - t0))

    async def rerank(self, request: web.Request) -> web.Response:
        params = rerank_params(await self.read_json(request), self.api.model_id)
        result = await self._run(request, params, "rerank")
        return web.json_response(rerank_response(result, self.api.model_id))

    async def _run(self, request: web.Request, params: dict, method: str = "embed") -> dict:
        """Validate and submit the `embed` (or `rerank`) params; the result map once the
        engine is done (the job withdrawn if the client goes away first)."""
        methods = self.api._serving()
        valid = methods.validate(method, params)
        events: asyncio.Queue = asyncio.Queue()
        self.api._next_msgid += 1
        job = methods.submit(self.conn_id, self.api._next_msgid, valid, events.put_nowait,
                             transport="http", endpoint=request.path)
        finished = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Failed):
                    finished = True
                    raise ev.error
                if isinstance(ev, Done):
                    finished = True
                    return job_result(ev)
        finally:
            if not finished:
                methods.scheduler.withdraw(job)
