"""`kestrelctl chat`: the conversation loop, its input and its slash commands.

Input comes through readline when stdin is a terminal (line editing, Tab completion of the
commands, history kept between runs in $XDG_STATE_HOME/kestrel/chat_history, else
~/.local/state/kestrel/chat_history, created 0600 in a 0700 directory), else line by line
from the pipe. A message between lines starting and ending with \"\"\" may span lines; a
pasted block arrives whole (readline's bracketed paste). A line starting with / is a
command and never reaches the model (/help lists them).

stdout carries the model's answers only; prompts, command output, notes and errors go to
stderr. Each turn resends the whole conversation, so the daemon's prefix cache reuses the
KV of everything said before and prefills only the new message.

Ctrl-C during an answer sends `cancel`; the cancelled turn (question and partial answer)
is not kept: a cut-off reply in the history would be continued as if the model had said it,
and dropping it costs nothing, since the daemon keeps the KV of every earlier turn (its
cache is cut back to what the arena holds) and the next turn's prompt still starts with
them. Up recalls the question. Ctrl-C at the prompt discards the line; Ctrl-D or /bye leaves.
"""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional

from kestreld.errors import BadRequest
from kestreld.protocol import OPTION_CHECKS

from .client import UNAVAILABLE, Client, KestrelClientError, Result
from .conversation import Conversation, read_image
from .display import AnswerPrinter, play
from .format import footer, human_bytes, weight_shares

PROMPT, CONTINUED = ">>> ", "... "
BLOCK = '"""'
HISTORY_LINES = 1000
# The sampling options /set changes (protocol.py's OPTION_CHECKS checks their values).
SET_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repeat_penalty")
SET_KEYS = SET_OPTIONS + ("system", "think", "nothink", "stats")
COMMANDS = ("/help", "/set", "/show", "/clear", "/save", "/load", "/image", "/bye")

HELP = f"""\
Commands (never sent to the model):
  /set {'|'.join(SET_OPTIONS)} VALUE
                      a sampling option for the next turns (checked as the daemon does)
  /set system TEXT    the system prompt (no TEXT: none)
  /set think|nothink  Qwen3's thinking on or off
  /set stats on|off   a footer after each answer: prompt and cached tokens, TTFT, tok/s
  /show               the model, the settings and the KV cache
  /clear              a new conversation (the system prompt stays)
  /save FILE          the conversation as JSON (the protocol's chat messages)
  /load FILE          a saved conversation instead of this one
  /image PATH         an image for the next message (Qwen3-VL)
  /bye                leave (or Ctrl-D)
Enter sends the line; {BLOCK} on a line of its own starts and ends a message of several
lines (also one that starts with /). Ctrl-C stops an answer; the turn is then not kept."""


def say(text: str) -> None:
    """A line for the person, on stderr (after whatever the answer has written)."""
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def history_path(env: Mapping[str, str]) -> str:
    """$XDG_STATE_HOME/kestrel/chat_history, else ~/.local/state/kestrel/chat_history."""
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "kestrel", "chat_history")


# ---------------------------------------------------------------- input

