"""kestrelctl: talk to kestreld from the shell.

    kestrelctl [--socket PATH] generate [TEXT] [--max-tokens N] [--temperature T] [--stats]
    kestrelctl chat [-m TEXT] [--system TEXT] [--image FILE ...]
                                                   interactive (history kept: prefix-cache hits);
                                                   images go with the first user message
    kestrelctl status [--json] | tokenize [TEXT] | ping

The socket is --socket, else $KESTREL_SOCKET, else the default path. Text is streamed to
stdout; statistics and the prefill progress bar (only when stderr is a terminal) go to
stderr. The exit status says what went wrong: one per error code (kestreld.errors.EXIT_STATUS,
also in docs/protocol.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from kestreld.errors import EXIT_INTERRUPTED, EXIT_STATUS

from .client import Client, KestrelClientError, Progress, Result, Token

BAR_WIDTH = 30


# ---------------------------------------------------------------- output helpers

class ProgressBar:
    """A one-line prefill bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.enabled = stream.isatty()
        self.shown = False

    def update(self, p: Progress) -> None:
        if not self.enabled:
            return
        if p.phase == "queued":
            line = f"queued: {p.total - p.done} request(s) ahead"
        else:
            filled = BAR_WIDTH * p.done // max(p.total, 1)
            line = f"prefill [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {p.done}/{p.total}"
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def stats_line(r: Result) -> str:
    u, t = r.usage, r.timings
    return (f"prompt {u['prompt_tokens']} tokens (cached {u['cached_tokens']}), prefill "
            f"{u['prefill_tokens']} in {t['prefill_ms']:.0f} ms ({t['prefill_tok_s']:.1f} tok/s), "
            f"{u['completion_tokens']} tokens in {t['decode_ms']:.0f} ms "
            f"({t['decode_tok_s']:.1f} tok/s), ttft {t['ttft_ms']:.0f} ms, "
            f"queue {t['queue_ms']:.0f} ms, finish {r.finish_reason}")


def stream_out(stream, out=sys.stdout) -> Result:
    """Print a stream's tokens as they come, drawing the progress bar; return the Result.
    Ctrl-C cancels the request before it propagates."""
    bar = ProgressBar()
    try:
        for ev in stream:
            if isinstance(ev, Progress):
                bar.update(ev)
                continue
            bar.clear()
            if isinstance(ev, Token):
                out.write(ev.text)
                out.flush()
            else:
                return ev
    except KeyboardInterrupt:
        bar.clear()
        stream.cancel()
        raise
    raise KestrelClientError("internal", "the stream ended without a result")


def format_status(s: dict) -> str:
    """The status map as a readable table."""
    m, p = s["model"], s["prefix"]
    up = int(s["uptime_s"])
    rows = [
        ("daemon", f"kestreld {s['version']} (protocol {s['protocol']}), pid {s['pid']}, "
                   f"up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s"),
        ("model", f"{m['name']} ({m['arch']}, {m['n_layers']} layers, "
                  f"{m['n_params'] / 1e6:.0f}M params, weights {m['weights']})"),
        ("path", m["path"]),
        ("kv arena", f"max_seq {s['max_seq']}, kv_bs {s['kv_bs']}, {s['kv_dtype']}, "
                     f"{s['kv_bytes_per_token_layer']} B/token/layer, "
                     f"{s['kv_arena_bytes'] / 1e6:.1f} MB"),
        ("cache", f"{s['cache_len']} tokens valid"),
        ("prefix", f"{'on' if p['enabled'] else 'off'}, min {p['min_match']}, hits {p['hits']}, "
                   f"misses {p['misses']}, {p['tokens_reused']} tokens reused"),
        ("requests", f"busy {'yes' if s['busy'] else 'no'}, active {s['active']}, "
                     f"queued {s['queued']}, total {s['total_requests']}"),
        ("memory", f"rss {s['rss_mb']:.0f} MB, available {s['mem_avail_mb']:.0f} MB"),
        ("threads", str(s["threads"])),
    ]
    d = s.get("disk_kv") or {}
    if d.get("enabled"):
        rows.insert(6, ("disk kv", f"{d['files']} files, {d['bytes'] / 1e6:.1f} MB, hits {d['hits']}, "
                                   f"misses {d['misses']}"))
    return "\n".join(f"{k:<9} {v}" for k, v in rows)


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


