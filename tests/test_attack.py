"""The outside attack of issue 49, replayed against the real daemon: each break it found
(and the degraded answers) with what a client now gets. Unit-level halves of these are in
test_prompt.py / test_control.py (control tokens), test_protocol.py (roles, schemas),
test_constraint.py (grammars), test_sampler.py (repeat penalty), test_http.py (CSRF, Host)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from daemon import Daemon
from kestrelctl import KestrelClientError
from test_server import SHORT

LEFTOVER = "kv-" + "0" * 32 + ".tmp"     # an interrupted write's temp file
CORRUPT = "kv-" + "1" * 32 + ".kv"       # a snapshot of garbage


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("atk") / "a.sock", "--max-seq", "256") as d:
        yield d


# ---------------------------------------------------------------- 8: disk KV unusable

@contextlib.contextmanager
def read_only(path: Path):
    """`path` bind-mounted read-only onto itself (as after errors=remount-ro)."""
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(path), str(path)]).returncode:
        pytest.skip("needs root and mount to make a read-only file system")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def assert_serves_without_disk_tier(d: Daemon, says: str) -> None:
    with d.client() as c:
        assert len(c.generate(prompt=SHORT, max_tokens=3).ids) == 3
        st = c.status()["disk_kv"]
    assert st["enabled"] is False and says in st["error"], st
    assert "starting without the disk KV tier" in d.log()


@pytest.mark.parametrize("leftover", [LEFTOVER, CORRUPT])
def test_a_read_only_disk_kv_dir_starts_without_the_tier(tmp_path, leftover):
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / leftover).write_bytes(b"garbage" * 100)
    with read_only(kv), Daemon(tmp_path / "k.sock", "--max-seq", "256", "--disk-kv", str(kv)) as d:
        assert_serves_without_disk_tier(d, "Read-only file system")


def test_a_disk_kv_path_that_is_a_file_starts_without_the_tier(tmp_path):
    kv = tmp_path / "kv"
    kv.write_text("not a directory")
    with Daemon(tmp_path / "k.sock", "--max-seq", "256", "--disk-kv", str(kv)) as d:
        assert_serves_without_disk_tier(d, str(kv))
