"""Qwen3's thinking block: a streamed chat answer split into reasoning and content.

Qwen3 (and the thinking models of its family) answer `<think>\\n...\\n</think>\\n\\n<answer>`;
with enable_thinking off its template closes an empty block in the prompt itself, and some
templates open the block in the prompt (it ends with `<think>\\n`), so the answer starts
inside it. As llama.cpp's and vLLM's servers do, the block counts only at the start of the
answer (after whitespace); the newlines after `</think>` are dropped; an answer that ends
inside the block (max_tokens) is all reasoning.

`ReasoningSplitter` takes the answer's text pieces as they are generated and returns what
each completes of both parts, holding back a tail that may still become a tag.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """True if a rendered prompt leaves the answer inside an open thinking block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Streaming split of one answer; `feed` then `flush`, each returning (content, reasoning)."""

    def __init__(self, in_thinking: bool = False):
        # "start": the answer may still open a block; "think": inside it; "after": just
        # closed (newlines to drop); "content": the rest is the answer
        self._state = "think" if in_thinking else "start"
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        content, reasoning = [], []
        while text:
            if self._state == "start":
                body = text.lstrip()
                if body.startswith(OPEN):
                    self._state, text = "think", body[len(OPEN):]
                elif OPEN.startswith(body):       # whitespace, or a tag still forming
                    self._held = text
                    text = ""
                else:
                    self._state = "content"
            elif self._state == "think":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end])
                    self._state, text = "after", text[end + len(CLOSE):]
                else:
                    keep = partial_tail(text, CLOSE)
                    reasoning.append(text[:len(text) - keep])
                    self._held, text = text[len(text) - keep:], ""
            elif self._state == "after":
                text = text.lstrip("\n")
                if text:
                    self._state = "content"
            else:
                content.append(text)
                text = ""
        return "".join(content), "".join(reasoning)

    def flush(self) -> tuple[str, str]:
        """What is held back at the end of the answer."""
        held, self._held = self._held, ""
        if self._state == "think":
            return "", held
        return ("", "") if self._state == "after" else (held, "")


def split_reasoning(text: str, in_thinking: bool = False) -> tuple[str, str]:
    """(content, reasoning) of a whole answer."""
    s = ReasoningSplitter(in_thinking)
    c1, r1 = s.feed(text)
    c2, r2 = s.flush()
    return c1 + c2, r1 + r2
