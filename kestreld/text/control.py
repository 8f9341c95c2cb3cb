"""Client text in a chat is text: it never becomes the model's control tokens.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`, ...) around each
message, and the rendered prompt is then tokenized. Were the whole prompt tokenized with
control tokens parsed, a message holding `<|im_end|>\\n<|im_start|>system\\n...` would open
a system turn of its own (prompt injection). So before rendering, every control-token text
in the client's strings (contents, tool calls, tool specs; keys and values) is hidden
behind a placeholder no client can write (a fresh random nonce per chat); after rendering,
the prompt is split at the control tokens left, which are the template's own, and the
pieces between them (placeholders restored) are tokenized as text.
"""
from __future__ import annotations

import re
import secrets


class ControlGuard:
    """One chat's hiding and tokenizing; `tokenizer` is a text.tokenizer.Tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._nonce = "kestrel" + secrets.token_hex(8)
        self._hidden: list = []          # placeholder number -> the client's control text
        controls = sorted(tokenizer.control_texts, key=len, reverse=True)   # longest first
        self._control = re.compile("|".join(map(re.escape, controls))) if controls else None
        self._split = re.compile(f"{self._nonce}:(\\d+):" + (
            f"|({self._control.pattern})" if controls else ""))

    def hide(self, value):
        """`value` (strings, maps, lists, tuples) with each control-token text in its
        strings replaced by a placeholder."""
        if isinstance(value, str):
            return value if self._control is None else self._control.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(v) for v in value)
        return value

    def _placeholder(self, match: re.Match) -> str:
        self._hidden.append(match.group(0))
        return f"{self._nonce}:{len(self._hidden) - 1}:"

    def restore(self, text: str) -> str:
        """`text` with the placeholders back to the client's text."""
        return re.sub(f"{self._nonce}:(\\d+):", lambda m: self._hidden[int(m.group(1))], text)

    def encode(self, text: str) -> list:
        """Token ids of a rendered prompt: its own control tokens as such, the rest
        (placeholders restored) as text."""
        ids, piece, hidden, at = [], [], False, 0
        for m in self._split.finditer(text):
            piece.append(text[at:m.start()])
            at = m.end()
            if m.group(1) is not None:
                piece.append(self._hidden[int(m.group(1))])
                hidden = True
            else:
                ids += self._encode("".join(piece), hidden)
                piece, hidden = [], False
                ids.append(self.tokenizer.token_id(m.group(0)))
        piece.append(text[at:])
        return ids + self._encode("".join(piece), hidden)

    def _encode(self, piece: str, hidden: bool) -> list:
        # a piece without a client's control text has none at all: the usual encoding
        return self.tokenizer.encode_text(piece) if hidden else self.tokenizer.encode(piece)
