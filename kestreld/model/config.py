"""A model's hyperparameters (`ModelConfig`), as read from its file's metadata."""
from __future__ import annotations

from dataclasses import dataclass

# How an embedding model makes one vector of a text's rows: llama.cpp's LLAMA_POOLING_TYPE
# numbers, as GGUF files hold them in `<arch>.pooling_type` (0 NONE: a generative model;
# 4 RANK: a reranker's classifier head, which is not computed here).
POOLINGS = ("last", "mean", "cls")
RANK = "rank"                 # a reranker's pooling (engine/rerank.py)
GGUF_POOLING = {0: "", 1: "mean", 2: "cls", 3: "last", 4: RANK}


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
    # Embedding models: "last" | "mean" | "cls" (POOLINGS) as the file says; "" for a
    # generative model (its file names no pooling); "rank" for a reranker.
    pooling: str = ""
