"""The `status` map (docs/protocol.md): what the daemon runs, its KV arena, its queue, its memory.

Built on the event-loop thread at any time, also while the worker is busy: it reads only
plain values (arena sizes, `engine.stats()` which copies ints, `scheduler.stats()` under
its lock) and psutil, never waiting for the engine thread.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import psutil

from .. import __version__
from ..model.config import POOLINGS, RANK
from .config import Config
from ..protocol import PROTOCOL_VERSION
from ..text.chat import CHATML_FALLBACK

KV_DTYPE = "q8"


def path_bytes(path: str) -> Optional[int]:
    """Size of a model file, or of the files directly inside a model directory; None if
    it cannot be read."""
    try:
        if not os.path.isdir(path):
            return os.path.getsize(path)
        with os.scandir(path) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file())
    except OSError:
        return None


class StatusReporter:
    """Builds the status map; created once at start-up."""

    def __init__(self, engine, scheduler, config: Config):
        self._engine = engine
        self._scheduler = scheduler
        self._config = config
        self._process = psutil.Process(os.getpid())
        self.started_at = self._process.create_time()   # process start: uptime includes the load
        model = engine.model
        self._model = {          # fixed for the daemon's life: computed once
            "path": model.path, "arch": model.config.arch, "name": model.config.name,
            "n_params": model.config.n_params, "n_layers": model.config.n_layers,
            "context_length": model.config.context_length,
            "weights": model.weights.main_type(), "source_dtype": model.source_dtype,
            "weight_types": model.weights.type_shares(),
            "weights_interleaved_bytes": model.weights.interleaved_bytes(),
            "file_bytes": path_bytes(model.path),
            "chat_template_source": model.chat_template_source or CHATML_FALLBACK,
            "vision": model.vision is not None,
            "pooling": (engine.embedder.pooling
                        if engine.embedder.pooling in POOLINGS + (RANK,) else None),
        }

    def rss_bytes(self) -> int:
        """The daemon's resident memory."""
        return self._process.memory_info().rss

    def _disk_kv(self, stats: dict) -> dict:
        """The disk tier's figures; off because --disk-kv's directory is unusable: why."""
        if not stats["enabled"] and self._engine.disk_kv_error is not None:
            return {"enabled": False, "dir": self._config.disk_kv,
                    "error": self._engine.disk_kv_error}
        return stats

    def status(self) -> dict:
        eng, kv = self._engine, self._engine.kv
        engine_stats = eng.stats()
        now = time.time()
        out = {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "started_at": round(self.started_at, 3),
            "uptime_s": round(now - self.started_at, 3),
            "model": dict(self._model),
            "max_seq": kv.max_seq,
            "kv_bs": kv.kv_bs,
            "kv_dtype": KV_DTYPE,
            "kv_bytes_per_token_layer": kv.bytes_per_token_layer,
            "kv_arena_bytes": kv.nbytes,
            "cache_len": engine_stats["cache_len"],
            "prefix": dict(engine_stats["prefix"]),
            "speculation": dict(engine_stats["speculation"]),
            "kv_memory": engine_stats["kv_store"]["memory"],
            "disk_kv": self._disk_kv(engine_stats["kv_store"]["disk"]),
            "experts_copied_bytes": eng.model.weights.expert_copies_bytes(),
            "rss_mb": round(self.rss_bytes() / 2**20, 1),
            "mem_avail_mb": round(psutil.virtual_memory().available / 2**20, 1),
            "threads": self._config.n_threads,
            "threads_working": self._engine.forward.working_threads,
        }
        out.update(self._scheduler.stats())
        return out
