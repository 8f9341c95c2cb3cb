"""A blocking Python client for kestreld (imports kestreld.protocol only, never the engine).

    from kestrelctl import Client
    with Client() as kc:                       # or Client("/path/to/kestreld.sock")
        print(kc.generate(prompt="Hello", max_tokens=16).text)
        for ev in kc.stream_chat([{"role": "user", "content": "Hi"}]):
            if isinstance(ev, Token):
                print(ev.text, end="", flush=True)
            else:                              # the Result, always last
                print(ev.usage)

One connection per Client. Several requests may be in flight on it (from several threads,
or a `stream_*` iterator together with `cancel`): whoever waits reads the socket and files
messages of other requests into their mailboxes. Errors raise `KestrelClientError(code,
message)`, with the protocol's codes plus `unavailable` (cannot connect, connection lost).
"""
from __future__ import annotations

import collections
import itertools
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import msgpack

from kestreld.errors import Unavailable
from kestreld.protocol import (DEFAULT_SOCKET, NOTIFICATION, PROGRESS, RESPONSE, TOKEN,
                               encode_request)

UNAVAILABLE = Unavailable.code  # client-side code: no daemon, or the connection broke


class KestrelClientError(Exception):
    """An error answer from the daemon, or `unavailable`."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Token:
    """A streamed piece of the completion (with split_reasoning, `reasoning` is the piece
    of the thinking block and `text` of the answer). With tools, `tool_calls` holds the
    calls this piece completed ([{"id", "type", "function": {"name", "arguments"}}]); the
    text of their blocks is not in `text`."""
    text: str
    ids: list
    logprobs: Optional[list] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list] = None


@dataclass
class Progress:
    """`queued` (done of total requests ahead) or `prefill` (done of total tokens)."""
    phase: str
    done: int
    total: int


@dataclass
class Result:
    """The final completion map of generate/chat (see docs/protocol.md)."""
    text: str
    ids: list
    finish_reason: str
    usage: dict
    timings: dict
    logprobs: Optional[list] = None
    reasoning: Optional[str] = None     # the thinking block, with split_reasoning
    tool_calls: Optional[list] = None   # the calls made (finish_reason "tool_calls")

    @classmethod
    def from_wire(cls, m: dict) -> "Result":
        return cls(m["text"], m["ids"], m["finish_reason"], m["usage"], m["timings"],
                   m.get("logprobs"), m.get("reasoning"), m.get("tool_calls"))


Event = Union[Token, Progress, Result]


@dataclass
class _Mailbox:
    messages: collections.deque = field(default_factory=collections.deque)


class Client:
    """A connection to kestreld. `socket_path` None: the default path."""

    def __init__(self, socket_path: Optional[str] = None, timeout: Optional[float] = None):
        self.socket_path = socket_path or DEFAULT_SOCKET
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.socket_path)
        except PermissionError as e:
            self._sock.close()
            raise KestrelClientError("permission_denied", f"{self.socket_path}: {e.strerror}") from None
        except OSError as e:
            self._sock.close()
            raise KestrelClientError(UNAVAILABLE, f"cannot connect to kestreld at "
                                                  f"{self.socket_path}: {e.strerror or e}") from None
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._reading = False
        self._boxes: dict = {}
        self._broken: Optional[str] = None

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send_request(self, method: str, params: Optional[dict] = None) -> int:
        """Send a request; returns its msgid (read its messages with `next_message`)."""
        msgid = next(self._ids)
        with self._cond:
            self._boxes[msgid] = _Mailbox()
        try:
            with self._send_lock:
                self._sock.sendall(encode_request(msgid, method, params))
        except OSError as e:
            self._forget(msgid)
            raise KestrelClientError(UNAVAILABLE, f"sending to kestreld failed: {e}") from None
        return msgid

    def next_message(self, msgid: int) -> list:
        """The next notification or the response of request `msgid`, as a raw list."""
        while True:
            with self._cond:
                while True:
                    box = self._boxes[msgid]
                    if box.messages:
                        return box.messages.popleft()
                    if self._broken:
                        raise KestrelClientError(UNAVAILABLE, self._broken)
                    if not self._reading:
                        self._reading = True      # our turn to read the socket
                        break
                    self._cond.wait()
            received: list = []
            try:
                received = self._read_messages()
            finally:
                with self._cond:
                    self._reading = False
                    for m in received:
                        target = m[1] if m[0] == RESPONSE else m[2][0]
                        if target in self._boxes:     # others: requests given up (_forget)
                            self._boxes[target].messages.append(m)
                    self._cond.notify_all()

    def _read_messages(self) -> list:
        """Block for bytes; return the whole messages they complete."""
        try:
            data = self._sock.recv(1 << 16)
        except socket.timeout:
            raise KestrelClientError(UNAVAILABLE, "timed out waiting for kestreld") from None
        except OSError as e:
            data, self._broken = b"", f"connection to kestreld lost: {e}"
        if not data:
            self._broken = self._broken or "kestreld closed the connection"
            return []
        self._unpacker.feed(data)
        return [m for m in self._unpacker
                if isinstance(m, list) and len(m) >= 3 and m[0] in (RESPONSE, NOTIFICATION)]

    def _forget(self, msgid: int) -> None:
        with self._cond:
            self._boxes.pop(msgid, None)

    def _events(self, msgid: int) -> Iterator[Union[Token, Progress, dict]]:
        """Notifications of `msgid` as Token/Progress, then its result map; raises its error."""
        try:
            while True:
                m = self.next_message(msgid)
                if m[0] == RESPONSE:
                    _, _, error, result = m
                    if error is not None:
                        raise KestrelClientError(error.get("code", "internal"),
                                                 error.get("message", ""))
                    yield result
                    return
                method, (_, payload) = m[1], m[2]
                if method == TOKEN:
                    yield Token(payload["text"], payload["ids"], payload.get("logprobs"),
                                payload.get("reasoning"), payload.get("tool_calls"))
                elif method == PROGRESS:
                    yield Progress(payload["phase"], payload["done"], payload["total"])
        finally:
            self._forget(msgid)

    def call(self, method: str, params: Optional[dict] = None) -> dict:
        """Send one request and return its result (notifications are skipped)."""
        msgid = self.send_request(method, params)
        for ev in self._events(msgid):
            if not isinstance(ev, (Token, Progress)):
                return ev
        raise AssertionError("unreachable: _events ends with the result or an error")

    # ------------------------------------------------------------ methods

    def generate(self, prompt: Optional[str] = None, ids: Optional[list] = None, **opts) -> Result:
        """A completion of `prompt` (text) or `ids`; options as in the protocol."""
        return Result.from_wire(self.call("generate", _generate_params(prompt, ids, opts, False)))

    def chat(self, messages: list, **opts) -> Result:
        """The assistant's reply to `messages` ([{"role", "content"}]), rendered with the
        model's chat template; `enable_thinking=True` for Qwen3 thinking."""
        return Result.from_wire(self.call("chat", {"messages": messages, **opts, "stream": False}))

    def stream_generate(self, prompt: Optional[str] = None, ids: Optional[list] = None,
                        progress: bool = False, **opts) -> "Stream":
        """Like generate, as an iterator of Token (and Progress if asked) then the Result."""
        return Stream(self, "generate", _generate_params(prompt, ids, opts, True), progress)

    def stream_chat(self, messages: list, progress: bool = False, **opts) -> "Stream":
        """Like chat, as an iterator of Token (and Progress if asked) then the Result."""
        return Stream(self, "chat", {"messages": messages, **opts, "stream": True}, progress)

    def embed(self, inputs, dimensions: Optional[int] = None, truncate: bool = False) -> dict:
        """The `embed` result map of `inputs` (a text, [text], [id] or [[id]]): embeddings,
        usage, timings."""
        params = {"input": inputs, "truncate": truncate}
        if dimensions is not None:
            params["dimensions"] = dimensions
        return self.call("embed", params)

    def rerank(self, query: str, documents: list, top_n: Optional[int] = None,
               instruction: Optional[str] = None) -> dict:
        """The `rerank` result map: `results` [{"index", "relevance_score"}], best first."""
        params = {"query": query, "documents": list(documents)}
        for name, value in (("top_n", top_n), ("instruction", instruction)):
            if value is not None:
                params[name] = value
        return self.call("rerank", params)

    def tokenize(self, text: str, add_special: bool = False) -> list:
        return self.call("tokenize", {"text": text, "add_special": add_special})["ids"]

    def detokenize(self, ids: list) -> str:
        return self.call("detokenize", {"ids": list(ids)})["text"]

    def status(self) -> dict:
        return self.call("status")

    def ping(self) -> dict:
        return self.call("ping")

    def cancel(self, msgid: int) -> bool:
        """Cancel request `msgid` of this connection; True if it was queued or running."""
        return self.call("cancel", {"id": msgid})["cancelled"]


