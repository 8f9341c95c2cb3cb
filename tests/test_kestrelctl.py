"""kestrelctl: the CLI and the Python client library against the real daemon."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pexpect
import pytest

from daemon import REPO, Daemon, daemon_env
from kestreld import __version__
from kestreld.errors import EXIT_STATUS
from kestrelctl import Client, KestrelClientError, Progress, Result, Token
from kestrelctl.format import format_show, format_status
from kestrelctl.repl import history_path

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
    cached = [int(n) for n in re.findall(r"\(cached (\d+)", out.stderr)]
    assert len(cached) == 2 and cached[1] >= 16
    assert out.stdout.count("\n") == 2 and "(cached" not in out.stdout


def test_status_json_and_table(daemon):
    out = ctl("status", "--json", socket=daemon.socket)
    s = json.loads(out.stdout)
    assert s["pid"] == daemon.pid and s["max_seq"] == 512
    table = ctl("status", socket=daemon.socket).stdout
    labels = [line.split()[0] for line in table.splitlines()]
    assert labels == ["daemon", "model", "path", "kv", "cache", "prefix", "kv", "speculation",
                      "requests", "memory", "threads"]
    assert table.splitlines()[6].startswith("kv store  memory: ") and " MB, hits " in table
    assert f"pid {daemon.pid}" in table and "max_seq 512, kv_bs 32, q8, 408 B/token/layer" in table
    assert format_status(s).splitlines()[1:3] == table.splitlines()[1:3]
    assert s["experts_copied_bytes"] == {} and "experts" not in table      # a dense model
    s["experts_copied_bytes"] = {"q4_k": 1_000_000_000, "q8_0": 234_000_000}
    assert format_status(s).splitlines()[9].endswith(", MoE experts copied 1.2 GB")
    assert s["speculation"]["enabled"] and "speculation  on, " in table


def test_show_table_and_json(daemon):
    """`show` reports the status map's model and arena facts; each figure checked against
    the file itself."""
    import gguf
    out = ctl("show", "--json", socket=daemon.socket)
    shown = json.loads(out.stdout)
    r = gguf.GGUFReader(daemon.model)
    matrices = sum(int(t.n_elements) for t in r.tensors if len(t.shape) == 2)
    assert matrices / shown["model"]["n_params"] > 0.99          # norm vectors are the rest
    assert shown["model"]["weight_types"] == {"q8_0": 1.0}
    assert shown["model"]["context_length"] == r.fields["llama.context_length"].contents() == 8192
    assert shown["model"]["file_bytes"] == os.path.getsize(daemon.model)
    assert shown["model"]["chat_template_source"] == "gguf" and shown["model"]["vision"] is False
    assert shown["kv_arena_bytes"] == 512 * 30 * 408 and shown["max_seq"] == 512
    s = json.loads(ctl("status", "--json", socket=daemon.socket).stdout)
    assert shown == {"model": s["model"], **{k: s[k] for k in (
        "max_seq", "kv_bs", "kv_dtype", "kv_bytes_per_token_layer", "kv_arena_bytes")}}
    table = ctl("show", socket=daemon.socket).stdout
    assert table == format_show(s) + "\n"
    rows = dict(line.split(None, 1) if not line.startswith(("weight", "chat", "kv "))
                else (line[:14].strip(), line[15:]) for line in table.splitlines())
    assert rows["parameters"] == "134.5M" and rows["layers"] == "30"
    assert rows["context"] == "8192 tokens trained; the KV arena holds 512 (max_seq)"
    assert rows["weight types"] == "q8_0 100%" and rows["chat template"] == "gguf"
    assert rows["file"] == f"{daemon.model}, {os.path.getsize(daemon.model) / 1e6:.1f} MB"
    assert rows["kv arena"] == "6.3 MB: 512 tokens x 30 layers x 408 B (q8)"


def test_version_and_completion_need_no_daemon(tmp_path):
    out = ctl("--version", socket=str(tmp_path / "none.sock"))
    assert (out.returncode, out.stdout) == (0, f"kestrelctl {__version__} (protocol 1)\n")
    bash = ctl("completion", "bash", socket=str(tmp_path / "none.sock"))
    assert bash.returncode == 0 and "complete -o bashdefault -F _shtab_kestrelctl kestrelctl" in bash.stdout
    zsh = ctl("completion", "zsh", socket=str(tmp_path / "none.sock"))
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef kestrelctl\n")


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_in_a_real_shell(shell, tmp_path):
    """The generated script, installed as docs/client.md says, completes at Tab in the shell."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    script = ctl("completion", shell).stdout
    if shell == "bash":
        (tmp_path / "kestrelctl.bash").write_text(script)
        argv, setup = ["--norc", "--noprofile", "-i"], f"source {tmp_path / 'kestrelctl.bash'}"
    else:
        (tmp_path / "_kestrelctl").write_text(script)
        argv = ["-f", "-i"]
        setup = f"fpath=({tmp_path} $fpath); autoload -Uz compinit; compinit -u"
    sh = pexpect.spawn(shell, argv, env={"PATH": os.defpath, "TERM": "xterm", "HOME": str(tmp_path)},
                       encoding="utf-8", dimensions=(24, 200), timeout=30)
    sh.send(f"{setup}; PS1='ready> '\r")
    sh.expect_exact("ready> ")
    sh.send("kestrelctl sh\t")
    sh.expect_exact("kestrelctl show")
    sh.send("\x15kestrelctl chat --hide-t\t")            # Ctrl-U, then an option of chat
    sh.expect_exact("--hide-thinking")
    sh.send("\x15exit\r")
    sh.expect(pexpect.EOF)


def test_history_path_follows_xdg():
    assert history_path({"XDG_STATE_HOME": "/s"}) == "/s/kestrel/chat_history"
    assert history_path({}) == os.path.expanduser("~/.local/state/kestrel/chat_history")


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
