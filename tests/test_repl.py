"""`kestrelctl chat` as a person uses it: in a pseudo-terminal (pexpect), its screen rendered
by a terminal emulator (pyte), against the real daemon on SmolLM2 (and, for the thinking
display, on a scripted model whose greedy answer is known: tests/scripted_model.py).

What reached the daemon is read back from the daemon itself: after a turn, its prefix cache
holds that turn's prompt, so asking again with the messages the test expects must reuse all
but the last token (`cached_tokens == prompt_tokens - 1`); any other text gives a shorter
common prefix. `status.total_requests` shows what never reached the engine.
"""
from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys

import pexpect
import pyte
import pytest

import modelgen_vl
import scripted_model
from daemon import REPO, Daemon, daemon_env
from test_server import wait_idle
from kestreld.errors import BadRequest
from kestreld.protocol import OPTION_CHECKS
from kestrelctl.display import DIM, RESET

COLS, ROWS = 250, 50          # wide: tmp paths in messages fit on one line
PROMPT = ">>> "


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("repl") / "k.sock") as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture
def state(tmp_path):
    """An empty home and XDG state directory for one test."""
    return tmp_path / "home"


class Terminal:
    """`kestrelctl chat ARGS` in a pseudo-terminal; `screen()` is what a person sees."""

    def __init__(self, socket: str, home, *args: str):
        env = {**daemon_env(), "KESTREL_SOCKET": socket, "HOME": str(home),
               "XDG_STATE_HOME": str(home / "state"), "TERM": "xterm"}
        home.mkdir(parents=True, exist_ok=True)
        self._screen = pyte.Screen(COLS, ROWS)
        self._stream = pyte.Stream(self._screen)
        self.raw = ""
        # Ctrl-C reaches the program as at a person's terminal, even where the tests run as a
        # background job (whose shell leaves SIGINT ignored, and the child would inherit that)
        self.child = pexpect.spawn(sys.executable, ["-m", "kestrelctl", "chat", *args], cwd=str(REPO),
                                   env=env, encoding="utf-8", dimensions=(ROWS, COLS), timeout=120,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.child.logfile_read = self
        self.prompt()

    def write(self, data: str) -> None:        # pexpect's logfile_read: all the child writes
        self.raw += data
        self._stream.feed(data)

    def flush(self) -> None:
        pass

    def prompt(self) -> None:
        """Wait for the next input prompt."""
        self.child.expect_exact(PROMPT)

    def line(self, text: str) -> None:
        """Type a line, press Enter, wait for the next prompt."""
        self.child.send(text + "\r")
        self.prompt()

    def screen(self) -> str:
        return "\n".join(line.rstrip() for line in self._screen.display).rstrip()

    def after(self, marker: str) -> str:
        """The screen from the last line that starts with `marker` on."""
        lines = self.screen().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(marker)]
        assert starts, f"{marker!r} not on the screen:\n{self.screen()}"
        return "\n".join(lines[starts[-1]:])

    def bye(self) -> int:
        self.child.send("/bye\r")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def saved(self, path) -> list:
        """The conversation as the REPL holds it (/save)."""
        self.line(f"/save {path}")
        return json.loads(path.read_text())


def assert_daemon_received(client, messages: list, **opts) -> dict:
    """The daemon's last prompt was exactly `messages` rendered; returns the usage."""
    r = client.chat(messages, max_tokens=1, **opts)
    assert r.usage["cached_tokens"] == r.usage["prompt_tokens"] - 1, r.usage
    return r.usage


def total_requests(client) -> int:
    return client.status()["total_requests"]


def error_of(name: str, value) -> str:
    """The protocol's own message for a bad option value."""
    with pytest.raises(BadRequest) as e:
        OPTION_CHECKS[name](value)
    return str(e.value)


# ---------------------------------------------------------------- input

def test_line_editing_edits_what_reaches_the_daemon(daemon, client, state):
    t = Terminal(daemon.socket, state, "--max-tokens", "6")
    t.child.send("kestrel in one word")
    t.child.send("\x01")                    # Ctrl-A: start of the line
    t.child.send("Describe a ")
    t.line("")
    assert ">>> Describe a kestrel in one word" in t.screen()
    assert_daemon_received(client, [{"role": "user", "content": "Describe a kestrel in one word"}])
    t.child.send("/sh\t")                   # Tab completes the command
    t.line("")
    assert t.after(">>> /show").splitlines()[1].startswith("model")
    assert t.bye() == 0


