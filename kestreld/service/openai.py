"""OpenAI's API shapes <-> Kestrel's wire params and results (the HTTP API's translator).

A request body of `POST /v1/chat/completions` or `/v1/completions` (responses.py: the
Responses API's `/v1/responses`) becomes the params map
of the RPC `chat` or `generate` method (`chat_request`, `completion_request`), which the
methods then validate exactly as they validate an RPC request: the same bounds, the same
messages, the same engine path. A completion map (methods.completion_result) or a `token`
payload (methods.token_payload) becomes OpenAI's response, chunk or usage here.

So the two transports cannot drift apart: presence_penalty, frequency_penalty,
response_format, tools and tool_choice go to the RPC params by their OpenAI names (the RPC
methods take OpenAI's shapes for them), and the completion map's `tool_calls` (already in
OpenAI's shape) come back as they are.

Pure functions of their arguments (no engine, no I/O): `token_bytes(id) -> bytes` is how
logprobs name their tokens.
"""
from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import BadRequest, KestrelError, ModelNotFound
from ..protocol import MAX_LOGPROBS, MAX_MESSAGES

OWNED_BY = "kestrel"
MAX_CHOICES = 16              # `n`: choices of one request (each one a job after the first)

TokenBytes = Callable[[int], bytes]

# OpenAI's sampling fields, and llama.cpp's extras, that map one to one onto the RPC options
# of the same name
_SAME_NAME = ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "ignore_eos")
# OpenAI's penalties, passed by name when not neutral (0): the RPC validation checks them
_PASSED_THROUGH = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class Translated:
    """An OpenAI request as an RPC method and params map, and how to answer it."""
    method: str                 # "chat" | "generate"
    params: dict                # the RPC params map (validated by methods.validate)
    stream: bool
    include_usage: bool         # stream_options.include_usage: a last chunk with usage
    top_logprobs: Optional[int]  # None: no logprobs; else how many alternatives to show
    n: int = 1                  # choices: the same prompt decoded n times
    prompt_param: str = "messages"  # the field a too-long prompt is blamed on
    echo: Optional[dict] = None  # request fields the answer repeats (the Responses API)


# ---------------------------------------------------------------- requests

def check_object(body) -> dict:
    """The body, if it is a JSON object."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, model_id: str, strict: tuple) -> None:
    """The `model` a request names: any name is answered by the loaded model (its name in
    the answer's `model`), as llama.cpp's server does, since many clients hard-code one;
    under --strict-model, `strict` holds the names served (the model's and its --alias
    names) and another name is ModelNotFound."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {type(model).__name__}", param="model")
    if strict and model not in strict:
        raise ModelNotFound(f"The model {model[:100]!r} does not exist: this daemon serves "
                            f"{model_id!r} (GET /v1/models)", param="model")


def _unsupported(body: dict, name: str, default_ok) -> None:
    """A field Kestrel does not implement: only its neutral value(s) are accepted."""
    value = body.get(name)
    if value is not None and not default_ok(value):
        raise BadRequest(f"{name}={str(value)[:60]} is not supported", param=name)


def _choices(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be an integer in 1..{MAX_CHOICES}, got {str(n)[:60]}",
                         param="n")
    return n


def _logit_bias(value) -> dict:
    """OpenAI's logit_bias (JSON keys are strings: token ids in decimal) -> {id: bias};
    the RPC validation checks the ids against the vocabulary and the biases' range."""
    if not isinstance(value, dict):
        raise BadRequest("logit_bias must be an object of token ids to biases",
                         param="logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise BadRequest(f"logit_bias: a key is a token id in decimal, got {key[:40]!r}",
                             param="logit_bias")
        out[int(key)] = bias
    return out


def sampling(body: dict) -> tuple[dict, bool]:
    """The sampling fields every generating endpoint shares -> (RPC options, stream)."""
    options = {k: body[k] for k in _SAME_NAME + _PASSED_THROUGH if body.get(k) is not None}
    for name in _PASSED_THROUGH:
        if options.get(name) == 0:
            del options[name]          # OpenAI's neutral value: nothing to ask of the engine
    if body.get("logit_bias"):
        options["logit_bias"] = _logit_bias(body["logit_bias"])
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {str(stream)[:60]}", param="stream")
    return options, stream


def _common(body: dict, model_id: str, strict: tuple) -> tuple[dict, bool, bool]:
    """The fields shared by chat and completions -> (RPC options, stream, include_usage)."""
    check_model(body, model_id, strict)
    options, stream = sampling(body)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is not None:
        options["max_tokens"] = limit
    stop = body.get("stop")
    if stop is not None:
        options["stop"] = [stop] if isinstance(stop, str) else stop
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise BadRequest("stream_options.include_usage must be true or false",
                             param="stream_options")
    return options, stream, stream and include_usage


def _top_logprobs(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {str(value)[:60]}",
                         param=name)
    return value


