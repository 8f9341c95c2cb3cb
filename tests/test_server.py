"""End-to-end: the real kestreld process, its real socket, SmolLM2, the real client.

One daemon serves the module (--max-queue 1, small prefill chunks, 64 KiB message limit);
the prefix-off comparison and the restart tests start their own.
"""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import time

import msgpack
import psutil
import pytest

from daemon import REPO, Daemon, daemon_env
from kestrelctl import Client, KestrelClientError, Result, Token

MAX_MESSAGE = 65536
SHORT = "The capital of France is"
# A story long enough for a prefill of several chunks, and a question sharing its prefix.
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
         "named Tomas who repaired nets every morning and told stories every evening. ")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("kd") / "k.sock"
    with Daemon(path, "--max-queue", "1", "--prefill-chunk", "32",
                "--max-message-bytes", str(MAX_MESSAGE)) as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


class Raw:
    """A bare MessagePack connection, to send what the client library never would."""

    def __init__(self, path: str, timeout: float = 60):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.unpacker = msgpack.Unpacker(raw=False)

    def send(self, obj) -> None:
        self.sock.sendall(obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True))

    def read(self):
        """The next message, or None at end of stream."""
        while True:
            for m in self.unpacker:
                return m
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.unpacker.feed(data)

    def until_response(self, msgid: int):
        """(notifications of msgid, its response); other messages are returned too."""
        notes = []
        while True:
            m = self.read()
            assert m is not None, f"connection closed before the response to {msgid}"
            if m[0] == 1 and m[1] == msgid:
                return notes, m
            notes.append(m)

    def close(self) -> None:
        self.sock.close()