def test_history_is_kept_between_runs(daemon, client, state):
    t = Terminal(daemon.socket, state, "--max-tokens", "4")
    t.line("What do kestrels eat?")
    assert t.bye() == 0
    path = state / "state" / "kestrel" / "chat_history"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert "What do kestrels eat?" in path.read_text().splitlines()

    client.chat([{"role": "user", "content": "Something else entirely."}], max_tokens=1)
    t = Terminal(daemon.socket, state, "--max-tokens", "4")
    t.child.send("\x1b[A\x1b[A")            # Up, Up (past /bye): the first run's question
    t.line("")
    assert ">>> What do kestrels eat?" in t.screen()
    assert_daemon_received(client, [{"role": "user", "content": "What do kestrels eat?"}])
    assert t.bye() == 0


def test_a_multi_line_message_typed_and_pasted(daemon, client, state, tmp_path):
    t = Terminal(daemon.socket, state, "--max-tokens", "4")
    t.child.send('"""\r')
    t.child.expect_exact("... ")
    t.child.send("Roses are red,\r")
    t.child.send("violets are blue.\r")
    t.line('"""')
    assert '... Roses are red,\n... violets are blue.\n... """' in t.screen()
    # a paste, as a terminal sends it once readline asked for bracketed paste
    assert "\x1b[?2004h" in t.raw
    t.child.send("\x1b[200~First line\rsecond line\x1b[201~")
    t.line("")
    messages = t.saved(tmp_path / "c.json")
    assert [m["content"] for m in messages if m["role"] == "user"] == \
        ["Roses are red,\nviolets are blue.", "First line\nsecond line"]
    assert_daemon_received(client, messages[:-1])
    assert t.bye() == 0


# ---------------------------------------------------------------- commands

def test_commands_that_never_reach_the_engine(daemon, client, state):
    t = Terminal(daemon.socket, state)
    before = total_requests(client)
    t.line("/help")
    assert "/set temperature|top_p|top_k|min_p|max_tokens|seed|repeat_penalty VALUE" in t.screen()
    t.line("/nope")
    assert t.after(">>> /nope").splitlines()[1] == "unknown command /nope (/help lists them)"
    t.line("/set temperature -1")
    t.line("/set top_k 1.5")
    t.line("/set top_p 0")
    t.line("/set seed lots")
    t.line("/set stats maybe")
    t.line("/set colour blue")
    screen = t.after(">>> /set temperature -1")
    for msg in (error_of("temperature", -1), error_of("top_k", 1.5), error_of("top_p", 0),
                "seed needs a number, got 'lots'", "usage: /set stats on|off",
                "/set takes one of temperature, top_p"):
        assert "error: " + msg in screen
    t.line("/set temperature 0.5")
    t.line("/set system Be brief.")
    t.line("/set think")
    t.line("/set nothink")
    t.line("/set stats on")
    t.line("/show")
    t.line("/clear")
    t.line("/image /no/such/picture.png")
    t.child.send("a half-typed line\x03")   # Ctrl-C at the prompt drops the line
    t.prompt()
    assert "(Ctrl-D or /bye to leave)" in t.screen()
    assert total_requests(client) == before
    assert t.bye() == 0
    assert total_requests(client) == before


def test_set_options_reach_the_daemon(daemon, client, state, tmp_path):
    t = Terminal(daemon.socket, state)
    values = {"temperature": "1.5", "top_p": "0.95", "top_k": "40", "min_p": "0.02",
              "max_tokens": "8", "seed": "7", "repeat_penalty": "1.1"}
    for name, value in values.items():
        t.line(f"/set {name} {value}")
        assert t.after(f">>> /set {name}").splitlines()[1] == f"{name} = {json.loads(value)}"
    t.line("Name three colours.")
    messages = t.saved(tmp_path / "c.json")
    opts = {k: json.loads(v) for k, v in values.items()}
    sampled = client.chat(messages[:-1], **opts).text
    greedy = client.chat(messages[:-1], max_tokens=8).text
    assert messages[-1] == {"role": "assistant", "content": sampled} and sampled != greedy
    assert sampled in t.screen()
    assert t.bye() == 0


