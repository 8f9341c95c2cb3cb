"""Ollama's native API shapes <-> Kestrel's wire params and results (the HTTP API's
translator for /api/*, as openai.py is for /v1/*).

A body of `POST /api/chat` or `/api/generate` becomes the params of the RPC `chat` or
`generate` method (`chat_request`, `generate_request`), which the methods validate as
they validate an RPC request; a `token` payload or a completion map becomes Ollama's
NDJSON object here (`Answer`). The model's names and facts (`ModelCard`) give
/api/tags, /api/show, /api/ps and /api/pull their answers.

Pure functions of their arguments (no engine, no I/O) but for one log line: a `num_ctx`
above the daemon's context is clamped, and said so.
"""
from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import BadRequest, NotFound

log = logging.getLogger("kestreld.service.ollama")

# The Ollama release whose API these shapes follow: apps gate features on /api/version.
OLLAMA_VERSION = "0.12.6"
PATHS = ("/", "/api/version", "/api/tags", "/api/show", "/api/ps", "/api/chat", "/api/generate",
         "/api/pull", "/api/embed", "/api/embeddings", "/api/copy", "/api/delete", "/api/create",
         "/api/push")
# Ollama's own answer for a model it keeps loaded for ever (keep_alive -1)
NEVER_EXPIRES = "2318-08-08T08:08:08.000000000Z"
# What the daemon cannot do, in the words an Ollama user reads.
ONE_MODEL = ("this Kestrel daemon serves the one model it was started with and downloads, "
             "creates, copies, deletes or pushes no models")

TokenBytes = Callable[[int], bytes]

# options: Ollama's name -> the RPC option of the same meaning
_OPTION_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "seed": "seed", "stop": "stop",
                 "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
# options that tune Ollama's runner (memory, threads, GPUs): Kestrel's come from its own
# configuration, and the answer is the same without them
_RUNNER_OPTIONS = frozenset((
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
    "repeat_last_n", "penalize_newline"))
# sampling options Kestrel does not have: accepted at their neutral (Ollama's "off") value
_NEUTRAL_OPTIONS = {"mirostat": (0,), "tfs_z": (1, 1.0), "typical_p": (1, 1.0)}
_DURATION = re.compile(r"-?(\d+(\.\d+)?(ns|us|µs|ms|s|m|h)?)+")
_NAME_CHARS = re.compile(r"[^a-z0-9._-]+")
_CHAT_FIELDS = ("model", "messages", "tools", "stream", "format", "options", "keep_alive",
                "think", "logprobs", "top_logprobs", "truncate", "shift")
_GENERATE_FIELDS = ("model", "prompt", "suffix", "system", "template", "context", "stream",
                    "raw", "format", "images", "options", "keep_alive", "think", "logprobs",
                    "top_logprobs", "truncate", "shift")
_MESSAGE_KEYS = ("role", "content", "images", "thinking", "tool_calls", "tool_name",
                 "tool_call_id")


# ---------------------------------------------------------------- the model's names and facts

def ollama_name(text: str) -> str:
    """`text` as an Ollama model name: lower case, `name:tag` (`:latest` if it has no tag)."""
    name, _, tag = text.strip().lower().partition(":")
    name = _NAME_CHARS.sub("-", name).strip("-") or "model"
    return f"{name}:{_NAME_CHARS.sub('-', tag).strip('-') or 'latest'}"


def parameter_size(n_params: int) -> str:
    """Ollama's `details.parameter_size`: "135M", "1.7B"."""
    return f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"


@dataclass(frozen=True)
class ModelCard:
    """What the Ollama routes say about the one model: its names (the first is its own,
    from general.name or the file name; then the --alias names) and facts."""
    names: tuple
    model_id: str               # the OpenAI API's id (the file name), also accepted
    path: str
    arch: str
    general_name: str
    n_params: int
    quantization: str           # the file's dominant type, upper case ("Q8_0")
    file_bytes: int
    memory_bytes: int           # weights and KV arena: what /api/ps calls size
    context_length: int         # trained (the model's metadata)
    max_seq: int                # served (--max-seq)
    template: str
    vision: bool
    modified_at: str
    digest: str                 # an identity of the file (path, size, time), not its hash

    def serves(self, name) -> str:
        """`name` if it names this model (any of its names, with or without `:latest`,
        or its OpenAI id); NotFound otherwise, BadRequest if it is no name at all."""
        if not isinstance(name, str) or not name:
            raise BadRequest("model is required: a name of GET /api/tags", param="model")
        if name in self.names or name == self.model_id or f"{name}:latest" in self.names:
            return name
        raise NotFound(f"model '{name[:200]}' not found", param="model")

    @property
    def details(self) -> dict:
        return {"parent_model": "", "format": "gguf", "family": self.arch,
                "families": [self.arch], "parameter_size": parameter_size(self.n_params),
                "quantization_level": self.quantization}

    @property
    def capabilities(self) -> list:
        """Ollama's capability names of this model: what its template and files allow."""
        out = ["completion"]
        if "tools" in self.template:
            out.append("tools")
        if "<think>" in self.template or "enable_thinking" in self.template:
            out.append("thinking")
        if self.vision:
            out.append("vision")
        return out


