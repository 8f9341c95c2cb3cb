"""Load on a live kestreld: many concurrent clients, mixed requests, a bounded queue.

    .venv/bin/python bench/load.py --clients 64 --requests 1000       # the long run
    .venv/bin/python bench/load.py --clients 64 --requests 200        # what tests/test_load.py runs

Each client is a thread with its own raw connection. It sends, in a seeded random mix,
`generate` (1-2 tokens, streamed or not), `chat` (1 token), `tokenize`, `status`, and
`generate` followed at once by a `cancel` of that request, and reads until every request
it sent has its one response. The daemon runs with `--max-queue 16` (DAEMON_ARGS), so most
generation requests of 64 clients are refused `queue_full`: that is the point.

Checked: every request gets exactly one response, each a result, `queue_full` or
`cancelled` (the cancel itself answers {"cancelled": bool}); nothing hangs (a global
deadline); `status` latency (a separate probe connection, every 5 ms from before the first
client starts to after the last ends) max and p99; the
daemon's RSS after the first 10 requests and after all of them.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from daemon import Daemon  # noqa: E402

DAEMON_ARGS = ("--max-seq", "256", "--max-queue", "16")
READ_TIMEOUT_S = 120.0
PROBE_EVERY_S = 0.005       # the whole load may take under a second: enough samples still
ALLOWED_ERRORS = ("queue_full", "cancelled")
PROMPTS = ("The capital of France is", "Count: 1, 2, 3,", "Hello", "Name a colour.",
           "Once upon a time")


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@dataclass
class LoadReport:
    clients: int = 0
    requests: int = 0                    # requests sent (cancels included)
    responses: int = 0
    outcomes: dict = field(default_factory=dict)    # "result:generate", "queue_full", ...
    status_ms: list = field(default_factory=list)
    rss_first_mb: float = 0.0            # after the first 10 requests were answered
    rss_last_mb: float = 0.0
    seconds: float = 0.0
    violations: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, key: str) -> None:
        with self._lock:
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            self.responses += 1

    def violate(self, what: str) -> None:
        with self._lock:
            if len(self.violations) < 50:
                self.violations.append(what)

    def status_percentile(self, q: float) -> float:
        s = sorted(self.status_ms)
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0

    def summary(self) -> dict:
        return {"clients": self.clients, "requests": self.requests, "responses": self.responses,
                "outcomes": dict(sorted(self.outcomes.items())),
                "status_probes": len(self.status_ms),
                "status_max_ms": round(max(self.status_ms, default=0.0), 2),
                "status_p99_ms": round(self.status_percentile(0.99), 2),
                "status_p50_ms": round(self.status_percentile(0.5), 2),
                "rss_first_mb": self.rss_first_mb, "rss_last_mb": self.rss_last_mb,
                "rss_drift_mb": round(self.rss_last_mb - self.rss_first_mb, 2),
                "seconds": self.seconds, "violations": self.violations}


class Client(threading.Thread):
    """One load client: `n` rounds of one request (or a generate and its cancel)."""

    def __init__(self, path: str, n: int, seed: int, rep: LoadReport, on_answer):
        super().__init__(daemon=True)
        self.path, self.n, self.rep, self.on_answer = path, n, rep, on_answer
        self.r = random.Random(seed)
        self.next_id = 0

    def msgid(self) -> int:
        self.next_id += 1
        return self.next_id

    def round(self) -> list:
        """The messages of one round: [(msgid, method, bytes)]."""
        r = self.r
        kind = r.choices(["generate", "chat", "tokenize", "status", "cancel"], [35, 15, 20, 15, 15])[0]
        prompt = r.choice(PROMPTS)
        if kind in ("generate", "cancel"):
            mid = self.msgid()
            out = [(mid, "generate", pack([0, mid, "generate", [{
                "prompt": prompt, "max_tokens": r.randint(1, 2) if kind == "generate" else 8,
                "stream": r.random() < 0.5}]]))]
            if kind == "cancel":
                cid = self.msgid()
                out.append((cid, "cancel", pack([0, cid, "cancel", [{"id": mid}]])))
            return out
        mid = self.msgid()
        if kind == "chat":
            params = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        elif kind == "tokenize":
            params = {"text": prompt * r.randint(1, 20)}
        else:
            params = {}
        return [(mid, kind, pack([0, mid, kind, [params] if params else []]))]

    def run(self) -> None:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(READ_TIMEOUT_S)
            sock.connect(self.path)
            unpacker = msgpack.Unpacker(raw=False)
            for _ in range(self.n):
                msgs = self.round()
                sock.sendall(b"".join(m[2] for m in msgs))
                waiting = {m[0]: m[1] for m in msgs}
                with self.rep._lock:
                    self.rep.requests += len(msgs)
                while waiting:
                    data = sock.recv(1 << 16)
                    if not data:
                        self.rep.violate(f"connection closed with {waiting} unanswered")
                        return
                    unpacker.feed(data)
                    for m in unpacker:
                        if m[0] == 2:
                            if m[2][0] not in waiting:
                                self.rep.violate(f"notification of a request not in flight: {m}")
                            continue
                        method = waiting.pop(m[1], None)
                        if method is None:
                            self.rep.violate(f"unexpected or duplicate response {str(m)[:120]}")
                        elif m[2] is None:
                            self.rep.count(f"result:{method}")
                            self.on_answer()
                        elif m[2]["code"] in ALLOWED_ERRORS and method in ("generate", "chat"):
                            self.rep.count(m[2]["code"])
                            self.on_answer()
                        else:
                            self.rep.violate(f"{method} answered {m[2]}")
            sock.close()
        except Exception as e:            # a timeout here is a hang: reported, not raised
            self.rep.violate(f"client failed: {type(e).__name__}: {e}")


def probe_status(path: str, out, ready, stop) -> None:
    """Time `status` on its own connection while the load runs; runs in its own process
    (the 64 client threads' GIL must not be measured), latencies (ms) and errors into `out`;
    sets `ready` at its first answer, so that the load starts only once it is probing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(READ_TIMEOUT_S)
    sock.connect(path)
    unpacker = msgpack.Unpacker(raw=False)
    i = 0
    while not stop.is_set():
        i += 1
        t0 = time.perf_counter()
        sock.sendall(pack([0, i, "status", []]))
        while True:
            unpacker.feed(sock.recv(1 << 16))
            reply = next(iter(unpacker), None)
            if reply is not None:
                break
        out.put((time.perf_counter() - t0) * 1e3 if reply[:3] == [1, i, None]
                else f"status answered {str(reply)[:120]}")
        ready.set()
        time.sleep(PROBE_EVERY_S)
    sock.close()
    out.put(None)


def warm_up(path: str) -> None:
    """One generate (pages every weight in), one chat (compiles the template), one tokenize:
    RSS after the first 10 answers then holds what a steady daemon holds."""
    from kestrelctl import Client as KestrelClient
    with KestrelClient(path, timeout=READ_TIMEOUT_S) as c:
        c.generate(prompt=PROMPTS[0], max_tokens=2)
        c.chat([{"role": "user", "content": PROMPTS[1]}], max_tokens=1)
        c.tokenize(PROMPTS[2])


def load(socket_path: str, pid: int, clients: int = 64, requests: int = 1000, seed: int = 1,
         deadline_s: float = 900.0) -> LoadReport:
    """`requests` rounds spread over `clients` concurrent clients (see the module doc)."""
    rep = LoadReport(clients=clients)
    proc = psutil.Process(pid)
    answered = [0]
    lock = threading.Lock()

    def on_answer() -> None:
        with lock:
            answered[0] += 1
            if answered[0] == 10:
                rep.rss_first_mb = round(proc.memory_info().rss / 2**20, 2)

    warm_up(socket_path)
    ctx = multiprocessing.get_context("fork")
    ready, stop, probe_out = ctx.Event(), ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=probe_status, args=(socket_path, probe_out, ready, stop),
                        daemon=True)
    probe.start()
    if not ready.wait(READ_TIMEOUT_S):
        rep.violate(f"the status probe got no answer in {READ_TIMEOUT_S} s")
    per = [requests // clients + (i < requests % clients) for i in range(clients)]
    threads = [Client(socket_path, n, seed * 1000 + i, rep, on_answer) for i, n in enumerate(per)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline_s - (time.monotonic() - t0)))
    rep.seconds = round(time.monotonic() - t0, 1)
    if any(t.is_alive() for t in threads):
        rep.violate(f"deadlock or hang: clients still waiting after {deadline_s} s")
    stop.set()
    for item in iter(lambda: probe_out.get(timeout=READ_TIMEOUT_S), None):
        if isinstance(item, str):
            rep.violate(item)
        else:
            rep.status_ms.append(item)
    probe.join(READ_TIMEOUT_S)
    rep.rss_last_mb = round(proc.memory_info().rss / 2**20, 2)
    if rep.responses != rep.requests:
        rep.violate(f"{rep.requests} requests sent, {rep.responses} answered")
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp) / "l.sock", *DAEMON_ARGS) as d:
        rep = load(d.socket, d.pid, args.clients, args.requests, args.seed)
    out = rep.summary()
    out["daemon_exit_after_sigterm"] = d.proc.returncode
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = not rep.violations and d.proc.returncode == 0
    print("load:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
