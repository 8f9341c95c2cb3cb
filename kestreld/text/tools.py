"""Tool calls in Qwen3's format (Hermes' format, which other templates share too).

The tools of a chat request are rendered by the model's own chat template (`tools=`, as
transformers' apply_chat_template passes them); the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. `ToolCallParser` takes the answer's text as it is generated and
returns the text outside the blocks and each call as soon as its block is closed; a block
whose JSON is not a call (malformed, no name, arguments not an object) stays in the text,
as it was written. `template_messages` turns OpenAI-style messages into what templates
read (a tool call's `arguments` JSON string as an object, as transformers' and llama.cpp's
servers do).
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Optional

from .reasoning import partial_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One call the answer made: `arguments` is its JSON text (an object), as OpenAI's."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat answer may call and how: `tools` are OpenAI function specs
    ({"type": "function", "function": {"name", "description", "parameters"}}); `required`:
    the answer must be calls (tool_choice "required", or a named function); `only`: the
    named function it must call (exactly once); `parallel` False: at most one call
    (OpenAI's parallel_tool_calls)."""
    tools: tuple
    required: bool = False
    only: Optional[str] = None
    parallel: bool = True

    @property
    def single(self) -> bool:
        """The answer makes at most one call."""
        return self.only is not None or not self.parallel

    def call_schemas(self) -> list:
        """The JSON schema of a call, for each function the answer may call."""
        out = []
        for tool in self.tools:
            f = tool["function"]
            if self.only is not None and f["name"] != self.only:
                continue
            params = f.get("parameters") or {"type": "object", "properties": {}}
            out.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                         "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
        return out


def new_call_id() -> str:
    """A fresh call id in OpenAI's form: "call_" and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def parse_call(body: str) -> Optional[ToolCall]:
    """The call in a block's JSON text, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):         # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Streaming split of an answer into text and tool calls: `feed` each piece, then
    `flush`; both return (text, [ToolCall]) for what they complete. Whitespace between and
    after blocks is dropped (it separates calls); text before a block is kept."""

    def __init__(self):
        self._held = ""          # text that may still become a tag, or a block's body
        self._in_block = False
        self._after_block = False  # only whitespace since the last block closed

    def feed(self, piece: str) -> tuple[str, list]:
        text, self._held = self._held + piece, ""
        out, calls = [], []
        while text:
            if self._in_block:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    break
                body, text = text[:end], text[end + len(CLOSE):]
                call = parse_call(body)
                if call is None:
                    out.append(OPEN + body + CLOSE)
                    self._after_block = False
                else:
                    calls.append(call)
                    self._after_block = True
                self._in_block = False
                continue
            start = text.find(OPEN)
            if start >= 0:
                before, text = text[:start], text[start + len(OPEN):]
                if not (self._after_block and not before.strip()):
                    out.append(before)
                self._in_block = True
                continue
            keep = partial_tail(text, OPEN)
            before, self._held = text[:len(text) - keep], text[len(text) - keep:]
            if self._after_block and not before.strip():
                self._held = before + self._held       # blanks after a call: wait and see
            else:
                out.append(before)
                self._after_block = False
            break
        return "".join(out), calls

    def flush(self) -> tuple[str, list]:
        """The end of the answer: an unclosed block or a partial tag is text."""
        held, self._held = self._held, ""
        if self._in_block:
            return OPEN + held, []
        if self._after_block and not held.strip():
            return "", []
        return held, []


def template_messages(messages) -> list:
    """Messages as chat templates read them: an assistant's tool calls with their
    `arguments` as objects (a string that is not a JSON object stays as it is)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_template_call(c) for c in calls])
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    f = call["function"]
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    return dict(call, function=dict(f, arguments=args))
