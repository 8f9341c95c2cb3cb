"""Constrained sampling: the tokens a grammar allows next, as a mask on the logits.

A request that asks for JSON (`response_format`) or forces a tool call (`tool_choice`
"required" or a named function) gets a grammar for its answer (`answer_grammar`, Lark text
with inline JSON schemas); a `Constraint` follows it token by token: `mask` puts -inf on
every token the grammar does not allow next (end-of-sequence included, until the grammar
accepts the end), `commit` feeds it the chosen token, `finished` says only the end may
follow.

The grammar engine is llguidance (an Earley parser over lexemes that walks the token trie,
in Rust): it compiles a grammar as the request arrives, its mask per decode step is small
beside the forward pass, and it needs no other package. Not kept: outlines-core builds its
index per schema over the whole vocabulary before the first token, and takes plain
`json_object` (not a regular language) only as a depth-bounded regex; xgrammar needs torch
and transformers at run time. The mask is computed in line, on the engine thread: handing
it to a helper thread during the forward pass would save only the mask's own time, at the
price of a core taken from the forward pass's team of threads and a hand-off per token.
The engines' costs: docs/speed.md, "Constrained sampling: what the grammar costs".

`GrammarVocabulary` is built once per model, at its first constrained request, from
Kestrel's own tokenizer: token id -> bytes, control tokens marked as not text, the
end-of-generation ids. Thread-safety: a GrammarVocabulary is immutable; a Constraint belongs
to one request on the engine thread.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from ..errors import BadRequest
from ..text.tools import CLOSE as CALL_CLOSE
from ..text.tools import OPEN as CALL_OPEN
from ..text.tools import ToolUse
from ..text.reasoning import CLOSE as THINK_CLOSE
from ..text.reasoning import OPEN as THINK_OPEN
from .sampler import ResponseFormat

# JSON whitespace between tokens: a space, or one or two newlines and an indent of at most
# 20 (llama.cpp's grammars' rule), so that a sampled answer cannot fill max_tokens with
# blanks; \uXXXX escapes of any character, as JSON allows (llguidance's default: control
# characters only).
JSON_OPTIONS = {"whitespace_pattern": r" |\n{1,2}[ \t]{0,20}",
                "json_allow_general_unicode_escapes": True}
# what `{"type": "json_object"}` means: any JSON object
JSON_OBJECT_SCHEMA = {"type": "object"}


class _TokenizerBridge:
    """The `llguidance.TokenizerWrapper` protocol over Kestrel's tokenizer: token bytes,
    control token ids (llguidance marks them as not text), BOS/EOS, and encode."""
    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, n_vocab: int):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        # ids past the tokenizer (embedding rows of padding) are empty: never allowed
        self.tokens = ([tokenizer.token_bytes([i]) for i in range(tokenizer.vocab_size)]
                       + [b""] * (n_vocab - tokenizer.vocab_size))
        self.special_token_ids = sorted(tokenizer.control_ids)
        self._encode = tokenizer.encode

    def __call__(self, text) -> list:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class GrammarVocabulary:
    """A model's vocabulary for llguidance: `n_vocab` ids (the logits' width); the
    tokenizer's end-of-generation ids end an answer where the grammar accepts the end."""

    def __init__(self, tokenizer, n_vocab: int):
        self.n_vocab = n_vocab
        self.eos_ids = sorted(tokenizer.eos_ids)
        self.lltok = LLTokenizer(_TokenizerBridge(tokenizer, n_vocab), eos_token=self.eos_ids)


