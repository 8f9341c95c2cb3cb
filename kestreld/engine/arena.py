"""The KV arena: int8 K/V with fp32 scales for `max_seq` tokens, allocated once per process.

Layout: one contiguous uint8 buffer cut into four views (shapes in order of the axes):

    k_q  int8    (n_layers, n_kv_heads, max_seq, head_dim)
    v_q  int8    (n_layers, n_kv_heads, max_seq, head_dim)
    k_s  float32 (n_layers, n_kv_heads, max_seq)    one scale per (token, layer, head)
    v_s  float32 (n_layers, n_kv_heads, max_seq)

so one (token, layer) costs 2*n_kv_heads*head_dim + 2*4*n_kv_heads bytes (2112 for
Qwen3-VL-2B: 8 KV heads x 128), and the arena n_layers * max_seq times that. Keys of one
head are contiguous over tokens, which is what attention scans.

Only `cache_len` moves: tokens [0, cache_len) hold valid KV. `reset(keep)` forgets the
rest without touching memory ("logical clear"); new prefill overwrites the old bytes.
"""
from __future__ import annotations

import numpy as np


def kv_bytes_per_token_layer(n_kv_heads: int, head_dim: int) -> int:
    """Bytes of K+V (int8) and their two fp32 scales for one token in one layer."""
    return 2 * n_kv_heads * head_dim + 2 * 4 * n_kv_heads


class KVArena:
    """Preallocated int8 KV cache. Owned by the engine thread; `cache_len` may be read anywhere."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_seq: int, kv_bs: int = 32):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_seq = max_seq
        self.kv_bs = kv_bs
        self.bytes_per_token_layer = kv_bytes_per_token_layer(n_kv_heads, head_dim)
        self.nbytes = self.bytes_per_token_layer * n_layers * max_seq

        q_shape = (n_layers, n_kv_heads, max_seq, head_dim)
        s_shape = (n_layers, n_kv_heads, max_seq)
        q_bytes = n_layers * n_kv_heads * max_seq * head_dim
        s_bytes = n_layers * n_kv_heads * max_seq * 4
        # Touch every page now so RSS shows the arena from the first moment and no
        # request ever pays for page faults in it.
        self._buffer = np.zeros(self.nbytes, dtype=np.uint8)
        self._buffer[::4096] = 0
        b = self._buffer
        self.k_q = b[0:q_bytes].view(np.int8).reshape(q_shape)
        self.v_q = b[q_bytes:2 * q_bytes].view(np.int8).reshape(q_shape)
        self.k_s = b[2 * q_bytes:2 * q_bytes + s_bytes].view(np.float32).reshape(s_shape)
        self.v_s = b[2 * q_bytes + s_bytes:].view(np.float32).reshape(s_shape)
        self.cache_len = 0

    def layer(self, i: int):
        """(k_q, k_s, v_q, v_s) views of layer i: (n_kv, max_seq, hd) int8 and (n_kv, max_seq) f32."""
        return self.k_q[i], self.k_s[i], self.v_q[i], self.v_s[i]

    def reset(self, keep: int) -> None:
        """Keep the first `keep` tokens' KV valid and forget the rest (no memory is touched)."""
        if not 0 <= keep <= self.cache_len:
            raise ValueError(f"reset(keep={keep}) outside the valid cache [0, {self.cache_len}]")
        self.cache_len = keep

    def room(self) -> int:
        """Tokens that still fit after the valid cache."""
        return self.max_seq - self.cache_len