def model_card(model: dict, model_id: str, aliases, max_seq: int, kv_bytes: int,
               template: str, mtime: float) -> ModelCard:
    """The card of the status map's `model` (status.py), served as `model_id` and the
    --alias names, with a context of `max_seq` tokens in a KV arena of `kv_bytes`."""
    own = ollama_name(model["name"] or model_id)
    names = tuple(dict.fromkeys([own, *aliases]))
    file_bytes = model["file_bytes"] or 0
    stamp = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
    identity = f"{model['path']}\0{file_bytes}\0{mtime}".encode()
    return ModelCard(
        names=names, model_id=model_id, path=model["path"], arch=model["arch"],
        general_name=model["name"] or model_id, n_params=model["n_params"],
        quantization=model["source_dtype"].upper(), file_bytes=file_bytes,
        memory_bytes=file_bytes + kv_bytes, context_length=model["context_length"],
        max_seq=max_seq, template=template, vision=bool(model.get("vision")),
        modified_at=stamp.isoformat().replace("+00:00", "Z"),
        digest=hashlib.sha256(identity).hexdigest())


def tags(card: ModelCard) -> dict:
    """`GET /api/tags`: the model once per name."""
    return {"models": [{"name": n, "model": n, "modified_at": card.modified_at,
                        "size": card.file_bytes, "digest": card.digest,
                        "details": card.details} for n in card.names]}


def running(card: ModelCard) -> dict:
    """`GET /api/ps`: the model, loaded (under each of its names) until the daemon stops."""
    return {"models": [{"name": n, "model": n, "size": card.memory_bytes, "digest": card.digest,
                        "details": card.details, "expires_at": NEVER_EXPIRES, "size_vram": 0,
                        "context_length": card.max_seq} for n in card.names]}


def show(card: ModelCard, body) -> dict:
    """`POST /api/show`."""
    body = _fields(body, ("model", "name", "verbose"))
    card.serves(body.get("model", body.get("name")))
    info = {"general.architecture": card.arch, "general.name": card.general_name,
            "general.parameter_count": card.n_params,
            f"{card.arch}.context_length": card.context_length}
    return {"license": "", "modelfile": f"# served by Kestrel\nFROM {card.path}\n",
            "parameters": f"num_ctx {card.max_seq}", "template": card.template,
            "details": card.details, "model_info": info, "capabilities": card.capabilities,
            "modified_at": card.modified_at}


def pull(card: ModelCard, body) -> tuple[list, bool]:
    """`POST /api/pull` of a name this daemon serves: (the progress objects, stream);
    NotFound for any other name."""
    body = _fields(body, ("model", "name", "insecure", "stream", "username", "password"))
    name = body.get("model", body.get("name"))
    try:
        card.serves(name)
    except NotFound:
        raise NotFound(f"model '{str(name)[:200]}' not found: {ONE_MODEL} (its names: "
                       f"{', '.join(card.names)}; start kestreld with --alias "
                       f"{str(name)[:200]} to serve it under that name)", param="model") from None
    layer = f"sha256:{card.digest}"
    steps = [{"status": "pulling manifest"},
             {"status": f"pulling {card.digest[:12]}", "digest": layer,
              "total": card.file_bytes, "completed": card.file_bytes},
             {"status": "verifying sha256 digest"}, {"status": "writing manifest"},
             {"status": "success"}]
    return steps, _stream(body)


def not_here(what: str) -> BadRequest:
    """The error of a route that manages models (copy, delete, create, push)."""
    return BadRequest(f"{what}: {ONE_MODEL} (kestreld --model FILE --alias NAME)")


