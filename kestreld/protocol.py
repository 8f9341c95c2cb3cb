"""The wire protocol (version 1), shared by the daemon and kestrelctl.

MessagePack-RPC over a Unix stream socket, no extra framing:
    request      [0, msgid, method, [params-map]]
    response     [1, msgid, error|nil, result|nil]
    notification [2, method, [msgid, payload]]     (server -> client, before the response)

This module holds everything both sides must agree on: message kinds, method names,
limits, the validation of each method's parameters into typed values, the encoders,
and `FrameReader` (bounded framing of a byte stream into MessagePack objects).
It imports msgpack and errors only: kestrelctl imports it without the engine or kernels.
"""
from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import msgpack

from .errors import BadRequest, KestrelError, PromptTooLong, TooLarge, UnknownMethod

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/kestrel/kestreld.sock"

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2

# Methods: generate and chat generate text (and take the sampling options); the others are
# answered at once (service/methods.py says where each runs).
ENGINE_METHODS = ("generate", "chat")
METHODS = ENGINE_METHODS + ("embed", "rerank", "tokenize", "detokenize", "status", "cancel",
                            "ping")

# Server -> client notifications.
TOKEN = "token"
PROGRESS = "progress"

# Limits on what a request may hold (the message size bounds the rest).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
SEED_LIMIT = 1 << 64          # seeds are 0 <= seed < 2**64
MAX_IMAGES = 16               # image parts in one chat request
MAX_MESSAGES = 4096           # messages in one chat (each takes a few tokens of the context)
MAX_PATH_CHARS = 4096
MAX_TOOLS = 128               # functions offered in one chat request
MAX_TOOL_CALLS = 64           # calls in one assistant message
MAX_ID_CHARS = 256            # a tool call's id
MAX_SCHEMA_DEPTH = 32         # nesting of a JSON schema (response_format, tool parameters)
MAX_SCHEMA_NODES = 10_000     # values in one JSON schema
MAX_EMBED_INPUTS = 2048       # inputs of one embed request (OpenAI's limit)
MAX_EMBED_TOKENS = 1 << 17    # their tokens together
# What the grammar engine (llguidance) follows exactly and within its limits: numbers as
# doubles (integers beyond 2**53 come out rounded), a few hundred alternatives per choice
# (its parser keeps at most 2,000 items per step), and regexes of bounded size once their
# counted repetitions are expanded (a{1000000} exhausts it).
MAX_SCHEMA_INT = 1 << 53
MAX_SCHEMA_ALTERNATIVES = 256  # anyOf / oneOf branches
MAX_SCHEMA_ENUM = 1000         # enum values
MAX_PATTERN_SIZE = 10_000      # a pattern's characters, counted repetitions expanded
PENALTY_LIMIT = 2.0           # presence / frequency penalties in [-2, 2], as OpenAI's
BIAS_LIMIT = 100.0            # logit_bias values in [-100, 100], as OpenAI's; -100 bans
MAX_BIASED = 1024             # token ids in one logit_bias map
# OpenAI's rule for function and response-format names
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("auto", "none", "required")
ROLES = ("system", "user", "assistant", "tool")   # a chat message's role (the template's words)


# ---------------------------------------------------------------- typed parameters

@dataclass(frozen=True)
class GenerateParams:
    """`generate`: exactly one of prompt / ids. `options` holds the validated sampling
    options that were given, keyed like SamplingOptions' fields."""
    prompt: Optional[str]
    ids: Optional[tuple]
    options: dict
    stream: bool


@dataclass(frozen=True)
class ChatParams:
    """`chat`: messages as ({"role": str, "content": str | (part, ...)}, ...); a part is
    {"type": "text", "text": str} or {"type": "image", "path": str} / {"type": "image",
    "data": bytes} (Qwen3-VL). An assistant message may also hold `tool_calls` ([{"id",
    "type": "function", "function": {"name", "arguments": str}}]; its content "" when it
    had none), a "tool" message `tool_call_id`. `split_reasoning`: the answer's thinking
    block comes back apart, as `reasoning`. `tools`: OpenAI function specs;
    `tool_choice`: "auto" | "none" | "required" | {"type": "function", "function": {"name"}};
    `parallel_tool_calls` False: at most one call."""
    messages: tuple
    enable_thinking: bool
    options: dict
    stream: bool
    split_reasoning: bool = False
    tools: tuple = ()
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class EmbedParams:
    """`embed`: `inputs` each a text (str) or token ids (tuple); `dimensions`: the first d
    values of each vector, renormalized; `truncate`: an input longer than the context keeps
    its first tokens instead of an error."""
    inputs: tuple
    dimensions: Optional[int]
    truncate: bool