def wait_idle(client: Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = client.status()
        if not s["busy"] and s["queued"] == 0:
            return s
        assert time.monotonic() < deadline, f"daemon still busy after {timeout} s: {s}"
        time.sleep(0.05)


def long_ids(client: Client, n: int) -> list:
    ids = client.tokenize(STORY * 16)
    assert len(ids) >= n
    return ids[:n]


# ---------------------------------------------------------------- socket and status

def test_socket_file_is_0660_socket(daemon):
    st = os.lstat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


@pytest.fixture(scope="module")
def meta(daemon):
    """The model's facts read straight from the GGUF file (independent of the daemon)."""
    import gguf
    r = gguf.GGUFReader(daemon.model)
    f = {k: r.fields[k].contents() for k in ("general.name", "llama.block_count",
                                             "llama.embedding_length", "llama.attention.head_count",
                                             "llama.attention.head_count_kv", "llama.context_length")}
    return {"name": f["general.name"], "n_layers": f["llama.block_count"],
            "context_length": f["llama.context_length"],
            "n_kv_heads": f["llama.attention.head_count_kv"],
            "head_dim": f["llama.embedding_length"] // f["llama.attention.head_count"],
            "n_params": sum(int(t.n_elements) for t in r.tensors),
            "vocab": r.fields["tokenizer.ggml.tokens"].contents()}


def test_ping_and_status_fields(daemon, client, meta):
    assert client.ping() == {"ok": True, "pid": daemon.pid}
    s = client.status()
    now = time.time()
    per_token_layer = 2 * meta["n_kv_heads"] * meta["head_dim"] + 2 * meta["n_kv_heads"] * 4
    assert s["version"] == "0.1.0" and s["protocol"] == 1 and s["pid"] == daemon.pid
    assert abs(s["started_at"] - psutil.Process(daemon.pid).create_time()) < 1
    assert abs(s["started_at"] + s["uptime_s"] - now) < 1
    interleaved = s["model"].pop("weights_interleaved_bytes")   # its bytes: test_status.py
    assert set(interleaved) <= {"q8_0"}
    assert s["model"] == {"path": daemon.model, "arch": "llama", "name": meta["name"],
                          "n_params": meta["n_params"], "n_layers": meta["n_layers"],
                          "context_length": meta["context_length"],
                          "weights": "q8_0", "source_dtype": "q8_0", "weight_types": {"q8_0": 1.0},
                          "file_bytes": os.path.getsize(daemon.model),
                          "chat_template_source": "gguf", "vision": False}
    assert (s["max_seq"], s["kv_bs"], s["kv_dtype"], s["threads"]) == (512, 32, "q8", 1)
    assert s["kv_bytes_per_token_layer"] == per_token_layer == 408
    assert s["kv_arena_bytes"] == per_token_layer * meta["n_layers"] * 512
    assert set(s["prefix"]) == {"enabled", "min_match", "hits", "misses", "tokens_reused"}
    assert s["prefix"]["enabled"] is True and s["prefix"]["min_match"] == 16
    assert {k: type(s[k]) for k in ("busy", "active", "queued", "total_requests")} == \
        {"busy": bool, "active": int, "queued": int, "total_requests": int}
    rss = psutil.Process(daemon.pid).memory_info().rss / 2**20
    assert abs(s["rss_mb"] - rss) < 0.2 * rss
    avail = psutil.virtual_memory().available / 2**20
    assert abs(s["mem_avail_mb"] - avail) < 0.2 * avail


def test_tokenize_detokenize_against_gguf_vocabulary(client, meta):
    text = "Hello world, how are you?"
    ids = client.tokenize(text)
    assert "".join(meta["vocab"][i] for i in ids).replace("\u0120", " ") == text
    assert client.detokenize(ids) == text
    assert client.tokenize(text, add_special=True) == ids      # SmolLM2 adds no BOS


# ---------------------------------------------------------------- generation

def test_generate_streamed_equals_not_streamed_and_ids(client):
    plain = client.generate(prompt=SHORT, max_tokens=8)
    events = list(client.stream_generate(prompt=SHORT, max_tokens=8))
    tokens, final = events[:-1], events[-1]
    assert all(isinstance(e, Token) for e in tokens) and isinstance(final, Result)
    assert "".join(t.text for t in tokens) == final.text == plain.text
    assert [i for t in tokens for i in t.ids] == final.ids == plain.ids
    assert len(plain.ids) == 8 and plain.finish_reason == "length"
    assert client.detokenize(plain.ids) == plain.text
    prompt_ids = client.tokenize(SHORT, add_special=True)
    by_ids = client.generate(ids=prompt_ids, max_tokens=8)
    assert by_ids.ids == plain.ids
    u = by_ids.usage
    assert (u["prompt_tokens"], u["completion_tokens"]) == (len(prompt_ids), 8)
    assert u["cached_tokens"] + u["prefill_tokens"] == u["prompt_tokens"]
    assert set(plain.timings) == {"queue_ms", "prefill_ms", "decode_ms", "ttft_ms",
                                  "prefill_tok_s", "decode_tok_s"}
    assert plain.timings["ttft_ms"] >= plain.timings["queue_ms"]


def test_logprobs_top_k(client):
    r = client.generate(prompt=SHORT, max_tokens=4, logprobs=3)
    assert len(r.logprobs) == len(r.ids) == 4
    for entry, tok in zip(r.logprobs, r.ids):
        assert entry["id"] == tok and len(entry["top"]) == 3
        top = [lp for _, lp in entry["top"]]
        assert top == sorted(top, reverse=True) and top[0] <= 0.0
        assert entry["top"][0][0] == tok and entry["logprob"] == pytest.approx(top[0])  # greedy


def test_chat_streamed_equals_not_streamed_and_history_hits_cache(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat(msgs, max_tokens=6)
    events = list(client.stream_chat(msgs, max_tokens=6))
    assert "".join(e.text for e in events[:-1]) == events[-1].text == plain.text
    turn2 = msgs + [{"role": "assistant", "content": plain.text},
                    {"role": "user", "content": "Another one."}]
    r = client.chat(turn2, max_tokens=6)
    assert r.usage["cached_tokens"] >= 16


def test_prefix_hit_reuses_the_common_prefix(client):
    first = client.generate(prompt=STORY + "Where did Tomas live?", max_tokens=4)
    second_prompt = STORY + "What did Tomas repair?"
    lcp = 0
    a = client.tokenize(STORY + "Where did Tomas live?", add_special=True) + first.ids
    b = client.tokenize(second_prompt, add_special=True)
    while lcp < min(len(a), len(b)) and a[lcp] == b[lcp]:
        lcp += 1
    hits_before = client.status()["prefix"]["hits"]
    r = client.generate(prompt=second_prompt, max_tokens=4)
    assert 16 <= r.usage["cached_tokens"] <= lcp
    assert r.usage["prefill_tokens"] == len(b) - r.usage["cached_tokens"]
    assert client.status()["prefix"]["hits"] == hits_before + 1


def test_prompt_too_long(client):
    with pytest.raises(KestrelClientError) as e:
        client.generate(ids=[42] * 600, max_tokens=4)
    assert e.value.code == "prompt_too_long"
    assert "600" in e.value.message and "512" in e.value.message
    assert client.generate(prompt=SHORT, max_tokens=2).finish_reason == "length"


# ---------------------------------------------------------------- protocol edges

@pytest.mark.parametrize("params, needle", [
    ({"prompt": SHORT, "temperature": -0.5}, "temperature"),
    ({"prompt": SHORT, "top_p": 0}, "top_p"),
    ({"prompt": SHORT, "top_p": 1.5}, "top_p"),
    ({"prompt": SHORT, "min_p": 2}, "min_p"),
    ({"prompt": SHORT, "top_k": -1}, "top_k"),
    ({"prompt": SHORT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": SHORT, "repeat_penalty": 0}, "repeat_penalty"),
    ({"prompt": SHORT, "seed": "x"}, "seed"),
    ({"prompt": SHORT, "logprobs": 21}, "logprobs"),
    ({"prompt": SHORT, "stop": ["a"] * 17}, "stop"),
    ({"prompt": SHORT, "stop": "."}, "stop"),
    ({"prompt": SHORT, "temprature": 0.5}, "temprature"),
    ({"ids": [1, 10**9]}, "ids"),
    ({"ids": [1], "prompt": "x"}, "exactly one"),
    ({}, "exactly one"),
])
def test_bad_params_get_bad_request_and_connection_stays(daemon, params, needle):
    raw = Raw(daemon.socket)
    raw.send([0, 3, "generate", [params]])
    _, resp = raw.until_response(3)
    assert resp[2]["code"] == "bad_request" and needle in resp[2]["message"]
    raw.send([0, 4, "ping", []])
    assert raw.until_response(4)[1][3]["pid"] == daemon.pid
    raw.close()


def test_unknown_method_bin_names_and_client_notifications(daemon):
    raw = Raw(daemon.socket)
    raw.send([2, "client_info", [{"name": "generic-rpc", "version": 1}]])   # ignored, no reply
    raw.send([0, 1, b"ping", []])                                           # bin method name
    assert raw.read() == [1, 1, None, {"ok": True, "pid": daemon.pid}]
    raw.send([0, 2, "summon_dragon", []])
    resp = raw.read()
    assert resp[:2] == [1, 2] and resp[2]["code"] == "unknown_method" and resp[3] is None
    raw.send([0, 3, "status", [{}]])
    assert raw.read()[3]["pid"] == daemon.pid
    raw.close()


def test_malformed_and_oversized_messages_close_only_that_connection(daemon, client):
    short = Raw(daemon.socket)                      # a request with 3 elements: msgid readable
    short.send([0, 5, "ping"])
    resp = short.read()
    assert resp[:2] == [1, 5] and resp[2]["code"] == "bad_request"
    assert short.read() is None
    garbage = Raw(daemon.socket)                    # not MessagePack: nothing to answer to
    garbage.send(b"\xc1\xc1\xc1")
    assert garbage.read() is None
    header_then_garbage = Raw(daemon.socket)
    header_then_garbage.send(b"\x94\x00\x07\xc1")   # [0, 7, <invalid>
    resp = header_then_garbage.read()
    assert resp[:2] == [1, 7] and resp[2]["code"] == "bad_request"
    big = Raw(daemon.socket)
    payload = msgpack.packb([0, 9, "generate", [{"prompt": "x" * (2 * MAX_MESSAGE)}]])
    try:
        big.send(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass                                         # closed while we were still sending
    resp = big.read()
    assert resp[:2] == [1, 9] and resp[2]["code"] == "too_large"
    assert str(MAX_MESSAGE) in resp[2]["message"]
    assert big.read() is None
    assert client.ping()["pid"] == daemon.pid        # the other connection goes on
    for r in (short, garbage, header_then_garbage, big):
        r.close()


def test_duplicate_msgid_in_flight_is_refused(daemon, client):
    raw = Raw(daemon.socket)
    raw.send([0, 1, "generate", [{"prompt": SHORT, "max_tokens": 6, "stream": False}]])
    raw.send([0, 1, "generate", [{"prompt": SHORT, "max_tokens": 2, "stream": False}]])
    first = raw.read()
    assert first[:2] == [1, 1] and first[2]["code"] == "bad_request" and "in flight" in first[2]["message"]
    second = raw.read()
    assert second[2] is None and len(second[3]["ids"]) == 6
    raw.close()


def test_slow_reader_gets_its_requests_cancelled_instead_of_buffering():
    """Unit test of the outgoing bound (filling a real socket needs ~300 tokens)."""
    from types import SimpleNamespace

    from kestreld.service.config import Config
    from kestreld.engine.generate import Completion, TokenEvent
    from kestreld.service.scheduler import Done, Token as TokenEv
    from kestreld.service.server import Connection

    class Transport:
        unsent = 0

        def write(self, data):
            self.unsent += len(data)

        def get_write_buffer_size(self):
            return self.unsent

    cancelled = []
    server = SimpleNamespace(config=Config(max_outgoing_bytes=200), connections={},
                             scheduler=SimpleNamespace(cancel=lambda c, m: cancelled.append((c, m))))
    conn = Connection(server, 7)
    conn.transport = Transport()
    conn.jobs = {5: object(), 6: object()}
    conn._on_job_event(5, TokenEv(TokenEvent([1], "x" * 100)))
    assert cancelled == [] and not conn.slow
    conn._on_job_event(5, TokenEv(TokenEvent([1], "x" * 100)))
    assert cancelled == [(7, 5), (7, 6)] and conn.slow
    before = conn.transport.unsent
    conn._on_job_event(5, TokenEv(TokenEvent([1], "x" * 100)))
    assert conn.transport.unsent == before                      # notifications dropped
    c = Completion("x", [1], "cancelled", 1, 0, None, 1, 1, 1.0, 1.0, 1.0)
    conn._on_job_event(5, Done(c, 0.0, 0.0))
    assert conn.transport.unsent > before and 5 not in conn.jobs   # the answer still goes out


# ---------------------------------------------------------------- queue, cancel, disconnect

def test_queue_full_then_cancel_queued_and_running(daemon, client):
    ids = long_ids(client, 300)
    raw = Raw(daemon.socket)
    raw.send([0, 1, "generate", [{"ids": ids, "max_tokens": 50}]])
    time.sleep(0.3)
    raw.send([0, 2, "generate", [{"prompt": SHORT, "max_tokens": 4}]])
    raw.send([0, 3, "generate", [{"prompt": SHORT, "max_tokens": 4}]])
    resp3, queued = None, None          # the order between different msgids is free
    while resp3 is None or queued is None:
        m = raw.read()
        if m[:2] == [1, 3]:
            resp3 = m
        elif m[:2] == [2, "progress"] and m[2][0] == 2:
            queued = m[2][1]
    assert resp3[2]["code"] == "queue_full" and "max-queue 1" in resp3[2]["message"]
    assert queued == {"phase": "queued", "done": 0, "total": 1}
    assert client.status()["queued"] == 1
    raw.send([0, 4, "cancel", [{"id": 2}]])
    seen = {}
    while len(seen) < 2:
        m = raw.read()
        if m[0] == 1:
            seen[m[1]] = m
    assert seen[4][3] == {"cancelled": True}
    assert seen[2][2]["code"] == "cancelled"
    raw.send([0, 5, "cancel", [{"id": 1}]])
    raw.send([0, 6, "cancel", [{"id": 99}]])
    seen = {}
    while len(seen) < 3:
        m = raw.read()
        if m[0] == 1:
            seen[m[1]] = m
    assert seen[5][3] == {"cancelled": True} and seen[6][3] == {"cancelled": False}
    assert seen[1][2] is None and seen[1][3]["finish_reason"] == "cancelled"
    assert seen[1][3]["usage"]["completion_tokens"] < 50
    raw.close()
    wait_idle(client)


def test_status_fast_during_long_prefill_then_disconnect_mid_prefill(daemon, client):
    reference = client.generate(prompt=SHORT + " a city", max_tokens=6)
    ids = long_ids(client, 450)
    raw = Raw(daemon.socket)
    raw.send([0, 1, "generate", [{"ids": ids, "max_tokens": 4}]])
    first = raw.read()                               # a prefill progress note (>= 0.25 s in)
    assert first[:2] == [2, "progress"] and first[2][0] == 1
    p = first[2][1]
    assert p["phase"] == "prefill" and 0 < p["done"] < p["total"] <= 450
    latencies = []
    for _ in range(5):
        t0 = time.perf_counter()
        s = client.status()
        latencies.append(time.perf_counter() - t0)
        assert s["busy"] is True and s["active"] == 1
        time.sleep(0.05)
    assert max(latencies) < 0.050, latencies
    raw.close()                                      # disconnect mid-prefill
    s = wait_idle(client, timeout=5)
    assert s["cache_len"] < 450
    again = client.generate(prompt=SHORT + " a city", max_tokens=6)
    assert (again.text, again.ids) == (reference.text, reference.ids)


def test_disconnect_mid_stream_stops_the_request(daemon, client):
    reference = client.generate(prompt=STORY, max_tokens=6)
    raw = Raw(daemon.socket)
    raw.send([0, 1, "generate", [{"prompt": SHORT, "max_tokens": 200, "ignore_eos": True}]])
    tokens = 0
    while tokens < 2:
        m = raw.read()
        tokens += m[:2] == [2, "token"]
    raw.close()
    t0 = time.monotonic()
    s = wait_idle(client, timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert s["cache_len"] < len(client.tokenize(SHORT)) + 100
    again = client.generate(prompt=STORY, max_tokens=6)
    assert (again.text, again.ids) == (reference.text, reference.ids)


def test_log_has_ready_line_request_lines_and_no_prompt_text(daemon, client):
    client.generate(prompt="zebraquokka " + STORY, max_tokens=2)
    client.generate(prompt="zebraquokka " + STORY + "More.", max_tokens=2)   # a prefix hit
    log = daemon.log()
    ready = "inference state ready (max_seq=512, kv_bs=32, kv_arena=6.3 MB, threads=1, kv_memory="
    assert ready in log and " MB by default)" in log
    assert "request conn=" in log and " cached=" in log and " tok/s" in log
    assert "[KV-PREFIX]" in log
    assert "zebraquokka" not in log


# ---------------------------------------------------------------- other daemons

def test_greedy_after_prefix_hit_equals_no_prefix_kv(daemon, client, tmp_path):
    question = STORY + "What did Tomas repair every morning?"
    client.generate(prompt=STORY + "Who was Tomas?", max_tokens=4)
    hit = client.generate(prompt=question, max_tokens=12)
    assert hit.usage["cached_tokens"] >= 16 and hit.usage["cached_source"] in ("memory", "store")
    with Daemon(tmp_path / "n.sock", "--no-prefix-kv") as nd, nd.client() as nc:
        assert nc.status()["prefix"]["enabled"] is False
        nc.generate(prompt=STORY + "Who was Tomas?", max_tokens=4)
        miss = nc.generate(prompt=question, max_tokens=12)
        assert miss.usage["cached_tokens"] == 0 and miss.usage["cached_source"] is None
        assert nc.status()["prefix"]["hits"] == 0
    assert (miss.text, miss.ids) == (hit.text, hit.ids)


def test_refuses_paths_that_are_not_a_free_socket(daemon, tmp_path):
    regular = tmp_path / "file.sock"
    regular.write_text("keep me")
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    link = tmp_path / "link.sock"
    link.symlink_to(stale)
    for path, says in ((regular, "is not a socket"), (link, "is not a socket"),
                       (daemon.socket, "another daemon is listening")):
        cmd = Daemon(path).command()
        out = subprocess.run(cmd, cwd=REPO, env=daemon_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and says in out.stderr, out.stderr
    assert regular.read_text() == "keep me" and link.is_symlink() and stale.exists()


def test_restart_loses_the_cache_and_sigterm_is_clean(tmp_path):
    path = tmp_path / "r.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))                            # left behind by a dead daemon
    stale.close()
    prompt = STORY + "Where did Tomas live?"
    with Daemon(path) as first, first.client() as c:
        c.generate(prompt=prompt, max_tokens=4)
        again = c.generate(prompt=prompt, max_tokens=4)
        assert again.usage["cached_tokens"] >= 16
        assert c.status()["cache_len"] > 0
        # SIGTERM with one request running and one queued: the running one finishes,
        # the queued one is answered shutting_down, the socket goes away, exit 0.
        raw = Raw(str(path))
        raw.send([0, 1, "generate", [{"prompt": SHORT, "max_tokens": 48, "ignore_eos": True}]])
        raw.send([0, 2, "generate", [{"prompt": SHORT, "max_tokens": 4}]])
        while True:                                   # request 1 is running once it streams
            m = raw.read()
            assert m is not None, first.log()
            if m[0] == 2 and m[1] == "token":
                break
        first.proc.send_signal(signal.SIGTERM)
        seen = {}
        while len(seen) < 2:
            m = raw.read()
            assert m is not None, first.log()
            if m[0] == 1:
                seen[m[1]] = m
        assert seen[2][2]["code"] == "shutting_down"
        # finished within the grace, or cancelled when the grace ran out
        assert seen[1][2] is None and seen[1][3]["finish_reason"] in ("length", "cancelled")
        assert first.stop() == 0
        assert not path.exists()
        first_pid = first.pid
    with Daemon(path) as second, second.client() as c:
        assert second.pid != first_pid
        s = c.status()
        assert s["cache_len"] == 0 and s["prefix"]["hits"] == 0 and s["total_requests"] == 0
        assert c.generate(prompt=prompt, max_tokens=4).usage["cached_tokens"] == 0


def test_model_load_error_is_one_line_and_exit_1(tmp_path):
    cmd = Daemon(tmp_path / "m.sock", model=str(tmp_path / "missing.gguf")).command()
    out = subprocess.run(cmd, cwd=REPO, env=daemon_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == \
        f"kestreld: {tmp_path / 'missing.gguf'}: no such file or directory"