# ---------------------------------------------------------------- requests

@dataclass(frozen=True)
class Translated:
    """An Ollama request as an RPC method and params, and how to answer it."""
    method: str                 # "chat" | "generate"; "" when no job is needed (load/unload)
    params: dict
    stream: bool
    model: str                  # the name the request used: answers echo it
    chat: bool                  # /api/chat (a message) or /api/generate (a response)
    top_logprobs: Optional[int] = None   # None: no logprobs
    done_reason: str = ""       # of an answer without a job: "load" or "unload"


def _fields(body, allowed: tuple) -> dict:
    """The request body, a JSON object of known fields (BadRequest naming the others)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(repr(k[:60]) for k in unknown[:8])}; "
                         f"allowed: {', '.join(allowed)}", param=unknown[0][:60])
    return body


def _stream(body: dict) -> bool:
    stream = body.get("stream")
    if stream is None:
        return True                # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {str(stream)[:60]}", param="stream")
    return stream


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {str(v)[:60]}", param=name)
    return v


def _options(opts, max_seq: int) -> dict:
    """Ollama's `options` -> RPC options (their values checked by the RPC validation)."""
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise BadRequest("options must be an object", param="options")
    out = {}
    for key, value in opts.items():
        if value is None or key in _RUNNER_OPTIONS:
            continue
        if key in _OPTION_NAMES:
            out[_OPTION_NAMES[key]] = value
        elif key in _NEUTRAL_OPTIONS:
            if isinstance(value, bool) or value not in _NEUTRAL_OPTIONS[key]:
                raise BadRequest(f"options.{key}={str(value)[:60]} is not supported (only "
                                 f"{_NEUTRAL_OPTIONS[key][0]}, off)", param=f"options.{key}")
        elif key == "num_ctx":
            n = _int("options.num_ctx", value)
            if n < 1:
                raise BadRequest(f"options.num_ctx must be >= 1, got {n}", param="options.num_ctx")
            if n > max_seq:
                log.info("options.num_ctx %d is above the context of %d tokens (--max-seq): "
                         "clamped to %d", n, max_seq, max_seq)
        elif key == "num_predict":
            n = _int("options.num_predict", value)
            if n in (-1, -2):
                out["max_tokens"] = max_seq       # no limit / fill the context: the room left
            elif n < 1:
                raise BadRequest(f"options.num_predict must be -1, -2 or >= 1, got {n}",
                                 param="options.num_predict")
            else:
                out["max_tokens"] = n
        else:
            raise BadRequest(f"unknown option {str(key)[:60]!r}; Kestrel takes num_ctx, "
                             f"num_predict, {', '.join(_OPTION_NAMES)} (and ignores Ollama's "
                             f"runner options)", param="options")
    if isinstance(out.get("seed"), int) and not isinstance(out["seed"], bool) and out["seed"] < 0:
        del out["seed"]                           # Ollama's -1: a random seed
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    for name in ("presence_penalty", "frequency_penalty"):
        if out.get(name) == 0:
            del out[name]                         # neutral: nothing to ask of the engine
    return out


def _keep_alive(body: dict) -> bool:
    """True when keep_alive asks to unload now (0). Any valid value is accepted; the model
    stays loaded (it is the daemon's one model)."""
    value = body.get("keep_alive")
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
            isinstance(value, str) and not _DURATION.fullmatch(value)):
        raise BadRequest(f"keep_alive must be a number of seconds or a duration such as "
                         f"\"5m\", got {str(value)[:60]!r}", param="keep_alive")
    return value == 0 or (isinstance(value, str) and float(re.sub(r"[a-zµ]+", "", value)
                                                           or 0) == 0)


def _images(images, where: str) -> list:
    """base64 images (Ollama's shape; a data: URI prefix is also taken) -> RPC image parts."""
    if not isinstance(images, list):
        raise BadRequest(f"{where} must be an array of base64 strings", param=where)
    out = []
    for j, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise BadRequest(f"{where}[{j}] must be a base64 string", param=where)
        data = image.partition(",")[2] if image.startswith("data:") else image
        try:
            out.append({"type": "image", "data": base64.b64decode(data, validate=True)})
        except (binascii.Error, ValueError):
            raise BadRequest(f"{where}[{j}] is not valid base64", param=where) from None
    return out


