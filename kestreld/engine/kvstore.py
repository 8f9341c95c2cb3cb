"""The KV store: recent prompts' KV kept beyond the arena's one line, in two tiers.

- memory (`--kv-memory BYTES`, on by default): snapshots of arena rows in the daemon's own
  memory; they die with the process.
- disk (`--disk-kv DIR`, off by default): the same snapshots as files that survive a restart
  (engine/diskkv.py).

Both tiers are indexes of the same snapshots (engine/snapshots.py): found by the longest
common prefix of token ids (compared, never only hashed), kept as delta chains (a turn
holds its new rows on top of its parent's), the least recently used evicted under the
tier's byte budget. A store is made for one model and one arena layout (`max_seq`), so an
entry can never be matched across models or layouts: the memory tier lives and dies with
the engine that made it, and each disk file carries the fingerprint of both.

- `restore` (engine thread, before the prefill, after the arena's own prefix rule): memory
  first, then disk; a tier copies in only rows beyond those the arena (or the memory
  tier) kept.
- `save` (engine thread, after the answer was sent: Engine.store_kv): each tier copies the
  arena rows it does not hold yet.

Thread-safety: `restore`, `save` and `close` run on the engine thread; `stats` from any
thread (each tier guards its index and counters with its own lock).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import numpy as np

from .kvcache import KVCache, KVLayout
from .snapshots import Snapshot, SnapshotIndex, check_layout, restore_keep, segments

log = logging.getLogger("kestreld.kvstore")

DEFAULT_SHARE = 8                 # --kv-memory by default: 1/8 of the machine's RAM ...
DEFAULT_CAP = 1 << 30             # ... at most 1 GiB ...
DEFAULT_OF_FREE = 2               # ... and at most half of what is left once weights and arena fit
ID_BYTES = 8


def default_kv_memory(total_ram: int, left: int) -> int:
    """The memory tier's budget when --kv-memory is not given: 1/8 of the RAM, at most
    1 GiB (an 8 GB board: 1 GiB, ~18,000 tokens of Qwen3-VL-2B or ~88,000 of SmolLM2),
    and at most half of the `left` bytes available once the weights and the arena are
    counted, so that the default never makes a start fail."""
    return max(0, min(total_ram // DEFAULT_SHARE, DEFAULT_CAP, left // DEFAULT_OF_FREE))


class MemoryKV:
    """The memory tier; see the module docstring."""

    def __init__(self, max_bytes: int, layout: KVLayout, prefix_min: int = 16):
        self.max_bytes = max_bytes
        self.layout = layout
        self.prefix_min = prefix_min
        self._lock = threading.Lock()
        self._index = SnapshotIndex()
        self._serial = 0
        self._counts = dict(hits=0, misses=0, tokens_reused=0, bytes_copied_in=0,
                            bytes_copied_out=0, saves=0, evictions=0, dropped=0)

    def restore(self, keys, kv: KVCache) -> bool:
        """Copy into the KV cache, after its valid rows, the rows of the entry with the
        longest common prefix with the prompt's `keys`; True if it did, False if no entry
        beats what the arena kept (kv.cache_len)."""
        check_layout(self.layout, kv)
        have = kv.cache_len
        prompt = np.asarray(keys, dtype=np.int64)
        with self._lock:
            best, lcp = self._index.best(prompt, lambda s: True)
            chain = self._index.chain(best) if best is not None else []
            keep = restore_keep(lcp, len(prompt), have, self.prefix_min)
            if keep is None:
                if have == 0:
                    self._counts["misses"] += 1
                    log.info("[KV-STORE] miss lcp=%d entries=%d", lcp, len(self._index.entries))
                return False
            self._index.touch(chain, time.monotonic_ns())
        t0 = time.perf_counter()
        keys = prompt[:keep].tolist()
        for s, a, b in reversed(list(segments(chain, have, keep))):   # oldest link first
            kv.restore(a, keys[:b], s.rows.slice(a - s.base, b - s.base))
        nbytes = self.layout.row_bytes() * (keep - have)
        with self._lock:
            self._counts["hits"] += 1
            self._counts["tokens_reused"] += keep - have
            self._counts["bytes_copied_in"] += nbytes
        log.info("[KV-STORE] hit keep=%d prompt=%d prefill=%d entry=%s (+%d parents) "
                 "copied=%.1f MB in %.0f ms", keep, len(prompt), len(prompt) - keep, best.name,
                 len(chain) - 1, nbytes / 1e6, (time.perf_counter() - t0) * 1e3)
        return True

    def save(self, kv: KVCache) -> None:
        """Copy out the KV cache's valid rows that no entry holds yet: a new conversation's
        prefix, or a turn's delta on top of the entry it extends. Evicts the least recently
        used entries to stay within max_bytes; rows that cannot fit are not kept."""
        check_layout(self.layout, kv)
        new = np.asarray(kv.keys, dtype=np.int64)
        n = len(new)
        if n < self.prefix_min:
            return
        now = time.monotonic_ns()
        with self._lock:
            parent, base = self._index.place(new, self.prefix_min, lambda s: True)
            chain = self._index.chain(parent) if parent is not None else []
            self._index.touch(chain, now)
            if base == n:                         # held already: only fresher now
                return
            nbytes = self._cost(n, base)
            victims = self._index.victims(nbytes, self.max_bytes, {s.name for s in chain})
            if victims is None and parent is not None:   # the parent itself must go: take it whole
                parent, base = None, 0
                nbytes = self._cost(n, 0)
                victims = self._index.victims(nbytes, self.max_bytes, set())
            if victims is None:
                self._counts["dropped"] += 1
                log.info("[KV-STORE] %d tokens not kept: %d bytes exceed --kv-memory %d",
                         n, nbytes, self.max_bytes)
                return
            self._counts["evictions"] += len(victims)
            self._serial += 1
            name = f"m{self._serial}"
        t0 = time.perf_counter()
        rows = kv.copy_rows(base, n)
        entry = Snapshot(name, new, base, parent.name if parent is not None else None, nbytes,
                         now, ours=True, rows=rows)
        with self._lock:
            self._index.entries[name] = entry
            self._counts["saves"] += 1
            self._counts["bytes_copied_out"] += rows.nbytes
        log.info("[KV-STORE] kept entry=%s tokens=%d rows=%d..%d parent=%s %.1f MB in %.0f ms%s",
                 name, n, base, n, entry.parent, rows.nbytes / 1e6,
                 (time.perf_counter() - t0) * 1e3,
                 f" (evicted {', '.join(victims)})" if victims else "")

    def stats(self) -> dict:
        """Entries, bytes used against the budget, hits, misses and the rest."""
        with self._lock:
            entries = self._index.entries
            return {"enabled": True, "entries": len(entries), "bytes": self._index.used_bytes(),
                    "max_bytes": self.max_bytes,
                    "tokens": sum(len(s.ids) - s.base for s in entries.values()),
                    **self._counts}

    def _cost(self, n: int, base: int) -> int:
        """What an entry of ids [0, n) holding rows [base, n) takes: its rows and its ids."""
        return self.layout.row_bytes() * (n - base) + ID_BYTES * n


class KVStore:
    """Memory first, then disk; either tier may be off (None)."""

    def __init__(self, memory: Optional[MemoryKV] = None, disk=None):
        self.memory = memory
        self.disk = disk          # diskkv.DiskKV or None

    def restore(self, keys, kv: KVCache) -> Optional[str]:
        """After the arena's prefix rule: copy in the longest prefix a tier holds beyond what
        the arena kept. Returns the last tier that added rows ("store" for memory, "disk"),
        or None."""
        source = None
        if self.memory is not None and self.memory.restore(keys, kv):
            source = "store"
        if self.disk is not None and self.disk.restore(keys, kv):
            source = "disk"
        return source

    def save(self, kv: KVCache) -> None:
        """After a request: each tier keeps the arena rows it does not hold yet."""
        if self.memory is not None:
            self.memory.save(kv)
        if self.disk is not None:
            self.disk.save(kv)

    def stats(self) -> dict:
        """{"memory": ..., "disk": ...}: each tier's figures, or {"enabled": False}."""
        off = {"enabled": False}
        return {"memory": self.memory.stats() if self.memory is not None else off,
                "disk": self.disk.stats() if self.disk is not None else off}

    def close(self) -> None:
        """At shutdown: the disk writer finishes what is queued; the memory tier just goes."""
        if self.disk is not None:
            self.disk.close()
