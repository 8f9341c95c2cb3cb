"""A chat conversation as kestrelctl keeps it, saves it and loads it.

The messages are the protocol's chat messages (docs/protocol.md): {"role", "content"} with
a string content, or for a message with images a list of parts, images first:
[{"type": "image", "path": "/abs/picture.png"}, {"type": "text", "text": "..."}]. That is
also the file format of /save and /load (a JSON array), so a saved conversation is a valid
`messages` parameter. The client reads the images itself (with the user's permissions) and
sends their bytes: `wire()` turns each path part into a data part.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from kestreld.errors import BadRequest
from kestreld.protocol import validate_params


def read_image(path: str) -> tuple[str, bytes]:
    """(absolute path, bytes) of an image file; BadRequest if it cannot be read."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            return path, f.read()
    except OSError as e:
        raise BadRequest(f"cannot read image {path}: {e.strerror}") from None


class Conversation:
    """The messages of one chat, oldest first; a system prompt, if any, is the first."""

    def __init__(self, system: Optional[str] = None):
        self.messages: list = []
        self._images: dict = {}         # absolute path -> the bytes read when it was added
        self.set_system(system)

    @property
    def system(self) -> Optional[str]:
        if self.messages and self.messages[0]["role"] == "system":
            return self.messages[0]["content"]
        return None

    def set_system(self, text: Optional[str]) -> None:
        """Set (or with None / "" remove) the system prompt; the rest stays."""
        if self.system is not None:
            del self.messages[0]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        """A new conversation with the same system prompt."""
        system = self.system
        self.messages, self._images = [], {}
        self.set_system(system)

    def add_user(self, text: str, images: Optional[list] = None) -> None:
        """A user message; `images`: (path, bytes) pairs from `read_image`."""
        if not images:
            self.messages.append({"role": "user", "content": text})
            return
        self._images.update(images)
        parts = [{"type": "image", "path": path} for path, _ in images]
        self.messages.append({"role": "user", "content": parts + [{"type": "text", "text": text}]})

    def add_assistant(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def drop_last_user(self) -> list:
        """Remove the last message (a user message whose answer did not come); returns its
        images as (path, bytes) pairs."""
        message = self.messages.pop()
        if isinstance(message["content"], str):
            return []
        return [(p["path"], self._images[p["path"]]) for p in message["content"]
                if p["type"] == "image"]

    def wire(self) -> list:
        """The messages as sent: image paths replaced by the images' bytes."""
        return [m if isinstance(m["content"], str) else
                {"role": m["role"], "content": [
                    {"type": "image", "data": self._images[p["path"]]} if p["type"] == "image"
                    else p for p in m["content"]]}
                for m in self.messages]

    def save(self, path: str) -> None:
        """Write the messages as a JSON array (BadRequest if the file cannot be written)."""
        try:
            with open(os.path.expanduser(path), "w", encoding="utf-8") as f:
                json.dump(self.messages, f, ensure_ascii=False, indent=1)
                f.write("\n")
        except OSError as e:
            raise BadRequest(f"cannot write {path}: {e.strerror}") from None

    @classmethod
    def load(cls, path: str) -> "Conversation":
        """A conversation read from a JSON array of chat messages, checked by the protocol's
        own rules, with its images read; BadRequest naming the fault otherwise."""
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                messages = json.load(f)
        except OSError as e:
            raise BadRequest(f"cannot read {path}: {e.strerror}") from None
        except ValueError as e:
            raise BadRequest(f"{path} is not JSON: {e}") from None
        if messages != []:
            try:
                messages = [dict(m) for m in validate_params(
                    "chat", [{"messages": messages}], vocab_size=0).messages]
            except BadRequest as e:
                raise BadRequest(f"{path} does not hold chat messages: {e}") from None
        conversation = cls()
        for m in messages:
            if not isinstance(m["content"], str):
                m["content"] = [dict(p) for p in m["content"]]
                for p in m["content"]:
                    if p["type"] == "image":
                        p["path"], data = read_image(p["path"])
                        conversation._images[p["path"]] = data
        conversation.messages = messages
        return conversation
