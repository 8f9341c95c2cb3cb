"""Prometheus metrics (`GET /metrics` of the HTTP API), in the daemon's own registry.

Counted where both transports pass: the scheduler calls `finished(job, final)` once for
every job it queued (RPC and HTTP alike), so requests, tokens and times cover the RPC
socket too. The HTTP layer adds its responses by path and status. Gauges (queue, busy,
KV arena, cache, memory) and the prefix counters are read from the status map at scrape
time, on the event loop, without waiting for the engine thread.

Thread safety: prometheus_client's metrics are thread-safe; `finished` runs on the
worker or the loop thread.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .scheduler import Done, Event, Job

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds: from a short reply on a fast machine to a 4,000-token prefill on a board
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
                   50.0, 100.0, 250.0, 500.0)


class _StatusCollector:
    """The status map's figures, at scrape time."""

    def __init__(self, reporter):
        self._reporter = reporter

    def collect(self):
        s = self._reporter.status()
        gauges = (
            ("kestrel_queue_depth", "requests waiting in the queue", s["queued"]),
            ("kestrel_busy", "1 while the engine runs a request", int(s["busy"])),
            ("kestrel_kv_arena_bytes", "bytes of the KV arena (allocated once)", s["kv_arena_bytes"]),
            ("kestrel_kv_cache_tokens", "tokens whose KV is valid in the arena", s["cache_len"]),
            ("kestrel_max_seq_tokens", "the KV arena's capacity in tokens", s["max_seq"]),
            ("kestrel_rss_bytes", "resident memory of the daemon", self._reporter.rss_bytes()),
            ("kestrel_experts_copied_bytes", "bytes of MoE experts copied into interleaved "
             "groups so far (each when first chosen)", sum(s["experts_copied_bytes"].values())),
            ("kestrel_threads", "threads of the forward pass", s["threads"]),
            ("kestrel_threads_working", "threads that took work in the last forward pass",
             s["threads_working"]),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        prefix = s["prefix"]
        for name, key, doc in (("kestrel_prefix_hits", "hits", "requests that reused a cached prefix"),
                               ("kestrel_prefix_misses", "misses", "requests that reused none"),
                               ("kestrel_prefix_tokens_reused", "tokens_reused",
                                "prompt tokens whose KV was reused")):
            yield CounterMetricFamily(name, doc, value=prefix[key])
        spec = s["speculation"]
        for name, key, doc in (
                ("kestrel_speculation_drafted_tokens", "drafted", "tokens drafted from the context"),
                ("kestrel_speculation_accepted_tokens", "accepted",
                 "drafted tokens that were chosen (each one saved a decode pass)")):
            yield CounterMetricFamily(name, doc, value=spec[key])
        yield from _kv_store_metrics(s)
        info = GaugeMetricFamily("kestrel_info", "what this daemon runs",
                                 labels=["version", "model", "arch"])
        info.add_metric([s["version"], s["model"]["name"], s["model"]["arch"]], 1)
        yield info


def _kv_store_metrics(s: dict):
    """The KV store's tiers (status's kv_memory and disk_kv maps), labelled by tier."""
    tiers = {"memory": s["kv_memory"], "disk": s["disk_kv"]}
    on = {t: v for t, v in tiers.items() if v["enabled"]}
    for name, doc, key, kind in (
            ("kestrel_kv_store_entries", "snapshots the KV store holds", None, GaugeMetricFamily),
            ("kestrel_kv_store_bytes", "bytes the KV store's snapshots take", "bytes",
             GaugeMetricFamily),
            ("kestrel_kv_store_max_bytes", "the tier's budget in bytes", "max_bytes",
             GaugeMetricFamily),
            ("kestrel_kv_store_hits", "requests whose prefix the tier restored", "hits",
             CounterMetricFamily),
            ("kestrel_kv_store_misses", "requests the arena missed and the tier had nothing "
             "for", "misses", CounterMetricFamily),
            ("kestrel_kv_store_evictions", "snapshots evicted (least recently used)",
             "evictions", CounterMetricFamily)):
        family = kind(name, doc, labels=["tier"])
        for tier, v in on.items():
            value = v[key] if key else v["entries"] if tier == "memory" else v["files"]
            family.add_metric([tier], value)
        yield family


class Metrics:
    """The daemon's metrics. `attach` the status reporter once the model is loaded."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kestrel_requests", "generation requests by transport, endpoint "
                                "and result (finish reason or error code)",
                                ["transport", "endpoint", "result"], registry=r)
        self.http_responses = Counter("kestrel_http_responses", "HTTP API responses by path and status",
                                      ["path", "status"], registry=r)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.cached_tokens = Counter("kestrel_cached_tokens", "prompt tokens whose KV was reused "
                                     "(memory or disk)", registry=r)
        self.prefill_tokens = Counter("kestrel_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("kestrel_generated_tokens", "tokens generated", registry=r)
        self.prefill_seconds = Histogram("kestrel_prefill_seconds", "prefill time of a request",
                                         buckets=SECONDS_BUCKETS, registry=r)
        self.decode_seconds = Histogram("kestrel_decode_seconds", "decode time of a request",
                                        buckets=SECONDS_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kestrel_ttft_seconds", "time from arrival to the first "
                                      "token, queue included", buckets=SECONDS_BUCKETS, registry=r)
        self._status: Optional[_StatusCollector] = None

    def attach(self, reporter) -> None:
        """Export the status figures (once the engine exists)."""
        self._status = _StatusCollector(reporter)
        self.registry.register(self._status)

    def finished(self, job: Job, final: Event) -> None:
        """The scheduler's on_finish: one finished (or dropped) job."""
        if not isinstance(final, Done):
            self.requests.labels(job.transport, job.endpoint, final.error.code).inc()
            return
        c = final.completion
        self.requests.labels(job.transport, job.endpoint, c.finish_reason).inc()
        self.prompt_tokens.inc(c.prompt_tokens)
        self.cached_tokens.inc(c.cached_tokens)
        self.prefill_tokens.inc(c.prefill_tokens)
        self.generated_tokens.inc(c.completion_tokens)
        self.prefill_seconds.observe(c.prefill_ms / 1000.0)
        self.decode_seconds.observe(c.decode_ms / 1000.0)
        self.ttft_seconds.observe(final.ttft_ms / 1000.0)

    def http_response(self, path: str, status: int) -> None:
        self.http_responses.labels(path, str(status)).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
