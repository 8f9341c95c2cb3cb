"""The forward pass of the model over the KV cache: one C call per chunk of tokens.

`Forward` holds the compiled pass (kestreld._kernels.Forward, pyx/ks_forward.h: every layer,
dense or MoE, in one pass of its ks_team threads), the RoPE tables and the logits buffer.
Each call runs n >= 1 tokens at KV rows cache_len .., writes their KV there and appends their
keys to the KV cache: decode is a call with one token, prefill a call per chunk. What stays in
Python is only what a chunk needs beyond its ids, in a `Batch` (ks_batch's Python side): its
RoPE rows (Qwen3-VL: from M-RoPE positions) and its visual tokens' embeddings and DeepStack
features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..kernels import K
from ..vision.prompt import ChunkVision, MRopeTables
from .kvcache import KVCache


def rope_tables(max_pos: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (max_pos, head_dim/2): angle[p, i] = p * theta**(-2i/head_dim)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@dataclass
class Batch:
    """One chunk as the compiled pass takes it: the Python side of ks_batch (pyx/ks_forward.h),
    read by field name (pyx/forward.pxi). Arrays C-contiguous."""
    tokens: np.ndarray                    # int32 (n,), n <= max_chunk
    pos0: int                             # the KV row of tokens[0]; rows before it are valid
    rope_cos: np.ndarray                  # float32 (n, head_dim/2): each token's rotation
    rope_sin: np.ndarray
    logits: Optional[np.ndarray]          # float32 (1, vocab): the last token's; (n, vocab): all
    vis_rows: Optional[np.ndarray] = None     # Qwen3-VL: int32 (r,) rows fed vis_embd
    vis_embd: Optional[np.ndarray] = None     # float32 (r, hidden): their input embeddings
    deep: Optional[np.ndarray] = None         # float32 (d, r, hidden): DeepStack, layers 0..d-1
    routing: Optional[np.ndarray] = None      # MoE: int32 (MoE layers, n, top-k), filled
    hidden: Optional[np.ndarray] = None       # float32 (1 | n, hidden): rows after the output
                                              # norm, filled instead of logits (embeddings)
    seq_starts: Optional[np.ndarray] = None   # int32 (s,): packed sequences' first tokens,
                                              # each attending only its own keys (embeddings)


class Forward:
    """The model's forward pass over a KV cache (see the module docstring)."""

    def __init__(self, model, kv: KVCache, max_chunk: int, threads: int):
        c = model.config
        self.config = c
        self.kv = kv
        self.max_chunk = max_chunk
        self.threads = threads
        self.cos, self.sin = rope_tables(kv.max_seq, c.head_dim, c.rope_theta)
        # Qwen3-VL: chunk tables from 3-D positions when a prompt has images
        self.mrope = (MRopeTables(c.head_dim, c.rope_theta, c.mrope_section, max_chunk)
                      if c.mrope_section else None)
        self.logits = np.zeros((1, c.vocab), dtype=np.float32)   # the last token's
        self.tokens = np.zeros(max_chunk, dtype=np.int32)
        self.compiled = K.Forward(c, model.weights, kv, max_chunk, threads)

    @property
    def working_threads(self) -> int:
        """Threads that took work in the last forward pass (0 before the first): `threads` on
        a quiet machine, fewer while other processes hold the cores."""
        return self.compiled.working_threads

    def __call__(self, ids, keys=None, logits_out: Optional[np.ndarray] = None,
                 vision: Optional[ChunkVision] = None, rope_pos0: Optional[int] = None,
                 routing: Optional[np.ndarray] = None,
                 hidden_out: Optional[np.ndarray] = None,
                 seq_starts: Optional[list] = None) -> np.ndarray:
        """Run tokens `ids` (n <= max_chunk) at KV rows pos0 = cache_len .., store their KV
        and append `keys` (default: the ids) to the cache.

        `vision` (Qwen3-VL, a prompt with images): the chunk's M-RoPE positions (3, n), which
        replace pos0.. in RoPE (the KV still goes to rows pos0..), and its visual tokens'
        input embeddings and DeepStack features. `rope_pos0` (Qwen3-VL text after images):
        RoPE positions start there instead of pos0 (all three M-RoPE components are equal).
        `routing` (MoE, diagnostics): int32 (MoE layers, n, top-k) filled with each token's
        experts.

        Returns the last token's logits (1, vocab), or fills `logits_out` (n, vocab) with
        every token's. `hidden_out` (1 | n, hidden), embeddings: filled with the last /
        every token's row after the output norm instead (no logits are made) and returned.
        `seq_starts` (embeddings): the chunk packs sequences beginning at these indices (the
        first 0), each at RoPE positions 0.. and attending only its own keys; every row is
        the same bits as its sequence run alone from row 0. The keys appended are the ids,
        so only the first sequence's rows form a valid prefix afterwards."""
        n, pos0 = len(ids), self.kv.cache_len
        if not 0 < n <= self.max_chunk:
            raise ValueError(f"chunk of {n} tokens; 1..{self.max_chunk} allowed")
        if pos0 + n > self.kv.max_seq:
            raise ValueError(f"positions up to {pos0 + n} exceed max_seq={self.kv.max_seq}")
        tokens = self.tokens[:n]
        tokens[:] = ids
        vis_rows = vis_embd = deep = None
        if vision is not None:
            cos, sin = self.mrope.tables(vision.positions)
            if vision.embeds is not None:
                vis_rows = vision.rows.astype(np.int32)
                vis_embd = np.ascontiguousarray(vision.embeds, np.float32)
                deep = np.ascontiguousarray(np.stack(vision.deepstack), np.float32) \
                    if vision.deepstack else None
        elif seq_starts is not None:
            bounds = list(seq_starts) + [n]
            rows = np.concatenate([np.arange(b - a) for a, b in zip(bounds, bounds[1:])])
            cos, sin = self.cos[rows], self.sin[rows]
        else:
            r0 = pos0 if rope_pos0 is None else rope_pos0
            if not (0 <= r0 and r0 + n <= len(self.cos)):
                raise ValueError(f"RoPE positions {r0}..{r0 + n - 1} outside [0, {len(self.cos)})")
            cos, sin = self.cos[r0:r0 + n], self.sin[r0:r0 + n]
        logits = self.logits if logits_out is None else logits_out
        if hidden_out is not None:
            logits = None
        self.compiled.run(Batch(tokens=tokens, pos0=pos0, rope_cos=cos, rope_sin=sin,
                                logits=logits, vis_rows=vis_rows, vis_embd=vis_embd, deep=deep,
                                routing=routing, hidden=hidden_out,
                                seq_starts=None if seq_starts is None
                                else np.asarray(seq_starts, np.int32)))
        self.kv.append(ids if keys is None else keys)
        return logits if hidden_out is None else hidden_out
