"""Protocol fuzzing of a live kestreld: seeded hostile messages, checked invariants.

    .venv/bin/python bench/fuzz.py --messages 100000          # `make fuzz`; starts its own daemon
    .venv/bin/python bench/fuzz.py --messages 3000 --seed 7   # what tests/test_fuzz.py runs

The daemon is the real process (tests/daemon.py) on SmolLM2 Q8_0 with `DAEMON_ARGS`. One
persistent connection receives batches of well-framed requests (valid ones, and valid ones
with one field mutated into a hostile value), client notifications and responses (ignored by
the daemon); messages that break the framing or the MessagePack-RPC shape go each on a
connection of its own, since the daemon closes it. A watcher thread on a second connection
keeps asking one fixed greedy prompt and compares every answer with its first one.

Invariants checked (every violation is recorded with the message that caused it):
  - each well-framed request gets exactly one response with its msgid: a result, or an error
    whose code is in the closed set (errors.WIRE_CODES); a valid request gets a result
    (generate/chat: or `queue_full`, or `cancelled` when we cancelled it); no `internal`;
  - notifications name a request in flight; client notifications/responses get no reply;
  - a malformed message gets at most one error response (with its msgid when readable),
    then the connection is closed by the daemon; a truncated frame then EOF: closed, no reply;
  - the watcher's greedy ids never change; the daemon stays alive;
  - RSS after the warm-up (5 % of the messages) grows by less than `--rss-limit-mb`.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import msgpack
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from daemon import Daemon  # noqa: E402
from kestrelctl import Client, KestrelClientError  # noqa: E402
from kestreld.errors import WIRE_CODES  # noqa: E402

MAX_MESSAGE = 65536             # a small --max-message-bytes makes too_large cheap to reach
DAEMON_ARGS = ("--max-seq", "256", "--max-message-bytes", str(MAX_MESSAGE), "--max-queue", "64")
VOCAB = 49152                   # SmolLM2
WATCH_PROMPT = "The capital of France is"
WATCH_TOKENS = 4
BATCH = 48                      # well-framed messages sent before reading the answers
READ_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 20.0          # a broken connection must be closed by the daemon within this
WATCH_EVERY_S = 0.25
# A valid temperature below ~1e-300 or a repeat penalty below ~1e-30 overflows the sampler to
# NaN (an `internal` error: a known bug of engine/sampler.py, see docs/reliability.md and
# tests/test_faults.py); the valid values drawn here stay above them.
MIN_TEMPERATURE, MIN_PENALTY = 1e-3, 1e-3

ENGINE = ("generate", "chat")


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------- the generator

HOSTILE_VALUES = [None, True, False, 0, -1, 1, 2**63, 2**64 - 1, -2**63, 2**31, 0.0, -0.0,
                  float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, -1e-300, "", "x",
                  "\u0000", "\U0010ffff", b"", b"\xff\xfe", [], [[]], {}, {"a": 1},
                  [1, 2, 3], "é" * 300, list(range(100)), {"prompt": "nested"}]


@dataclass
class Case:
    """One message and what the daemon must do with it."""
    data: bytes
    kind: str                        # "request" | "silent" | "fatal" | "truncated" | "garbage"
    msgid: Optional[int] = None      # the msgid a reply must carry (None: no reply allowed)
    method: str = ""
    valid: bool = False              # known valid: must get a result
    note: str = ""                   # what was done to it, for the report
    cancel: bool = False             # send a cancel right after (it may run long)


class Fuzzer:
    """Seeded source of hostile messages; msgids are unique per run."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self._next = 0

    def msgid(self) -> int:
        self._next += 1
        r = self.r.random()
        if r < 0.1:                              # extremes of the MessagePack int range
            return 2**64 - self._next
        if r < 0.2:
            return -2**63 + self._next
        if r < 0.3:
            return -self._next
        return self._next

    # ---- values -----------------------------------------------------------------
    def text(self, n: int = 12) -> str:
        alphabet = "abc XYZ 012 .,!?\n\t é中😀\u0301<|im_start|>"
        return "".join(self.r.choice(alphabet) for _ in range(self.r.randint(0, n)))

    def hostile(self, depth: int = 0):
        r = self.r.random()
        if r < 0.55 or depth > 3:
            return self.r.choice(HOSTILE_VALUES)
        if r < 0.7:
            return self.r.randint(-2**63, 2**64 - 1)
        if r < 0.8:
            return self.r.uniform(-1e6, 1e6) * 10 ** self.r.randint(-320, 300) if self.r.random() < 0.5 \
                else self.r.random()
        if r < 0.9:
            return [self.hostile(depth + 1) for _ in range(self.r.randint(0, 5))]
        return {self.text(6): self.hostile(depth + 1) for _ in range(self.r.randint(0, 4))}

    # ---- valid requests -----------------------------------------------------------
    def options(self) -> dict:
        r, o = self.r, {"max_tokens": 1}
        if r.random() < 0.5:
            o["temperature"] = r.choice([0, 0.0, r.uniform(MIN_TEMPERATURE, 3.0), 1e6])
        if r.random() < 0.3:
            o["top_k"] = r.choice([0, 1, 40, VOCAB, 2**63 - 1])
        if r.random() < 0.3:
            o["top_p"] = r.choice([1, 1.0, 1e-9, r.uniform(0.01, 1.0)])
        if r.random() < 0.3:
            o["min_p"] = r.choice([0, 1, r.random()])
        if r.random() < 0.3:
            o["repeat_penalty"] = r.choice([1, r.uniform(MIN_PENALTY, 3.0), 1e30])
        if r.random() < 0.3:
            o["seed"] = r.choice([0, 2**64 - 1, r.randint(0, 2**64 - 1)])
        if r.random() < 0.2:
            o["stop"] = [self.text(5) or "." for _ in range(r.randint(0, 16))]
        if r.random() < 0.2:
            o["logprobs"] = r.randint(0, 20)
        for name in ("ignore_eos", "stream"):
            if r.random() < 0.2:
                o[name] = r.random() < 0.5
        return o

    def valid_params(self, method: str) -> dict:
        r = self.r
        if method == "generate":
            p = self.options()
            if r.random() < 0.5:
                p["prompt"] = self.text(16) or "x"      # "" is refused: no token to start from
            else:
                p["ids"] = [r.randrange(VOCAB) for _ in range(r.randint(1, 16))]
            return p
        if method == "chat":
            p = self.options()
            p["messages"] = [{"role": r.choice(["user", "assistant", "system"]),
                              "content": self.text(16)} for _ in range(r.randint(1, 2))]
            if r.random() < 0.3:
                p["enable_thinking"] = r.random() < 0.5
            return p
        if method == "tokenize":
            p = {"text": self.text(200)}
            if r.random() < 0.5:
                p["add_special"] = r.random() < 0.5
            return p
        if method == "detokenize":
            return {"ids": [r.randrange(VOCAB) for _ in range(r.randint(0, 60))]}
        if method == "cancel":
            return {"id": self.r.randint(-2**63, 2**64 - 1)}
        return {}

    def request(self) -> Case:
        """A well-framed request: valid, or with one field made hostile."""
        r = self.r
        method = r.choices(["generate", "chat", "tokenize", "detokenize", "status", "ping",
                            "cancel", "unknown"], [20, 8, 10, 10, 6, 6, 6, 4])[0]
        msgid = self.msgid()
        if method == "unknown":
            name = self.text(20) if r.random() < 0.7 else self.text(20).encode()   # str or bin
            return Case(pack([0, msgid, name, [self.hostile()]]), "request", msgid, "?",
                        note="unknown method")
        params = self.valid_params(method)
        valid = r.random() < 0.2
        note = "valid"
        wire_params: object = [params] if params or r.random() < 0.5 else []
        if not valid:
            note = self.mutate(method, params)
            if note.startswith("params="):
                wire_params = params.pop("__wire__")
            else:
                wire_params = [params]
        name = method.encode() if r.random() < 0.1 else method
        # A mutated generate/chat may be valid with a long run (max_tokens 2**63, or the
        # default 256 when removed): cancel those; and a third of the others.
        cancel = method in ENGINE and (not valid or r.random() < 0.3)
        return Case(pack([0, msgid, name, wire_params]), "request", msgid, method, valid, note,
                    cancel)

    def mutate(self, method: str, p: dict) -> str:
        """Make `p` hostile in one way; returns what was done."""
        r = self.r
        fields = list(p) + ["max_tokens", "temperature", "top_k", "top_p", "min_p",
                            "repeat_penalty", "seed", "stop", "logprobs", "ids", "prompt",
                            "messages", "text", "id", "bogus_option"]
        k = r.random()
        if k < 0.08:
            wire = r.choice([p, self.hostile(), None, [p, p], "params", 7, [[p]]])
            p["__wire__"] = wire
            return f"params={type(wire).__name__}"
        if k < 0.14 and p:
            del p[r.choice(list(p))]
            return "field removed"
        name = r.choice(fields)
        special = {
            "max_tokens": [2**63, 2**64 - 1, 0, -5, 1.5, True, "8"],
            "top_k": [-1, -2**63, 2**64 - 1, 0.5],
            "logprobs": [21, 2**40, -1, 10**18],
            "stop": [["x"] * 10000, [""], ["a" * 257], [1], "stop", [None]],
            "ids": [[VOCAB], [-1], [2**64 - 1], [True], list(range(VOCAB, VOCAB + 5)), [],
                    [1] * 300, [0.5]],
            "temperature": [float("nan"), float("inf"), -1e-9, -0.0],
            "seed": [-1, 1.0, "seed", 2**64 - 1],
            "messages": [[], [{}], [{"role": "user"}], [{"role": 1, "content": "x"}],
                         [{"role": "user", "content": "x", "name": "n"}], "hi", [["user", "x"]]],
        }.get(name)
        value = r.choice(special) if special and r.random() < 0.6 else self.hostile()
        p[name] = value
        return f"{name}={value!r:.60}"

    # ---- messages that end the connection ----------------------------------------
    def fatal(self) -> Case:
        r = self.r
        msgid = self.msgid()
        k = r.randrange(12)
        if k == 0:
            return Case(bytes(r.randrange(256) for _ in range(r.randint(1, 64))), "garbage",
                        note="random bytes")
        if k == 1:   # a request whose prompt is invalid UTF-8 (str type 0xa3)
            return Case(b"\x94\x00" + pack(msgid) + pack("generate") + b"\x91\x81" + pack("prompt")
                        + b"\xa3\xff\xfe\xfd", "fatal", msgid, note="invalid UTF-8 str")
        if k == 2:
            return Case(b"\x94\x00" + pack(msgid) + b"\xc1", "fatal", msgid, note="0xc1 byte")
        if k == 3:
            return Case(pack([0, msgid, "ping"]), "fatal", msgid, note="3-element request")
        if k == 4:
            bad = self.r.choice([None, True, 1.0, "7", b"7", [7], {"id": 7}, float("nan")])
            return Case(pack([0, bad, "ping", []]), "fatal", None, note="msgid not int")
        if k == 5:
            return Case(pack([0, msgid, self.r.choice([5, None, [], 1.5]), []]), "fatal", msgid,
                        note="method not a string")
        if k == 6:
            return Case(pack([0, msgid, b"\xff\xfe", []]), "fatal", msgid, note="bin method not UTF-8")
        if k == 7:
            return Case(pack(self.r.choice([{"a": 1}, 5, "x", None, [], [3, 1, 2, 3], [0.5],
                                            [2, 1], [1, 2]])), "fatal", None, note="not RPC")
        if k == 8:   # map with an int key: valid MessagePack, refused by the strict unpacker
            return Case(b"\x94\x00" + pack(msgid) + pack("ping") + b"\x91\x81\x01\x02", "fatal",
                        msgid, note="int map key")
        if k == 9:
            big = pack([0, msgid, "generate", [{"prompt": "x" * (MAX_MESSAGE + r.randint(1, 5000))}]])
            return Case(big, "fatal", msgid, note="too large")
        if k == 10:  # nesting deeper than the unpacker's stack
            depth = r.choice([2000, 5000])
            return Case(b"\x94\x00" + pack(msgid) + pack("ping") + b"\x91" * depth + b"\x00",
                        "fatal", msgid, note=f"nesting {depth}")
        full = pack([0, msgid, "generate", [self.valid_params("generate")]])
        return Case(full[:r.randint(1, len(full) - 1)], "truncated", note="truncated then EOF")

    def silent(self) -> Case:
        if self.r.random() < 0.5:
            return Case(pack([2, self.text(10), self.hostile()]), "silent", note="client notification")
        return Case(pack([1, self.msgid(), self.hostile(), self.hostile()]), "silent",
                    note="client response")

    def deep_but_readable(self) -> Case:
        """Nesting the unpacker accepts: the value reaches validation (bounded quoting)."""
        msgid = self.msgid()
        depth = self.r.choice([100, 900, 1000, 1020])
        return Case(b"\x94\x00" + pack(msgid) + pack("generate") + b"\x91\x82" + pack("prompt")
                    + pack("x") + pack("max_tokens") + b"\x91" * depth + b"\x00",
                    "request", msgid, "generate", note=f"max_tokens nested {depth}")


