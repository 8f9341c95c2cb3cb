"""Load on the real daemon: 64 concurrent clients, mixed requests, --max-queue 16 (the fast
subset of bench/load.py; the 1,000-request run is in docs/reliability.md)."""
from __future__ import annotations

import sys

import pytest

from daemon import REPO, Daemon

sys.path.insert(0, str(REPO / "bench"))
import load  # noqa: E402  (bench/load.py: the clients, the status probe, the checks)

CLIENTS, REQUESTS = 64, 200
DEADLINE_S = 180.0          # no deadlock: 200 tiny requests take under a second here


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("ld") / "l.sock", *load.DAEMON_ARGS) as d:
        yield d


def test_64_clients_every_request_answered_once_status_fast_memory_flat(daemon):
    rep = load.load(daemon.socket, daemon.pid, CLIENTS, REQUESTS, seed=3, deadline_s=DEADLINE_S)
    s = rep.summary()
    assert s["violations"] == []
    assert s["responses"] == s["requests"] >= REQUESTS
    outcomes = s["outcomes"]
    # The bounded queue was hit, and every kind of request also got real results.
    assert outcomes.get("queue_full", 0) > 0
    for kind in ("generate", "chat", "tokenize", "status", "cancel"):
        assert outcomes.get(f"result:{kind}", 0) > 0, outcomes
    assert s["status_probes"] >= 20
    assert s["status_max_ms"] < 50 and s["status_p99_ms"] < 50, s
    # Weights are paged in by the warm-up, so RSS after 10 answers is the steady state;
    # a leak of even 25 KB per request would show here.
    assert abs(s["rss_drift_mb"]) < 5, s
    with daemon.client() as c:
        st = c.status()
        assert (st["busy"], st["queued"]) == (False, 0)
        assert c.ping()["pid"] == daemon.pid
