"""kestrelctl/display.py: where each piece of a streamed answer is written."""
from __future__ import annotations

import io

from kestrelctl.client import Progress, Token
from kestrelctl.display import DIM, RESET, AnswerPrinter, ProgressBar

WIPE = "\r\033[K"


class Tty(io.StringIO):
    def isatty(self):
        return True


def pieces(printer, *tokens) -> None:
    """Feed (text, reasoning) pairs, then finish."""
    for text, reasoning in tokens:
        printer.token(Token(text, [0], reasoning=reasoning))
    printer.finish()


STREAM = [("", "\n"), ("", "I should"), ("", " greet.\n"), ("", "\n"), ("Hello", ""), ("!", None)]


def test_progress_bar_draws_only_on_a_tty():
    tty = Tty()
    bar = ProgressBar(tty)
    bar.update(Progress("prefill", 15, 30))
    bar.clear()
    assert tty.getvalue() == WIPE + "prefill [" + "#" * 15 + "." * 15 + "] 15/30" + WIPE
    plain = io.StringIO()
    ProgressBar(plain).update(Progress("prefill", 1, 2))
    assert plain.getvalue() == ""


def test_thinking_on_a_terminal_is_dimmed_and_apart():
    out, err = Tty(), Tty()
    pieces(AnswerPrinter(True, out, err), *STREAM)
    assert out.getvalue() == DIM + "I should greet." + RESET + "\n\nHello!\n"
    assert err.getvalue() == ""


def test_thinking_goes_to_stderr_when_stdout_is_not_a_terminal():
    out, err = io.StringIO(), Tty()
    pieces(AnswerPrinter(True, out, err), *STREAM)
    assert out.getvalue() == "Hello!\n"
    assert err.getvalue() == DIM + "I should greet." + RESET + "\n"
    out, err = io.StringIO(), io.StringIO()
    pieces(AnswerPrinter(True, out, err), *STREAM)
    assert (out.getvalue(), err.getvalue()) == ("Hello!\n", "I should greet.\n")


def test_hidden_thinking_leaves_only_a_note_that_is_wiped():
    out, err = Tty(), Tty()
    pieces(AnswerPrinter(False, out, err), *STREAM)
    assert out.getvalue() == "Hello!\n"
    assert err.getvalue() == WIPE + "thinking..." + WIPE


def test_an_answer_cut_inside_its_thinking():
    out = Tty()
    pieces(AnswerPrinter(True, out, io.StringIO()), ("", "Still"), ("", " thinking "))
    assert out.getvalue() == DIM + "Still thinking" + RESET + "\n"
