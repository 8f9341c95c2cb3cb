"""Who may talk to the daemon, and what it will touch on disk. (The 0660 mode of a running
daemon's socket and the refusal of a regular file / a symlink to a stale socket at start-up
are in test_server.py.)"""
from __future__ import annotations

import grp
import json
import os
import re
import signal
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from daemon import REPO, Daemon
from kestrelctl import Client, KestrelClientError
from kestreld.service import server as kserver
from kestreld.protocol import _FIELDS, OPTION_CHECKS, validate_params
from test_server import SHORT, Raw

NOBODY = 65534
GROUP = "daemon"                       # an existing group the test user is put in


@pytest.fixture
def shared_dir():
    """A directory other users may traverse (pytest's tmp dirs are 0700)."""
    d = tempfile.mkdtemp(prefix="kestrel-sec-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


def as_user(uid: int, gid: int, action) -> tuple:
    """Run `action()` in a child process that dropped to uid/gid (no supplementary groups);
    returns ("ok", value) or ("error", code) from a KestrelClientError."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = ("ok", action())
            except KestrelClientError as e:
                out = ("error", e.code)
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(text)) if text else ("crashed", None)


# ---------------------------------------------------------------- the socket file

def test_socket_is_never_wider_than_its_mode_even_under_umask_0(tmp_path, monkeypatch):
    """The mode right after bind(), before the chmod, is already within 0660: there is no
    window in which the socket is wider. Run with a caller umask of 0 (the worst case)."""
    seen = []
    real_chmod = os.chmod

    def spy_chmod(path, mode, *a, **kw):
        seen.append(stat.S_IMODE(os.lstat(path).st_mode))
        return real_chmod(path, mode, *a, **kw)

    monkeypatch.setattr(kserver.os, "chmod", spy_chmod)
    old = os.umask(0)
    try:
        sock, _ = kserver.bind_unix_socket(str(tmp_path / "s.sock"), 0o660, None)
        assert os.umask(0) == 0                     # the caller's umask is given back
    finally:
        os.umask(old)
    sock.close()
    assert seen == [0o660]                          # created 0660, not 0777 then narrowed


def test_socket_group_and_who_may_connect(shared_dir):
    gid = grp.getgrnam(GROUP).gr_gid
    with Daemon(shared_dir / "g.sock", "--max-seq", "256", "--socket-group", GROUP) as d:
        st = os.lstat(d.socket)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, 0o660)

        def ping():
            with Client(d.socket, timeout=30) as c:
                return c.ping()["pid"]

        assert as_user(NOBODY, gid, ping) == ("ok", d.pid)                 # in the group
        assert as_user(NOBODY, NOBODY, ping) == ("error", "permission_denied")  # not in it


def test_peer_credentials_are_recorded_per_connection(shared_dir):
    with Daemon(shared_dir / "p.sock", "--max-seq", "256", "--log-level", "debug",
                "--socket-mode", "666") as d:
        def my_pid():
            with Client(d.socket, timeout=30) as c:
                c.ping()
            return os.getpid()

        status, child_pid = as_user(NOBODY, NOBODY, my_pid)
        assert status == "ok"
        with Client(d.socket) as c:
            c.ping()
        log = d.log()
    assert re.search(rf"connection \d+ from pid={child_pid} uid={NOBODY} gid={NOBODY}\b", log)
    assert re.search(rf"connection \d+ from pid={os.getpid()} uid=0 gid=0\b", log)


def test_no_connection_can_cancel_another_ones_request(tmp_path):
    """There are no administrative methods; the one that acts on a request, `cancel`, only
    reaches requests of the same connection."""
    with Daemon(tmp_path / "c.sock", "--max-seq", "256") as d:
        owner, other = Raw(d.socket), Raw(d.socket)
        owner.send([0, 1, "generate", [{"prompt": SHORT, "max_tokens": 12, "ignore_eos": True,
                                        "stream": False}]])
        other.send([0, 2, "cancel", [{"id": 1}]])
        assert other.until_response(2)[1][3] == {"cancelled": False}
        done = owner.until_response(1)[1][3]
        assert done["finish_reason"] == "length" and len(done["ids"]) == 12
        owner.close()
        other.close()


# ---------------------------------------------------------------- what it touches on disk

@pytest.mark.parametrize("kind", ["symlink-to-file", "dangling-symlink", "directory", "fifo"])
def test_start_refuses_and_never_follows_what_is_at_the_path(tmp_path, kind):
    path, victim = tmp_path / "k.sock", tmp_path / "victim"
    victim.write_text("precious")
    if kind == "symlink-to-file":
        path.symlink_to(victim)
    elif kind == "dangling-symlink":
        path.symlink_to(tmp_path / "nothing")
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    before = os.lstat(path)
    d = Daemon(path)
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    assert "is not a socket; refusing to remove it" in d.log()
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert victim.read_text() == "precious" and not (tmp_path / "nothing").exists()


def test_shutdown_removes_only_its_own_socket(tmp_path):
    """If the socket path was replaced while the daemon ran (by a symlink to a victim file,
    or by another socket), SIGTERM leaves it alone."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for replacement in ("symlink", "socket"):
        path = tmp_path / f"{replacement}.sock"
        with Daemon(path, "--max-seq", "256") as d:
            os.unlink(path)
            if replacement == "symlink":
                path.symlink_to(victim)
            else:
                other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                other.bind(str(path))
                other.close()
            assert d.stop(signal.SIGTERM) == 0
        assert path.is_symlink() if replacement == "symlink" else path.is_socket()
    assert victim.read_text() == "precious"


# ---------------------------------------------------------------- the code itself

FORBIDDEN = re.compile(r"\bpickle\b|\bcPickle\b|\bmarshal\b|(?<![\w.])eval\(|(?<![\w.])exec\(|"
                       r"shell\s*=\s*True|os\.system\(|os\.popen\(|yaml\.load\(|__import__\(")


def test_product_code_has_no_pickle_eval_exec_or_shell():
    files = sorted(p for d in ("kestreld", "kestrelctl") for p in (REPO / d).rglob("*.py"))
    assert len(files) > 20
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
            for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
            if FORBIDDEN.search(line.split("#", 1)[0])]
    assert hits == []
    # The pattern does find what it looks for.
    assert all(FORBIDDEN.search(s) for s in ("import pickle", "eval(x)", "exec(code)",
                                             "run(cmd, shell=True)", "os.system('ls')"))