@dataclass(frozen=True)
class RerankParams:
    """`rerank`: `documents` (texts) scored against `query`; `top_n`: how many of the best
    the answer lists (None: all); `instruction`: the task, in the reranker's prompt (None:
    the model's default)."""
    query: str
    documents: tuple
    top_n: Optional[int]
    instruction: Optional[str] = None


@dataclass(frozen=True)
class TokenizeParams:
    text: str
    add_special: bool


@dataclass(frozen=True)
class DetokenizeParams:
    ids: tuple


@dataclass(frozen=True)
class CancelParams:
    id: int


@dataclass(frozen=True)
class NoParams:
    """`status` and `ping`."""


Params = Union[GenerateParams, ChatParams, EmbedParams, RerankParams, TokenizeParams,
               DetokenizeParams, CancelParams, NoParams]


# ---------------------------------------------------------------- value checks

# Client values quoted in error messages are cut short: a hostile value (megabytes, or
# nested a thousand levels deep) must not make a huge reply or a RecursionError.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 3, 60, 60


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if not _is_int(v):
        raise BadRequest(f"{name} must be an integer, got {type(v).__name__} {_QUOTE.repr(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise BadRequest(f"{name} must be {bounds}, got {v}")
    return v


def _number(name: str, v, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number, got {_QUOTE.repr(v)}")
    if v < lo or (lo_open and v == lo) or v > hi:
        left = "(" if lo_open else "["
        right = "]" if math.isfinite(hi) else ")"
        raise BadRequest(f"{name} must be in {left}{lo}, {hi}{right}, got {v}")
    return float(v)


def _bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {_QUOTE.repr(v)}")
    return v


def _str(name: str, v) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string, got {type(v).__name__}")
    return v


def _stop(name: str, v) -> tuple:
    if not isinstance(v, (list, tuple)):
        raise BadRequest(f"{name} must be a list of strings, got {type(v).__name__}")
    if len(v) > MAX_STOP_STRINGS:
        raise BadRequest(f"{name}: at most {MAX_STOP_STRINGS} strings, got {len(v)}")
    for s in v:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise BadRequest(f"{name}: each entry must be a string of 1..{MAX_STOP_CHARS} "
                             f"characters, got {_QUOTE.repr(s)}")
    return tuple(v)


def _ids(name: str, v, vocab_size: int) -> tuple:
    if not isinstance(v, (list, tuple)):
        raise BadRequest(f"{name} must be a list of token ids, got {type(v).__name__}")
    # C-speed passes first (an 8 MiB message holds millions of ids and this runs on the
    # event loop); the Python loop only runs to name the first bad id.
    if not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) < vocab_size):
        return tuple(v)
    for i in v:
        if not _is_int(i) or not 0 <= i < vocab_size:
            raise BadRequest(f"{name}: token ids must be integers in 0..{vocab_size - 1}, "
                             f"got {_QUOTE.repr(i)}")
    return tuple(v)


def _embed_inputs(v, vocab_size: int) -> tuple:
    """`input`: a text, a list of texts, a list of ids or a list of such lists -> a tuple of
    texts (str) and id tuples."""
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple)) or not v:
        raise BadRequest("input must be a string, a list of strings, a list of token ids or "
                         f"a list of such lists (not empty), got {_QUOTE.repr(v)}")
    if len(v) > MAX_EMBED_INPUTS and not _is_int(v[0]):
        raise BadRequest(f"input holds {len(v)} inputs; at most {MAX_EMBED_INPUTS} per request")
    if _is_int(v[0]):
        return (_ids("input", v, vocab_size),)
    if all(isinstance(x, str) for x in v):
        return tuple(v)
    if all(isinstance(x, (list, tuple)) for x in v):
        return tuple(_ids(f"input[{i}]", x, vocab_size) for i, x in enumerate(v))
    raise BadRequest("input: a list must hold only strings or only lists of token ids")


def _messages(v) -> tuple:
    if not isinstance(v, (list, tuple)) or not v:
        raise BadRequest("messages must be a non-empty list of {role, content} maps")
    if len(v) > MAX_MESSAGES:      # checked first: a huge list must not hold the event loop
        raise BadRequest(f"messages: at most {MAX_MESSAGES}, got {len(v)}")
    out = [_message(f"messages[{n}]", m) for n, m in enumerate(v)]
    n_images = sum(1 for m in out if not isinstance(m["content"], str)
                   for part in m["content"] if part["type"] == "image")
    if n_images > MAX_IMAGES:
        raise BadRequest(f"messages hold {n_images} images; at most {MAX_IMAGES} are accepted")
    return tuple(out)


