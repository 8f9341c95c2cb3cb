"""The prefix rule: how much of the previous request's KV a new prompt may keep.

    lcp  = longest common prefix of the prompt's ids and `last_ids`
    keep = min(lcp, len(prompt) - 1, cache_len)   at least one token is prefilled for logits
    hit  if reuse is enabled and keep >= min_match (16, as in the design source),
         else miss: cache_len = 0 and the old bytes are simply overwritten.

After a request `last_ids` is prompt + generated ids; after a cancel or an error only
the ids whose KV is really in the arena (the first cache_len of them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two id sequences (vectorized)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


@dataclass
class PrefixPlan:
    keep: int       # tokens of KV reused
    lcp: int
    hit: bool
    log_line: str   # the [KV-PREFIX] line of this request


class PrefixCache:
    """Remembers `last_ids` and counts hits; the arena itself holds the KV."""

    def __init__(self, enabled: bool = True, min_match: int = 16):
        self.enabled = enabled
        self.min_match = min_match
        self.last_ids: list = []
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0

    def plan(self, prompt_ids, cache_len: int) -> PrefixPlan:
        """Decide how many tokens of KV the prompt keeps, and count the hit or miss."""
        lcp = common_prefix_len(prompt_ids, self.last_ids)
        keep = min(lcp, len(prompt_ids) - 1, cache_len)
        if self.enabled and keep >= self.min_match:
            self.hits += 1
            self.tokens_reused += keep
            line = f"[KV-PREFIX] hit keep={keep} prompt={len(prompt_ids)} prefill={len(prompt_ids) - keep}"
            return PrefixPlan(keep, lcp, True, line)
        self.misses += 1
        why = "" if self.enabled else " (prefix reuse off)"
        return PrefixPlan(0, lcp, False, f"[KV-PREFIX] miss lcp={lcp}{why}")

    def commit(self, ids) -> None:
        """Record the ids behind the arena's KV (prompt + generated, or the valid part)."""
        self.last_ids = list(ids)

    def forget(self) -> None:
        self.last_ids = []

    def stats(self) -> dict:
        return {"enabled": self.enabled, "min_match": self.min_match, "hits": self.hits,
                "misses": self.misses, "tokens_reused": self.tokens_reused}
