"""The `status` map (docs/protocol.md): what the daemon runs, its KV arena, its queue, its memory.

Built on the event-loop thread at any time, also while the worker is busy: it reads only
plain values (arena sizes, `engine.stats()` which copies ints, `scheduler.stats()` under
its lock) and psutil, never waiting for the engine thread.
"""
from __future__ import annotations

import os
import time

import psutil

from .. import __version__
from .config import Config
from ..protocol import PROTOCOL_VERSION

# Every matrix is held as Q8_0 in memory whatever the file held (model/weights.py).
WEIGHTS_IN_MEMORY = "q8_0"
KV_DTYPE = "q8"


class StatusReporter:
    """Builds the status map; created once at start-up."""

    def __init__(self, engine, scheduler, config: Config):
        self._engine = engine
        self._scheduler = scheduler
        self._config = config
        self._process = psutil.Process(os.getpid())
        self.started_at = self._process.create_time()   # process start: uptime includes the load

    def rss_bytes(self) -> int:
        """The daemon's resident memory."""
        return self._process.memory_info().rss

    def status(self) -> dict:
        eng, kv = self._engine, self._engine.kv
        cfg = eng.model.config
        engine_stats = eng.stats()
        now = time.time()
        out = {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "started_at": round(self.started_at, 3),
            "uptime_s": round(now - self.started_at, 3),
            "model": {"path": eng.model.path, "arch": cfg.arch, "name": cfg.name,
                      "n_params": cfg.n_params, "n_layers": cfg.n_layers,
                      "weights": WEIGHTS_IN_MEMORY, "source_dtype": eng.model.source_dtype},
            "max_seq": kv.max_seq,
            "kv_bs": kv.kv_bs,
            "kv_dtype": KV_DTYPE,
            "kv_bytes_per_token_layer": kv.bytes_per_token_layer,
            "kv_arena_bytes": kv.nbytes,
            "cache_len": engine_stats["cache_len"],
            "prefix": dict(engine_stats["prefix"]),
            "disk_kv": eng.disk_kv.stats() if eng.disk_kv is not None else {"enabled": False},
            "rss_mb": round(self.rss_bytes() / 2**20, 1),
            "mem_avail_mb": round(psutil.virtual_memory().available / 2**20, 1),
            "threads": self._config.n_threads,
        }
        out.update(self._scheduler.stats())
        return out
