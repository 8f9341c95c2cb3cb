"""The prefix rule: how much of the KV cache a new prompt may keep. This is its one place.

    lcp  = longest common prefix of the prompt's keys and the cache's keys (the previous
           prompt and the generated tokens fed back: every token whose KV the arena holds)
    keep = min(lcp, len(prompt) - 1)   at least one token is prefilled, for its logits
    hit  if reuse is enabled and keep >= min_match (16, as in the design source),
         else miss: keep = 0, and the old bytes are simply overwritten.

The cache's keys are exactly the tokens whose KV is valid (engine/kvcache.py), so after a
cancel or an error only what was really written can match. (The last sampled token of a
request has no KV yet: it never counts.)
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


def hit_line(keep: int, n_prompt: int, source: str) -> str:
    """The [KV-PREFIX] line of a request that kept `keep` tokens from `source`: "memory"
    (the arena), "store" (the KV store's memory tier) or "disk"."""
    return (f"[KV-PREFIX] hit keep={keep} prompt={n_prompt} prefill={n_prompt - keep} "
            f"source={source}")


@dataclass(frozen=True)
class PrefixPlan:
    keep: int       # tokens of KV reused
    lcp: int
    hit: bool
    log_line: str   # the [KV-PREFIX] line of this request


class PrefixCache:
    """Applies the rule and counts hits and misses; the KV cache holds the keys and the KV."""

    def __init__(self, enabled: bool = True, min_match: int = 16):
        self.enabled = enabled
        self.min_match = min_match
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0

    def plan(self, prompt_keys, cached_keys) -> PrefixPlan:
        """How many tokens of the cache the prompt keeps; counts the hit or miss."""
        lcp = common_prefix_len(prompt_keys, cached_keys)
        keep = min(lcp, len(prompt_keys) - 1)
        if self.enabled and keep >= self.min_match:
            self.hits += 1
            self.tokens_reused += keep
            return PrefixPlan(keep, lcp, True, hit_line(keep, len(prompt_keys), "memory"))
        self.misses += 1
        why = "" if self.enabled else " (prefix reuse off)"
        return PrefixPlan(0, lcp, False, f"[KV-PREFIX] miss lcp={lcp}{why}")

    def stats(self) -> dict:
        return {"enabled": self.enabled, "min_match": self.min_match, "hits": self.hits,
                "misses": self.misses, "tokens_reused": self.tokens_reused}