class Constraint:
    """One answer's grammar matcher (not thread-safe: the engine thread's)."""

    def __init__(self, vocab: GrammarVocabulary, grammar: str):
        """Compile `grammar` and compute its first mask, so that a schema the engine cannot
        follow (a $ref cycle with no way out, a limit of the engine) is refused before the
        prompt's prefill: BadRequest."""
        self.n_vocab = vocab.n_vocab
        self.matcher = LLMatcher(vocab.lltok, grammar, log_level=0)   # compiles, GIL released
        if self.matcher.is_error():    # a client's schema the engine cannot use
            raise BadRequest(f"response_format / tools: the JSON schema cannot be used: "
                             f"{_engine_error(self.matcher.get_error())}")
        self._bits = np.empty((vocab.n_vocab + 31) // 32, dtype=np.int32)
        if self._allowed() is None:        # computed again at the first `mask`
            raise BadRequest("response_format / tools: the JSON schema allows no answer "
                             "(a $ref, allOf or anyOf cycle with no way out?)"
                             + _engine_reason(self.matcher))

    def _allowed(self) -> Optional[np.ndarray]:
        """The tokens allowed next (bools), None if none is."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab,
                                bitorder="little").view(bool)
        return None if self.matcher.is_error() or not allowed.any() else allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` (vocab,) with -inf on every token the grammar forbids now.
        A schema whose grammar outgrows the engine's limits mid-answer: BadRequest."""
        allowed = self._allowed()
        if allowed is None:
            raise BadRequest("response_format / tools: the JSON schema is beyond the grammar "
                             "engine's limits here" + _engine_reason(self.matcher))
        return np.where(allowed, logits, -np.inf)

    def commit(self, token: int) -> None:
        """Advance the grammar by the chosen token (one that `mask` allowed)."""
        if not self.matcher.consume_token(token):
            raise BadRequest("response_format / tools: the JSON schema is beyond the grammar "
                             "engine's limits here" + _engine_reason(self.matcher))

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()


def _engine_error(text: str) -> str:
    """The first line of llguidance's message, cut short: never its state dump or the
    grammar (tens of kilobytes for a large schema)."""
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line[:200] + ("..." if len(line) > 200 else "")


def _engine_reason(matcher) -> str:
    return f": {_engine_error(matcher.get_error())}" if matcher.is_error() else ""


# ---------------------------------------------------------------- grammars

# the keywords whose value is a subschema, a list of them, or a map of names to them
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties",
              "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties` and says nothing of other keys (a copy). JSON Schema lets such an object
    hold any other key; for generation that is an invitation to invent keys without end,
    so Kestrel reads it as llama.cpp's grammars and OpenAI's strict mode do: only the
    listed keys. An object without `properties` (`{"type": "object"}`) stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if ("properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def _json(schema: dict) -> str:
    """A Lark `%json` body: `schema`, its objects closed (`closed_objects`), with Kestrel's
    JSON options."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": JSON_OPTIONS},
                                 ensure_ascii=False)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join(f"\\{c}" if c in r"\/.^$*+?()[]{}|" else ("\\n" if c == "\n" else c)
                   for c in text)


def answer_grammar(response_format: Optional[ResponseFormat], tools: Optional[ToolUse],
                   thinking: Optional[bool]) -> Optional[str]:
    """The Lark grammar an answer must follow, or None if it is free.

    - a forced call (`tools.required`): tool-call blocks, each a valid call of an offered
      function (exactly one block, of that function, when `tools.only` names one);
    - `response_format`: a JSON value of its schema, or tool calls if tools are offered
      (tool_choice "auto");
    - `thinking`: None, the answer does not think; False, it may open with a thinking
      block; True, it starts inside one (the prompt opened it). The block's text is free."""
    rules = []
    if tools is not None and tools.required:
        body = "calls"
    elif response_format is not None:
        schema = (JSON_OBJECT_SCHEMA if response_format.kind == "json_object"
                  else response_format.schema)
        rules.append(f"reply: {_json(schema)}")
        body = "reply | calls" if tools is not None else "reply"
    else:
        return None
    if tools is not None:
        rules += _call_rules(tools)
    start = f"({body})"
    close = _regex(THINK_CLOSE)
    if thinking is False:
        start = '(think "\\n"*)? ' + start
        rules.append(f"think[lazy]: /{_regex(THINK_OPEN)}(.|\\n)*{close}/")
    elif thinking:
        start = 'think_tail "\\n"* ' + start
        rules.append(f"think_tail[lazy]: /(.|\\n)*{close}/")
    return "\n".join([f"start: {start}"] + rules) + "\n"


def _call_rules(tools: ToolUse) -> list:
    """Qwen3's tool-call blocks: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one after another on their own lines; exactly one when the answer makes one call (a
    named function, or parallel_tool_calls false)."""
    schemas = tools.call_schemas()
    call_json = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    calls = "call" if tools.single else 'call ("\\n" call)*'
    return [f"calls: {calls}",
            f"call: {_lark_string(CALL_OPEN + chr(10))} call_json {_lark_string(chr(10) + CALL_CLOSE)}",
            f"call_json: {_json(call_json)}"]