def test_the_only_client_given_path_is_a_chat_image_part():
    """Client-given paths: the model path comes from the command line/config only; the one
    path a client can give is a chat image part's `path`, read by the daemon with its own
    permissions and not confined (docs/reliability.md, "Open"). Either list changing is a
    reason to review confinement."""
    content = [{"type": "image", "path": "/etc/hostname"}, {"type": "text", "text": "hi"}]
    p = validate_params("chat", [{"messages": [{"role": "user", "content": content}]}], 100)
    assert p.messages[0]["content"][0] == {"type": "image", "path": "/etc/hostname"}
    names = {n for fields in _FIELDS.values() for n in fields} | set(OPTION_CHECKS)
    # (tools, tool_choice and response_format carry JSON schemas and names; embed's input,
    # rerank's query, documents and instruction are texts or ids; none is a path)
    assert names == {"prompt", "ids", "stream", "messages", "enable_thinking", "text",
                     "add_special", "id", "max_tokens", "temperature", "top_k", "top_p",
                     "min_p", "repeat_penalty", "seed", "stop", "ignore_eos", "logprobs",
                     "split_reasoning", "tools", "tool_choice", "presence_penalty",
                     "frequency_penalty", "response_format", "parallel_tool_calls",
                     "logit_bias", "speculate", "input", "dimensions", "truncate", "query",
                     "documents", "top_n", "instruction"}
