"""bench/lifecycle.py (`make demo`) at small sizes, as a subprocess with --json: the KV cache's
life cycle on the real daemon. R1 misses, its follow-up hits (R1's prompt reused, only the
new tokens prefilled, no memory grown), an unrelated raw prompt misses with LCP < 16, and
after a restart (new pid, empty cache) the same follow-up misses and prefills everything."""
import json
import re
import subprocess
import sys

from daemon import REPO, daemon_env

ARGS = ("--doc-tokens", "250", "--r2-tokens", "300", "--max-seq", "1024", "--max-tokens", "4",
        "--threads", "1", "--json")


def run_demo() -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "lifecycle.py"), *ARGS], cwd=REPO,
                          env=daemon_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_lifecycle_hit_miss_and_restart():
    res = run_demo()
    r1, hit, r2, again = res["requests"]
    pid = res["starts"][0]["pid"]

    assert res["documents"]["r1"]["tokens"] >= 250 and res["documents"]["r2"]["tokens"] >= 300
    assert res["max_seq"] == 1024 and res["threads"] == 1

    # R1: the first request of a fresh daemon, nothing to reuse.
    assert not r1["hit"] and r1["cache_len_before"] == 0
    assert r1["cached_tokens"] == 0 and r1["prefill_tokens"] == r1["prompt_tokens"] > 250
    assert r1["cache_len_after"] >= r1["prompt_tokens"]

    # Follow-up: R1's prompt (and some of its answer) reused, only the new tokens prefilled.
    assert hit["hit"] and hit["pid"] == r1["pid"] == pid
    assert hit["cached_tokens"] >= r1["prompt_tokens"] - 2
    assert hit["prefill_tokens"] == hit["prompt_tokens"] - hit["cached_tokens"] < 60
    keep = int(re.search(r"keep=(\d+)", hit["kv_prefix"]).group(1))
    assert keep == hit["cached_tokens"]
    # RSS grows by what the KV store's memory tier copied out (R1's rows, then the hit's
    # delta: after each answer, so R1's may land after its status was read), no more
    assert hit["rss_mb"] - r1["rss_mb"] < 5.0 + hit["kv_memory_mb"]
    assert 0 < hit["kv_memory_mb"] < 20

    # R2: a raw prompt shares (almost) nothing with the chat-rendered R1.
    assert not r2["hit"] and r2["lcp"] < 16
    assert r2["cached_tokens"] == 0 and r2["prefill_tokens"] == r2["prompt_tokens"] > 300

    # Restart: a new process with an empty cache; the follow-up is recomputed in full.
    rst = res["restart"]
    assert rst["old_pid"] == pid and rst["exit_status"] == 0
    assert rst["pid"] != pid and again["pid"] == rst["pid"]
    assert rst["cache_len_after"] == 0 and again["cache_len_before"] == 0
    assert not again["hit"] and again["cached_tokens"] == 0
    assert again["prompt_tokens"] == again["prefill_tokens"] == hit["prompt_tokens"]

    # Each daemon's own log: three lines for the first (miss, hit, miss), one for the second.
    first, second = res["daemon_logs"]
    assert [ln.split()[1] for ln in first["kv_prefix"]] == ["miss", "hit", "miss"]
    assert [ln.split()[1] for ln in second["kv_prefix"]] == ["miss"]
