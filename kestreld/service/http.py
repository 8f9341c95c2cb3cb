"""The HTTP transport: OpenAI's API (and /health, /metrics) on aiohttp, beside the RPC socket.

It runs on the daemon's event loop and shares the RPC socket's engine, scheduler, limits
and methods: openai.py turns a request body into the params of the RPC `chat` / `generate`
method, `Methods.validate` and `Methods.submit` take it from there, and the job's events
come back here to be written as one JSON response or as server-sent events.

Life cycle: `start` listens before the model is loaded (`/health` answers 503 `loading`),
`ready` once it is, `stop_accepting` when shutdown begins (503 `shutting_down`), `close`
last.

Security (docs/http.md): loopback addresses only unless --http-allow-remote; the Host header
must name a loopback host (DNS rebinding) unless the request came over the Unix socket or
remote access is allowed; CORS headers only for the configured origins; an optional API
key (Bearer, constant-time compare); the body bounded by max_message_bytes; every error
JSON in OpenAI's shape. A client that closes its connection cancels its request: aiohttp
cancels the handler (handler_cancellation=True), which withdraws the job from the
scheduler (removed if queued, stopped within a prefill chunk or a token if running).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import time
from typing import Optional

from aiohttp import web

from ..errors import (BadRequest, KestrelError, Loading, MethodNotAllowed, ModelNotFound,
                      NotFound, PermissionDenied, PromptTooLong, ShuttingDown, StartupError,
                      TooLarge, Unauthorized, UnsupportedMediaType,
                      internal)
from .config import Config, HttpAddress
from .connlimit import Bounded, cut_stalled_readers
from .methods import Methods, completion_result, nth_choice, token_payload
from .embeddings import PATHS as EMBED_PATHS, EmbeddingRoutes
from .metrics import CONTENT_TYPE, Metrics
from .native import PATHS as NATIVE_PATHS, NativeRoutes, error_body_for, read_json
from .openai import (Answer, Translated, chat_request, completion_request, model,
                     models)
from .responses import ResponseAnswer, responses_request
from .scheduler import Done, Failed, Progress, Token
from .server import bind_unix_socket, remove_own_socket

log = logging.getLogger("kestreld.service.http")

_BUSY_BODY = json.dumps({"error": {
    "message": "too many connections open (max-connections); retry later",
    "type": "unavailable_error", "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_BUSY_BODY) + _BUSY_BODY)
HTTP_CONN_ID = 0              # the scheduler's conn_id of HTTP jobs (RPC connections count from 1)
SHUTDOWN_TIMEOUT_S = 2.0      # after the scheduler is drained: time for the last answers to go out
# OpenAI's routes, under /v1 and also without it (a client given a base URL without /v1),
# as llama.cpp's server serves them
OPENAI_PREFIXES = ("/v1", "")
OPENAI_PATHS = ("/chat/completions", "/completions", "/responses", "/models")
PATHS = tuple(prefix + path for prefix in OPENAI_PREFIXES for path in OPENAI_PATHS) + (
    "/health", "/metrics") + NATIVE_PATHS + EMBED_PATHS
CORS_HEADERS = "Authorization, Content-Type"


def read_api_key(path: str) -> str:
    """The API key in `path` (its first line, stripped); StartupError if unreadable or empty."""
    try:
        with open(path) as f:
            key = f.readline().strip()
    except OSError as e:
        raise StartupError(f"cannot read the HTTP API key file {path}: {e.strerror}") from None
    if not key:
        raise StartupError(f"the HTTP API key file {path} is empty")
    return key


# Host and Origin, strictly: a name or an [IPv6], then perhaps a port, and nothing else
# (`[::1]evil.example` and `localhost:1@evil.example` name no loopback host).
_HOST = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]+))(?::[0-9]{1,5})?")
_ORIGIN = re.compile(r"https?://(" + _HOST.pattern + ")")


def _loopback_host(host: str) -> bool:
    """A Host header naming this machine's loopback: localhost, 127.0.0.0/8 or [::1]."""
    m = _HOST.fullmatch(host)
    if m is None:
        return False
    name = m.group(1) or m.group(2)
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _loopback_origin(origin: str) -> bool:
    """An Origin of a page served from this machine's loopback (http(s), any port)."""
    m = _ORIGIN.fullmatch(origin)
    return m is not None and _loopback_host(m.group(1))


def _loopback_socket(sock: socket.socket) -> bool:
    """A Unix socket or one bound to a loopback address (0.0.0.0 and :: are not)."""
    if sock.family == socket.AF_UNIX:
        return True
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