def test_system_stats_and_show(daemon, client, state, tmp_path):
    t = Terminal(daemon.socket, state, "--max-tokens", "5")
    t.line("/set system You answer in French.")
    assert "system prompt set: You answer in French." in t.screen()
    t.line("/set stats on")
    t.line("Good morning!")
    t.line("And good night!")
    t.line("/show")
    status = client.status()
    messages = t.saved(tmp_path / "c.json")
    assert messages[0] == {"role": "system", "content": "You answer in French."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    footer = [line for line in t.screen().splitlines() if line.startswith("prompt ")]
    show = t.after(">>> /show")
    usage = assert_daemon_received(client, messages[:-1])
    # the second turn resent the first: the footer shows the daemon's reuse
    assert footer[-1].startswith(f"prompt {usage['prompt_tokens']} tokens (cached ")
    second = int(footer[-1].split("(cached ")[1].split()[0])
    assert second >= 16 and "from memory" in footer[-1] and "tok/s" in footer[-1]
    assert f"cache      {status['cache_len']} tokens valid; prefix hits {status['prefix']['hits']}" in show
    assert (f"last turn  reused {second} of {usage['prompt_tokens']} prompt tokens from memory"
            in show)
    assert "system     You answer in French." in show and "weights    q8_0 100%" in show
    assert "context    512 tokens (KV arena" in show and "sampling   max_tokens 5" in show
    t.line("/set system")
    t.line("Bye!")
    messages = t.saved(tmp_path / "c.json")
    assert messages[0]["role"] == "user" and len(messages) == 6
    assert_daemon_received(client, messages[:-1])
    assert t.bye() == 0


def test_clear_save_and_load(daemon, client, state, tmp_path):
    t = Terminal(daemon.socket, state, "--max-tokens", "5", "--system", "Be kind.")
    t.line("Hello!")
    t.line("/clear")
    assert t.saved(tmp_path / "empty.json") == [{"role": "system", "content": "Be kind."}]
    t.line("A new start.")
    assert_daemon_received(client, [{"role": "system", "content": "Be kind."},
                                    {"role": "user", "content": "A new start."}])
    earlier = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": "Nice to meet you, Ada."}]
    (tmp_path / "ada.json").write_text(json.dumps(earlier))
    t.line(f"/load {tmp_path / 'ada.json'}")
    assert f"loaded 2 messages from {tmp_path / 'ada.json'}" in t.screen()
    t.line("What is my name?")
    assert_daemon_received(client, earlier + [{"role": "user", "content": "What is my name?"}])
    (tmp_path / "bad.json").write_text('[{"role": "user"}]')
    (tmp_path / "junk.json").write_text("not json")
    before = t.saved(tmp_path / "now.json")
    t.line(f"/load {tmp_path / 'bad.json'}")
    t.line(f"/load {tmp_path / 'junk.json'}")
    t.line(f"/load {tmp_path / 'missing.json'}")
    screen = t.after(f">>> /load {tmp_path / 'bad.json'}")
    assert "does not hold chat messages: messages[0] must be a map with role and content" in screen
    assert f"error: {tmp_path / 'junk.json'} is not JSON" in screen
    assert f"error: cannot read {tmp_path / 'missing.json'}: No such file or directory" in screen
    assert t.saved(tmp_path / "now.json") == before
    assert t.bye() == 0


def test_image_needs_a_vision_model(daemon, client, state, tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(modelgen_vl.test_image(1, 100, 75))
    t = Terminal(daemon.socket, state)
    before = total_requests(client)
    t.line(f"/image {picture}")
    assert "error: the model takes no images" in t.screen()
    assert total_requests(client) == before
    assert t.bye() == 0


@pytest.fixture(scope="module")
def vl_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    gen = modelgen_vl.generate(root / "model")
    with Daemon(root / "v.sock", "--cache-dir", str(root / "cache"), model=str(gen.dir)) as d:
        yield d


def test_image_goes_with_the_next_message(vl_daemon, state, tmp_path):
    picture = tmp_path / "p.png"
    picture.write_bytes(modelgen_vl.test_image(1, 100, 75))
    t = Terminal(vl_daemon.socket, state, "--max-tokens", "4", "--stats")
    t.line(f"/image {picture}")
    assert f"image {picture} ({len(picture.read_bytes()) / 1e3:.1f} kB) goes with the next message" \
        in t.screen()
    t.line("What is this?")
    assert "1 image(s)" in t.after(">>> What is this?")
    t.line("And this word?")
    messages = t.saved(tmp_path / "c.json")
    assert messages[0] == {"role": "user", "content": [{"type": "image", "path": str(picture)},
                                                       {"type": "text", "text": "What is this?"}]}
    assert messages[2] == {"role": "user", "content": "And this word?"}
    sent = [{"role": "user", "content": [{"type": "image", "data": picture.read_bytes()},
                                         {"type": "text", "text": "What is this?"}]}] + messages[1:3]
    with vl_daemon.client() as c:
        assert assert_daemon_received(c, sent)["images"] == 1
    assert t.bye() == 0


# ---------------------------------------------------------------- Ctrl-C, Ctrl-D

def test_ctrl_c_cancels_the_answer_and_the_conversation_goes_on(daemon, client, state, tmp_path):
    t = Terminal(daemon.socket, state, "--max-tokens", "300", "--ignore-eos", "--stats")
    before = total_requests(client)
    t.child.send("Tell me a long story about a kestrel.\r")
    t.child.expect(r"\n[^\n]*\w+ \w+ \w+ \w+")      # the answer is streaming
    t.child.sendintr()
    t.child.expect_exact("(cancelled: this turn is not kept)")
    t.prompt()
    footer = [line for line in t.screen().splitlines() if line.startswith("prompt ")][-1]
    generated = int(footer.split(" tokens at ")[0].rsplit(" ", 1)[1])
    assert 0 < generated < 300
    s = wait_idle(client)
    assert s["total_requests"] == before + 1 and s["active"] == 0
    t.line("/set max_tokens 5")
    t.line("Hi!")
    messages = t.saved(tmp_path / "c.json")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Hi!"
    assert_daemon_received(client, messages[:1], ignore_eos=True)
    assert not client.status()["busy"]
    t.child.sendeof()                       # Ctrl-D leaves
    t.child.expect(pexpect.EOF)
    t.child.close()
    assert t.child.exitstatus == 0


# ---------------------------------------------------------------- thinking

@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    model = scripted_model.write(root / "scripted.gguf")
    with Daemon(root / "s.sock", model=str(model)) as d:
        yield d


def test_thinking_is_dimmed_and_apart_from_the_answer(scripted, state, tmp_path):
    t = Terminal(scripted.socket, state, "--think")
    t.line("Hello!")
    answer = t.after(">>> Hello!").splitlines()[1:4]
    assert answer == [scripted_model.THOUGHT, "", scripted_model.ANSWER]
    assert DIM + scripted_model.THOUGHT + RESET in t.raw
    assert (scripted_model.ANSWER + "\r\n") in t.raw.split(RESET, 1)[1]
    t.line("/set nothink")
    t.line("Hello again!")
    assert t.after(">>> Hello again!").splitlines()[1] == scripted_model.PLAIN
    messages = t.saved(tmp_path / "c.json")
    assert [m["content"] for m in messages if m["role"] == "assistant"] == \
        [scripted_model.ANSWER, scripted_model.PLAIN]       # the thinking is not kept
    assert t.bye() == 0

    t = Terminal(scripted.socket, state, "--think", "--hide-thinking")
    t.line("Hello!")
    assert t.after(">>> Hello!").splitlines()[1] == scripted_model.ANSWER
    assert scripted_model.THOUGHT not in t.raw
    assert t.bye() == 0


def test_thinking_never_reaches_a_piped_stdout(scripted):
    def run(*args, stdin=""):
        return subprocess.run([sys.executable, "-m", "kestrelctl", "--socket", scripted.socket,
                               "chat", "--think", *args], cwd=REPO, env=daemon_env(),
                              input=stdin, capture_output=True, text=True, timeout=120)
    out = run("-m", "Hello!")
    assert (out.returncode, out.stdout) == (0, scripted_model.ANSWER + "\n")
    assert out.stderr == scripted_model.THOUGHT + "\n"              # no colour: not a tty
    out = run(stdin="Hello!\n")
    assert (out.returncode, out.stdout) == (0, scripted_model.ANSWER + "\n")
    out = run("-m", "Hello!", "--hide-thinking")
    assert (out.stdout, out.stderr) == (scripted_model.ANSWER + "\n", "")