def _generate_params(prompt, ids, opts: dict, stream: bool) -> dict:
    if (prompt is None) == (ids is None):
        raise ValueError("generate needs exactly one of prompt= or ids=")
    p = {"prompt": prompt} if prompt is not None else {"ids": list(ids)}
    return {**p, **opts, "stream": stream}


class Stream:
    """A streamed generate/chat: iterate for Token (and Progress) events, then the Result.

    `cancel()` asks the daemon to stop it; iteration then ends with a Result whose
    finish_reason is "cancelled" (or raises `cancelled` if it had not started). Leaving the
    iteration early cancels the request."""

    def __init__(self, client: Client, method: str, params: dict, progress: bool):
        self.client = client
        self.msgid = client.send_request(method, params)
        self._progress = progress
        self._finished = False

    def __iter__(self) -> Iterator[Event]:
        try:
            for ev in self.client._events(self.msgid):
                if isinstance(ev, dict):
                    self._finished = True
                    yield Result.from_wire(ev)
                elif isinstance(ev, Token) or self._progress:
                    yield ev
        except KestrelClientError:
            self._finished = True           # the request is over (error answer or no daemon)
            raise
        finally:
            if not self._finished:          # left early: stop the daemon's work
                try:
                    self.cancel()
                except KestrelClientError:
                    pass
                self._finished = True

    def cancel(self) -> None:
        """Ask the daemon to stop this request; its answer is not awaited."""
        if not self._finished:
            self.client._forget(self.client.send_request("cancel", {"id": self.msgid}))
