"""The RPC transport: a Unix stream socket, MessagePack-RPC framing, flow control.

Each connection is an asyncio Protocol on the event-loop thread. Bytes go through a
`FrameReader` (message size bound), objects through `decode_message`; requests go to the
methods (methods.py: validation, then a scheduler Job, a side-executor answer, or an answer
at once). Job events come back on the loop thread and are written as `token`/`progress`
notifications and one final response.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import grp
import logging
import os
import socket
import stat
import struct
import time
from typing import Callable, Optional

from ..errors import BadRequest, KestrelError, StartupError, internal
from ..protocol import (PROGRESS, TOKEN, FrameError, FrameReader, Request, decode_message,
                        encode_notification, encode_response, msgid_of)
from .config import Config
from .connlimit import Bounded
from .methods import ASIDE, JOB, Methods, job_result, token_payload
from .scheduler import Done, Failed, Progress, Token

log = logging.getLogger("kestreld.service.server")

_PEERCRED = struct.Struct("3i")     # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
MAX_ASIDE_IN_FLIGHT = 4             # tokenize/detokenize answers pending per connection


# ---------------------------------------------------------------- the listening socket

def check_socket_path(path: str) -> None:
    """Make `path` free for our socket: remove a socket file nobody listens on (stale);
    raise StartupError for anything else there (a live daemon, a file, a symlink)."""
    try:
        st = os.lstat(path)            # lstat: never follow a symlink
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)                # stale: its daemon is gone
        log.info("removed stale socket %s", path)
        return
    except OSError as e:
        raise StartupError(f"cannot check existing socket {path}: {e}") from None
    finally:
        probe.close()
    raise StartupError(f"another daemon is listening on {path}")


def bind_unix_socket(path: str, mode: int, group: Optional[str]) -> tuple:
    """A listening socket at `path` with `mode` (and `group`) from its creation on.

    Returns (socket, (st_dev, st_ino)) so that we later remove only our own file."""
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)    # bind creates the file with 0777 & ~umask
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot bind {path}: {e}") from None
    finally:
        os.umask(old_umask)
    st = os.lstat(path)
    os.chmod(path, mode)                   # exact bits; the umask could only narrow them
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid, follow_symlinks=False)
        except (KeyError, OSError) as e:
            sock.close()
            os.unlink(path)
            raise StartupError(f"cannot give {path} to group {group!r}: {e}") from None
    sock.listen(64)
    return sock, (st.st_dev, st.st_ino)


def remove_own_socket(path: str, identity: tuple) -> None:
    """Unlink `path` only if it is still the socket file we created."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == identity:
        os.unlink(path)


# ---------------------------------------------------------------- one connection