def _with_images(text, images, where: str):
    if images is None or images == []:
        return text
    return [{"type": "text", "text": text}, *_images(images, f"{where}.images")]


def _tool_calls(calls, where: str) -> list:
    """Ollama's calls ({"function": {"name", "arguments": {...}}}) -> the RPC's (OpenAI's)."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be an array", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                             param=where)
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})}})
    return out


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects",
                         param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", param="messages")
        unknown = sorted(str(k)[:60] for k in m if k not in _MESSAGE_KEYS)
        if unknown:
            raise BadRequest(f"{where}: unknown key(s) {', '.join(unknown[:8])}; allowed: "
                             f"{', '.join(_MESSAGE_KEYS)}", param="messages")
        content = m.get("content") or ""
        if not isinstance(content, str):     # parts are built here, never taken as sent
            raise BadRequest(f"{where}.content must be a string", param="messages")
        message = {"role": m.get("role"), "content": _with_images(content, m.get("images"),
                                                                     where)}
        if m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        # `thinking` of earlier turns is dropped (Qwen3's template drops it too), as is
        # `tool_name` (the template knows a result by its place after the call)
        out.append(message)
    return out


def _think(value) -> bool:
    """`think`: true/false, or a level ("low", "medium", "high") which means true."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if value in ("low", "medium", "high"):
        return True
    raise BadRequest(f"think must be true, false, \"low\", \"medium\" or \"high\", got "
                     f"{str(value)[:60]!r}", param="think")


def _format(value) -> Optional[dict]:
    """`format`: "json" or a JSON schema -> the RPC response_format."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise BadRequest(f"format must be \"json\" or a JSON schema object, got {str(value)[:60]!r}",
                     param="format")


def _logprobs(body: dict) -> Optional[int]:
    top = body.get("top_logprobs")
    if body.get("logprobs") is None and top is None:
        return None
    if not isinstance(body.get("logprobs", False), bool):
        raise BadRequest("logprobs must be true or false", param="logprobs")
    top = 0 if top is None else _int("top_logprobs", top)
    if not body.get("logprobs"):
        if top:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top


def _common(body: dict, card: ModelCard) -> tuple[str, dict, bool, Optional[int]]:
    """The fields of both routes -> (model name, RPC params, stream, top logprobs)."""
    model = card.serves(body.get("model"))
    _keep_alive(body)
    # truncate and shift are accepted: a prompt too long is refused (prompt_too_long),
    # never truncated, and an answer ends at the context's end, never shifted
    params = _options(body.get("options"), card.max_seq)
    response_format = _format(body.get("format"))
    if response_format is not None:
        params["response_format"] = response_format
    top = _logprobs(body)
    if top is not None:
        params["logprobs"] = max(top, 1)
    return model, params, _stream(body), top


def chat_request(body, card: ModelCard) -> Translated:
    """A `POST /api/chat` body -> the RPC `chat` params (BadRequest naming the field)."""
    body = _fields(body, _CHAT_FIELDS)
    model, params, stream, top = _common(body, card)
    params.update(messages=_messages(body.get("messages")), split_reasoning=True,
                  enable_thinking=_think(body.get("think")), stream=stream)
    tools = body.get("tools")
    if tools:
        # Ollama's tools are OpenAI's function specs, whose `type` some clients leave out
        params["tools"] = [dict(t, type=t.get("type", "function")) if isinstance(t, dict)
                           else t for t in tools] if isinstance(tools, list) else tools
    return Translated("chat", params, stream, model, True, top)


def generate_request(body, card: ModelCard, fim: Optional[tuple]) -> Translated:
    """A `POST /api/generate` body -> the RPC `chat` params (the model's template around
    `system` and `prompt`), or `generate` params (`raw`, or `suffix` with the model's
    fill-in-the-middle tokens `fim` = (prefix, suffix, middle)). An empty prompt loads (or,
    with keep_alive 0, "unloads") the model: no job."""
    body = _fields(body, _GENERATE_FIELDS)
    model, params, stream, top = _common(body, card)
    prompt, system, suffix = body.get("prompt"), body.get("system"), body.get("suffix")
    for name, value in (("prompt", prompt), ("system", system), ("suffix", suffix)):
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{name} must be a string", param=name)
    if body.get("template"):
        raise BadRequest("template overrides are not supported: the model's own chat template "
                         "is used (raw: true sends the prompt as it is)", param="template")
    if body.get("context"):
        raise BadRequest("context (the token memory of earlier answers) is not supported: "
                         "send the conversation to /api/chat", param="context")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise BadRequest("raw must be true or false", param="raw")
    if not prompt and not body.get("images") and not suffix:
        reason = "unload" if _keep_alive(body) else "load"
        return Translated("", {}, stream, model, False, done_reason=reason)
    params["stream"] = stream
    if suffix:
        if fim is None:
            raise BadRequest("suffix: this model has no fill-in-the-middle tokens",
                             param="suffix")
        params["prompt"] = f"{fim[0]}{prompt or ''}{fim[1]}{suffix}{fim[2]}"
        return Translated("generate", params, stream, model, False, top)
    if raw:
        if body.get("images") or system:
            raise BadRequest("raw: true sends the prompt as it is: images and system need "
                             "the template (raw: false)", param="raw")
        params["prompt"] = prompt
        return Translated("generate", params, stream, model, False, top)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user",
                     "content": _with_images(prompt or "", body.get("images"), "prompt")})
    params.update(messages=messages, split_reasoning=True,
                  enable_thinking=_think(body.get("think")))
    return Translated("chat", params, stream, model, False, top)


# ---------------------------------------------------------------- answers

def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def error_body(message: str) -> dict:
    """Ollama's error shape."""
    return {"error": message}


