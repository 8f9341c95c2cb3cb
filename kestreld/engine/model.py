"""What a loaded model is: hyperparameters, Q8_0 weights, tokenizer, chat template.

Loaders (`gguf_loader`, `hf_loader`) produce a `LoadedModel`; the forward pass reads it.
Every weight matrix is Q8_0 in the GGUF layout, whatever the file held:

    Q8_0 row of `cols` values = cols/32 blocks of 34 bytes: fp16 scale d, then 32 int8 q;
    value = d * q.   A matrix (rows, cols) is a uint8 array (rows, cols/32*34).

For a Q8_0 GGUF the arrays are views of the file's memory map (no copy); other formats
are converted once at load. Norm weights are float32 vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

Q8_BLOCK = 32          # values per Q8_0 block
Q8_BLOCK_BYTES = 34    # fp16 scale + 32 int8


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters, all read from the model file's metadata."""
    arch: str                 # "qwen3" | "qwen3moe" | "llama"
    name: str
    n_layers: int
    hidden: int               # d_model
    n_heads: int
    n_kv_heads: int
    head_dim: int             # may differ from hidden / n_heads (Qwen3)
    ffn: int                  # SwiGLU intermediate size
    vocab: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool     # output projection == token embedding
    qk_norm: bool             # per-head RMSNorm on q and k (Qwen3)
    rope_neox: bool           # True: rotate halves (x[i], x[i+d/2]); False: adjacent pairs (x[2i], x[2i+1])
    context_length: int       # trained context (informational)
    n_params: int = 0
    # Mixture of experts (Qwen3-MoE); all 0 / empty for dense models.
    n_experts: int = 0            # experts per MoE layer
    n_experts_used: int = 0       # experts each token is routed to (top-k)
    expert_ffn: int = 0           # SwiGLU intermediate size of one expert
    norm_topk_prob: bool = True   # rescale the k chosen router probabilities to sum to 1
    moe_layers: tuple = ()        # indices of the layers whose feed-forward is MoE
    # Qwen3-VL: interleaved M-RoPE, frequencies per (t, h, w) component; () = plain RoPE.
    # Text-only input has t = h = w, which is plain RoPE.
    mrope_section: tuple = ()


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


@dataclass
class LoadedModel:
    """Everything the engine needs from a model file or directory."""
    path: str
    config: ModelConfig
    weights: ModelWeights
    tokenizer: "Tokenizer"
    chat_template: Optional[str]  # Jinja source, from the file
    source_format: str            # "gguf" | "hf"
    source_dtype: str             # what the file held, e.g. "q8_0", "q4_1", "bf16"
    keepalive: list = field(default_factory=list)  # memory maps the arrays view into
    vision: Optional[object] = None  # Qwen3-VL: the vision encoder (vision.VisionEncoder)
    mmproj: Optional[str] = None     # the vision projector GGUF the encoder came from, if any
