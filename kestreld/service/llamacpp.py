"""llama.cpp server's native shapes <-> Kestrel's wire params and results (the HTTP API's
translator for /completion, /tokenize, /detokenize, /props, /slots and /apply-template,
which front ends written for llama.cpp's server call).

A `/completion` body becomes the params of the RPC `generate` method; the `token` payloads
and the completion map come back as llama.cpp's objects (`Completion`). Pure functions of
their arguments (no engine, no I/O).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .. import __version__
from ..errors import BadRequest
from ..protocol import MAX_LOGPROBS

PATHS = ("/completion", "/tokenize", "/detokenize", "/props", "/slots", "/apply-template")
RANDOM_SEED = 4294967295       # llama.cpp's "no seed given"

TokenBytes = Callable[[int], bytes]

# fields that map one to one onto the RPC options of the same name
_SAME_NAME = ("temperature", "top_k", "top_p", "min_p", "stop", "repeat_penalty",
              "presence_penalty", "frequency_penalty", "ignore_eos")
# llama.cpp's samplers Kestrel does not have: accepted at their value that turns them off
_NEUTRAL = {"grammar": "", "typical_p": 1, "tfs_z": 1, "mirostat": 0, "dynatemp_range": 0,
            "xtc_probability": 0, "dry_multiplier": 0, "n_cmpl": 1, "n_indent": 0,
            "t_max_predict_ms": 0, "post_sampling_probs": False, "logit_bias": [],
            "lora": [], "response_fields": []}
# fields that do not change an answer here: how llama.cpp's slots, caches and samplers
# are arranged, the parameters of samplers that are off, timing extras
_IGNORED = frozenset((
    "model", "cache_prompt", "id_slot", "n_keep", "repeat_last_n", "penalize_nl", "samplers",
    "min_keep", "timings_per_token", "return_progress", "n_cache_reuse", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_threshold",
    "mirostat_tau", "mirostat_eta", "dynatemp_exponent", "sse_ping_interval"))
_OWN = ("prompt", "n_predict", "max_tokens", "seed", "n_probs", "stream", "json_schema",
        "return_tokens")


@dataclass(frozen=True)
class Translated:
    """A /completion request as RPC `generate` params, and how to answer it."""
    params: dict
    stream: bool
    n_probs: int
    return_tokens: bool
    prompt: str                  # the prompt text, echoed in the answer ("" for token ids)
    n_predict: int               # as asked (-1: up to the context's end)


def _neutral(value, off) -> bool:
    if isinstance(off, bool) or isinstance(value, bool):
        return value is off
    if isinstance(off, list):
        return value in ([], {})
    return value == off


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {str(value)[:60]}", param=name)
    return value


def _int(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {str(value)[:60]}", param=name)
    return value


def object_body(body) -> dict:
    """The body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _prompt(value) -> dict:
    """`prompt`: a string, token ids, or one of them in an array of one."""
    if isinstance(value, dict) and set(value) == {"prompt_string"}:
        value = value["prompt_string"]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in value):
        return {"ids": value}
    raise BadRequest("prompt must be a string or an array of token ids (one prompt: "
                     "batches, mixed arrays and multimodal data are not supported)",
                     param="prompt")


