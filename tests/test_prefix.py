"""The prefix rule (DESIGN.md): LCP >= min_match is a hit, keep <= len(prompt) - 1."""
import pytest

from kestreld.engine.prefix import PrefixCache, common_prefix_len

pytestmark = pytest.mark.arm64


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


def test_hit_keeps_lcp():
    p = PrefixCache(True, 16)
    plan = p.plan(list(range(60)) + [999] * 10, cached_keys=list(range(99)))
    assert plan.hit and plan.keep == 60 and plan.lcp == 60
    assert plan.log_line == "[KV-PREFIX] hit keep=60 prompt=70 prefill=10 source=memory"
    assert p.stats()["hits"] == 1 and p.stats()["tokens_reused"] == 60


def test_keep_leaves_one_token_to_prefill():
    p = PrefixCache(True, 16)
    plan = p.plan(list(range(30)), cached_keys=list(range(49)))
    assert plan.hit and plan.keep == 29 and plan.lcp == 30


def test_keep_bounded_by_valid_cache():
    p = PrefixCache(True, 16)          # only 20 rows valid (e.g. after a cancel)
    plan = p.plan(list(range(40)), cached_keys=list(range(20)))
    assert plan.keep == 20


def test_short_lcp_is_miss():
    p = PrefixCache(True, 16)
    plan = p.plan(list(range(15)) + [7] * 30, cached_keys=list(range(49)))
    assert not plan.hit and plan.keep == 0 and plan.lcp == 15
    assert plan.log_line == "[KV-PREFIX] miss lcp=15"
    assert p.stats()["misses"] == 1


def test_disabled_never_hits():
    p = PrefixCache(False, 16)
    plan = p.plan(list(range(50)), cached_keys=list(range(49)))
    assert not plan.hit and plan.keep == 0 and "off" in plan.log_line