def _calls(calls: list) -> list:
    """The RPC's (OpenAI's) tool calls -> Ollama's, with the arguments as an object."""
    out = []
    for call in calls:
        args = call["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass                  # parsed calls always hold an object; keep what is there
        out.append({"id": call["id"], "function": {"name": call["function"]["name"],
                                                   "arguments": args}})
    return out


class Answer:
    """One Ollama answer's objects: its model name and how it shows tokens."""

    def __init__(self, req: Translated, token_bytes: TokenBytes):
        self.req = req
        self.token_bytes = token_bytes

    def _envelope(self, done: bool) -> dict:
        return {"model": self.req.model, "created_at": now(), "done": done}

    def _logprobs(self, entries: Optional[list]) -> Optional[list]:
        if self.req.top_logprobs is None or entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                    "bytes": list(raw)}
        return [dict(item(e["id"], e["logprob"]),
                     top_logprobs=[item(i, lp) for i, lp in e["top"][:self.req.top_logprobs]])
                for e in entries]

    def _body(self, out: dict, text: str, reasoning: Optional[str], calls, logprobs) -> dict:
        if self.req.chat:
            message = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = _calls(calls)
            out["message"] = message
        else:
            out["response"] = text
            if reasoning:
                out["thinking"] = reasoning
        lps = self._logprobs(logprobs)
        if lps is not None:
            out["logprobs"] = lps
        return out

    def chunk(self, payload: dict) -> Optional[dict]:
        """The object of a `token` payload, or None when it carries nothing to show."""
        if not (payload["text"] or payload.get("reasoning") or payload.get("tool_calls")
                or self._logprobs(payload.get("logprobs"))):
            return None
        return self._body(self._envelope(False), payload["text"], payload.get("reasoning"),
                          payload.get("tool_calls"), payload.get("logprobs"))

    def final(self, result: dict, streamed: bool) -> dict:
        """The last object (streamed: empty, the text went in the chunks) or the whole
        answer, with done_reason and the counters in nanoseconds."""
        out = self._envelope(True)
        if streamed:
            self._body(out, "", None, None, None)
        else:
            self._body(out, result["text"], result.get("reasoning"), result.get("tool_calls"),
                       result.get("logprobs"))
        reason = result["finish_reason"]
        t, u = result["timings"], result["usage"]
        ns = 1_000_000
        out.update(done_reason="stop" if reason == "tool_calls" else reason,
                   total_duration=int((t["queue_ms"] + t["prefill_ms"] + t["decode_ms"]) * ns),
                   load_duration=0, prompt_eval_count=u["prompt_tokens"],
                   prompt_eval_duration=int(t["prefill_ms"] * ns),
                   eval_count=u["completion_tokens"], eval_duration=int(t["decode_ms"] * ns))
        return out

    def loaded(self) -> dict:
        """The answer of a generate without a prompt: the model is loaded (or "unloaded")."""
        return self._body(dict(self._envelope(True), done_reason=self.req.done_reason),
                          "", None, None, None)
