"""systemd integration without a library: sd_notify and socket activation.

`Notifier` sends the sd_notify datagrams (READY=1, STATUS=, WATCHDOG=1, STOPPING=1) to
`$NOTIFY_SOCKET`; every method is a no-op when the daemon was not started by systemd
(or `systemd-socket-activate`, or a test) with that variable. `listen_fds` takes over the
listening sockets that systemd passes with `LISTEN_FDS` (socket activation), and
`activated_sockets` tells the RPC socket from the HTTP API's by their LISTEN_FDNAMES.

Only `main` reads the environment: it hands `os.environ` to `Notifier.from_environ` and
`activated_sockets` once, at start-up. Integration contract (docs/service.md):
`ready()` only after the model is loaded and the KV arena allocated; `watchdog()` from a
timer in the asyncio loop every `watchdog_interval` seconds (so a wedged loop is restarted,
while a long prefill in the engine thread is not taken for a hang); `status()` when the
model / cache / queue figures change; `stopping()` when shutdown begins. A socket obtained
from `listen_fds` belongs to systemd's .socket unit: the server must not unlink its path.

Thread safety: a Notifier may be called from any thread (one `sendto` per message).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import MutableMapping, Optional

from ..errors import StartupError

log = logging.getLogger("kestreld.service.systemd")

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START: passed descriptors begin at fd 3


def _notify_address(value: str) -> str:
    """The AF_UNIX address of $NOTIFY_SOCKET: a path, or `@name` for the abstract namespace."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise StartupError(f"NOTIFY_SOCKET must be an absolute path or @abstract name, got {value!r}")


class Notifier:
    """sd_notify sender for one daemon process; inert when `address` is None."""

    def __init__(self, address: Optional[str], watchdog_usec: Optional[int] = None):
        self.address = address                 # AF_UNIX datagram address, "\0..." if abstract
        self.watchdog_interval: Optional[float] = (
            watchdog_usec / 2e6 if address and watchdog_usec else None)  # seconds between pings
        self._sock = (socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                      if address else None)
        self._warned = False

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str]) -> "Notifier":
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID once (main passes os.environ).

        The watchdog is on only when WATCHDOG_USEC is set and WATCHDOG_PID, if set, is this
        process (systemd sets it to the main pid; a child must not ping for its parent)."""
        value = environ.get("NOTIFY_SOCKET")
        if not value:
            return cls(None)
        usec = _positive_int(environ, "WATCHDOG_USEC")
        watchdog_pid = _positive_int(environ, "WATCHDOG_PID")
        if watchdog_pid is not None and watchdog_pid != os.getpid():
            usec = None
        return cls(_notify_address(value), usec)

    @property
    def enabled(self) -> bool:
        """True when there is a NOTIFY_SOCKET to talk to."""
        return self._sock is not None

    def ready(self, status: Optional[str] = None) -> None:
        """Tell systemd start-up is complete (call after the model and arena are ready)."""
        self._send("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def status(self, text: str) -> None:
        """Set the one-line status that `systemctl status` shows."""
        self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        """Keep-alive ping; must come at least every WatchdogSec (we send every half)."""
        self._send("WATCHDOG=1")

    def stopping(self, status: Optional[str] = None) -> None:
        """Tell systemd the daemon is shutting down."""
        self._send("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def close(self) -> None:
        """Release the datagram socket; later calls are no-ops."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, message: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as e:
            # systemd gone or socket full: the daemon keeps serving; say it once.
            if not self._warned:
                log.warning("sd_notify to %r failed: %s", self.address, e)
                self._warned = True


def _positive_int(environ: MutableMapping[str, str], name: str) -> Optional[int]:
    """An optional positive integer variable; a malformed one stops start-up."""
    value = environ.get(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise StartupError(f"{name} must be a positive integer, got {value!r}")
    return number


def _one_line(text: str) -> str:
    # A newline would start a new KEY=VALUE assignment in the datagram.
    return " ".join(text.splitlines())


HTTP_FDNAME = "http"   # FileDescriptorName= of kestreld-http.socket


def listen_fds(environ: MutableMapping[str, str]) -> list[tuple[str, socket.socket]]:
    """The sockets passed by socket activation (LISTEN_FDS from fd 3), in order, each with
    its name (LISTEN_FDNAMES: the unit's FileDescriptorName=, by default the unit's name).

    Empty unless LISTEN_PID is this process. LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES are
    removed from `environ` in every case (with os.environ: from the process environment),
    so children do not take the descriptors for theirs. The fds get FD_CLOEXEC."""
    try:
        pid = _positive_int(environ, "LISTEN_PID")
        n = _positive_int(environ, "LISTEN_FDS")
        names = environ.get("LISTEN_FDNAMES", "").split(":")
    finally:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            environ.pop(name, None)
    if pid != os.getpid() or n is None:
        return []
    names += ["unknown"] * (n - len(names))
    sockets = []
    for i, fd in enumerate(range(LISTEN_FDS_START, LISTEN_FDS_START + n)):
        try:
            os.set_inheritable(fd, False)
            sockets.append((names[i], socket.socket(fileno=fd)))  # family, type read from the fd
        except OSError as e:
            for _, s in sockets:
                s.close()
            raise StartupError(f"socket activation: fd {fd} of LISTEN_FDS={n} is not a "
                               f"socket: {e.strerror}") from None
    return sockets


def activated_sockets(environ: MutableMapping[str, str]) -> tuple[Optional[socket.socket], tuple]:
    """(the RPC socket, the HTTP sockets) passed by systemd; (None, ()) without activation.

    The HTTP API's sockets are the ones named `http` (kestreld-http.socket's
    FileDescriptorName=http: listening stream sockets, TCP or Unix); the others must be
    exactly one listening Unix stream socket (kestreld.socket: ListenStream=, Accept=no).
    Anything else is a misconfigured unit and stops start-up."""
    sockets = listen_fds(environ)
    http = tuple(s for name, s in sockets if name == HTTP_FDNAME)
    rpc = [s for name, s in sockets if name != HTTP_FDNAME]
    try:
        for s in http:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6,
                                                                 socket.AF_UNIX):
                raise StartupError(f"socket activation: the http socket fd {s.fileno()} is not "
                                   f"a TCP or Unix stream socket")
        kinds = [(s.family, s.type) for s in rpc]
        if len(rpc) > 1 or kinds and kinds[0] != (socket.AF_UNIX, socket.SOCK_STREAM):
            raise StartupError(f"socket activation: expected one AF_UNIX stream socket, got {kinds}")
        for s in rpc + list(http):
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise StartupError(f"socket activation: the passed socket fd {s.fileno()} is "
                                   f"not listening (Accept=yes?)")
    except StartupError:
        for _, s in sockets:
            s.close()
        raise
    return (rpc[0] if rpc else None), http