def completion_request(body, max_seq: int) -> Translated:
    """A `POST /completion` body -> the RPC `generate` params (BadRequest naming the field)."""
    body = object_body(body)
    params = {}
    for name, value in body.items():
        if name in _SAME_NAME:
            params[name] = value
        elif name in _NEUTRAL:
            if value is not None and not _neutral(value, _NEUTRAL[name]):
                raise BadRequest(f"{name}={str(value)[:60]} is not supported (only "
                                 f"{_NEUTRAL[name]!r}, off)", param=name)
        elif name not in _IGNORED and name not in _OWN:
            raise BadRequest(f"unknown field {str(name)[:60]!r} (docs/http.md lists the "
                             f"fields of /completion)", param=str(name)[:60])
    if "prompt" not in body:
        raise BadRequest("prompt is required", param="prompt")
    params.update(_prompt(body["prompt"]))
    _bool(body, "cache_prompt", True)   # the prefix rule reuses KV either way (same answer)
    n_predict = _int(body, "n_predict", _int(body, "max_tokens", -1))
    if n_predict == -1 or n_predict == -2:
        params["max_tokens"] = max_seq                    # up to the context's end
    elif n_predict >= 1:
        params["max_tokens"] = n_predict
    else:
        raise BadRequest(f"n_predict must be -1 or >= 1, got {n_predict}", param="n_predict")
    seed = _int(body, "seed", -1)
    if seed >= 0:
        params["seed"] = seed
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    for name in ("presence_penalty", "frequency_penalty"):
        if params.get(name) == 0:
            del params[name]
    n_probs = _int(body, "n_probs", 0)
    if not 0 <= n_probs <= MAX_LOGPROBS:
        raise BadRequest(f"n_probs must be in 0..{MAX_LOGPROBS}, got {n_probs}", param="n_probs")
    if n_probs:
        params["logprobs"] = n_probs
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise BadRequest("json_schema must be a JSON schema object", param="json_schema")
        params["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "json_schema", "schema": schema}}
    stream = _bool(body, "stream", False)
    params["stream"] = stream
    return Translated(params, stream, n_probs, _bool(body, "return_tokens", False),
                      params.get("prompt", ""), n_predict)


# ---------------------------------------------------------------- settings and slots

def default_settings(max_seq: int, max_tokens: int) -> dict:
    """The sampling a request gets when it names none (Kestrel's defaults: greedy)."""
    return {"n_predict": max_tokens, "seed": RANDOM_SEED, "temperature": 0.0, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_last_n": 0,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "mirostat": 0, "stop": [], "max_tokens": max_tokens, "n_keep": 0,
            "ignore_eos": False, "stream": False, "n_probs": 0, "grammar": "",
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "n_ctx": max_seq}


def _settings(req: Translated, max_seq: int, model_id: str) -> dict:
    out = default_settings(max_seq, req.params["max_tokens"])
    out.update({k: v for k, v in req.params.items() if k in out})
    out.update(n_predict=req.n_predict, n_probs=req.n_probs, stream=req.stream, model=model_id)
    return out


def slot(max_seq: int, max_tokens: int, busy: bool) -> dict:
    """The one slot (Kestrel's one KV arena), read only."""
    return {"id": 0, "id_task": -1, "n_ctx": max_seq, "speculative": False,
            "is_processing": busy, "params": default_settings(max_seq, max_tokens),
            "next_token": {"has_next_token": busy, "has_new_line": False, "n_remain": -1,
                           "n_decoded": 0, "stopping_word": ""}}


def props(model_id: str, path: str, template: str, vision: bool, max_seq: int,
          max_tokens: int, busy: bool) -> dict:
    """`GET /props`."""
    return {"default_generation_settings": slot(max_seq, max_tokens, busy), "total_slots": 1,
            "model_alias": model_id, "model_path": path, "chat_template": template,
            "modalities": {"vision": vision, "audio": False},
            "build_info": f"kestrel {__version__}", "is_sleeping": False}


# ---------------------------------------------------------------- tokens

def piece(raw: bytes):
    """A token's piece: its text if its bytes are UTF-8, else the bytes (llama.cpp's rule)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize_params(body) -> tuple[dict, bool]:
    """`POST /tokenize` -> (the RPC tokenize params, with_pieces)."""
    body = object_body(body)
    unknown = sorted(str(k)[:60] for k in body
                     if k not in ("content", "add_special", "parse_special", "with_pieces"))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown[:8])}; /tokenize takes content, "
                         f"add_special, parse_special, with_pieces", param=unknown[0])
    if not _bool(body, "parse_special", True):
        raise BadRequest("parse_special: false is not supported (special-token texts always "
                         "become their tokens)", param="parse_special")
    return ({"text": body.get("content"), "add_special": _bool(body, "add_special", False)},
            _bool(body, "with_pieces", False))


def tokens(ids: list, with_pieces: bool, token_bytes: TokenBytes) -> dict:
    """The /tokenize answer."""
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": piece(token_bytes(i))} for i in ids]}


def detokenize_params(body) -> dict:
    """`POST /detokenize` -> the RPC detokenize params."""
    body = object_body(body)
    if set(body) - {"tokens"}:
        raise BadRequest("/detokenize takes tokens (an array of token ids) only",
                         param="tokens")
    return {"ids": body.get("tokens", [])}


# ---------------------------------------------------------------- answers

class Completion:
    """One /completion answer's objects."""

    def __init__(self, req: Translated, model_id: str, max_seq: int, token_bytes: TokenBytes):
        self.req = req
        self.model_id = model_id
        self.max_seq = max_seq
        self.token_bytes = token_bytes

    def _probs(self, entries: Optional[list]) -> Optional[list]:
        if not self.req.n_probs or entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes(token_id)
            return {"id": token_id, "token": raw.decode("utf-8", errors="replace"),
                    "logprob": logprob, "bytes": list(raw)}
        return [dict(item(e["id"], e["logprob"]),
                     top_logprobs=[item(i, lp) for i, lp in e["top"][:self.req.n_probs]])
                for e in entries]

    def _object(self, content: str, ids: list, logprobs, stop: bool) -> dict:
        out = {"index": 0, "content": content, "tokens": ids, "id_slot": 0, "stop": stop}
        probs = self._probs(logprobs)
        if probs is not None:
            out["completion_probabilities"] = probs
        return out

    def chunk(self, payload: dict) -> Optional[dict]:
        """The streamed object of a `token` payload (None when it carries nothing)."""
        if not payload["text"] and not payload["ids"]:
            return None
        return self._object(payload["text"], payload["ids"], payload.get("logprobs"), False)

    def final(self, result: dict, streamed: bool) -> dict:
        """The whole answer, or (streamed) the last object: `stop` true, the counters."""
        ids = result["ids"]
        if streamed:
            out = self._object("", [], None, True)
        else:
            out = self._object(result["text"], ids if self.req.return_tokens else [],
                               result.get("logprobs"), True)
        word = self._stopping_word(result["text"], ids)
        reason = result["finish_reason"]
        stop_type = "limit" if reason == "length" else "word" if word else "eos"
        u, t = result["usage"], result["timings"]
        out.update(model=self.model_id, tokens_predicted=u["completion_tokens"],
                   tokens_evaluated=u["prompt_tokens"],
                   generation_settings=_settings(self.req, self.max_seq, self.model_id),
                   prompt=self.req.prompt, has_new_line="\n" in result["text"],
                   truncated=False, stop_type=stop_type, stopping_word=word,
                   tokens_cached=u["prompt_tokens"] + u["completion_tokens"],
                   timings=timings(u, t))
        return out

    def _stopping_word(self, text: str, ids: list) -> str:
        """The stop string that ended the answer: the generated tokens hold it past the
        text, which ends before it ("" when none did)."""
        stops = self.req.params.get("stop") or []
        if not stops:
            return ""
        rest = b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        rest = rest[len(text):] if rest.startswith(text) else ""
        return next((s for s in stops if rest.startswith(s)), "")


def timings(u: dict, t: dict) -> dict:
    """llama.cpp's `timings` of a completion map's usage and timings."""
    prompt_n, predicted_n = u["prefill_tokens"], u["completion_tokens"]
    prompt_ms, predicted_ms = t["prefill_ms"], t["decode_ms"]
    return {"cache_n": u["cached_tokens"], "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": t["prefill_tok_s"], "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": t["decode_tok_s"]}