def _image(part: dict, where: str) -> dict:
    """An `image_url` part with a data: URI -> the RPC image part (its bytes)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise BadRequest(f"{where}.image_url must be {{\"url\": \"data:...\"}}", param=where)
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise BadRequest(f"{where}: only base64 data: URIs are accepted "
                         f"(data:image/png;base64,...); the daemon fetches no URL", param=where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: the data: URI is not valid base64", param=where) from None
    return {"type": "image", "data": raw}


def _content(content, where: str):
    """A message's content: a string, null (an assistant turn of tool calls) or parts."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content                 # a string, or a wrong type the RPC check names
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": part.get("text")})
        elif kind == "image_url":
            out.append(_image(part, at))
        else:
            raise BadRequest(f"{at}: a content part has type \"text\" or \"image_url\", "
                             f"got {str(kind)[:40]!r}", param=at)
    return out


def messages_of(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects",
                         param="messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"messages: at most {MAX_MESSAGES}, got {len(messages)}",
                         param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        role = "system" if m.get("role") == "developer" else m.get("role")   # OpenAI's newer name
        message = {"role": role, "content": _content(m.get("content"), f"messages[{i}].content")}
        # tool turns: handed to the RPC chat as they are (it checks them)
        for key in ("tool_calls", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        out.append(message)
    return out


def chat_request(body, model_id: str, strict: tuple = ()) -> Translated:
    """A chat completions request -> the RPC `chat` params (BadRequest naming the field)."""
    body = check_object(body)
    options, stream, include_usage = _common(body, model_id, strict)
    params = {"messages": messages_of(body.get("messages")), "split_reasoning": True,
              "stream": stream, **options}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
            raise BadRequest("chat_template_kwargs: only enable_thinking is supported",
                             param="chat_template_kwargs")
        if "enable_thinking" in kwargs:
            params["enable_thinking"] = kwargs["enable_thinking"]
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        params["response_format"] = response_format
    if body.get("tools"):
        params["tools"] = body["tools"]
        if body.get("tool_choice") is not None:
            params["tool_choice"] = body["tool_choice"]
        if body.get("parallel_tool_calls") is not None:
            params["parallel_tool_calls"] = body["parallel_tool_calls"]
    top = None
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be true or false", param="logprobs")
    if logprobs:
        top = _top_logprobs(body.get("top_logprobs") or 0, "top_logprobs")
        params["logprobs"] = max(top, 1)
    elif body.get("top_logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return Translated("chat", params, stream, include_usage, top, _choices(body))


def completion_request(body, model_id: str, strict: tuple = ()) -> Translated:
    """A (legacy) completions request -> the RPC `generate` params."""
    body = check_object(body)
    options, stream, include_usage = _common(body, model_id, strict)
    _unsupported(body, "echo", lambda v: v is False)
    _unsupported(body, "suffix", lambda v: v == "")
    _unsupported(body, "best_of", lambda v: v == 1 and not isinstance(v, bool))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]             # a batch of one
    if isinstance(prompt, str):
        params = {"prompt": prompt}
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                     for i in prompt):
        params = {"ids": prompt}
    else:
        raise BadRequest("prompt must be a string or an array of token ids (one prompt: "
                         "batches are not supported)", param="prompt")
    params.update(stream=stream, **options)
    top = None
    if body.get("logprobs") is not None:
        top = _top_logprobs(body["logprobs"], "logprobs")
        if top:
            params["logprobs"] = top
        else:
            top = None
    return Translated("generate", params, stream, include_usage, top, _choices(body), "prompt")


# ---------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choices_usage(results: list) -> dict:
    """OpenAI's usage of the choices' completion maps: the prompt counted once (it is the
    same prompt), the completion tokens of every choice; cached_tokens is the KV the first
    choice reused (prefix rule)."""
    u = results[0]["usage"]
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": u["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def _token(token_id: int, logprob: float, token_bytes: TokenBytes) -> dict:
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}