def _message(name: str, m) -> dict:
    """{role, content}; an assistant's may add tool_calls (content then may be nil or
    missing: ""), a tool's tool_call_id."""
    role = m.get("role") if isinstance(m, dict) else None
    extra = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set()) \
        if isinstance(role, str) else set()
    if not isinstance(m, dict) or "role" not in m or not set(m) <= {"role", "content"} | extra \
            or ("content" not in m and "tool_calls" not in m):
        keys = sorted(map(str, m)) if isinstance(m, dict) else type(m).__name__
        allowed = ", ".join(["role", "content"] + sorted(extra))
        raise BadRequest(f"{name} must be a map with role and content (an assistant's may add "
                         f"tool_calls, a tool's tool_call_id); allowed here: {allowed}, got {keys}")
    if role not in ROLES:
        raise BadRequest(f"{name}.role must be one of {', '.join(ROLES)}, got {_QUOTE.repr(role)}")
    out = {"role": role}
    content = m.get("content")
    if "tool_calls" in m:
        out["tool_calls"] = _tool_calls(f"{name}.tool_calls", m["tool_calls"])
        content = "" if content is None else content
    if isinstance(content, (list, tuple)):
        out["content"] = tuple(_part(f"{name}.content[{j}]", part) for j, part in enumerate(content))
    else:
        out["content"] = _str(f"{name}.content", content)
    if "tool_call_id" in m:
        out["tool_call_id"] = _bounded_str(f"{name}.tool_call_id", m["tool_call_id"], MAX_ID_CHARS)
    return out


def _bounded_str(name: str, v, max_chars: int) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= max_chars:
        raise BadRequest(f"{name} must be a string of 1..{max_chars} characters, got {_QUOTE.repr(v)}")
    return v


def _name(name: str, v) -> str:
    if not isinstance(v, str) or not NAME_RE.fullmatch(v):
        raise BadRequest(f"{name} must be 1..64 letters, digits, _ or -, got {_QUOTE.repr(v)}")
    return v


def _map(name: str, v, required: tuple, optional: tuple = ()) -> dict:
    """`v` as a map holding `required` keys and perhaps `optional` ones, nothing else."""
    if not isinstance(v, dict):
        raise BadRequest(f"{name} must be a map, got {_QUOTE.repr(v)}")
    missing = [k for k in required if k not in v]
    unknown = sorted(str(k) for k in v if k not in required + optional)
    if missing or unknown:
        keys = ", ".join(required + tuple(f"{k}?" for k in optional))
        raise BadRequest(f"{name} must be a map of {keys}; "
                         + (f"missing {', '.join(missing)}" if missing
                            else f"unknown {', '.join(_QUOTE.repr(k) for k in unknown[:8])}"))
    return v


def _tool_calls(name: str, v) -> list:
    """An assistant message's calls: [{"id", "type": "function", "function": {"name",
    "arguments"}}], arguments a JSON string (as OpenAI sends it) or a map."""
    if not isinstance(v, (list, tuple)) or not 0 < len(v) <= MAX_TOOL_CALLS:
        raise BadRequest(f"{name} must be a list of 1..{MAX_TOOL_CALLS} calls, got {_QUOTE.repr(v)}")
    out = []
    for j, call in enumerate(v):
        c = _map(f"{name}[{j}]", call, ("function",), ("id", "type"))
        if c.get("type", "function") != "function":
            raise BadRequest(f"{name}[{j}].type must be \"function\", got {_QUOTE.repr(c['type'])}")
        f = _map(f"{name}[{j}].function", c["function"], ("name", "arguments"))
        args = f["arguments"]
        if isinstance(args, dict):
            args = _json_value(f"{name}[{j}].function.arguments", args)
        elif not isinstance(args, str):
            raise BadRequest(f"{name}[{j}].function.arguments must be a JSON string or a map, "
                             f"got {type(args).__name__}")
        out.append({"id": _bounded_str(f"{name}[{j}].id", c.get("id", f"call_{j}"), MAX_ID_CHARS),
                    "type": "function",
                    "function": {"name": _name(f"{name}[{j}].function.name", f["name"]),
                                 "arguments": args}})
    return out