class Connection(asyncio.Protocol):
    """One client. Several requests may be in flight; `jobs` maps msgid -> Job."""

    def __init__(self, server: "Server", conn_id: int):
        self.server = server
        self.id = conn_id
        self.transport: Optional[asyncio.Transport] = None
        self.reader = FrameReader(server.config.max_message_bytes)
        self.jobs: dict = {}
        self.peer = (0, -1, -1)         # (pid, uid, gid) from SO_PEERCRED
        self.closed = False
        self.slow = False               # outgoing buffer over the limit: notifications dropped
        # Flow control: decoded objects not handled yet, held while the peer does not read
        # its replies or has too many tokenize/detokenize answers pending (see _drain).
        self.pending: collections.deque = collections.deque()
        self.write_paused = False       # transport over its high-water mark (max_outgoing_bytes)
        self.aside = 0                  # tokenize/detokenize answers being computed
        self.reading = True
        self.last_active = time.monotonic()   # data received, or the peer reading again
        self._idle: Optional[asyncio.TimerHandle] = None

    # asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        limit = self.server.config.max_outgoing_bytes
        transport.set_write_buffer_limits(high=limit, low=limit // 2)   # -> pause/resume_writing
        sock = transport.get_extra_info("socket")
        try:
            self.peer = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         _PEERCRED.size))
        except OSError:
            pass
        self.server.connections[self.id] = self
        log.debug("connection %d from pid=%d uid=%d gid=%d", self.id, *self.peer)
        self._idle = asyncio.get_running_loop().call_later(self.server.config.idle_timeout,
                                                            self._check_idle)

    def _check_idle(self) -> None:
        """Close the connection once it has been idle for idle_timeout: no request running
        and nothing received, nor its replies read. An idle client holds a descriptor; a
        thousand of them exhausted RLIMIT_NOFILE."""
        now = time.monotonic()
        if self.jobs or self.aside:
            self.last_active = now
        deadline = self.last_active + self.server.config.idle_timeout
        if now < deadline:
            self._idle = asyncio.get_running_loop().call_later(deadline - now, self._check_idle)
            return
        log.info("connection %d idle for %d s: closing it", self.id,
                 self.server.config.idle_timeout)
        self.closed = True
        self.transport.abort()           # its unread replies, if any, are dropped

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        self.pending.clear()
        self.server.connections.pop(self.id, None)
        if self.jobs:
            log.info("connection %d closed with %d request(s) in flight: dropping them",
                     self.id, len(self.jobs))
            self.server.scheduler.drop_connection(self.id)
            self.jobs.clear()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        view = memoryview(data)
        step = self.reader.max_chunk
        for i in range(0, len(view), step):
            self.pending.extend(self.reader.feed(view[i:i + step]))
            self._drain()
            if self.closed or self.reader.dead:
                return

    def pause_writing(self) -> None:
        self.write_paused = True
        self._drain()

    def resume_writing(self) -> None:
        self.last_active = time.monotonic()
        self.write_paused = False
        self._drain()

    def _drain(self) -> None:
        """Handle the decoded objects while the peer reads its replies and has at most
        MAX_ASIDE_IN_FLIGHT tokenize/detokenize answers pending; otherwise hold them and
        stop reading the socket. Without this a client that pipelines requests and never
        reads (or floods tokenize) made the daemon buffer replies or texts without bound."""
        while self.pending and not self.closed and not self._held():
            obj = self.pending.popleft()
            if isinstance(obj, FrameError):
                self._fail(obj.msgid, obj.error)
                return
            self._on_object(obj)
        if self.closed:
            return
        if self._held() == self.reading:
            self.reading = not self.reading
            (self.transport.resume_reading if self.reading else self.transport.pause_reading)()

    def _held(self) -> bool:
        return self.write_paused or self.aside >= MAX_ASIDE_IN_FLIGHT

    # requests ---------------------------------------------------------------

    def _on_object(self, obj) -> None:
        try:
            msg = decode_message(obj)
        except BadRequest as e:
            self._fail(msgid_of(obj), e)
            return
        if not isinstance(msg, Request):
            log.debug("connection %d: ignoring %s", self.id, type(msg).__name__)
            return
        try:
            self._on_request(msg)
        except Exception as e:          # a bug here must not kill the connection or daemon
            if not isinstance(e, KestrelError):
                log.exception("connection %d msgid %d: internal error", self.id, msg.msgid)
            self.reply(msg.msgid, error=internal(e))

    def _on_request(self, req: Request) -> None:
        methods = self.server.methods
        params = methods.validate(req.method, req.params)
        kind = methods.kind(req.method)
        if kind == JOB:
            if req.msgid in self.jobs:
                raise BadRequest(f"msgid {req.msgid} is already in flight on this connection")
            self.jobs[req.msgid] = methods.submit(
                self.id, req.msgid, params, functools.partial(self._on_job_event, req.msgid))
        elif kind == ASIDE:
            self._answer_aside(req.msgid, functools.partial(methods.aside, params))
        else:
            self.reply(req.msgid, methods.now(self.id, req.method, params))

    def _answer_aside(self, msgid: int, compute: Callable[[], dict]) -> None:
        """Answer from the side executor (tokenizing megabytes must not stall the loop)."""
        future = asyncio.get_running_loop().run_in_executor(self.server.executor, compute)
        self.aside += 1

        def done(f: asyncio.Future) -> None:
            self.aside -= 1
            exc = f.exception()
            if exc is None:
                self.reply(msgid, f.result())
            else:
                if not isinstance(exc, KestrelError):
                    log.error("connection %d msgid %d: %r", self.id, msgid, exc)
                self.reply(msgid, error=internal(exc))
            self._drain()                # requests held while too many answers were pending
        future.add_done_callback(done)

    # job events (loop thread) -----------------------------------------------

    def _on_job_event(self, msgid: int, ev) -> None:
        if isinstance(ev, Token):
            if not self.slow:
                self.send(encode_notification(TOKEN, msgid, token_payload(ev.event)))
        elif isinstance(ev, Progress):
            if not self.slow:
                self.send(encode_notification(PROGRESS, msgid, {"phase": ev.phase, "done": ev.done,
                                                                "total": ev.total}))
        elif isinstance(ev, Done):
            self.jobs.pop(msgid, None)
            self.reply(msgid, job_result(ev))
        elif isinstance(ev, Failed):
            self.jobs.pop(msgid, None)
            self.reply(msgid, error=ev.error)

    # output -----------------------------------------------------------------

    def reply(self, msgid: int, result=None, error: Optional[KestrelError] = None) -> None:
        self.send(encode_response(msgid, None if error is None else error.to_wire(),
                                  None if error is not None else result))

    def send(self, data: bytes) -> None:
        """Write, keeping the unsent bytes bounded: over the limit, this connection's
        requests are cancelled and its notifications dropped until the buffer drains."""
        if self.closed:
            return
        self.transport.write(data)
        pending = self.transport.get_write_buffer_size()
        limit = self.server.config.max_outgoing_bytes
        if pending > limit and not self.slow:
            self.slow = True
            log.warning("connection %d does not read its replies (%d bytes unsent > %d): "
                        "cancelling its %d request(s)", self.id, pending, limit, len(self.jobs))
            for job_msgid in list(self.jobs):
                self.server.scheduler.cancel(self.id, job_msgid)
        elif self.slow and pending <= limit // 2:
            self.slow = False

    def _fail(self, msgid: Optional[int], error: KestrelError) -> None:
        """A broken stream: answer where a msgid is known, then close this connection."""
        log.info("connection %d: %s (%s); closing it", self.id, error, error.code)
        if msgid is not None:
            self.reply(msgid, error=error)
        self.closed = True
        self.transport.close()           # flushes what is written, then closes


