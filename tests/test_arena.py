"""KVArena: exact size, layout, and reset moving only cache_len."""
import numpy as np
import pytest

from kestreld.engine.arena import KVArena, kv_bytes_per_token_layer


def test_design_source_figures():
    # Qwen3-VL-2B: 28 layers, 8 KV heads, head_dim 128, max_seq 8192 (DESIGN.md)
    assert kv_bytes_per_token_layer(8, 128) == 2112
    assert 2112 * 28 * 8192 == 484_442_112


def test_size_and_views():
    a = KVArena(n_layers=3, n_kv_heads=2, head_dim=64, max_seq=100, kv_bs=32)
    assert a.bytes_per_token_layer == 2 * 2 * 64 + 8 * 2
    assert a.nbytes == a.bytes_per_token_layer * 3 * 100
    assert a.k_q.shape == a.v_q.shape == (3, 2, 100, 64) and a.k_q.dtype == np.int8
    assert a.k_s.shape == a.v_s.shape == (3, 2, 100) and a.k_s.dtype == np.float32
    total = a.k_q.nbytes + a.v_q.nbytes + a.k_s.nbytes + a.v_s.nbytes
    assert total == a.nbytes
    # the four views tile one buffer without overlap
    assert not np.shares_memory(a.k_q, a.v_q) and not np.shares_memory(a.k_s, a.v_s)
    kq, ks, vq, vs = a.layer(1)
    kq[0, 5, :] = 7
    assert a.k_q[1, 0, 5, 0] == 7 and a.k_q[0, 0, 5, 0] == 0


def test_reset_moves_only_cache_len():
    a = KVArena(2, 1, 32, 50)
    a.k_q[...] = 3
    a.cache_len = 40
    a.reset(16)
    assert a.cache_len == 16 and a.room() == 34
    assert (a.k_q == 3).all()          # logical clear: bytes stay
    with pytest.raises(ValueError):
        a.reset(17)                    # cannot keep tokens that are not valid
    with pytest.raises(ValueError):
        a.reset(-1)
