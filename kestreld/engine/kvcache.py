"""The KV cache: the int8 KV arena, allocated once per process, and the keys of the tokens
whose KV it holds. This module is the one place the KV layout is defined, and `KVCache`'s
methods are the only writers of the cache's state.

Layout: one contiguous uint8 buffer cut into four views (shapes in order of the axes):

    k_q  int8    (n_layers, n_kv_heads, max_seq, head_dim)
    v_q  int8    (n_layers, n_kv_heads, max_seq, head_dim)
    k_s  float32 (n_layers, n_kv_heads, max_seq)    one scale per (token, layer, head)
    v_s  float32 (n_layers, n_kv_heads, max_seq)

k[layer, head, p, :] = k_s[layer, head, p] * k_q[layer, head, p, :], and the same for V. One
(token, layer) costs 2*n_kv_heads*head_dim + 2*4*n_kv_heads bytes (2112 for Qwen3-VL-2B: 8
KV heads x 128), and the arena n_layers * max_seq times that. Keys of one head are
contiguous over tokens, which is what attention scans.

The invariant: rows [0, cache_len) hold the KV of `keys` (cache_len == len(keys)), in
order; the rest of the arena is stale bytes that the next forward pass overwrites.
`truncate(keep)` forgets rows without touching memory ("logical clear"). A key is the
token id, or for Qwen3-VL's image placeholders a negative key derived from the image
(vision/prompt.py), so that the prefix rule compares images, not placeholder ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def kv_bytes_per_token_layer(n_kv_heads: int, head_dim: int) -> int:
    """Bytes of K+V (int8) and their two fp32 scales for one token in one layer."""
    return 2 * n_kv_heads * head_dim + 2 * 4 * n_kv_heads


@dataclass(frozen=True)
class KVLayout:
    """The arena's shape. A disk snapshot is only ever loaded into the same one."""
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq: int

    @property
    def bytes_per_token_layer(self) -> int:
        return kv_bytes_per_token_layer(self.n_kv_heads, self.head_dim)

    @classmethod
    def of(cls, config, max_seq: int) -> "KVLayout":
        """The layout of a model's (a ModelConfig's) arena for max_seq tokens."""
        return cls(config.n_layers, config.n_kv_heads, config.head_dim, max_seq)

    def row_bytes(self) -> int:
        """Bytes of one token's K, V and scales over all layers."""
        return self.n_layers * self.bytes_per_token_layer

    @property
    def nbytes(self) -> int:
        """Bytes of the whole arena."""
        return self.row_bytes() * self.max_seq

    def rows_shapes(self, n: int) -> tuple:
        """Shapes of (k_q, v_q, k_s, v_s) for n tokens: what `copy_rows` returns."""
        q = (self.n_layers, self.n_kv_heads, n, self.head_dim)
        s = (self.n_layers, self.n_kv_heads, n)
        return q, q, s, s


class RowBlock(NamedTuple):
    """Some tokens' rows of the four arrays, shaped as KVLayout.rows_shapes: what
    `KVCache.copy_rows` returns and `KVCache.restore` takes."""
    k_q: np.ndarray
    v_q: np.ndarray
    k_s: np.ndarray
    v_s: np.ndarray

    @classmethod
    def empty(cls, layout: "KVLayout", n: int) -> "RowBlock":
        """Uninitialised rows for n tokens."""
        return cls(*(np.empty(shape, dtype) for shape, dtype in
                     zip(layout.rows_shapes(n), (np.int8, np.int8, np.float32, np.float32))))

    def slice(self, a: int, b: int) -> "RowBlock":
        """Views of the block's rows [a, b)."""
        return RowBlock(*(x[:, :, a:b] for x in self))

    @property
    def n(self) -> int:
        """Tokens in the block."""
        return self.k_q.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self)