# ---------------------------------------------------------------- the server

class Server:
    """The listening socket and its connections."""

    def __init__(self, config: Config, methods: Methods):
        self.config = config
        self.methods = methods
        self.scheduler = methods.scheduler
        self.connections: dict = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kestrel-tok")
        self._next_id = 0
        self._aserver: Optional[asyncio.AbstractServer] = None
        self._own_socket: Optional[tuple] = None     # (path, identity) when we created it

    def _new_connection(self) -> Connection:
        self._next_id += 1
        return Connection(self, self._next_id)

    async def start(self, inherited: Optional[socket.socket] = None) -> str:
        """Listen on the socket systemd passed in, or on a new one at config.socket.
        Returns a description of where we listen."""
        if inherited is not None:
            sock, where = inherited, f"inherited socket fd {inherited.fileno()}"
        else:
            sock, identity = bind_unix_socket(self.config.socket, self.config.socket_mode,
                                              self.config.socket_group)
            self._own_socket = (self.config.socket, identity)
            where = self.config.socket
        loop = asyncio.get_running_loop()
        # about max_connections: a burst accepted at once may pass it by the listen backlog
        factory = Bounded(self._new_connection,
                          lambda: sum(not c.closed for c in self.connections.values()),
                          self.config.max_connections, "RPC socket", evict=self._evict_idlest)
        self._aserver = await loop.create_unix_server(factory, sock=sock)
        return where

    def _evict_idlest(self) -> bool:
        """At max_connections: close the connection idle the longest (none of its requests
        running), so that a flood of idle connections cannot lock out a new client.
        False if every connection is busy."""
        idle = [c for c in self.connections.values() if not (c.closed or c.jobs or c.aside)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.last_active)
        log.info("connection %d closed: idle the longest at max-connections (%d)", oldest.id,
                 self.config.max_connections)
        oldest.closed = True
        oldest.transport.abort()
        return True

    def stop_accepting(self) -> None:
        """Close the listening socket and remove our socket file (never systemd's)."""
        if self._aserver is not None:
            self._aserver.close()
        if self._own_socket is not None:
            remove_own_socket(*self._own_socket)
            self._own_socket = None

    async def close_connections(self, timeout: float = 2.0) -> None:
        """Close every connection once its written replies are flushed."""
        for conn in list(self.connections.values()):
            conn.closed = True
            conn.transport.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.executor.shutdown(wait=False, cancel_futures=True)
