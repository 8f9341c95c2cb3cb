"""kestrelctl: talk to kestreld from the shell.

    kestrelctl [--socket PATH] generate [TEXT] [--max-tokens N] [--temperature T] [--stats]
    kestrelctl chat [-m TEXT] [--system TEXT] [--think] [--hide-thinking] [--image FILE ...]
                                        a conversation (kestrelctl/repl.py: readline, history,
                                        /commands; each turn reuses the cached prefix), or
                                        one turn with -m; images go with the first message
    kestrelctl show [--json]            the loaded model: architecture, size, weight types,
                                        context, chat template, file, KV arena
    kestrelctl embed TEXT... [--dimensions D]   one JSON line per TEXT (or stdin's lines):
                                        {"index", "text", "embedding"}
    kestrelctl rerank QUERY DOC... [--top-n N] [--instruction TEXT]
                                        one JSON line per document, best first:
                                        {"index", "relevance_score", "document"}
    kestrelctl status [--json] | tokenize [TEXT] | ping
    kestrelctl completion bash|zsh      a shell completion script (docs/client.md: how to install)
    kestrelctl --version

The socket is --socket, else $KESTREL_SOCKET, else the default path. stdout carries the
model's text only; statistics, notes and the prefill progress bar (only when stderr is a
terminal) go to stderr, and so does the thinking when stdout is not a terminal
(kestrelctl/display.py). The exit status says what went wrong: one per error code
(kestreld.errors.EXIT_STATUS, also in docs/protocol.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import shtab

from kestreld import __version__
from kestreld.errors import EXIT_INTERRUPTED, EXIT_STATUS, KestrelError
from kestreld.protocol import PROTOCOL_VERSION

from .client import Client, KestrelClientError
from .conversation import Conversation, read_image
from .display import AnswerPrinter, play
from .format import format_show, format_status, show_map, stats_line
from .repl import LineReader, Repl, Session, Settings, history_path, say


# ---------------------------------------------------------------- commands

def _options(args) -> dict:
    opts = {name: getattr(args, name) for name in
            ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed")
            if getattr(args, name) is not None}
    if args.stop:
        opts["stop"] = args.stop
    if args.ignore_eos:
        opts["ignore_eos"] = True
    return opts


def _exit_status(interrupted: bool, result) -> int:
    """EXIT_INTERRUPTED if Ctrl-C cut the answer short, else 0."""
    cut = result is None or result.finish_reason == "cancelled"
    return EXIT_INTERRUPTED if interrupted and cut else 0


def cmd_generate(client: Client, args) -> int:
    text = args.text if args.text is not None else sys.stdin.read()
    result, interrupted = play(client.stream_generate(prompt=text, progress=True, **_options(args)),
                               AnswerPrinter(show_thinking=False))
    if result is not None and args.stats:
        say(stats_line(result))
    return _exit_status(interrupted, result)


def cmd_chat(client: Client, args) -> int:
    """One turn with -m, else the conversation loop (kestrelctl/repl.py); --image files go
    with the first user message."""
    settings = Settings(options=_options(args), think=args.think,
                        show_thinking=not args.hide_thinking, stats=args.stats)
    session = Session(client, settings, Conversation(args.system),
                      [read_image(path) for path in args.image or ()])
    if args.message is not None:
        result, interrupted = session.ask(args.message)
        return _exit_status(interrupted, result)
    interactive = sys.stdin.isatty()
    reader = LineReader(interactive, history_path(os.environ) if interactive else None)
    return Repl(session, reader).run()


def cmd_show(client: Client, args) -> int:
    s = client.status()
    print(json.dumps(show_map(s), indent=2) if args.json else format_show(s))
    return 0


def cmd_status(client: Client, args) -> int:
    s = client.status()
    print(json.dumps(s, indent=2) if args.json else format_status(s))
    return 0


def cmd_tokenize(client: Client, args) -> int:
    text = args.text if args.text is not None else sys.stdin.read()
    ids = client.tokenize(text, add_special=args.add_special)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_embed(client: Client, args) -> int:
    texts = args.text or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        print("kestrelctl: embed: no text (give TEXT... or lines on stdin)", file=sys.stderr)
        return EXIT_STATUS["bad_request"]
    r = client.embed(texts, dimensions=args.dimensions, truncate=args.truncate)
    for i, (text, vector) in enumerate(zip(texts, r["embeddings"])):
        print(json.dumps({"index": i, "text": text, "embedding": vector}, ensure_ascii=False))
    return 0


def cmd_rerank(client: Client, args) -> int:
    r = client.rerank(args.query, args.documents, top_n=args.top_n, instruction=args.instruction)
    for x in r["results"]:
        print(json.dumps({**x, "document": args.documents[x["index"]]}, ensure_ascii=False))
    return 0


def cmd_ping(client: Client, args) -> int:
    r = client.ping()
    print(f"ok (pid {r['pid']})")
    return 0


def cmd_completion(args) -> int:
    """Print the completion script for bash or zsh, generated from the argparse tree."""
    print(shtab.complete(parser(), shell=args.shell))
    return 0


# ---------------------------------------------------------------- argv

def _sampling_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--max-tokens", type=int, help="most tokens to generate (daemon default 256)")
    a("--temperature", type=float, help="0 = greedy (default)")
    a("--top-k", type=int)
    a("--top-p", type=float)
    a("--min-p", type=float)
    a("--repeat-penalty", type=float)
    a("--seed", type=int)
    a("--stop", action="append", help="stop string (repeatable)")
    a("--ignore-eos", action="store_true", help="go on past end-of-sequence (benchmarks)")
    a("--stats", action="store_true", help="token counts and timings on stderr")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kestrelctl", description="Client for the kestreld daemon",
                                epilog="exit status: " + ", ".join(
                                    f"{v} {k}" for k, v in EXIT_STATUS.items()))
    p.add_argument("--version", action="version",
                   version=f"kestrelctl {__version__} (protocol {PROTOCOL_VERSION})")
    p.add_argument("--socket", help="kestreld socket (default $KESTREL_SOCKET or "
                                    "/run/kestrel/kestreld.sock)").complete = shtab.FILE
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete TEXT (or stdin), streamed")
    g.add_argument("text", nargs="?", help="the prompt (default: read stdin)")
    _sampling_args(g)
    g.set_defaults(run=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (a conversation, or one turn with -m)")
    c.add_argument("-m", "--message", help="one user message: answer it and exit")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--think", action="store_true", help="enable_thinking (Qwen3)")
    c.add_argument("--hide-thinking", action="store_true",
                   help="do not show the thinking (shown dimmed on a terminal, else on stderr)")
    c.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the first user message (repeatable; Qwen3-VL)"
                   ).complete = shtab.FILE
    _sampling_args(c)
    c.set_defaults(run=cmd_chat)
    w = sub.add_parser("show", help="the loaded model: architecture, size, weight types, "
                                    "context, chat template, file, KV arena")
    w.add_argument("--json", action="store_true", help="the status map's model and arena keys")
    w.set_defaults(run=cmd_show)
    s = sub.add_parser("status", help="what the daemon runs and how it is doing")
    s.add_argument("--json", action="store_true", help="the raw status map as JSON")
    s.set_defaults(run=cmd_status)
    t = sub.add_parser("tokenize", help="token ids of TEXT (or stdin)")
    t.add_argument("text", nargs="?")
    t.add_argument("--add-special", action="store_true", help="add BOS etc. as the model does")
    t.add_argument("--json", action="store_true", help="print a JSON list")
    t.set_defaults(run=cmd_tokenize)
    e = sub.add_parser("embed", help="the embedding of each TEXT (or of each line of stdin), "
                                     "one JSON line each")
    e.add_argument("text", nargs="*")
    e.add_argument("--dimensions", type=int, help="keep the first D values (renormalized)")
    e.add_argument("--truncate", action="store_true",
                   help="cut a text longer than the context instead of an error")
    e.set_defaults(run=cmd_embed)
    r = sub.add_parser("rerank", help="score each DOC against QUERY with a reranker, best first")
    r.add_argument("query")
    r.add_argument("documents", nargs="+", metavar="DOC")
    r.add_argument("--top-n", type=int, help="list only the N best")
    r.add_argument("--instruction", help="the task, in the reranker's prompt (default: the "
                                         "model's, e.g. web search)")
    r.set_defaults(run=cmd_rerank)
    sub.add_parser("ping", help="is the daemon there?").set_defaults(run=cmd_ping)
    k = sub.add_parser("completion", help="print a completion script for bash or zsh")
    k.add_argument("shell", choices=("bash", "zsh"))
    k.set_defaults(offline=cmd_completion)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    path = args.socket or os.environ.get("KESTREL_SOCKET") or None
    try:
        if hasattr(args, "offline"):    # needs no daemon
            return args.offline(args)
        with Client(path) as client:
            return args.run(client, args)
    except KestrelClientError as e:
        print(f"kestrelctl: {e}", file=sys.stderr)
        return EXIT_STATUS.get(e.code, 1)
    except KestrelError as e:           # refused here before asking the daemon (a bad file)
        print(f"kestrelctl: {e.code}: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:             # stdout closed early (| head): not an error of ours
        return 0


if __name__ == "__main__":
    sys.exit(main())
