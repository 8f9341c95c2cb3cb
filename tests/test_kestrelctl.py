"""kestrelctl: the CLI and the Python client library against the real daemon."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest

from daemon import REPO, Daemon, daemon_env
from kestrelctl import Client, KestrelClientError, Progress, Result, Token
from kestrelctl.cli import EXIT_STATUS, ProgressBar, format_status

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kc") / "k.sock", "--prefill-chunk", "32") as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


def ctl(*args, socket=None, stdin="", env_socket=None):
    env = daemon_env()
    if env_socket:
        env["KESTREL_SOCKET"] = env_socket
    cmd = [sys.executable, "-m", "kestrelctl.cli"] + (["--socket", socket] if socket else []) + list(args)
    return subprocess.run(cmd, cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------- the CLI

def test_ping_with_socket_flag_and_env(daemon):
    out = ctl("ping", socket=daemon.socket)
    assert (out.returncode, out.stdout) == (0, f"ok (pid {daemon.pid})\n")
    assert ctl("ping", env_socket=daemon.socket).stdout == f"ok (pid {daemon.pid})\n"


def test_generate_streams_the_same_text_as_the_library(daemon, client):
    want = client.generate(prompt=PROMPT, max_tokens=8).text
    out = ctl("generate", PROMPT, "--max-tokens", "8", "--stats", socket=daemon.socket)
    assert out.returncode == 0 and out.stdout == want + "\n"
    assert "prompt 5 tokens" in out.stderr and "8 tokens in" in out.stderr
    assert "\r" not in out.stderr                   # no progress bar when stderr is no tty
    piped = ctl("generate", "--max-tokens", "8", socket=daemon.socket, stdin=PROMPT)
    assert piped.stdout == want + "\n"


def test_chat_one_shot_and_multi_turn_history_hits_the_cache(daemon, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = client.chat(msgs, max_tokens=6).text
    out = ctl("chat", "--system", "Be brief.", "-m", "Hi!", "--max-tokens", "6",
              socket=daemon.socket)
    assert out.returncode == 0 and out.stdout == want + "\n"
    out = ctl("chat", "--system", "Be brief.", "--max-tokens", "6", "--stats",
              socket=daemon.socket, stdin="Hi!\nAnd again?\n")
    assert out.returncode == 0 and out.stdout.startswith(want + "\n")
    cached = [int(line.split("(cached ")[1].split(")")[0])
              for line in out.stderr.splitlines() if "(cached " in line]
    assert len(cached) == 2 and cached[1] >= 16


def test_status_json_and_table(daemon):
    out = ctl("status", "--json", socket=daemon.socket)
    s = json.loads(out.stdout)
    assert s["pid"] == daemon.pid and s["max_seq"] == 512
    table = ctl("status", socket=daemon.socket).stdout
    labels = [line.split()[0] for line in table.splitlines()]
    assert labels == ["daemon", "model", "path", "kv", "cache", "prefix", "requests", "memory",
                      "threads"]
    assert f"pid {daemon.pid}" in table and "max_seq 512, kv_bs 32, q8, 408 B/token/layer" in table
    assert format_status(s).splitlines()[1:3] == table.splitlines()[1:3]


def test_tokenize(daemon, client):
    out = ctl("tokenize", "Hello world", "--json", socket=daemon.socket)
    assert json.loads(out.stdout) == client.tokenize("Hello world")
    assert ctl("tokenize", socket=daemon.socket, stdin="Hello world").stdout.split() == \
        [str(i) for i in client.tokenize("Hello world")]


def test_exit_statuses(daemon, tmp_path):
    out = ctl("ping", socket=str(tmp_path / "nobody.sock"))
    assert out.returncode == EXIT_STATUS["unavailable"] == 11 and "cannot connect" in out.stderr
    out = ctl("generate", "x", "--temperature", "-1", socket=daemon.socket)
    assert out.returncode == EXIT_STATUS["bad_request"] == 2 and "temperature" in out.stderr
    out = ctl("generate", "word " * 600, socket=daemon.socket)
    assert out.returncode == EXIT_STATUS["prompt_too_long"] == 5
    assert len(set(EXIT_STATUS.values())) == len(EXIT_STATUS)


def test_progress_bar_draws_only_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty = Tty()
    bar = ProgressBar(tty)
    bar.update(Progress("prefill", 15, 30))
    bar.clear()
    assert tty.getvalue() == "\r\033[K" + "prefill [" + "#" * 15 + "." * 15 + "] 15/30" + "\r\033[K"
    plain = io.StringIO()
    ProgressBar(plain).update(Progress("prefill", 1, 2))
    assert plain.getvalue() == ""


# ---------------------------------------------------------------- the library

def test_stream_events_progress_and_result(client):
    ids = client.tokenize("Once upon a time there was a fisherman. " * 30)[:300]
    events = list(client.stream_generate(ids=ids, max_tokens=3, progress=True))
    progress = [e for e in events if isinstance(e, Progress)]
    tokens = [e for e in events if isinstance(e, Token)]
    assert isinstance(events[-1], Result) and len(tokens) >= 1
    assert progress and all(p.phase == "prefill" and p.done < p.total for p in progress)
    assert [e for e in events if not isinstance(e, Progress)][:len(tokens)] == tokens
    quiet = list(client.stream_generate(ids=ids, max_tokens=3))
    assert not any(isinstance(e, Progress) for e in quiet)


def test_stream_cancel_and_early_exit(daemon, client):
    stream = client.stream_generate(prompt=PROMPT, max_tokens=300, ignore_eos=True)
    it = iter(stream)
    assert isinstance(next(it), Token)
    stream.cancel()
    rest = list(it)
    assert isinstance(rest[-1], Result) and rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage["completion_tokens"] < 300
    for ev in client.stream_generate(prompt=PROMPT, max_tokens=300, ignore_eos=True):
        break                                        # leaving early cancels the request
    deadline = time.monotonic() + 5
    while client.status()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.generate(prompt=PROMPT, max_tokens=2).finish_reason == "length"


def test_cancel_by_msgid_and_errors(client):
    stream = client.stream_generate(prompt=PROMPT, max_tokens=300, ignore_eos=True)
    it = iter(stream)
    first = next(it)                                 # running now
    assert client.cancel(stream.msgid) is True       # its tokens wait in the stream's mailbox
    rest = list(it)
    assert all(isinstance(e, Token) for e in rest[:-1])
    assert rest[-1].finish_reason == "cancelled"
    assert rest[-1].ids == first.ids + [i for e in rest[:-1] for i in e.ids]
    assert client.cancel(12345) is False
    with pytest.raises(KestrelClientError) as e:
        client.call("no_such_method")
    assert e.value.code == "unknown_method"
    with pytest.raises(ValueError):
        client.generate()


def test_unavailable_when_no_daemon(tmp_path):
    with pytest.raises(KestrelClientError) as e:
        Client(str(tmp_path / "none.sock"))
    assert e.value.code == "unavailable"


def test_client_imports_only_the_protocol_from_kestreld():
    out = subprocess.run([sys.executable, "-c", "import kestrelctl.cli, sys; print(sorted("
                          "m for m in sys.modules if m.startswith('kestreld')))"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['kestreld', 'kestreld.errors', 'kestreld.protocol']"
