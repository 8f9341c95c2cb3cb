"""How a streamed answer reaches the terminal: the prefill bar, the thinking apart from the
answer, and Ctrl-C turned into the daemon's `cancel`.

stdout carries the model's answer and nothing else. The thinking block (chat with
`split_reasoning`) goes dimmed to stdout when stdout is a terminal, and to stderr when it is
not (so `| cat` or `> file` gets only the answer while a person still sees the thinking);
hidden, it is dropped and a "thinking..." note stands on stderr until the answer starts.
The progress bar and notes are drawn on stderr only when stderr is a terminal.
"""
from __future__ import annotations

import queue
import sys
import threading
from typing import Optional

from .client import KestrelClientError, Progress, Result, Stream, Token

BAR_WIDTH = 30
DIM, RESET = "\033[2m", "\033[0m"


class ProgressBar:
    """A one-line status on stderr (prefill bar, queue place, notes), drawn only when
    stderr is a terminal and wiped before anything else is written."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.shown = False

    def update(self, p: Progress) -> None:
        if p.phase == "queued":
            self.note(f"queued: {p.total - p.done} request(s) ahead")
        else:
            filled = BAR_WIDTH * p.done // max(p.total, 1)
            self.note(f"prefill [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {p.done}/{p.total}")

    def note(self, line: str) -> None:
        if not self.enabled:
            return
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


class AnswerPrinter:
    """Writes one streamed answer: `token` for each Token, `finish` at the end.

    The thinking is written without its surrounding blank lines, dimmed on a terminal, and
    ends with a blank line before the answer when both share stdout."""

    def __init__(self, show_thinking: bool, out=None, err=None, bar: Optional[ProgressBar] = None):
        self.out = out or sys.stdout
        err = err or sys.stderr
        self.bar = bar or ProgressBar(err)
        self.thought_to = (self.out if self.out.isatty() else err) if show_thinking else None
        self._dim = self.thought_to is not None and self.thought_to.isatty()
        self._thinking = False          # inside a shown thought
        self._thought_seen = False      # any thinking text so far (leading blanks dropped)
        self._pending = ""              # trailing whitespace of the thought, held back

    def token(self, t: Token) -> None:
        if t.reasoning:
            self._thought(t.reasoning)
        if t.text:
            self._end_thought(before_answer=True)
            self.bar.clear()
            self.out.write(t.text)
            self.out.flush()

    def finish(self) -> None:
        """End the answer's line (and an unfinished thought)."""
        self._end_thought(before_answer=False)
        self.bar.clear()
        self.out.write("\n")
        self.out.flush()

    def _thought(self, text: str) -> None:
        if self.thought_to is None:
            if not self._thought_seen:
                self._thought_seen = True
                self.bar.note("thinking...")
            return
        if not self._thought_seen:
            text = text.lstrip()
            if not text:
                return
            self._thought_seen = True
        body = text.rstrip()
        if not body:                    # only whitespace: it may be inside the thought
            self._pending += text
            return
        self.bar.clear()
        if not self._thinking:
            self._thinking = True
            if self.thought_to is not self.out:
                self.out.flush()
            if self._dim:
                self.thought_to.write(DIM)
        self.thought_to.write(self._pending + body)
        self._pending = text[len(body):]
        self.thought_to.flush()

    def _end_thought(self, before_answer: bool) -> None:
        """Close a shown thought: its own line on stderr; on stdout a blank line before the
        answer (or nothing more: `finish` ends the line)."""
        if not self._thinking:
            return
        self._thinking, self._pending = False, ""
        if self.thought_to is not self.out:
            end = "\n"
        else:
            end = "\n\n" if before_answer else ""
        self.thought_to.write((RESET if self._dim else "") + end)
        self.thought_to.flush()


_END = object()


def play(stream: Stream, printer: AnswerPrinter) -> tuple[Optional[Result], bool]:
    """Show `stream` until its Result; (the Result, whether Ctrl-C was pressed).

    The stream is read on a helper thread, so Ctrl-C (delivered to the main thread) never
    lands inside the client's socket reading: it sends `cancel`, and the stream is read on
    until the daemon's last word (a Result with finish_reason "cancelled", or the
    `cancelled` error if the request had not started: then the Result is None). Other
    errors are raised after the answer's line is ended."""
    events: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for ev in stream:
                events.put(ev)
        except BaseException as e:      # the error travels to the main thread, raised there
            events.put(e)
        events.put(_END)

    threading.Thread(target=read, name="kestrelctl-stream", daemon=True).start()
    result, error, interrupted = None, None, False
    while True:
        try:
            ev = events.get()
            if ev is _END:
                break
            if isinstance(ev, Progress):
                printer.bar.update(ev)
            elif isinstance(ev, Token):
                printer.token(ev)
            elif isinstance(ev, Result):
                result = ev
            else:
                error = ev
        except KeyboardInterrupt:
            if not interrupted:
                interrupted = True
                try:
                    stream.cancel()
                except KestrelClientError:
                    pass                # the connection is gone: the reader will say so
    printer.finish()
    if error is not None and not (interrupted and getattr(error, "code", None) == "cancelled"):
        raise error
    return result, interrupted
