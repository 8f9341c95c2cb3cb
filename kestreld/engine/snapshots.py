"""What the two tiers of the KV store share (engine/kvstore.py: memory, engine/diskkv.py:
disk): a snapshot of arena rows, an index of snapshots found by longest common prefix of
token ids, delta chains (a snapshot holds rows [base, n) on top of its parent's [0, base)),
least-recently-used eviction under a byte budget, and the rule of a restore.

Not thread-safe: each tier holds its own lock around its index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from .kvcache import KVCache, KVLayout, RowBlock
from .prefix import common_prefix_len

MAX_CHAIN = 8                    # deltas on a full snapshot before the next one is taken whole


@dataclass
class Snapshot:
    """One snapshot as its tier's index knows it."""
    name: str
    ids: np.ndarray              # int64 (n,): the prefix keys of rows [0, n) (this one + parents)
    base: int                    # rows [0, base) come from the parent, [base, n) from this one
    parent: Optional[str]
    nbytes: int                  # what it costs its tier: a file's size, or rows + ids in memory
    last_used: int               # ns (on disk: kept as the file's mtime)
    ours: bool                   # made for this model and layout (else only counted and evicted)
    written: bool = True         # disk: False while it waits for the writer
    rows: Optional[RowBlock] = None   # memory: rows [base, n)


def restore_keep(lcp: int, n_prompt: int, have: int, prefix_min: int) -> Optional[int]:
    """The rule of a restore from the store (the prefix rule, engine/prefix.py, applied to
    a snapshot): the prompt keeps min(lcp, n_prompt - 1) rows if that reaches prefix_min
    and beats the `have` rows the arena kept; else None."""
    keep = min(lcp, n_prompt - 1)
    return keep if keep >= prefix_min and keep > have else None


def check_layout(layout: KVLayout, kv: KVCache) -> None:
    """ValueError unless the KV cache has the layout the tier was made for."""
    if kv.layout != layout:
        raise ValueError(f"KV store made for {layout}, given a cache of {kv.layout}")


def segments(chain: list, lo: int, hi: int) -> Iterator[tuple]:
    """(snapshot, a, b): which link of a chain (the snapshot first, then its parents)
    holds which rows [a, b) of rows [lo, hi)."""
    for s in chain:
        a = max(lo, s.base)
        if a < hi:
            yield s, a, hi
        hi = min(hi, s.base)
        if hi <= lo:
            return


class SnapshotIndex:
    """Snapshots by name; the caller holds its tier's lock."""

    def __init__(self):
        self.entries: dict[str, Snapshot] = {}

    def best(self, ids: np.ndarray, usable: Callable[[Snapshot], bool]
             ) -> tuple[Optional[Snapshot], int]:
        """The usable snapshot sharing the longest prefix with ids (fewest links on a tie),
        and that length: the ids are compared, never only hashed."""
        best, best_key = None, (0, 0)
        for s in self.entries.values():
            if usable(s):
                key = (common_prefix_len(ids, s.ids), -len(self.chain(s)))
                if key > best_key:
                    best, best_key = s, key
        return best, best_key[0]

    def place(self, ids: np.ndarray, prefix_min: int, usable: Callable[[Snapshot], bool]
              ) -> tuple[Optional[Snapshot], int]:
        """Where a snapshot of `ids` goes: (the snapshot it extends, base). Base == len(ids):
        that snapshot holds them all already. (None, 0): a whole snapshot, when no prefix
        of at least prefix_min is held or the parent's chain is MAX_CHAIN long."""
        parent, lcp = self.best(ids, usable)
        if parent is not None and lcp == len(ids):
            return parent, lcp
        if parent is None or lcp < prefix_min or len(self.chain(parent)) > MAX_CHAIN:
            return None, 0
        return parent, lcp

    def chain(self, s: Snapshot) -> list:
        """s, its parent, its parent's parent, ... (all present: see drop)."""
        out = [s]
        while out[-1].parent is not None:
            out.append(self.entries[out[-1].parent])
        return out

    def with_children(self, names) -> set:
        """names and every snapshot built on them, directly or not."""
        out = {n for n in names if n in self.entries}
        while True:
            more = {s.name for s in self.entries.values() if s.parent in out} - out
            if not more:
                return out
            out |= more

    def drop(self, names) -> list:
        """Remove snapshots and everything built on them; their names."""
        gone = self.with_children(names)
        for n in gone:
            del self.entries[n]
        return sorted(gone)

    def used_bytes(self) -> int:
        """Bytes of the snapshots that count against the budget (those written)."""
        return sum(s.nbytes for s in self.entries.values() if s.written)

    def victims(self, extra: int, max_bytes: int, pinned: set) -> Optional[list]:
        """Remove the least recently used snapshots (with what is built on them) so that
        `extra` more bytes fit under max_bytes, and return their names (None: they cannot
        fit; nothing removed). Snapshots not yet written, `pinned` ones (a chain: closed under
        parents) and their parents are never chosen."""
        total = self.used_bytes() + extra
        keep = set(pinned) | {p.name for s in self.entries.values() if not s.written
                              for p in self.chain(s)}
        candidates = sorted((s for s in self.entries.values() if s.written and s.name not in keep),
                            key=lambda s: (s.last_used, -(len(self.chain(s)) if s.ours else 0)))
        chosen: set = set()
        for s in candidates:
            if total <= max_bytes:
                break
            if s.name not in chosen:
                more = self.with_children([s.name]) - chosen
                chosen |= more
                total -= sum(self.entries[n].nbytes for n in more)
        return self.drop(chosen) if total <= max_bytes else None

    def touch(self, chain: list, now: int) -> None:
        for s in chain:
            s.last_used = now
