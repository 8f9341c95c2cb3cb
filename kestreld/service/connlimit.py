"""Bounds on connections, shared by the RPC socket and the HTTP API.

Each open connection holds a file descriptor. Without a bound, clients that connect and
send nothing (any member of the socket's group, or any local process for the HTTP port)
used every descriptor of RLIMIT_NOFILE, and then `status`, `ping` and /health all failed.
So each listener holds at most `max_connections` at once: over it, the RPC socket closes
the connection idle the longest to make room, and otherwise the new one is accepted and
closed at once (with a short reply where the protocol has one), which frees its
descriptor. Idle connections are closed after `idle_timeout` (server.py, http.py), and
`cut_stalled_readers` aborts connections whose clients stopped reading their answers.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Callable, Iterable, Optional

log = logging.getLogger("kestreld.service.connlimit")

WARN_EVERY_S = 10.0       # at most one warning per listener this often during a flood
SPARE_FDS = 64            # descriptors beyond the connections: model, KV files, logs, pipes


class Refused(asyncio.Protocol):
    """A connection over the bound: `reply` (may be empty) written, then closed."""

    def __init__(self, reply: bytes):
        self.reply = reply

    def connection_made(self, transport) -> None:
        if self.reply:
            transport.write(self.reply)
        transport.close()


class Bounded:
    """A protocol factory that makes at most `limit` live connections through `factory`
    (`open_count` says how many are open). At the limit, `evict` (if given) may close an
    idle connection to make room (True if it did); otherwise the new one is refused."""

    def __init__(self, factory: Callable[[], asyncio.BaseProtocol], open_count: Callable[[], int],
                 limit: int, what: str, reply: bytes = b"",
                 evict: Optional[Callable[[], bool]] = None):
        self.factory = factory
        self.open_count = open_count
        self.limit = limit
        self.what = what
        self.reply = reply
        self.evict = evict
        self.refused = 0
        self._warned = 0.0

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open_count() < self.limit or (self.evict is not None and self.evict()):
            return self.factory()
        self.refused += 1
        now = time.monotonic()
        if now - self._warned > WARN_EVERY_S:
            self._warned = now
            log.warning("%s: %d connections open, the limit (max-connections): refusing "
                        "new ones (%d so far)", self.what, self.limit, self.refused)
        return Refused(self.reply)


def raise_nofile_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; warn if it is still below `needed`
    (the connections allowed plus SPARE_FDS). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed + SPARE_FDS:
        log.warning("RLIMIT_NOFILE is %d, below the %d connections max-connections allows "
                    "plus %d: lower max-connections or raise LimitNOFILE", soft, needed,
                    SPARE_FDS)
    return soft


async def cut_stalled_readers(transports: Callable[[], Iterable[asyncio.BaseTransport]],
                              timeout: float, what: str) -> None:
    """Forever: abort each of `transports()` whose unsent bytes have not shrunk for
    `timeout` seconds. Unsent bytes wait in user space only once the kernel's buffers are
    full: the client reads nothing. Without this a stream nobody read was generated in
    full into memory; aborted, its handler is cancelled, which withdraws its job."""
    seen: dict = {}                       # transport -> (unsent bytes, since when)
    while True:
        await asyncio.sleep(max(timeout / 4, 0.05))
        now, current = time.monotonic(), {}
        for t in transports():
            size = 0 if t.is_closing() else t.get_write_buffer_size()
            if not size:
                continue
            last = seen.get(t)
            since = last[1] if last is not None and size >= last[0] else now
            if now - since >= timeout:
                log.info("%s: a client read nothing of its answer for %d s (%d bytes unsent): "
                         "closing its connection", what, timeout, size)
                t.abort()
            else:
                current[t] = (size, since)
        seen = current
