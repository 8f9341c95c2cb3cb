"""The `status` map (docs/protocol.md): what the daemon runs, its KV arena, its queue, its memory.

Built on the event-loop thread at any time, also while the worker is busy: it reads only
plain values (arena sizes, `engine.stats()` which copies ints, `scheduler.stats()` under
its lock) and psutil, never waiting for the engine thread.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Optional

import numpy as np
import psutil

from .. import __version__
from .config import Config
from ..model.weights import ModelWeights, Q8Experts, Q8Matrix
from ..protocol import PROTOCOL_VERSION
from ..text.chat import CHATML_FALLBACK

# Every matrix is held as Q8_0 in memory whatever the file held (model/weights.py).
WEIGHTS_IN_MEMORY = "q8_0"
KV_DTYPE = "q8"
_FLOAT_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}   # GGUF's names


def _matrices(node):
    """(matrix, its type name, its parameter count) for every weight matrix under a weights
    dataclass; a matrix reachable twice (tied embeddings) is yielded twice."""
    if isinstance(node, Q8Matrix):
        yield node, WEIGHTS_IN_MEMORY, node.rows * node.cols
    elif isinstance(node, Q8Experts):
        yield node, WEIGHTS_IN_MEMORY, node.n_expert * node.rows * node.cols
    elif isinstance(node, np.ndarray) and node.ndim == 2:     # the MoE routers, float32
        yield node, _FLOAT_TYPES.get(node.dtype, str(node.dtype)), node.size
    elif isinstance(node, list):
        for item in node:
            yield from _matrices(item)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _matrices(getattr(node, f.name))


def weight_types(weights: ModelWeights) -> dict:
    """Share of the language model's matrix parameters held in each type, e.g.
    {"q8_0": 1.0} (norm vectors are not matrices; a tied output matrix counts once)."""
    counts: Counter = Counter()
    seen = set()
    for m, kind, n in _matrices(weights):
        if id(m) not in seen:
            seen.add(id(m))
            counts[kind] += n
    total = sum(counts.values())
    return {kind: round(n / total, 6) for kind, n in counts.most_common()}


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
            "weights": WEIGHTS_IN_MEMORY, "source_dtype": model.source_dtype,
            "weight_types": weight_types(model.weights),
            "file_bytes": path_bytes(model.path),
            "chat_template_source": model.chat_template_source or CHATML_FALLBACK,
            "vision": model.vision is not None,
        }

    def rss_bytes(self) -> int:
        """The daemon's resident memory."""
        return self._process.memory_info().rss

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
            "disk_kv": eng.disk_kv.stats() if eng.disk_kv is not None else {"enabled": False},
            "rss_mb": round(self.rss_bytes() / 2**20, 1),
            "mem_avail_mb": round(psutil.virtual_memory().available / 2**20, 1),
            "threads": self._config.n_threads,
        }
        out.update(self._scheduler.stats())
        return out
