"""The HTTP routes of Ollama's native API (/api/*, and / the probe) and of llama.cpp
server's native endpoints (/completion, /tokenize, /detokenize, /props, /slots,
/apply-template), on the HTTP API's one aiohttp application (http.py).

They sit behind the same middleware (loopback rule, Host check, API key, body limit) and
submit through the same methods, queue and limits as the OpenAI routes: ollama.py and
llamacpp.py translate the bodies into RPC params and the job's events back into their
shapes; this module only reads bodies, runs jobs and writes answers (Ollama's NDJSON,
llama.cpp's server-sent events).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Callable, Optional

from aiohttp import web

from ..errors import BadRequest, KestrelError
from ..text.chat import CHATML_TEMPLATE
from . import llamacpp, ollama
from .methods import completion_result, token_payload
from .openai import chat_request, error_body
from .scheduler import Done, Token

PATHS = ollama.PATHS + llamacpp.PATHS
NDJSON = "application/x-ndjson"
# fill-in-the-middle tokens (prefix, suffix, middle) of the model families that have them
_FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),   # Qwen2.5 / Qwen3
               ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))         # StarCoder, SmolLM2


async def read_json(request: web.Request):
    """The request body as JSON (TooLarge past max_message_bytes, BadRequest if invalid)."""
    body = await request.read()
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:    # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the body is not valid JSON: {str(e)[:200]}") from None


def error_body_for(path: str, error: KestrelError) -> dict:
    """An error in the shape of the API that `path` belongs to: Ollama's {"error": str}
    under /api/ (and /), OpenAI's (which llama.cpp's server also uses) elsewhere."""
    if path == "/" or path.startswith("/api/"):
        return ollama.error_body(str(error))
    return error_body(error)


def _ndjson(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class NativeRoutes:
    """The routes, on an HttpApi (its `serving`, `job_events`, `cfg`, `model_id`)."""

    def __init__(self, api):
        self.api = api
        self._card: Optional[ollama.ModelCard] = None

    def add_to(self, app: web.Application) -> None:
        add_get, add_post = app.router.add_get, app.router.add_post
        add_get("/", self._root)                 # and HEAD: the "is Ollama running" probe
        add_get("/api/version", self._version)
        add_get("/api/tags", self._tags)
        add_post("/api/show", self._show)
        add_get("/api/ps", self._ps)
        add_post("/api/chat", self._chat)
        add_post("/api/generate", self._generate)
        add_post("/api/pull", self._pull)
        for path in ("/api/embed", "/api/embeddings"):
            add_post(path, self._no_embeddings)
        for path in ("/api/copy", "/api/create", "/api/push"):
            add_post(path, self._manage)
        app.router.add_delete("/api/delete", self._manage)
        add_post("/completion", self._completion)
        add_post("/tokenize", self._tokenize)
        add_post("/detokenize", self._detokenize)
        add_get("/props", self._props)
        add_get("/slots", self._slots)
        add_post("/apply-template", self._apply_template)

    # ------------------------------------------------------------ what the model is

    def card(self) -> ollama.ModelCard:
        """The model's names and facts (built once, at the first Ollama request)."""
        methods = self.api.serving()
        if self._card is None:
            status = methods.status.status()
            template = methods.engine.model.chat_template or CHATML_TEMPLATE
            path = status["model"]["path"]
            self._card = ollama.model_card(status["model"], self.api.model_id,
                                           self.api.cfg.alias, status["max_seq"],
                                           status["kv_arena_bytes"], template,
                                           os.stat(path).st_mtime)
        return self._card

    def _fim(self) -> Optional[tuple]:
        tokenizer = self.api.serving().engine.tokenizer
        return next((t for t in _FIM_TOKENS if all(tokenizer.token_id(s) is not None
                                                   for s in t)), None)

    def _token_bytes(self) -> Callable[[int], bytes]:
        tokenizer = self.api.serving().engine.tokenizer
        return lambda i: tokenizer.token_bytes([i])

    # ------------------------------------------------------------ running a job

    async def _run(self, request: web.Request, method: str, params: dict, stream: bool,
                   chunk: Callable, final: Callable, content_type: str,
                   frame: Callable[[dict], bytes], error_frame: Callable) -> web.StreamResponse:
        """Run a chat / generate job: the whole answer as JSON, or its objects as `frame`s
        as they come. The status line waits for the first token, so an error before it is
        a plain error with its status; after it, a last `error_frame`."""
        async with contextlib.aclosing(self.api.job_events(request, method, params)) as events:
            if not stream:
                async for ev in events:
                    if isinstance(ev, Done):
                        result = completion_result(ev.completion, ev.queue_ms, ev.ttft_ms)
                        return web.json_response(final(result, False))
            response = None
            try:
                async for ev in events:
                    if response is None:
                        response = web.StreamResponse(headers={
                            "Content-Type": content_type, "Cache-Control": "no-cache",
                            "X-Accel-Buffering": "no"})
                        await response.prepare(request)
                    if isinstance(ev, Token):
                        obj = chunk(token_payload(ev.event))
                        if obj is not None:
                            await response.write(frame(obj))
                    elif isinstance(ev, Done):
                        result = completion_result(ev.completion, ev.queue_ms, ev.ttft_ms)
                        await response.write(frame(final(result, True)))
            except KestrelError as e:
                if response is None:
                    raise
                await response.write(frame(error_frame(e)))
        await response.write_eof()
        return response

    # ------------------------------------------------------------ Ollama

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def _version(self, request: web.Request) -> web.Response:
        self.api.serving()
        return web.json_response({"version": ollama.OLLAMA_VERSION})

    async def _tags(self, request: web.Request) -> web.Response:
        return web.json_response(ollama.tags(self.card()))

    async def _ps(self, request: web.Request) -> web.Response:
        return web.json_response(ollama.running(self.card()))

    async def _show(self, request: web.Request) -> web.Response:
        card = self.card()
        return web.json_response(ollama.show(card, await read_json(request)))

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        steps, stream = ollama.pull(self.card(), await read_json(request))
        if not stream:
            return web.json_response(steps[-1])
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        for step in steps:
            await response.write(_ndjson(step))
        await response.write_eof()
        return response

    async def _no_embeddings(self, request: web.Request) -> web.Response:
        raise BadRequest(f"{request.path}: the model this daemon serves makes no embeddings "
                         f"(an embedding model is not supported yet)")

    async def _manage(self, request: web.Request) -> web.Response:
        raise ollama.not_here(f"{request.method} {request.path}")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        card = self.card()
        return await self._ollama(request, ollama.chat_request(await read_json(request), card))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        card = self.card()
        req = ollama.generate_request(await read_json(request), card, self._fim())
        return await self._ollama(request, req)

    async def _ollama(self, request: web.Request, req: ollama.Translated) -> web.StreamResponse:
        answer = ollama.Answer(req, self._token_bytes())
        if not req.method:
            obj = answer.loaded()
            if not req.stream:
                return web.json_response(obj)
            return web.Response(body=_ndjson(obj), content_type=NDJSON)
        return await self._run(request, req.method, req.params, req.stream, answer.chunk,
                               answer.final, NDJSON, _ndjson,
                               lambda e: ollama.error_body(str(e)))

    # ------------------------------------------------------------ llama.cpp

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        cfg = self.api.cfg
        req = llamacpp.completion_request(await read_json(request), cfg.max_seq)
        answer = llamacpp.Completion(req, self.api.model_id, cfg.max_seq, self._token_bytes())
        return await self._run(request, "generate", req.params, req.stream, answer.chunk,
                               answer.final, "text/event-stream", _sse, error_body)

    async def _aside(self, method: str, params: dict) -> dict:
        """tokenize / detokenize off the event loop (megabytes of text take a while)."""
        methods = self.api.serving()
        valid = methods.validate(method, params)
        return await asyncio.get_running_loop().run_in_executor(None, methods.aside, valid)

    async def _tokenize(self, request: web.Request) -> web.Response:
        params, with_pieces = llamacpp.tokenize_params(await read_json(request))
        ids = (await self._aside("tokenize", params))["ids"]
        return web.json_response(llamacpp.tokens(ids, with_pieces, self._token_bytes()))

    async def _detokenize(self, request: web.Request) -> web.Response:
        params = llamacpp.detokenize_params(await read_json(request))
        return web.json_response({"content": (await self._aside("detokenize", params))["text"]})

    def _llama_state(self) -> tuple:
        methods = self.api.serving()
        return methods, methods.scheduler.stats()["busy"]

    async def _props(self, request: web.Request) -> web.Response:
        methods, busy = self._llama_state()
        model = methods.engine.model
        return web.json_response(llamacpp.props(
            self.api.model_id, model.path, model.chat_template or CHATML_TEMPLATE,
            model.vision is not None, self.api.cfg.max_seq, self.api.cfg.max_tokens, busy))

    async def _slots(self, request: web.Request) -> web.Response:
        _, busy = self._llama_state()
        return web.json_response([llamacpp.slot(self.api.cfg.max_seq, self.api.cfg.max_tokens,
                                                busy)])

    async def _apply_template(self, request: web.Request) -> web.Response:
        """The prompt text of OpenAI-shaped messages (and tools), as the chat route renders it."""
        body = llamacpp.object_body(await read_json(request))
        fields = {k: body[k] for k in ("messages", "tools", "tool_choice", "chat_template_kwargs")
                  if k in body}
        methods = self.api.serving()
        params = methods.validate("chat", chat_request(fields, self.api.model_id).params)
        prompt = await asyncio.get_running_loop().run_in_executor(None, methods.chat_prompt,
                                                                  params)
        return web.json_response({"prompt": prompt})
