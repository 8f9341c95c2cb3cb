"""KVCache: exact size and layout, and its methods as the only writers of its state."""
import numpy as np
import pytest

from kestreld.engine.kvcache import KVCache, KVLayout, kv_bytes_per_token_layer


def test_design_source_figures():
    # Qwen3-VL-2B: 28 layers, 8 KV heads, head_dim 128, max_seq 8192 (DESIGN.md)
    assert kv_bytes_per_token_layer(8, 128) == 2112
    assert 2112 * 28 * 8192 == 484_442_112


def test_size_and_views():
    kv = KVCache(KVLayout(n_layers=3, n_kv_heads=2, head_dim=64, max_seq=100), kv_bs=32)
    assert kv.bytes_per_token_layer == 2 * 2 * 64 + 8 * 2
    assert kv.nbytes == kv.bytes_per_token_layer * 3 * 100
    assert kv.k_q.shape == kv.v_q.shape == (3, 2, 100, 64) and kv.k_q.dtype == np.int8
    assert kv.k_s.shape == kv.v_s.shape == (3, 2, 100) and kv.k_s.dtype == np.float32
    total = kv.k_q.nbytes + kv.v_q.nbytes + kv.k_s.nbytes + kv.v_s.nbytes
    assert total == kv.nbytes
    # the four views tile one buffer without overlap
    assert not np.shares_memory(kv.k_q, kv.v_q) and not np.shares_memory(kv.k_s, kv.v_s)
    kv.k_q[1][0, 5, :] = 7
    assert kv.k_q[1, 0, 5, 0] == 7 and kv.k_q[0, 0, 5, 0] == 0


def test_truncate_moves_only_the_keys():
    kv = KVCache(KVLayout(2, 1, 32, 50))
    kv.k_q[...] = 3
    kv.append(range(40))
    kv.truncate(16)
    assert kv.cache_len == 16 and kv.keys == tuple(range(16)) and kv.room() == 34
    assert (kv.k_q == 3).all()          # logical clear: bytes stay
    with pytest.raises(ValueError):
        kv.truncate(17)                 # cannot keep tokens that are not valid
    with pytest.raises(ValueError):
        kv.truncate(-1)
    with pytest.raises(ValueError):
        kv.append(range(35))            # more rows than the arena has left


def test_copy_and_restore_rows():
    layout = KVLayout(2, 3, 32, 64)
    a, b = KVCache(layout), KVCache(layout)
    rng = np.random.default_rng(0)
    for x in (a.k_q, a.v_q):
        x[...] = rng.integers(-127, 128, x.shape)
    for x in (a.k_s, a.v_s):
        x[...] = rng.random(x.shape)
    a.append(range(100, 140))
    rows = a.copy_rows(10, 40)
    assert [r.shape for r in rows] == list(layout.rows_shapes(30))
    assert not np.shares_memory(rows[0], a.k_q)
    b.append(range(100, 110))           # rows 0..9 "computed" (same keys)
    b.k_q[:, :, :10] = a.k_q[:, :, :10]
    b.restore(10, a.keys, rows)
    assert b.keys == a.keys
    for x, y in ((a.k_q, b.k_q), (a.v_q, b.v_q), (a.k_s, b.k_s), (a.v_s, b.v_s)):
        np.testing.assert_array_equal(x[:, :, 10:40], y[:, :, 10:40])
    assert not b.v_q[:, :, :10].any()   # rows before `start` are not touched
    with pytest.raises(ValueError):
        a.copy_rows(0, 41)              # past the valid rows
    c = KVCache(layout)
    c.append([1] * 10)
    with pytest.raises(ValueError, match="differ"):
        c.restore(10, a.keys, rows)     # its rows [0, 10) hold other tokens
    with pytest.raises(ValueError):
        KVCache(KVLayout(2, 2, 32, 64)).restore(0, a.keys[:30], rows)   # another layout