class KVCache:
    """The preallocated int8 KV cache and the keys whose KV it holds.

    Owned by the engine thread, which alone calls the writing methods; `cache_len` may be
    read from any thread (it reads the length of a list)."""

    def __init__(self, layout: KVLayout, kv_bs: int = 32):
        self.layout = layout
        self.kv_bs = kv_bs
        self.bytes_per_token_layer = layout.bytes_per_token_layer
        self.nbytes = layout.nbytes
        (q_shape, _, s_shape, _) = layout.rows_shapes(layout.max_seq)
        q_bytes = int(np.prod(q_shape))
        s_bytes = int(np.prod(s_shape)) * 4
        # Touch every page now so RSS shows the arena from the first moment and no
        # request ever pays for page faults in it.
        self._buffer = np.zeros(self.nbytes, dtype=np.uint8)
        self._buffer[::4096] = 0
        b = self._buffer
        self.k_q = b[0:q_bytes].view(np.int8).reshape(q_shape)
        self.v_q = b[q_bytes:2 * q_bytes].view(np.int8).reshape(q_shape)
        self.k_s = b[2 * q_bytes:2 * q_bytes + s_bytes].view(np.float32).reshape(s_shape)
        self.v_s = b[2 * q_bytes + s_bytes:].view(np.float32).reshape(s_shape)
        self._keys: list = []

    @classmethod
    def for_model(cls, config, max_seq: int, kv_bs: int = 32) -> "KVCache":
        """The cache of a model (a ModelConfig) for max_seq tokens."""
        return cls(KVLayout.of(config, max_seq), kv_bs)

    # ---- reading ------------------------------------------------------------------
    @property
    def max_seq(self) -> int:
        return self.layout.max_seq

    @property
    def cache_len(self) -> int:
        """Tokens whose KV is valid: rows [0, cache_len)."""
        return len(self._keys)

    @property
    def keys(self) -> tuple:
        """The keys of rows [0, cache_len), in order (a copy)."""
        return tuple(self._keys)

    def room(self) -> int:
        """Tokens that still fit after the valid cache."""
        return self.max_seq - self.cache_len

    def copy_rows(self, a: int, b: int) -> RowBlock:
        """Copies of the valid rows [a, b) (for a snapshot in the KV store: the next request
        may overwrite the arena at once)."""
        if not 0 <= a <= b <= self.cache_len:
            raise ValueError(f"copy_rows({a}, {b}) outside the valid cache [0, {self.cache_len}]")
        return RowBlock(*(np.ascontiguousarray(x[:, :, a:b])
                          for x in (self.k_q, self.v_q, self.k_s, self.v_s)))

    # ---- writing (the engine thread) ----------------------------------------------
    def truncate(self, keep: int) -> None:
        """Keep the first `keep` tokens' KV valid and forget the rest (no memory is
        touched): a prefix hit keeps its prefix, a miss keeps 0, and after a cancel or an
        error the cache is cut back to the rows that were really written."""
        if not 0 <= keep <= self.cache_len:
            raise ValueError(f"truncate(keep={keep}) outside the valid cache [0, {self.cache_len}]")
        del self._keys[keep:]

    def append(self, keys) -> None:
        """Record that the forward pass has just written the KV of `keys` at rows
        [cache_len, cache_len + len(keys))."""
        keys = [int(k) for k in keys]
        if len(keys) > self.room():
            raise ValueError(f"{len(keys)} rows do not fit after {self.cache_len} of max_seq={self.max_seq}")
        self._keys.extend(keys)

    def restore(self, start: int, keys, rows: RowBlock) -> None:
        """Write rows [start, start + n) from a snapshot (k_q, v_q, k_s, v_s of n tokens)
        and make `keys` (the keys of rows [0, start + n)) the cache's keys. Rows before
        `start` must be valid already and are not touched."""
        n = rows.n
        keys = [int(k) for k in keys]
        if not 0 <= start <= self.cache_len or len(keys) != start + n or start + n > self.max_seq:
            raise ValueError(f"restore of rows [{start}, {start + n}) with {len(keys)} keys "
                             f"into a cache of {self.cache_len} valid rows, max_seq={self.max_seq}")
        if any(r.shape[:2] != self.k_q.shape[:2] or r.shape[2] != n for r in rows):
            raise ValueError("restore: rows shaped for another KV layout")
        if keys[:start] != self._keys[:start]:
            raise ValueError(f"restore: the keys of rows [0, {start}) differ from the cache's")
        del self._keys[start:]
        for dst, src in zip((self.k_q, self.v_q, self.k_s, self.v_s), rows):
            dst[:, :, start:start + n] = src
        self._keys[start:] = keys[start:]