# ---------------------------------------------------------------- the run

@dataclass
class Report:
    messages: int = 0
    by_kind: dict = field(default_factory=dict)
    responses: int = 0
    codes: dict = field(default_factory=dict)
    results: int = 0
    connections: int = 0
    watcher_checks: int = 0
    status_max_ms: float = 0.0
    rss_mb: list = field(default_factory=list)        # (messages sent, rss MB)
    rss_growth_mb: float = 0.0
    seconds: float = 0.0
    violations: list = field(default_factory=list)

    def violate(self, what: str, case: Optional[Case] = None) -> None:
        if len(self.violations) < 50:
            self.violations.append(what + (f" [{case.kind} {case.method} {case.note}]" if case else ""))

    def summary(self) -> dict:
        d = dict(self.__dict__)
        d["rss_mb"] = self.rss_mb[:: max(1, len(self.rss_mb) // 20)] + self.rss_mb[-1:]
        return d


class Conn:
    """A raw connection that reads MessagePack objects with a deadline."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(READ_TIMEOUT_S)
        self.sock.connect(path)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def read(self):
        """The next object, or None at end of stream."""
        while True:
            for obj in self.unpacker:
                return obj
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.unpacker.feed(data)

    def close(self) -> None:
        self.sock.close()


def check_error(rep: Report, resp, case: Case) -> None:
    """A response to `case`: closed-set code, or a result; counted."""
    rep.responses += 1
    err, result = resp[2], resp[3]
    if err is None:
        rep.results += 1
        if case.method in ENGINE and not (isinstance(result, dict) and "ids" in result):
            rep.violate(f"malformed result {str(result)[:80]}", case)
        return
    code = err.get("code") if isinstance(err, dict) else None
    rep.codes[code] = rep.codes.get(code, 0) + 1
    if code not in WIRE_CODES or not isinstance(err.get("message"), str) or result is not None:
        rep.violate(f"bad error {str(err)[:120]}", case)
    elif code == "internal":
        rep.violate(f"internal error: {err['message'][:160]}", case)
    elif case.valid and code not in ("queue_full", "cancelled"):
        rep.violate(f"valid request refused: {err}", case)
    elif case.valid and case.method not in ENGINE:
        rep.violate(f"valid request refused: {err}", case)


def run_batch(conn: Conn, cases: list, fz: Fuzzer, rep: Report) -> None:
    """Send a batch on the persistent connection (cancelling its generate/chat requests at
    random), read every answer, then a ping sentinel proves no extra answer is pending."""
    expected = {}
    out = []
    for c in cases:
        out.append(c.data)
        if c.kind == "request":
            expected[c.msgid] = c
            if c.cancel:
                cid = fz.msgid()
                expected[cid] = Case(b"", "request", cid, "cancel", True, "cancel own")
                out.append(pack([0, cid, "cancel", [{"id": c.msgid}]]))
    conn.sock.sendall(b"".join(out))
    answered: set = set()
    while len(answered) < len(expected):
        m = conn.read()
        if m is None:
            rep.violate(f"connection closed with {len(expected) - len(answered)} unanswered")
            raise ConnectionError("persistent connection closed by the daemon")
        if isinstance(m, list) and len(m) == 3 and m[0] == 2:
            if m[1] not in ("token", "progress") or m[2][0] not in expected or m[2][0] in answered:
                rep.violate(f"stray notification {str(m)[:100]}")
            continue
        if not (isinstance(m, list) and len(m) == 4 and m[0] == 1):
            rep.violate(f"not a response {str(m)[:100]}")
            continue
        case = expected.get(m[1])
        if case is None or m[1] in answered:
            rep.violate(f"unexpected or duplicate response to {m[1]}: {str(m)[:100]}", case)
            continue
        answered.add(m[1])
        check_error(rep, m, case)
    sentinel = fz.msgid()
    conn.sock.sendall(pack([0, sentinel, "ping", []]))
    while True:
        m = conn.read()
        if m is None:
            raise ConnectionError("persistent connection closed by the daemon")
        if m[0] == 1 and m[1] == sentinel:
            break
        if m[0] == 1:
            rep.violate(f"extra response {str(m)[:100]}")


def run_fatal(path: str, case: Case, rep: Report) -> None:
    """A message on its own connection: at most one error reply, then the daemon closes."""
    conn = Conn(path)
    conn.sock.settimeout(CLOSE_TIMEOUT_S)
    rep.connections += 1
    try:
        try:
            conn.sock.sendall(case.data)
        except (BrokenPipeError, ConnectionResetError):
            pass                                 # closed while we were still sending
        if case.kind in ("truncated", "garbage"):
            try:
                conn.sock.shutdown(socket.SHUT_WR)   # EOF: an incomplete message ends here
            except OSError:
                pass
        replies = []
        while True:
            m = conn.read()
            if m is None:
                break
            replies.append(m)
    except socket.timeout:
        rep.violate("daemon did not close a broken connection", case)
        return
    finally:
        conn.close()
    for m in replies:
        if not (isinstance(m, list) and len(m) == 4 and m[0] == 1):
            rep.violate(f"not a response {str(m)[:100]}", case)
            continue
        rep.responses += 1
        if m[2] is None:
            rep.results += 1
            continue
        code = m[2].get("code")
        rep.codes[code] = rep.codes.get(code, 0) + 1
        if code not in WIRE_CODES or code == "internal":
            rep.violate(f"bad error {m[2]}", case)
    if case.kind == "garbage":
        return                                   # random bytes may hold anything readable
    want = [] if case.msgid is None or case.kind == "truncated" else [case.msgid]
    got = [m[1] for m in replies if isinstance(m, list) and len(m) == 4]
    if got != want:
        rep.violate(f"replies to msgids {got}, expected {want}", case)
    elif want and replies[0][2] is None:
        rep.violate("a malformed message got a result", case)


class Watcher(threading.Thread):
    """A second connection asking one greedy prompt over and over; its ids must not change.
    Also times `status`."""

    def __init__(self, path: str, rep: Report):
        super().__init__(daemon=True)
        self.path, self.rep = path, rep
        self.stop = threading.Event()
        self.first: Optional[list] = None

    def run(self) -> None:
        with Client(self.path, timeout=READ_TIMEOUT_S) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.status()
                self.rep.status_max_ms = max(self.rep.status_max_ms, (time.perf_counter() - t0) * 1e3)
                try:
                    ids = c.generate(prompt=WATCH_PROMPT, max_tokens=WATCH_TOKENS).ids
                except KestrelClientError as e:
                    if e.code != "queue_full":
                        self.rep.violate(f"watcher: {e}")
                    time.sleep(0.05)
                    continue
                if self.first is None:
                    self.first = ids
                elif ids != self.first:
                    self.rep.violate(f"watcher: greedy ids changed {self.first} -> {ids}")
                self.rep.watcher_checks += 1
                time.sleep(WATCH_EVERY_S)


def fuzz(socket_path: str, pid: int, messages: int, seed: int = 1,
         rss_limit_mb: float = 16.0, log=None) -> Report:
    """Send `messages` fuzz messages to the daemon at `socket_path` (process `pid`)."""
    fz, rep = Fuzzer(seed), Report()
    proc = psutil.Process(pid)
    watcher = Watcher(socket_path, rep)
    watcher.start()
    t0 = time.monotonic()
    conn = Conn(socket_path)
    rep.connections += 1
    warm_rss = None
    next_log = 0
    try:
        while rep.messages < messages:
            batch = []
            while len(batch) < BATCH and rep.messages < messages:
                k = fz.r.random()
                if k < 0.06:
                    case = fz.fatal()
                    run_fatal(socket_path, case, rep)
                elif k < 0.12:
                    case = fz.silent()
                    batch.append(case)
                elif k < 0.125:
                    case = fz.deep_but_readable()
                    batch.append(case)
                else:
                    case = fz.request()
                    batch.append(case)
                rep.messages += 1
                rep.by_kind[case.kind] = rep.by_kind.get(case.kind, 0) + 1
            run_batch(conn, batch, fz, rep)
            rss = proc.memory_info().rss / 2**20
            rep.rss_mb.append((rep.messages, round(rss, 1)))
            if warm_rss is None and rep.messages >= messages * 0.05:
                warm_rss = rss
            if log and rep.messages >= next_log:
                log(f"{rep.messages} messages, {time.monotonic() - t0:.0f} s, rss {rss:.1f} MB, "
                    f"{len(rep.violations)} violations, watcher {rep.watcher_checks}")
                next_log += max(1000, messages // 20)
    finally:
        watcher.stop.set()
        watcher.join(READ_TIMEOUT_S)
        conn.close()
    rep.seconds = round(time.monotonic() - t0, 1)
    rep.rss_growth_mb = round(rep.rss_mb[-1][1] - (warm_rss or rep.rss_mb[0][1]), 1)
    if rep.rss_growth_mb > rss_limit_mb:
        rep.violate(f"RSS grew by {rep.rss_growth_mb} MB after the warm-up (> {rss_limit_mb})")
    if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
        rep.violate("the daemon died")
    if rep.watcher_checks == 0:
        rep.violate("the watcher never got an answer")
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rss-limit-mb", type=float, default=16.0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp) / "f.sock", *DAEMON_ARGS) as d:
        rep = fuzz(d.socket, d.pid, args.messages, args.seed, args.rss_limit_mb,
                   log=lambda s: print(s, flush=True))
        alive = d.proc.poll() is None
    out = rep.summary()
    out["daemon_exit_after_sigterm"] = d.proc.returncode
    print(json.dumps(out, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    ok = not rep.violations and alive and d.proc.returncode == 0
    print("fuzz:", "OK" if ok else "FAILED", f"{rep.messages} messages in {rep.seconds} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
