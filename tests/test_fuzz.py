"""Protocol fuzzing of the real daemon (fast subset of `make fuzz`, see bench/fuzz.py), and
the hostile values that fuzzing found mishandled, pinned one by one."""
from __future__ import annotations

import sys
import time

import msgpack
import pytest

from daemon import REPO, Daemon

sys.path.insert(0, str(REPO / "bench"))
import fuzz  # noqa: E402  (bench/fuzz.py: the generator and the invariant checks)

FAST_MESSAGES = 3000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("fz") / "f.sock", *fuzz.DAEMON_ARGS) as d:
        yield d


def request(path: str, msg: bytes):
    """Send one message on a fresh connection; its reply, then a ping proves the connection
    is still open."""
    conn = fuzz.Conn(path)
    try:
        conn.sock.sendall(msg)
        reply = conn.read()
        conn.sock.sendall(fuzz.pack([0, 424242, "ping", []]))
        pong = conn.read()
    finally:
        conn.close()
    assert pong is not None and pong[:3] == [1, 424242, None], "the connection was closed"
    return reply


def test_fuzz_fast_subset(daemon):
    rep = fuzz.fuzz(daemon.socket, daemon.pid, FAST_MESSAGES, seed=7)
    assert rep.violations == []
    assert rep.messages == FAST_MESSAGES
    # The run reached every branch: valid results, each kind of refusal, closed connections.
    assert rep.results > 300
    assert {"bad_request", "unknown_method", "too_large", "cancelled"} <= set(rep.codes)
    assert rep.by_kind.get("fatal", 0) > 50 and rep.by_kind.get("silent", 0) > 50
    assert rep.watcher_checks >= 10
    assert rep.rss_growth_mb < 16
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("depth", [900, 1000, 1020])
def test_deep_nesting_is_a_bad_request_not_a_recursion_error(daemon, depth):
    # Before the fix, quoting the value in the error message raised RecursionError: `internal`.
    msg = (b"\x94\x00\x05" + fuzz.pack("generate") + b"\x91\x82" + fuzz.pack("prompt") + fuzz.pack("x")
           + fuzz.pack("max_tokens") + b"\x91" * depth + b"\x00")
    reply = request(daemon.socket, msg)
    assert reply[:2] == [1, 5] and reply[2]["code"] == "bad_request"
    assert reply[2]["message"].startswith("max_tokens must be an integer, got list [[[")
    assert len(reply[2]["message"]) < 200


def test_huge_values_are_quoted_briefly(daemon):
    # A 60 KB value quoted in full made the reply larger than the request.
    for params in ({"prompt": "x", "max_tokens": [7] * 20000},
                   {"prompt": "x", "temperature": "t" * 60000},
                   {"prompt": "x", **{f"bogus{i}": 1 for i in range(3000)}}):
        reply = request(daemon.socket, fuzz.pack([0, 6, "generate", [params]]))
        assert reply[2]["code"] == "bad_request" and len(reply[2]["message"]) < 600, reply[2]
    reply = request(daemon.socket, fuzz.pack([0, 8, "m" * 60000, []]))
    assert reply[2]["code"] == "unknown_method" and len(reply[2]["message"]) < 300


def test_ids_beyond_the_context_are_refused_before_queueing(daemon, tmp_path):
    # 60,000 ids (a 60 KB message): refused on the event loop, never copied into the queue.
    with daemon.client() as c:
        total = c.status()["total_requests"]
        t0 = time.perf_counter()
        reply = request(daemon.socket, fuzz.pack([0, 9, "generate", [{"ids": [5] * 60000}]]))
        elapsed = time.perf_counter() - t0
        assert reply[2] == {"code": "prompt_too_long", "message":
                            "the prompt has 60000 tokens and the context holds max_seq=256: "
                            "no room for a new token"}
        assert c.status()["total_requests"] == total
    assert elapsed < 2.0


def test_greedy_ids_after_fuzzing_equal_a_fresh_daemon(daemon, tmp_path):
    with daemon.client() as c:
        after = c.generate(prompt=fuzz.WATCH_PROMPT + " a", max_tokens=8).ids
    with Daemon(tmp_path / "fresh.sock", *fuzz.DAEMON_ARGS) as fresh, fresh.client() as c:
        assert c.generate(prompt=fuzz.WATCH_PROMPT + " a", max_tokens=8).ids == after


def test_invalid_utf8_and_int_keys_close_only_that_connection(daemon):
    for msg, note in ((b"\x94\x00\x0b" + fuzz.pack("tokenize") + b"\x91\x81" + fuzz.pack("text")
                       + b"\xa2\xc3\x28", "invalid UTF-8"),
                      (b"\x94\x00\x0b" + fuzz.pack("ping") + b"\x91\x81\x01\x02", "int map key")):
        conn = fuzz.Conn(daemon.socket)
        conn.sock.sendall(msg)
        reply = conn.read()
        assert reply[:2] == [1, 11] and reply[2]["code"] == "bad_request", note
        assert conn.read() is None, note          # closed after the answer
        conn.close()
    assert request(daemon.socket, msgpack.packb([0, 12, "ping", []]))[2] is None