def _tools(v) -> tuple:
    """[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]"""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} functions, got {_QUOTE.repr(v)}")
    out, names = [], set()
    for j, tool in enumerate(v):
        t = _map(f"tools[{j}]", tool, ("type", "function"))
        if t["type"] != "function":
            raise BadRequest(f"tools[{j}].type must be \"function\", got {_QUOTE.repr(t['type'])}")
        f = _map(f"tools[{j}].function", t["function"], ("name",),
                 ("description", "parameters", "strict"))
        fn = {"name": _name(f"tools[{j}].function.name", f["name"])}
        if fn["name"] in names:
            raise BadRequest(f"tools[{j}].function.name: {fn['name']!r} is offered twice")
        names.add(fn["name"])
        if "description" in f:
            fn["description"] = _str(f"tools[{j}].function.description", f["description"])
        if "parameters" in f:
            fn["parameters"] = _schema(f"tools[{j}].function.parameters", f["parameters"])
        if "strict" in f:
            fn["strict"] = _bool(f"tools[{j}].function.strict", f["strict"])
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _tool_choice(v, tools: tuple):
    if isinstance(v, str) and v in TOOL_CHOICES:
        choice = v
    elif isinstance(v, dict):
        c = _map("tool_choice", v, ("type", "function"))
        if c["type"] != "function":
            raise BadRequest(f"tool_choice.type must be \"function\", got {_QUOTE.repr(c['type'])}")
        name = _name("tool_choice.function.name", _map("tool_choice.function", c["function"], ("name",))["name"])
        if name not in {t["function"]["name"] for t in tools}:
            raise BadRequest(f"tool_choice names function {name!r}, which is not in tools")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise BadRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_QUOTE.repr(v)}")
    if choice not in ("auto", "none") and not tools:
        raise BadRequest(f"tool_choice {_QUOTE.repr(v)} needs tools")
    return choice