class LineReader:
    """Messages and commands, one per `read`: from readline on a terminal, else from stdin."""

    def __init__(self, interactive: bool, history: Optional[str] = None):
        self.interactive = interactive
        self.history = history
        self._readline = None
        if interactive:
            import readline             # importing it turns input() into readline
            self._readline = readline
            self._setup_readline(readline)

    def _setup_readline(self, readline) -> None:
        readline.set_completer_delims(" \t\n")
        readline.set_completer(self._complete)
        if "libedit" in (readline.__doc__ or ""):
            readline.parse_and_bind("bind ^I rl_complete")
        else:
            readline.parse_and_bind("tab: complete")
            # CPython turns bracketed paste off (its own REPL runs each pasted line); here a
            # pasted block should arrive whole, as one message, newlines included
            readline.parse_and_bind("set enable-bracketed-paste on")
        if not self.history:
            return
        directory = os.path.dirname(self.history)
        try:
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700)
                os.chmod(directory, 0o700)      # makedirs' mode is masked by the umask
            os.close(os.open(self.history, os.O_WRONLY | os.O_CREAT, 0o600))
            readline.read_history_file(self.history)
        except OSError as e:
            say(f"(no history: {self.history}: {e.strerror})")
            self.history = None
        readline.set_history_length(HISTORY_LINES)
        self._first_new = readline.get_current_history_length()

    def close(self) -> None:
        """Append this session's lines to the history file."""
        if self._readline is None or not self.history:
            return
        new = self._readline.get_current_history_length() - self._first_new
        try:
            self._readline.append_history_file(max(new, 0), self.history)
        except OSError as e:
            say(f"(history not saved: {self.history}: {e.strerror})")

    def _input(self, prompt: str) -> str:
        if not self.interactive:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")
        if sys.stdout.isatty():
            return input(prompt)
        sys.stderr.write(prompt)        # stdout holds answers only
        sys.stderr.flush()
        return input()

    def read(self) -> Optional[tuple[str, bool]]:
        """(text, literal) of the next message or command, None at the end of input;
        `literal`: it came between \"\"\" lines (never a command). Ctrl-C discards the
        line or block being typed."""
        while True:
            try:
                return self._read_one()
            except EOFError:
                return None
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                say("\n(Ctrl-D or /bye to leave)")

    def _read_one(self) -> tuple[str, bool]:
        first = self._input(PROMPT)
        if not first.lstrip().startswith(BLOCK):
            return first, False
        text = first.lstrip()[len(BLOCK):]
        while BLOCK not in text:
            try:
                text += "\n" + self._input(CONTINUED)
            except EOFError:            # the input ended inside the block: send it
                break
        text = text.split(BLOCK, 1)[0]
        return text.removeprefix("\n").removesuffix("\n"), True

    def _complete(self, text: str, state: int) -> Optional[str]:
        """readline's completer: commands, /set keys, file names after /save /load /image."""
        line = self._readline.get_line_buffer()[:self._readline.get_endidx()]
        words = line.split()
        if not line.startswith("/"):
            return None
        if len(words) <= 1 and not line.endswith(" "):
            options = [c + " " for c in COMMANDS if c.startswith(text)]
        elif words[0] == "/set" and len(words) <= 2 and (len(words) == 1 or not line.endswith(" ")):
            options = [k + " " for k in SET_KEYS if k.startswith(text)]
        elif words[0] in ("/save", "/load", "/image"):
            options = [p + "/" if os.path.isdir(p) else p
                       for p in sorted(glob.glob(os.path.expanduser(text) + "*"))]
        else:
            options = []
        return options[state] if state < len(options) else None


# ---------------------------------------------------------------- the conversation

@dataclass
class Settings:
    """What the next turn is sent with; `options` are the protocol's sampling options."""
    options: dict = field(default_factory=dict)
    think: bool = False
    show_thinking: bool = True
    stats: bool = False


class Session:
    """A conversation with the daemon: `ask` sends one turn and keeps it if it completed."""

    def __init__(self, client: Client, settings: Settings, conversation: Conversation,
                 images: Optional[list] = None):
        self.client = client
        self.settings = settings
        self.conversation = conversation
        self.images = list(images or ())   # (path, bytes) for the next user message
        self.last: Optional[Result] = None

    def ask(self, text: str) -> tuple[Optional[Result], bool]:
        """Send `text` as the next user message, with the pending images; stream the
        answer. (Result, Ctrl-C pressed). A turn that did not complete (cancelled, or an
        error, raised) is taken back, its images pending again."""
        self.conversation.add_user(text, self.images)
        images, self.images = self.images, []
        try:
            stream = self.client.stream_chat(
                self.conversation.wire(), progress=True, enable_thinking=self.settings.think,
                split_reasoning=True, **self.settings.options)
            result, interrupted = play(stream, AnswerPrinter(self.settings.show_thinking))
        except BaseException:
            self.conversation.drop_last_user()
            self.images = images
            raise
        if result is None or result.finish_reason == "cancelled":
            self.conversation.drop_last_user()
            self.images = images
        else:
            self.conversation.add_assistant(result.text)
        if result is not None:
            self.last = result
            if self.settings.stats:
                say(footer(result))
        return result, interrupted