def cmd_generate(client: Client, args) -> int:
    text = args.text if args.text is not None else sys.stdin.read()
    r = stream_out(client.stream_generate(prompt=text, progress=True, **_options(args)))
    print()
    if args.stats:
        print(stats_line(r), file=sys.stderr)
    return 0


def _chat_turn(client: Client, history: list, args) -> None:
    r = stream_out(client.stream_chat(history, progress=True, enable_thinking=args.think,
                                      **_options(args)))
    print()
    history.append({"role": "assistant", "content": r.text})
    if args.stats:
        print(stats_line(r), file=sys.stderr)


def _user_message(text: str, images: list) -> dict:
    """A user message; with images, a list of image parts (their bytes) then the text."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image", "data": data} for data in images]
            + [{"type": "text", "text": text}]}


def _read_images(paths) -> list:
    out = []
    for path in paths or ():
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError as e:
            raise KestrelClientError("bad_request", f"cannot read image {path}: {e.strerror}") from None
    return out


def cmd_chat(client: Client, args) -> int:
    """One turn with -m, else a conversation read line by line until EOF; the history is
    sent again each turn, so the daemon reuses its KV for everything said before.
    --image files are sent (as bytes) with the first user message."""
    history = [{"role": "system", "content": args.system}] if args.system else []
    images = _read_images(args.image)
    if args.message is not None:
        history.append(_user_message(args.message, images))
        _chat_turn(client, history, args)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        if not line:
            return 0
        if not line.strip():
            continue
        history.append(_user_message(line.rstrip("\n"), images))
        try:
            _chat_turn(client, history, args)
            images = []
        except KeyboardInterrupt:
            if not interactive:
                raise
            history.pop()               # the turn was cancelled: forget the question
            print("\n(cancelled)", file=sys.stderr)


def cmd_status(client: Client, args) -> int:
    s = client.status()
    print(json.dumps(s, indent=2) if args.json else format_status(s))
    return 0


def cmd_tokenize(client: Client, args) -> int:
    text = args.text if args.text is not None else sys.stdin.read()
    ids = client.tokenize(text, add_special=args.add_special)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_ping(client: Client, args) -> int:
    r = client.ping()
    print(f"ok (pid {r['pid']})")
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
    p.add_argument("--socket", help="kestreld socket (default $KESTREL_SOCKET or "
                                    "/run/kestrel/kestreld.sock)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete TEXT (or stdin), streamed")
    g.add_argument("text", nargs="?", help="the prompt (default: read stdin)")
    _sampling_args(g)
    g.set_defaults(run=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (interactive, or one turn with -m)")
    c.add_argument("-m", "--message", help="one user message: answer it and exit")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--think", action="store_true", help="enable_thinking (Qwen3)")
    c.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the first user message (repeatable; Qwen3-VL)")
    _sampling_args(c)
    c.set_defaults(run=cmd_chat)
    s = sub.add_parser("status", help="what the daemon runs and how it is doing")
    s.add_argument("--json", action="store_true", help="the raw status map as JSON")
    s.set_defaults(run=cmd_status)
    t = sub.add_parser("tokenize", help="token ids of TEXT (or stdin)")
    t.add_argument("text", nargs="?")
    t.add_argument("--add-special", action="store_true", help="add BOS etc. as the model does")
    t.add_argument("--json", action="store_true", help="print a JSON list")
    t.set_defaults(run=cmd_tokenize)
    sub.add_parser("ping", help="is the daemon there?").set_defaults(run=cmd_ping)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    path = args.socket or os.environ.get("KESTREL_SOCKET") or None
    try:
        with Client(path) as client:
            return args.run(client, args)
    except KestrelClientError as e:
        print(f"kestrelctl: {e}", file=sys.stderr)
        return EXIT_STATUS.get(e.code, 1)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:             # stdout closed early (| head): not an error of ours
        return 0


if __name__ == "__main__":
    sys.exit(main())
