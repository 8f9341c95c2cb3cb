"""Interleaved requests on the real daemon, with the KV store's memory tier on and off.

    .venv/bin/python bench/interleaved.py                 # default flags vs --kv-memory 0
    .venv/bin/python bench/interleaved.py --json
    .venv/bin/python bench/interleaved.py --doc-tokens 300 --max-seq 1024 --max-tokens 4

Real apps interleave requests: Open WebUI sends a title and a tags request after a chat's
first answer, a voice assistant and a chat UI take turns. The arena holds one line, so
each of those evicts the conversation. Two daemons, one after the other (the default
flags: the memory tier on; `--kv-memory 0`: the arena alone), get through the real socket:

1. conversation A: a ~1,400-token manual and a question (chat);
2. a title request and a tags request about A (as Open WebUI words them);
3. A's follow-up;
4. conversation B (a ~1,000-token guide), then at once a short request: its queue time is
   the wait for B's copy out (the next request's TTFT, tier on against off);
5. follow-ups of A and B, alternating, twice each.

Reported: each follow-up's reuse (cached / prompt tokens), TTFT on and off, the speed-up,
whether the answers are the same text, RSS and the tier's status.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kestrelctl import KestrelClientError  # noqa: E402
from tests.daemon import Daemon, model_path  # noqa: E402

from lifecycle import REQUEST_TIMEOUT_S, say, send  # noqa: E402
from texts import island_guide, tide_gauge_manual  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M, "
                   "as the tests)")
    p.add_argument("--threads", type=int, default=0, help="daemon threads (default: its default)")
    p.add_argument("--max-seq", type=int, default=8192, help="KV arena capacity (default 8192)")
    p.add_argument("--doc-tokens", type=int, default=1400, help="conversation A (default 1400)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def task(kind: str, question: str, answer: str) -> list:
    """Open WebUI's background request about a chat: its title or its tags."""
    return [{"role": "user", "content": f"### Task:\nGenerate {kind} summarizing the chat "
             f"history.\n### Chat History:\n<chat_history>\nUSER: {question[-400:]}\n"
             f"ASSISTANT: {answer}\n</chat_history>"}]


def pattern(workdir: Path, opts: argparse.Namespace, tier: tuple) -> dict:
    """The whole pattern on one fresh daemon started with the extra flags `tier`."""
    daemon = Daemon(workdir / "kestreld.sock", "--max-seq", str(opts.max_seq), "--threads",
                    str(opts.threads), *tier, model=opts.model or model_path())
    say(f"starting kestreld {' '.join(tier) or '(default flags)'} ...")
    daemon.start()
    try:
        with daemon.client(REQUEST_TIMEOUT_S) as kc:
            loaded = kc.status()

            def count(text: str) -> int:
                return len(kc.tokenize(text))

            manual = tide_gauge_manual(opts.doc_tokens, count)
            guide = island_guide(opts.doc_tokens * 5 // 7, count)

            def chat(name, messages):
                return send(kc, daemon, name, "chat", opts, messages=messages)

            qa = f"{manual.text}\n\nQuestion: {manual.question}"
            a = [{"role": "user", "content": qa}]
            ra = chat("A", a)
            chat("A's title", task("a concise, 3-5 word title", qa, ra["text"]))
            chat("A's tags", task("1-3 broad tags", qa, ra["text"]))
            a += [{"role": "assistant", "content": ra["text"]},
                  {"role": "user", "content": manual.follow_up}]
            follow = [chat("A's follow-up", a)]
            b = [{"role": "user", "content": f"{guide.text}\n\nQuestion: {guide.question}"}]
            rb = chat("B", b)
            nxt = kc.generate(prompt="One more short request.", max_tokens=1)
            hist = {"A": a + [{"role": "assistant", "content": follow[0]["text"]}],
                    "B": b + [{"role": "assistant", "content": rb["text"]}]}
            for k in range(2):
                for name in ("A", "B"):
                    msgs = hist[name] + [{"role": "user", "content": f"Say it again ({k + 1})."}]
                    follow.append(chat(f"{name}'s follow-up {k + 1}", msgs))
                    hist[name] = msgs + [{"role": "assistant", "content": follow[-1]["text"]}]
            end = kc.status()
    finally:
        daemon.stop()
    return {"flags": list(tier), "model": loaded["model"]["name"], "threads": loaded["threads"],
            "rss_mb_loaded": loaded["rss_mb"], "rss_mb_end": end["rss_mb"],
            "kv_arena_bytes": loaded["kv_arena_bytes"], "kv_memory": end["kv_memory"],
            "follow_ups": follow, "after_new_conversation": {
                "queue_ms": nxt.timings["queue_ms"], "ttft_ms": nxt.timings["ttft_ms"]}}


def report(on: dict, off: dict) -> str:
    """One table of the follow-ups, tier on against off, and the figures around it."""
    lines = [f"model {on['model']}, threads {on['threads']}, KV arena "
             f"{on['kv_arena_bytes'] / 1e6:.1f} MB", "",
             "| follow-up | prompt | reused on | reused off | TTFT on | TTFT off | speed-up "
             "| same text |", "|" + "---|" * 8]
    for x, y in zip(on["follow_ups"], off["follow_ups"]):
        lines.append(f"| {x['request']} | {x['prompt_tokens']} "
                     f"| {100 * x['cached_tokens'] / x['prompt_tokens']:.0f}% "
                     f"| {100 * y['cached_tokens'] / y['prompt_tokens']:.0f}% "
                     f"| {x['ttft_ms'] / 1000:.2f} s | {y['ttft_ms'] / 1000:.2f} s "
                     f"| {y['ttft_ms'] / max(x['ttft_ms'], 1e-3):.1f}x "
                     f"| {'yes' if x['text'] == y['text'] else 'NO'} |")
    m = on["kv_memory"]
    nx, ny = on["after_new_conversation"], off["after_new_conversation"]
    lines += ["", f"memory tier: {m['entries']} entries, {m['bytes'] / 1e6:.1f} of "
              f"{m['max_bytes'] / 1e6:.1f} MB, hits {m['hits']}, misses {m['misses']}, "
              f"evictions {m['evictions']}",
              f"the request right after conversation B: queued {nx['queue_ms']:.0f} ms, TTFT "
              f"{nx['ttft_ms']:.0f} ms (tier on) against {ny['queue_ms']:.0f} ms, "
              f"{ny['ttft_ms']:.0f} ms (off)",
              f"RSS MiB: on {on['rss_mb_loaded']:.0f} -> {on['rss_mb_end']:.0f}, "
              f"off {off['rss_mb_loaded']:.0f} -> {off['rss_mb_end']:.0f}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    opts = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kestrel-interleaved-"))
    try:
        on = pattern(workdir, opts, ())
        off = pattern(workdir, opts, ("--kv-memory", "0"))
        print(json.dumps({"on": on, "off": off}, indent=1) if opts.json else report(on, off))
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    except (KestrelClientError, RuntimeError) as e:
        print(f"interleaved: {e}\ndaemon logs kept in {workdir}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