class Repl:
    """The loop: read, run a command or ask the model, until /bye or the end of input."""

    def __init__(self, session: Session, reader: LineReader):
        self.session = session
        self.reader = reader

    def run(self) -> int:
        if self.reader.interactive:
            say(f"{self.session.client.status()['model']['name']}: /help for commands, "
                "Ctrl-D or /bye to leave")
        try:
            while True:
                line = self.reader.read()
                if line is None:
                    return 0
                text, literal = line
                if not text.strip():
                    continue
                if not literal and text.startswith("/"):
                    try:
                        if self.command(text) == "bye":
                            return 0
                    except KeyboardInterrupt:
                        say("(interrupted)")
                    continue
                self.turn(text)
        finally:
            self.reader.close()

    def turn(self, text: str) -> None:
        try:
            result, interrupted = self.session.ask(text)
        except KestrelClientError as e:
            if e.code == UNAVAILABLE:
                raise
            say(f"error: {e}")
            return
        if interrupted and not self.reader.interactive:
            raise KeyboardInterrupt         # piped input: Ctrl-C ends kestrelctl
        if result is None or result.finish_reason == "cancelled":
            say("(cancelled: this turn is not kept)")

    # ------------------------------------------------------------ commands

    def command(self, line: str) -> Optional[str]:
        """Run one slash command; "bye" to leave. Errors are one line, nothing changes."""
        name, _, rest = line.partition(" ")
        run = {"/help": self._help, "/?": self._help, "/set": self._set, "/show": self._show,
               "/clear": self._clear, "/save": self._save, "/load": self._load,
               "/image": self._image, "/bye": lambda rest: "bye"}.get(name)
        if run is None:
            say(f"unknown command {name} (/help lists them)")
            return None
        try:
            return run(rest.strip())
        except BadRequest as e:
            say(f"error: {e}")
            return None

    def _help(self, rest: str) -> None:
        say(HELP)

    def _set(self, rest: str) -> None:
        key, _, value = rest.partition(" ")
        value = value.strip()
        s = self.session.settings
        if key == "system":
            self.session.conversation.set_system(value or None)
            say(f"system prompt set: {value}" if value else "system prompt removed")
        elif key in ("think", "nothink"):
            s.think = key == "think"
            say(f"thinking {'on' if s.think else 'off'}")
        elif key == "stats":
            if value not in ("on", "off"):
                raise BadRequest("usage: /set stats on|off")
            s.stats = value == "on"
            say(f"stats {value}")
        elif key in SET_OPTIONS:
            s.options[key] = OPTION_CHECKS[key](_number(key, value))
            say(f"{key} = {s.options[key]}")
        else:
            raise BadRequest(f"/set takes one of {', '.join(SET_KEYS)}; got {key or 'nothing'}")

    def _show(self, rest: str) -> None:
        st = self.session.client.status()
        m, p, s = st["model"], st["prefix"], self.session.settings
        conv = self.session.conversation
        options = ", ".join(f"{k} {v}" for k, v in s.options.items()) or "the daemon's defaults"
        lines = [
            ("model", f"{m['name']} ({m['arch']}, {m['n_layers']} layers)"),
            ("weights", weight_shares(m["weight_types"])),
            ("context", f"{st['max_seq']} tokens (KV arena, {human_bytes(st['kv_arena_bytes'])}); "
                        f"trained {m['context_length']}"),
            ("sampling", options),
            ("thinking", f"{'on' if s.think else 'off'}, "
                         f"{'shown' if s.show_thinking else 'hidden'}"),
            ("system", conv.system or "none"),
            ("messages", f"{len(conv.messages)} in this conversation"),
            ("cache", f"{st['cache_len']} tokens valid; prefix hits {p['hits']}, "
                      f"misses {p['misses']}, {p['tokens_reused']} tokens reused in all"),
            ("last turn", self._last_turn()),
        ]
        say("\n".join(f"{k:<10} {v}" for k, v in lines))

    def _last_turn(self) -> str:
        r = self.session.last
        if r is None:
            return "none yet"
        u = r.usage
        source = f" from {u['cached_source']}" if u.get("cached_source") else ""
        return (f"reused {u['cached_tokens']} of {u['prompt_tokens']} prompt tokens{source}, "
                f"prefilled {u['prefill_tokens']}, generated {u['completion_tokens']}")

    def _clear(self, rest: str) -> None:
        self.session.conversation.clear()
        self.session.images = []
        say("new conversation")

    def _save(self, path: str) -> None:
        if not path:
            raise BadRequest("usage: /save FILE")
        self.session.conversation.save(path)
        say(f"saved {len(self.session.conversation.messages)} messages to {path}")

    def _load(self, path: str) -> None:
        if not path:
            raise BadRequest("usage: /load FILE")
        self.session.conversation = Conversation.load(path)
        say(f"loaded {len(self.session.conversation.messages)} messages from {path}")

    def _image(self, path: str) -> None:
        if not path:
            raise BadRequest("usage: /image PATH")
        if not self.session.client.status()["model"]["vision"]:
            raise BadRequest("the model takes no images (a Qwen3-VL model with its vision "
                             "weights does)")
        self.session.images.append(read_image(path))
        say(f"image {self.session.images[-1][0]} ({human_bytes(len(self.session.images[-1][1]))}) "
            "goes with the next message")


def _number(name: str, text: str):
    """A /set value as the int or float it spells (the option's check says if it fits)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise BadRequest(f"{name} needs a number, got {text!r}") from None