def _json_content_type(content_type: str) -> bool:
    """application/json or application/*+json (aiohttp gives the type without parameters)."""
    kind = content_type.lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def _listening_socket(address: HttpAddress, cfg: Config) -> tuple[socket.socket, Optional[tuple]]:
    """A listening socket for `address` and, for a Unix socket we created, its identity."""
    if address.path is not None:
        sock, identity = bind_unix_socket(address.path, cfg.socket_mode, cfg.socket_group)
        return sock, identity
    try:
        family, _, _, _, where = socket.getaddrinfo(address.host, address.port,
                                                    type=socket.SOCK_STREAM)[0]
        sock = socket.create_server(where[:2], family=family, backlog=128)
    except OSError as e:
        raise StartupError(f"cannot listen on http {address}: {e.strerror or e}") from None
    return sock, None


class HttpApi:
    """The HTTP listeners and their aiohttp application."""

    def __init__(self, cfg: Config, metrics: Metrics, api_key: Optional[str] = None):
        self.cfg = cfg
        self.metrics = metrics
        self.api_key = api_key
        self.methods: Optional[Methods] = None
        self.model_id = ""
        self.created = int(time.time())
        self.state = "loading"            # "loading" -> "ready" -> "stopping" -> "closed"
        self._next_msgid = 0
        self._own_sockets: list = []      # (path, identity) of Unix sockets we created
        self._stall_watch: Optional[asyncio.Task] = None
        app = web.Application(client_max_size=cfg.max_message_bytes,
                              middlewares=[self._middleware])
        for prefix in OPENAI_PREFIXES:
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_post(prefix + "/responses", self._responses)
            app.router.add_get(prefix + "/models", self._models)
            app.router.add_get(prefix + "/models/{model_id}", self._model)
        EmbeddingRoutes(self, read_json).add_to(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        NativeRoutes(self).add_to(app)           # Ollama's and llama.cpp's routes (native.py)
        app.on_response_prepare.append(self._cors)
        # handler_cancellation: a closed connection cancels its handler (and so its job);
        # keepalive_timeout: aiohttp closes a connection waiting that long for a request
        # (from its start too: one that never sends anything)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                                     keepalive_timeout=cfg.idle_timeout)

    # ------------------------------------------------------------ life cycle

    async def start(self, inherited: tuple = ()) -> list[str]:
        """Listen on the sockets systemd passed (FileDescriptorName=http), else on every
        configured address. Returns where it listens (URLs)."""
        await self._runner.setup()
        sockets = list(inherited)
        if not sockets:
            for address in self.cfg.http_addresses:
                sock, identity = _listening_socket(address, self.cfg)
                if identity is not None:
                    self._own_sockets.append((address.path, identity))
                sockets.append(sock)
        where = []
        for sock in sockets:
            if self.api_key is None and not _loopback_socket(sock):
                log.warning("the HTTP API on %s answers anyone who can reach it: no API key "
                            "is set (--http-api-key-file)", sock.getsockname()[0])
            site = _BoundedSite(self._runner, sock, self.cfg.max_connections)
            await site.start()
            where.append(site.name)
        server = self._runner.server
        self._stall_watch = asyncio.get_running_loop().create_task(cut_stalled_readers(
            lambda: [h.transport for h in server.connections if h.transport is not None],
            self.cfg.idle_timeout, "HTTP API"))
        return where

    def ready(self, methods: Methods, model_id: str) -> None:
        """The model is loaded: serve requests."""
        self.methods = methods
        self.model_id = model_id
        self.state = "ready"

    async def stop_accepting(self) -> None:
        """Shutdown begins: close the listeners, remove our socket files; requests still
        arriving on open connections get 503 shutting_down."""
        self.state = "stopping"
        for site in list(self._runner.sites):
            await site.stop()
        for path, identity in self._own_sockets:
            remove_own_socket(path, identity)
        self._own_sockets = []

    async def close(self) -> None:
        """Close the connections (their answers are out: the scheduler is drained)."""
        if self.state == "closed":
            return
        await self.stop_accepting()
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        await self._runner.cleanup()
        self.state = "closed"

    # ------------------------------------------------------------ every request

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        path = ("/v1/models/{id}" if request.path.startswith("/v1/models/")
                else request.path if request.path in PATHS else "other")   # bounded labels
        try:
            self._check_access(request)
            if request.method == "OPTIONS":
                response = self._preflight(request)
            else:
                response = await handler(request)
        except web.HTTPException as e:
            response = self._error(_from_http_exception(request, e, self.cfg.max_message_bytes),
                                   request.path)
        except ConnectionError:           # the client went away mid-answer: nobody to tell
            raise
        except KestrelError as e:
            response = self._error(e, request.path)
        except Exception as e:            # a bug here must not kill the daemon
            log.exception("HTTP %s %s: internal error", request.method, request.path)
            response = self._error(internal(e), request.path)
        self.metrics.http_response(path, response.status)
        return response

    def _check_access(self, request: web.Request) -> None:
        """Host (DNS rebinding), Origin and Content-Type (CSRF), then the API key."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        over_unix = sock is not None and sock.family == socket.AF_UNIX
        host = request.headers.get("Host")
        if not (self.cfg.http_allow_remote or over_unix or host is None or _loopback_host(host)):
            raise PermissionDenied(f"Host {host[:100]!r} is not a loopback name: the HTTP API "
                                   f"answers only localhost, 127.0.0.1 or [::1]")
        self._check_browser(request)
        if self.api_key is None or request.method == "OPTIONS" or request.path == "/health":
            return
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise Unauthorized("missing or wrong API key: send Authorization: Bearer KEY")

    def _check_browser(self, request: web.Request) -> None:
        """CSRF: any web page may make a browser send a request here (a form, or fetch
        with a text/plain body: no preflight asked). So a request from a page (it carries
        Origin) must come from a loopback page or an --http-cors-origin one, and a request
        with a body must declare it JSON, which no page can do without a preflight."""
        origin = request.headers.get("Origin")
        if origin is not None and not (_loopback_origin(origin) or self._cors_listed(origin)):
            raise PermissionDenied(f"Origin {origin[:100]!r} is not allowed: the HTTP API "
                                   f"answers pages of loopback origins and --http-cors-origin")
        if request.method in ("GET", "HEAD", "OPTIONS") or not (
                request.method == "POST" or request.body_exists):
            return
        if request.match_info.http_exception is not None:    # no such route: 404 / 405
            return
        if not _json_content_type(request.content_type):
            raise UnsupportedMediaType(
                f"{request.method} {request.path[:100]}: the body must be sent as "
                f"Content-Type: application/json, got {request.content_type[:100]!r}")

    def _cors_listed(self, origin: str) -> bool:
        allowed = self.cfg.http_cors_origin
        return origin in allowed or "*" in allowed

    def _allowed_origin(self, request: web.Request) -> Optional[str]:
        origin = request.headers.get("Origin")
        if origin is None or not self._cors_listed(origin):
            return None
        return origin

    def _preflight(self, request: web.Request) -> web.Response:
        if self._allowed_origin(request) is None:
            raise MethodNotAllowed(f"OPTIONS {request.path}: no CORS origin is allowed "
                                   f"(--http-cors-origin)")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": CORS_HEADERS, "Access-Control-Max-Age": "600"})

    async def _cors(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self._allowed_origin(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    def _error(self, error: KestrelError, path: str) -> web.Response:
        return web.json_response(error_body_for(path, error), status=error.http_status)

    def serving(self) -> Methods:
        """The methods, once the model is loaded (Loading before, ShuttingDown after)."""
        if self.state == "loading":
            raise Loading("the model is loading; try again shortly")
        if self.state == "stopping":
            raise ShuttingDown("the daemon is shutting down")
        return self.methods

    def strict_names(self) -> tuple:
        """Under --strict-model, the names a request may give (the model's, its --alias
        names); else () and any name is answered by the loaded model."""
        return (self.model_id, *self.cfg.alias) if self.cfg.strict_model else ()

    # ------------------------------------------------------------ endpoints

    async def _health(self, request: web.Request) -> web.Response:
        self.serving()
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.serving()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        self.serving()
        return web.json_response(models(self.model_id, self.created))

    async def _model(self, request: web.Request) -> web.Response:
        self.serving()
        if request.match_info["model_id"] != self.model_id:
            raise ModelNotFound(f"no model {request.match_info['model_id'][:100]!r}: this "
                                f"daemon serves {self.model_id!r}", param="model")
        return web.json_response(model(self.model_id, self.created))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat_request, Answer)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, completion_request, Answer)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, responses_request, ResponseAnswer)

    # ------------------------------------------------------------ generation

    async def _generate(self, request: web.Request, translate, shapes) -> web.StreamResponse:
        """Read, translate (openai.py, responses.py), validate; run the request's `n`
        choices one after another, each a job of the same prompt (so each later one finds
        the prompt in the KV cache: the prefix rule keeps all of it but its last token);
        answer whole or streamed in the `shapes` of the route. A seed given is choice i's
        seed + i (methods.nth_choice)."""
        methods = self.serving()
        req: Translated = translate(await read_json(request), self.model_id, self.strict_names())
        try:
            params = methods.validate(req.method, req.params)
            answer = shapes(req, self.model_id,
                            lambda i: methods.engine.tokenizer.token_bytes([i]), int(time.time()))
            if req.stream:
                return await self._stream(request, methods, params, answer, req.n)
            results = [await self._result(methods, nth_choice(params, i), request.path)
                       for i in range(req.n)]
            return web.json_response(answer.response(results))
        except PromptTooLong as e:        # OpenAI's context_length_exceeded names the field
            e.param = e.param or req.prompt_param
            raise

    async def _events(self, methods: Methods, params, endpoint: str):
        """The events of one job, up to its Done or Failed. If the consumer stops first
        (the client went away: the handler is cancelled; a write failed), the job is
        withdrawn: it must not run on for nobody."""
        events: asyncio.Queue = asyncio.Queue()
        self._next_msgid += 1
        job = methods.submit(HTTP_CONN_ID, self._next_msgid, params, events.put_nowait,
                             transport="http", endpoint=endpoint)
        try:
            while True:
                ev = await events.get()
                yield ev
                if isinstance(ev, (Done, Failed)):
                    return
        finally:
            methods.scheduler.withdraw(job)      # nothing to do once it has finished

    async def job_events(self, request: web.Request, method: str, params: dict):
        """Validate and submit an RPC chat / generate request (the other APIs' routes,
        native.py); yield its Token events, then its Done, or raise its error. A consumer
        that stops early (its client went away) withdraws the job."""
        methods = self.serving()
        valid = methods.validate(method, params)
        async with contextlib.aclosing(self._events(methods, valid, request.path)) as events:
            async for ev in events:
                if isinstance(ev, Failed):
                    raise ev.error
                if not isinstance(ev, Progress):
                    yield ev

    async def _result(self, methods: Methods, params, endpoint: str) -> dict:
        """The completion map of one job."""
        async with contextlib.aclosing(self._events(methods, params, endpoint)) as events:
            async for ev in events:
                if isinstance(ev, Failed):
                    raise ev.error
        return completion_result(ev.completion, ev.queue_ms, ev.ttft_ms)   # the last: Done

    async def _stream(self, request: web.Request, methods: Methods, params, answer,
                      n: int) -> web.StreamResponse:
        """Server-sent events. The status line waits for the first token, so an error
        before it (a bad image, a prompt too long, a full queue's shutdown) is a plain
        JSON error with its status; after it, an error is the answer's last event."""
        response = None
        results: list = []
        try:
            for index in range(n):
                opened = False
                async with contextlib.aclosing(self._events(
                        methods, nth_choice(params, index), request.path)) as events:
                    async for ev in events:
                        if isinstance(ev, Progress):
                            continue
                        if response is None:
                            if isinstance(ev, Failed):
                                raise ev.error
                            response = web.StreamResponse(headers={
                                "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                "X-Accel-Buffering": "no"})
                            await response.prepare(request)
                        if not opened:
                            opened = True
                            await _send(response, answer, answer.opening(index))
                        if isinstance(ev, Token):
                            await _send(response, answer, answer.token(token_payload(ev.event)))
                        elif isinstance(ev, Done):
                            results.append(completion_result(ev.completion, ev.queue_ms,
                                                             ev.ttft_ms))
                            await _send(response, answer, answer.finish(results[-1]))
                        else:
                            raise ev.error
            await _send(response, answer, answer.closing(results))
        except KestrelError as e:
            if response is None:
                raise
            await _send(response, answer, answer.failure(e))
        if answer.DONE:
            await response.write(answer.DONE)
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, answer, events: list) -> None:
    """Write server-sent events: `data: JSON`, after an `event: TYPE` line when the answer's
    shapes name their events (the Responses API)."""
    for obj in events:
        name = b"event: " + obj["type"].encode() + b"\n" if answer.EVENT_NAMES else b""
        await response.write(name + b"data: " + json.dumps(obj, ensure_ascii=False).encode()
                             + b"\n\n")


class _BoundedSite(web.SockSite):
    """aiohttp's SockSite, its connections bounded (connlimit.py): over max_connections,
    a new one gets a 503 and is closed."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, limit: int):
        super().__init__(runner, sock)
        self._limit = limit

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        factory = Bounded(server, lambda: len(server.connections), self._limit,
                          f"HTTP API {self.name}", reply=_BUSY)
        self._server = await asyncio.get_running_loop().create_server(factory, sock=self._sock)


def _from_http_exception(request: web.Request, e: web.HTTPException, limit: int) -> KestrelError:
    """aiohttp's own refusals (no route, wrong method, body too large) as Kestrel errors."""
    if e.status == 404:
        return NotFound(f"no such path {request.path[:200]!r} (docs/openapi.yaml)")
    if e.status == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path[:200]}")
    if e.status == 413:
        return TooLarge(f"the body exceeds the limit of {limit} bytes (max-message-bytes)")
    return BadRequest(f"{e.status} {e.reason}")
