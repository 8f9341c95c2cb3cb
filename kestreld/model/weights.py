"""What a loaded model is: hyperparameters, Q8_0 weights, tokenizer, chat template.

Loaders (`gguf_file`, `hf_dir`) produce a `LoadedModel`; the forward pass reads it.
Every weight matrix is Q8_0 in the GGUF layout, whatever the file held:

    Q8_0 row of `cols` values = cols/32 blocks of 34 bytes: fp16 scale d, then 32 int8 q;
    value = d * q.   A matrix (rows, cols) is a uint8 array (rows, cols/32*34).

For a Q8_0 GGUF the arrays are views of the file's memory map (no copy); other formats
are converted once at load. Norm weights are float32 vectors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

Q8_BLOCK = 32          # values per Q8_0 block
Q8_BLOCK_BYTES = 34    # fp16 scale + 32 int8


@dataclass(frozen=True)
class Q8Matrix:
    """A (rows, cols) matrix in GGUF Q8_0 layout: `data` is uint8 (rows, cols/32*34)."""
    data: np.ndarray
    rows: int
    cols: int

    def __post_init__(self):
        want = (self.rows, self.cols // Q8_BLOCK * Q8_BLOCK_BYTES)
        if self.cols % Q8_BLOCK or self.data.dtype != np.uint8 or self.data.shape != want:
            raise ValueError(f"Q8Matrix: data {self.data.dtype}{self.data.shape} does not hold "
                             f"({self.rows}, {self.cols}) Q8_0 (want uint8{want})")


@dataclass(frozen=True)
class Q8Experts:
    """`n_expert` stacked (rows, cols) Q8_0 matrices: `data` is uint8 (n_expert, rows,
    cols/32*34) and data[e] is expert e's matrix (a C-contiguous view, no copy)."""
    data: np.ndarray
    n_expert: int
    rows: int
    cols: int

    def __post_init__(self):
        want = (self.n_expert, self.rows, self.cols // Q8_BLOCK * Q8_BLOCK_BYTES)
        if (self.cols % Q8_BLOCK or self.data.dtype != np.uint8 or self.data.shape != want
                or not self.data.flags.c_contiguous):
            raise ValueError(f"Q8Experts: data {self.data.dtype}{self.data.shape} does not hold "
                             f"{self.n_expert} x ({self.rows}, {self.cols}) Q8_0 "
                             f"(want C-contiguous uint8{want})")


@dataclass(frozen=True)
class MoEWeights:
    """The sparse feed-forward of one MoE layer: a router and n_expert SwiGLU experts."""
    router: np.ndarray            # (n_expert, hidden) f32: router logits = xn @ router.T
    gate: Q8Experts               # n_expert x (expert_ffn, hidden)
    up: Q8Experts                 # n_expert x (expert_ffn, hidden)
    down: Q8Experts               # n_expert x (hidden, expert_ffn)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are (out, in)."""
    attn_norm: np.ndarray         # (hidden,) f32
    wq: Q8Matrix                  # (n_heads*head_dim, hidden)
    wk: Q8Matrix                  # (n_kv_heads*head_dim, hidden)
    wv: Q8Matrix                  # (n_kv_heads*head_dim, hidden)
    wo: Q8Matrix                  # (hidden, n_heads*head_dim)
    q_norm: Optional[np.ndarray]  # (head_dim,) f32, Qwen3 only
    k_norm: Optional[np.ndarray]  # (head_dim,) f32, Qwen3 only
    ffn_norm: np.ndarray          # (hidden,) f32
    w_gate: Optional[Q8Matrix]    # (ffn, hidden); None in a MoE layer
    w_up: Optional[Q8Matrix]      # (ffn, hidden); None in a MoE layer
    w_down: Optional[Q8Matrix]    # (hidden, ffn); None in a MoE layer
    moe: Optional[MoEWeights] = None  # the layer's feed-forward when it is MoE


@dataclass(frozen=True)
class ModelWeights:
    tok_embd: Q8Matrix            # (vocab, hidden)
    layers: list[LayerWeights]
    out_norm: np.ndarray          # (hidden,) f32
    output: Q8Matrix              # (vocab, hidden); the same object as tok_embd when tied