_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def _json_value(name: str, v, depth: int = 0, budget: Optional[list] = None):
    """`v` if it is JSON (maps with string keys, lists, strings, finite numbers, booleans,
    nil) of at most MAX_SCHEMA_DEPTH levels and MAX_SCHEMA_NODES values."""
    budget = [MAX_SCHEMA_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise BadRequest(f"{name}: more than {MAX_SCHEMA_NODES} values")
    if depth > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{name}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(v, dict):
        for k, item in v.items():
            if not isinstance(k, str):
                raise BadRequest(f"{name}: map keys must be strings, got {_QUOTE.repr(k)}")
            _json_value(f"{name}.{k}", item, depth + 1, budget)
    elif isinstance(v, (list, tuple)):
        for j, item in enumerate(v):
            _json_value(f"{name}[{j}]", item, depth + 1, budget)
    elif isinstance(v, float) and not math.isfinite(v):
        raise BadRequest(f"{name}: numbers must be finite, got {v}")
    elif not (v is None or isinstance(v, (str, bool, int, float))):
        raise BadRequest(f"{name}: not a JSON value ({type(v).__name__})")
    return v


def _schema(name: str, v) -> dict:
    """A JSON schema (a map of JSON) whose common keywords have their shapes; the grammar
    engine checks the rest when the answer's grammar is compiled (engine/constraint.py)."""
    if not isinstance(v, dict):
        raise BadRequest(f"{name} must be a JSON schema (a map), got {_QUOTE.repr(v)}")
    _json_value(name, v)
    _schema_keywords(name, v)
    return v


def _schema_keywords(name: str, s) -> None:
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise BadRequest(f"{name} must be a schema (a map or a boolean), got {_QUOTE.repr(s)}")
    t = s.get("type")
    if t is not None and not (t in _JSON_TYPES if isinstance(t, str) else
                              isinstance(t, list) and t and all(x in _JSON_TYPES for x in t)):
        raise BadRequest(f"{name}.type must be one of {', '.join(_JSON_TYPES)} (or a list of "
                         f"them), got {_QUOTE.repr(t)}")
    if "required" in s and not (isinstance(s["required"], list)
                                and all(isinstance(k, str) for k in s["required"])):
        raise BadRequest(f"{name}.required must be a list of property names")
    if "enum" in s and not (isinstance(s["enum"], list) and 0 < len(s["enum"]) <= MAX_SCHEMA_ENUM):
        raise BadRequest(f"{name}.enum must be a list of 1..{MAX_SCHEMA_ENUM} values")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                "enum", "const"):
        if key in s:
            _exact_numbers(f"{name}.{key}", s[key])
    if "pattern" in s:
        _pattern(f"{name}.pattern", s["pattern"])
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if key in s:
            if not isinstance(s[key], dict):
                raise BadRequest(f"{name}.{key} must be a map of schemas")
            for k, sub in s[key].items():
                _schema_keywords(f"{name}.{key}.{k}", sub)
    for key in ("items", "additionalProperties", "not", "contains", "propertyNames"):
        if key in s and not isinstance(s[key], list):
            _schema_keywords(f"{name}.{key}", s[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in s:
            if not (isinstance(s[key], list) and s[key]):
                raise BadRequest(f"{name}.{key} must be a non-empty list of schemas")
            if key != "prefixItems" and len(s[key]) > MAX_SCHEMA_ALTERNATIVES:
                raise BadRequest(f"{name}.{key}: at most {MAX_SCHEMA_ALTERNATIVES} schemas "
                                 f"(what the grammar engine follows), got {len(s[key])}")
            for j, sub in enumerate(s[key]):
                _schema_keywords(f"{name}.{key}[{j}]", sub)


def _exact_numbers(name: str, v) -> None:
    """Numbers in a schema must be ones the grammar engine holds exactly: integers within
    +-2**53 (it reads numbers as doubles), and any number within the same bound when it
    is a limit (minimum: 12345678901234567890 would let it write 9223372036854775807)."""
    if isinstance(v, dict):
        for k, item in v.items():
            _exact_numbers(f"{name}.{k}", item)
    elif isinstance(v, list):
        for j, item in enumerate(v):
            _exact_numbers(f"{name}[{j}]", item)
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > MAX_SCHEMA_INT:
        raise BadRequest(f"{name}: {_QUOTE.repr(v)} is beyond +-2**53, which the grammar "
                         f"engine cannot enforce exactly")


def _pattern(name: str, v) -> None:
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string (a regex), got {_QUOTE.repr(v)}")
    size = _regex_size(v)
    if size > MAX_PATTERN_SIZE:
        raise BadRequest(f"{name}: the regex spans {size} characters once its counted "
                         f"repetitions are expanded; at most {MAX_PATTERN_SIZE}")


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _regex_size(pattern: str) -> int:
    """An upper bound of the characters a regex's expansion spells out: each atom counts 1,
    a group the sum of its content, a counted repetition {n}, {n,}, {n,m} multiplies its
    atom by its largest count (n + 1 for {n,}), * + ? count once."""
    stack = [[0, 0]]                      # per open group: [sum of the atoms before, last atom]
    i = 0
    while i < len(pattern):
        c, atom = pattern[i], 1
        if c == "\\":
            i += 2
        elif c == "[":                    # a class: up to its closing ] (not escaped, not first)
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += 1 if pattern[i:i + 1] == "]" else 0
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "(":
            stack.append([0, 0])
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            total, last = stack.pop()
            atom = total + last
            i += 1
        elif c == "{" and _COUNT.match(pattern, i):
            m = _COUNT.match(pattern, i)
            count = int(m.group(3)) if m.group(3) else int(m.group(1)) + (1 if m.group(2) else 0)
            stack[-1][1] *= max(count, 1)
            i = m.end()
            continue
        elif c in "*+?|^$":
            i += 1
            continue
        else:
            i += 1
        top = stack[-1]
        top[0], top[1] = top[0] + top[1], atom
    while len(stack) > 1:                 # unclosed groups: the engine refuses the regex itself
        total, last = stack.pop()
        stack[-1][1] += total + last
    return sum(stack[0])


def _response_format(v) -> Optional[dict]:
    """OpenAI's response_format: {"type": "text"} (free: None), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}}
    -> {"kind", "schema"} (the fields of the engine's ResponseFormat)."""
    kind = v.get("type") if isinstance(v, dict) else None
    if kind in ("text", "json_object"):
        _map("response_format", v, ("type",))
        return None if kind == "text" else {"kind": kind, "schema": None}
    if kind != "json_schema":
        raise BadRequest("response_format must be {\"type\": \"json_object\"}, {\"type\": "
                         "\"json_schema\", \"json_schema\": {\"name\", \"schema\"}} or "
                         f"{{\"type\": \"text\"}}, got {_QUOTE.repr(v)}")
    js = _map("response_format.json_schema", _map("response_format", v, ("type", "json_schema"))["json_schema"],
              ("name", "schema"), ("description", "strict"))
    _name("response_format.json_schema.name", js["name"])
    if "description" in js:
        _str("response_format.json_schema.description", js["description"])
    if js.get("strict") is not None:
        _bool("response_format.json_schema.strict", js["strict"])
    return {"kind": "json_schema", "schema": _schema("response_format.json_schema.schema", js["schema"])}


def _logit_bias(v) -> dict:
    """{token id: bias}: ids checked against the vocabulary by validate_params."""
    if not isinstance(v, dict) or len(v) > MAX_BIASED:
        raise BadRequest(f"logit_bias must be a map of at most {MAX_BIASED} token ids to "
                         f"biases, got {_QUOTE.repr(v)}")
    return {_int("logit_bias key", k, lo=0): _number(f"logit_bias[{k}]", b, -BIAS_LIMIT, BIAS_LIMIT)
            for k, b in v.items()}


def _part(name: str, v) -> dict:
    """One part of a list content: text, or an image by path or by its bytes."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "image"):
        raise BadRequest(f"{name} must be a map with type \"text\" or \"image\", "
                         f"got {_QUOTE.repr(v)}")
    if v["type"] == "text":
        if set(v) != {"type", "text"}:
            raise BadRequest(f"{name}: a text part has exactly type and text, got {sorted(map(str, v))}")
        return {"type": "text", "text": _str(f"{name}.text", v["text"])}
    keys = set(v) - {"type"}
    if keys == {"path"}:
        path = _str(f"{name}.path", v["path"])
        if not 0 < len(path) <= MAX_PATH_CHARS or "\0" in path:
            raise BadRequest(f"{name}.path must be 1..{MAX_PATH_CHARS} characters without NUL")
        return {"type": "image", "path": path}
    if keys == {"data"}:
        if not isinstance(v["data"], (bytes, bytearray)) or not v["data"]:
            raise BadRequest(f"{name}.data must be non-empty binary (MessagePack bin), "
                             f"got {type(v['data']).__name__}")
        return {"type": "image", "data": bytes(v["data"])}
    raise BadRequest(f"{name}: an image part has type and exactly one of path or data, "
                     f"got {sorted(map(str, v))}")


# Sampling options of generate/chat: name -> check returning the typed value.
OPTION_CHECKS = {
    "max_tokens": lambda v: _int("max_tokens", v, lo=1),
    "temperature": lambda v: _number("temperature", v, 0.0),
    "top_k": lambda v: _int("top_k", v, lo=0),
    "top_p": lambda v: _number("top_p", v, 0.0, 1.0, lo_open=True),
    "min_p": lambda v: _number("min_p", v, 0.0, 1.0),
    "repeat_penalty": lambda v: _number("repeat_penalty", v, 0.0, lo_open=True),
    "seed": lambda v: _int("seed", v, lo=0, hi=SEED_LIMIT - 1),
    "stop": lambda v: _stop("stop", v),
    "ignore_eos": lambda v: _bool("ignore_eos", v),
    "speculate": lambda v: _bool("speculate", v),
    "logprobs": lambda v: _int("logprobs", v, lo=0, hi=MAX_LOGPROBS),
    "presence_penalty": lambda v: _number("presence_penalty", v, -PENALTY_LIMIT, PENALTY_LIMIT),
    "frequency_penalty": lambda v: _number("frequency_penalty", v, -PENALTY_LIMIT, PENALTY_LIMIT),
    "response_format": _response_format,
    "logit_bias": _logit_bias,
}

_FIELDS = {  # method -> its own parameter names (besides the options of generate/chat)
    "generate": ("prompt", "ids", "stream"),
    "chat": ("messages", "enable_thinking", "split_reasoning", "tools", "tool_choice",
             "parallel_tool_calls", "stream"),
    "embed": ("input", "dimensions", "truncate"),
    "rerank": ("query", "documents", "top_n", "instruction"),
    "tokenize": ("text", "add_special"),
    "detokenize": ("ids",),
    "cancel": ("id",),
    "status": (),
    "ping": (),
}


def _params_map(method: str, params) -> dict:
    """Kestrel methods take one map (or nothing) in the params array."""
    if params is None or params == []:
        return {}
    if isinstance(params, list) and len(params) == 1 and isinstance(params[0], dict):
        params = params[0]
    if not isinstance(params, dict):
        raise BadRequest(f"{method}: params must be an array holding one map")
    allowed = set(_FIELDS[method]) | (set(OPTION_CHECKS) if method in ENGINE_METHODS else set())
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        named = ", ".join(_QUOTE.repr(k) for k in unknown[:8])        # bounded, as values
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise BadRequest(f"{method}: unknown parameter(s) {named}{more}; "
                         f"allowed: {', '.join(sorted(allowed)) or 'none'}")
    return params


def _options(p: dict, vocab_size: int) -> dict:
    out = {k: OPTION_CHECKS[k](p[k]) for k in OPTION_CHECKS if k in p}
    outside = [i for i in out.get("logit_bias", ()) if i >= vocab_size]
    if outside:
        raise BadRequest(f"logit_bias: token id {outside[0]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return out


def validate_params(method: str, params, vocab_size: int,
                    max_seq: Optional[int] = None) -> Params:
    """Check a request's params against `method`'s schema; return the typed value.

    Raises UnknownMethod for a method not in METHODS and BadRequest (naming the field, the
    limit and the value) for anything else wrong. `vocab_size` bounds token ids; with
    `max_seq`, generate `ids` that leave no room in the context raise PromptTooLong here,
    before they are copied and queued (the engine checks again, for prompts and chats)."""
    if method not in METHODS:
        raise UnknownMethod(f"unknown method {_QUOTE.repr(method)}; methods: {', '.join(METHODS)}")
    p = _params_map(method, params)
    if method == "generate":
        has_prompt, has_ids = "prompt" in p, "ids" in p
        if has_prompt == has_ids:
            raise BadRequest("generate needs exactly one of prompt (str) or ids ([int])")
        if has_ids and max_seq is not None and isinstance(p["ids"], list) \
                and len(p["ids"]) >= max_seq:
            raise PromptTooLong(f"the prompt has {len(p['ids'])} tokens and the context holds "
                                f"max_seq={max_seq}: no room for a new token")
        return GenerateParams(
            prompt=_str("prompt", p["prompt"]) if has_prompt else None,
            ids=_ids("ids", p["ids"], vocab_size) if has_ids else None,
            options=_options(p, vocab_size), stream=_bool("stream", p.get("stream", True)))
    if method == "chat":
        if "messages" not in p:
            raise BadRequest("chat needs messages ([{role, content}])")
        tools = _tools(p.get("tools", []))
        return ChatParams(messages=_messages(p["messages"]),
                          enable_thinking=_bool("enable_thinking", p.get("enable_thinking", False)),
                          options=_options(p, vocab_size),
                          stream=_bool("stream", p.get("stream", True)),
                          split_reasoning=_bool("split_reasoning", p.get("split_reasoning", False)),
                          tools=tools,
                          tool_choice=_tool_choice(p.get("tool_choice", "auto"), tools),
                          parallel_tool_calls=_bool("parallel_tool_calls",
                                                    p.get("parallel_tool_calls", True)))
    if method == "embed":
        if "input" not in p:
            raise BadRequest("embed needs input (a string, [string], [int] or [[int]])")
        dims = p.get("dimensions")
        return EmbedParams(_embed_inputs(p["input"], vocab_size),
                           None if dims is None else _int("dimensions", dims, 1),
                           _bool("truncate", p.get("truncate", False)))
    if method == "rerank":
        docs = p.get("documents")
        if "query" not in p or not isinstance(docs, list) or not docs \
                or not all(isinstance(d, str) for d in docs):
            raise BadRequest("rerank needs query (str) and documents (a list of strings, not "
                             "empty)")
        if len(docs) > MAX_EMBED_INPUTS:
            raise BadRequest(f"documents holds {len(docs)}; at most {MAX_EMBED_INPUTS} per "
                             "request")
        top_n, instruction = p.get("top_n"), p.get("instruction")
        return RerankParams(_str("query", p["query"]), tuple(docs),
                            None if top_n is None else _int("top_n", top_n, 1),
                            None if instruction is None else _str("instruction", instruction))
    if method == "tokenize":
        if "text" not in p:
            raise BadRequest("tokenize needs text (str)")
        return TokenizeParams(_str("text", p["text"]),
                              _bool("add_special", p.get("add_special", False)))
    if method == "detokenize":
        if "ids" not in p:
            raise BadRequest("detokenize needs ids ([int])")
        return DetokenizeParams(_ids("ids", p["ids"], vocab_size))
    if method == "cancel":
        if "id" not in p:
            raise BadRequest("cancel needs id (the msgid of a request on this connection)")
        return CancelParams(_int("id", p["id"]))
    return NoParams()


# ---------------------------------------------------------------- messages

class Request(NamedTuple):
    msgid: int
    method: str
    params: object


class Response(NamedTuple):
    msgid: int
    error: Optional[dict]
    result: object


class Notification(NamedTuple):
    method: str
    params: object


Message = Union[Request, Response, Notification]


def _method_name(v) -> str:
    """Method names may arrive as MessagePack str or bin."""
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("method name is not UTF-8") from None
    if isinstance(v, str):
        return v
    raise BadRequest(f"method name must be a string, got {type(v).__name__}")


def decode_message(obj) -> Message:
    """Classify one decoded MessagePack object; BadRequest if it is no MessagePack-RPC
    message (the sender then gets an error where `msgid_of` finds a msgid, and is closed)."""
    if not isinstance(obj, (list, tuple)) or not obj or not _is_int(obj[0]):
        raise BadRequest("not a MessagePack-RPC message: expected an array starting with 0, 1 or 2")
    kind = obj[0]
    if kind == REQUEST and len(obj) == 4 and _is_int(obj[1]):
        return Request(obj[1], _method_name(obj[2]), obj[3])
    if kind == RESPONSE and len(obj) == 4 and _is_int(obj[1]):
        return Response(obj[1], obj[2], obj[3])
    if kind == NOTIFICATION and len(obj) == 3:
        return Notification(_method_name(obj[1]), obj[2])
    raise BadRequest(f"malformed MessagePack-RPC message of type {kind} with {len(obj)} elements")


def msgid_of(obj) -> Optional[int]:
    """The msgid of something that looks like a request, else None."""
    if isinstance(obj, (list, tuple)) and len(obj) >= 2 and obj[0] == REQUEST and _is_int(obj[1]):
        return obj[1]
    return None


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_request(msgid: int, method: str, params: Optional[dict] = None) -> bytes:
    return pack([REQUEST, msgid, method, [] if params is None else [params]])


def encode_response(msgid: int, error: Optional[dict], result) -> bytes:
    return pack([RESPONSE, msgid, error, result])


def encode_notification(method: str, msgid: int, payload: dict) -> bytes:
    return pack([NOTIFICATION, method, [msgid, payload]])


# ---------------------------------------------------------------- framing

@dataclass(frozen=True)
class FrameError:
    """The stream cannot go on: `error` for the peer (reply where `msgid` is known), then close."""
    error: KestrelError
    msgid: Optional[int]


_HEAD_BYTES = 32   # enough of a message's start to read [0, msgid, ...]


def _msgid_from_head(head: bytes) -> Optional[int]:
    u = msgpack.Unpacker(raw=False)
    u.feed(head)
    try:
        if u.read_array_header() < 2 or u.unpack() != REQUEST:
            return None
        mid = u.unpack()
    except Exception:       # any malformed or truncated start: no msgid to answer to
        return None
    return mid if _is_int(mid) else None


class FrameReader:
    """Splits a byte stream into MessagePack objects; no message may exceed `max_bytes`.

    `feed(chunk)` (chunks of at most `max_chunk` bytes) returns the objects completed,
    ending with a `FrameError` when the stream is malformed or a message too large; the
    reader is then dead. A too-large message is refused as soon as its first `max_bytes`
    have arrived, with its msgid read from its first bytes. Not thread-safe."""

    def __init__(self, max_bytes: int, max_chunk: int = 1 << 16):
        self.max_bytes = max_bytes
        self.max_chunk = max_chunk
        # The buffer holds at most one partial message plus one chunk.
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max_bytes + max_chunk)
        self._fed = 0           # bytes fed so far
        self._start = 0         # stream offset where the current message begins
        self._head = b""        # first bytes of the current message
        self.dead = False

    def feed(self, chunk: bytes) -> list:
        if self.dead:
            return []
        if len(chunk) > self.max_chunk:
            raise ValueError(f"chunk of {len(chunk)} bytes > max_chunk {self.max_chunk}")
        self._unpacker.feed(chunk)
        self._fed += len(chunk)
        out: list = []
        try:
            for obj in self._unpacker:
                end = self._unpacker.tell()
                if end - self._start > self.max_bytes:
                    return self._fail(out, self._too_large(end - self._start), msgid_of(obj))
                out.append(obj)
                self._start = end
        except Exception as e:  # msgpack raises several types for malformed data
            return self._fail(out, BadRequest(f"malformed MessagePack data: {e}"),
                              _msgid_from_head(self._head_after(chunk)))
        self._head = self._head_after(chunk)
        pending = self._fed - self._start
        if pending > self.max_bytes:
            return self._fail(out, self._too_large(pending, partial=True), _msgid_from_head(self._head))
        return out

    def _head_after(self, chunk: bytes) -> bytes:
        """The first bytes of the message that begins at `self._start`."""
        pending = self._fed - self._start
        if pending <= len(chunk):            # it began inside this chunk
            return bytes(chunk[len(chunk) - pending:][:_HEAD_BYTES])
        return self._head + bytes(chunk[:_HEAD_BYTES - len(self._head)])

    def _too_large(self, size: int, partial: bool = False) -> TooLarge:
        more = "more than " if partial else ""
        return TooLarge(f"message of {more}{size} bytes exceeds the limit of {self.max_bytes} bytes")

    def _fail(self, out: list, error: KestrelError, msgid: Optional[int]) -> list:
        self.dead = True
        out.append(FrameError(error, msgid))
        return out
