"""docs/openapi.yaml fuzzed against the real daemon with schemathesis, in a bounded run:
valid and invalid requests generated from the description must never get a 5xx, and
every response must match the status codes, content types and schemas it declares.

The daemon has a tiny context (--max-seq 48) so that generated requests are cheap; after
the run it still answers a normal request and its engine is idle.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from daemon import Daemon

SPEC = Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml"
EXAMPLES = 8             # per operation: a bounded run (about 20 s here)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]

schema = schemathesis.openapi.from_path(SPEC)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kf") / "k.sock", "--http", "127.0.0.1:0",
                "--max-seq", "48", "--max-tokens", "4", "--max-message-bytes", "65536") as d:
        yield d


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_description_holds(case, daemon):
    case.call_and_validate(base_url=daemon.http_url, checks=CHECKS, timeout=60)


def test_daemon_serves_after_the_fuzz(daemon):
    with httpx.Client(base_url=daemon.http_url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with daemon.client() as c:
        s = c.status()
    assert s["busy"] is False and s["queued"] == 0