def chat_logprobs(entries: Optional[list], top: Optional[int], token_bytes: TokenBytes):
    """OpenAI's choice.logprobs of Kestrel's entries ({"id", "logprob", "top"})."""
    if top is None or entries is None:
        return None
    content = []
    for e in entries:
        item = _token(e["id"], e["logprob"], token_bytes)
        item["top_logprobs"] = [_token(i, lp, token_bytes) for i, lp in e["top"][:top]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Optional[list], top: Optional[int], token_bytes: TokenBytes,
                        offset: int = 0):
    """The legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset);
    `offset`: characters of text before these tokens."""
    if top is None or entries is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = token_bytes(e["id"]).decode("utf-8", errors="replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({token_bytes(i).decode("utf-8", errors="replace"): lp
                                    for i, lp in e["top"][:top]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _tool_calls(calls: list, streamed: bool = False, first: int = 0) -> list:
    """The wire's tool calls (OpenAI's shape already); streamed, each with its index among
    the answer's calls (`first`: how many came in earlier chunks)."""
    return [dict(call, index=first + n) if streamed else dict(call) for n, call in enumerate(calls)]


class Answer:
    """One chat or completions answer's shapes: its id, creation time and model, how it
    shows logprobs, its `n` choices. The HTTP transport drives it: `response` for a whole
    answer; streamed, `opening` as each choice starts, `token` per piece, `finish` as each
    choice ends, `closing` after the last (and `failure` if a job fails mid-stream), each
    returning the server-sent events to write, then `DONE`."""
    EVENT_NAMES = False               # SSE lines carry `data:` only
    DONE = b"data: [DONE]\n\n"

    def __init__(self, req: Translated, model_id: str, token_bytes: TokenBytes, created: int):
        self.req = req
        self.chat = req.method == "chat"
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = created
        self.model = model_id
        self.token_bytes = token_bytes
        self.index = 0                   # the choice being streamed
        self.text_chars = 0              # completions' text_offset across chunks
        self.calls_sent = 0              # streamed tool calls so far (their index)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def _choice(self, index: int, result: dict) -> dict:
        top, lps = self.req.top_logprobs, result.get("logprobs")
        if self.chat:
            message = {"role": "assistant", "content": result["text"]}
            if result.get("reasoning"):
                message["reasoning_content"] = result["reasoning"]
            if result.get("tool_calls"):
                message["tool_calls"] = _tool_calls(result["tool_calls"])
            choice = {"index": index, "message": message,
                      "logprobs": chat_logprobs(lps, top, self.token_bytes)}
        else:
            choice = {"index": index, "text": result["text"],
                      "logprobs": completion_logprobs(lps, top, self.token_bytes)}
        choice["finish_reason"] = result["finish_reason"]
        return choice

    def response(self, results: list) -> dict:
        """The whole response of the choices' completion maps."""
        out = self._envelope("chat.completion" if self.chat else "text_completion",
                             [self._choice(i, r) for i, r in enumerate(results)])
        out["usage"] = choices_usage(results)
        out["timings"] = results[0]["timings"]   # Kestrel's own figures, as llama.cpp adds its
        return out

    def _chunk(self, fields: dict, logprobs, finish_reason: Optional[str] = None) -> dict:
        if self.chat:
            choice = {"index": self.index, "delta": fields, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": self.index, "text": fields.get("content", ""),
                      "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._envelope("text_completion", [choice])
        if self.req.include_usage:
            out["usage"] = None
        return out

    def opening(self, index: int) -> list:
        """Choice `index` starts: the chat stream's role chunk (nothing for completions)."""
        self.index, self.text_chars, self.calls_sent = index, 0, 0
        return [self._chunk({"role": "assistant", "content": ""}, None)] if self.chat else []

    def token(self, payload: dict) -> list:
        """The chunk of a `token` payload (none when it carries nothing to show)."""
        fields = {}
        if payload["text"]:
            fields["content"] = payload["text"]
        if payload.get("reasoning") and self.chat:
            fields["reasoning_content"] = payload["reasoning"]
        if payload.get("tool_calls") and self.chat:
            fields["tool_calls"] = _tool_calls(payload["tool_calls"], True, self.calls_sent)
            self.calls_sent += len(payload["tool_calls"])
        top, lps = self.req.top_logprobs, payload.get("logprobs")
        if self.chat:
            logprobs = chat_logprobs(lps, top, self.token_bytes)
        else:
            logprobs = completion_logprobs(lps, top, self.token_bytes, self.text_chars)
            self.text_chars += len(payload["text"])
        if not fields and logprobs is None:
            return []
        return [self._chunk(fields, logprobs)]

    def finish(self, result: dict) -> list:
        """The choice's finish_reason chunk."""
        return [self._chunk({}, None, result["finish_reason"])]

    def closing(self, results: list) -> list:
        """After the last choice: the usage chunk, when stream_options asked for it."""
        if not self.req.include_usage:
            return []
        final = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        final["usage"] = choices_usage(results)
        return [final]

    def failure(self, error: KestrelError) -> list:
        """A job failed after the stream began: a last `data: {"error": ...}`."""
        return [error_body(error)]


def models(model_id: str, created: int) -> dict:
    """`GET /v1/models`: the one model this daemon serves."""
    return {"object": "list", "data": [model(model_id, created)]}


def model(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}


# OpenAI's error types by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error", 499: "invalid_request_error", 503: "unavailable_error"}


def error_body(error: KestrelError) -> dict:
    """`{"error": {message, type, param, code}}` (OpenAI's shape); code is the error's
    `http_code` (Kestrel's, or OpenAI's where it has one: errors.py)."""
    return {"error": {"message": str(error),
                      "type": _ERROR_TYPES.get(error.http_status, "server_error"),
                      "param": error.param, "code": error.http_code}}
