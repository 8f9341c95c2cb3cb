"""An independent float64 numpy forward pass for Qwen3, Qwen3-MoE and Llama: the oracle the
engine is judged against. Written from the architectures' math on Hugging Face weight layouts
(rotate-half RoPE), not from the engine's code.

    logits = forward(weights, config, ids)                       # exact math on the weights
    logits = forward(quantize_weights(weights), config, ids,     # the numbers the engine
                     kv_int8=True, act_q8=True)                  # computes with

`weights` is a dict of arrays in HF naming (model.embed_tokens.weight, model.layers.N.*,
model.norm.weight, lm_head.weight absent when tied; Qwen3-MoE: mlp.gate.weight and
mlp.experts.J.*_proj.weight per expert); `config` is the HF config.json dict.
"""
from __future__ import annotations

import numpy as np

Q8_BLOCK = 32
ROUTER_SUFFIX = ".mlp.gate.weight"   # Qwen3-MoE router (E, hidden)


# ---------------------------------------------------------------- quantization emulation

def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves go away from zero (numpy's rint would go to even). Exact in float32
    (floor(|v| + 0.5) is not: 0.49999997 + 0.5 rounds up to 1)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= 0.5, t + np.sign(v), t)


def q8_0_round(x: np.ndarray, fp16_scale: bool = True) -> np.ndarray:
    """Round `x` through Q8_0 along its last axis (blocks of 32): per block d = absmax/127 and
    q = roundf(x * (1/d)) in float32, then x' = d * q. fp16_scale: d is stored as fp16, as in
    GGUF weights (bit-exact with ggml's quantize_row_q8_0 + dequantize); False: d stays float32,
    as the engine keeps it for activations. Returns float64."""
    shape = x.shape
    if shape[-1] % Q8_BLOCK:
        raise ValueError(f"q8_0_round: last axis {shape[-1]} is not a multiple of {Q8_BLOCK}")
    b = np.asarray(x, np.float32).reshape(-1, Q8_BLOCK)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = round_half_away(b * inv)
    if fp16_scale:
        d = d.astype(np.float16)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(shape)


def quantize_weights(weights: dict[str, np.ndarray], via_f16: bool = False) -> dict[str, np.ndarray]:
    """Every 2-D matrix (embedding included) rounded through Q8_0 along its input dim, as the
    engine holds it; 1-D norm weights and MoE routers (kept float) unchanged. via_f16: the
    source file held F16, so the values are rounded to fp16 first (a F16 GGUF converted to
    Q8_0 at load)."""
    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and not name.endswith(ROUTER_SUFFIX):
            out[name] = q8_0_round(w.astype(np.float16) if via_f16 else w)
        else:
            out[name] = np.asarray(w, np.float64)
    return out


def int8_round_heads(x: np.ndarray) -> np.ndarray:
    """The int8 KV cache: per (token, head) row of head_dim values, scale = absmax/127
    (float32), q = roundf(x/scale), x' = q * scale. x: (n_tokens, n_heads, head_dim)."""
    x = np.asarray(x, np.float32)
    s = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, np.float32(0), round_half_away(x / s))
    return q.astype(np.float64) * s.astype(np.float64)


def int16_round_heads(x: np.ndarray) -> np.ndarray:
    """A query head as the attention's integer scores take it: int8 codes hi as the KV
    cache's (scale s), and the rest lo = roundf((x/s - hi) * 254), so x' = s * (hi + lo/254)."""
    x = np.asarray(x, np.float32)
    s = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s == 0, np.float32(0), x / s).astype(np.float32)
    hi = round_half_away(v)
    lo = round_half_away((v - hi) * np.float32(254))
    return (hi.astype(np.float64) + lo / 254) * s.astype(np.float64)


# ---------------------------------------------------------------- blocks

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(n: int, head_dim: int, theta: float, start_pos: int = 0):
    """cos, sin of shape (n, 1, head_dim) for HF's rotate-half RoPE: frequency j
    (j < head_dim/2) turns dims j and j + head_dim/2 by pos * theta^(-2j/head_dim)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(start_pos, start_pos + n, dtype=np.float64)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). x: (n, heads, head_dim)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def causal_gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax(q k^T / sqrt(d)) v; query head h reads KV head h // (n_heads/n_kv).
    q: (n, n_heads, d), k and v: (n, n_kv, d). Returns (n, n_heads * d)."""
    n, n_heads, d = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    future = np.triu(np.ones((n, n), dtype=bool), 1)
    out = np.empty_like(q)
    for h in range(n_heads):   # one head at a time keeps a 2,000-token score matrix at 32 MB
        kv = h // group
        s = q[:, h, :] @ k[:, kv, :].T / np.sqrt(d)
        s[future] = -np.inf
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h, :] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv, :]
    return out.reshape(n, n_heads * d)


def is_moe_layer(config: dict, i: int) -> bool:
    """Transformers' Qwen3MoeDecoderLayer rule: experts unless in mlp_only_layers, and only
    every decoder_sparse_step-th layer."""
    return (config["model_type"] == "qwen3_moe" and i not in config.get("mlp_only_layers", ())
            and config["num_experts"] > 0 and (i + 1) % config.get("decoder_sparse_step", 1) == 0)


def moe_ffn(h: np.ndarray, prefix: str, config: dict, W, linear, routing=None) -> np.ndarray:
    """Qwen3-MoE sparse feed-forward of h (n, hidden): router softmax over experts (exact
    float, activation not rounded), the top-k by probability (ties: lower index), weights
    divided by their sum when norm_topk_prob, each token through its k SwiGLU experts, the
    outputs summed with those weights. `routing`: a list that gets the (n, k) choice."""
    k = config["num_experts_per_tok"]
    logits = h @ W(prefix + "mlp.gate.weight").T                   # (n, E)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]          # (n, k)
    w = np.take_along_axis(probs, top, axis=-1)
    if config.get("norm_topk_prob", False):
        w = w / w.sum(axis=-1, keepdims=True)
    if routing is not None:
        routing.append(top)
    out = np.zeros_like(h)
    for e in np.unique(top):
        tok, slot = np.nonzero(top == e)                              # each token at most once
        p = f"{prefix}mlp.experts.{e}."
        gate = linear(h[tok], p + "gate_proj.weight")
        up = linear(h[tok], p + "up_proj.weight")
        out[tok] += w[tok, slot, None] * linear(gate / (1.0 + np.exp(-gate)) * up,
                                                 p + "down_proj.weight")
    return out


# ---------------------------------------------------------------- model

def forward(weights: dict[str, np.ndarray], config: dict, ids, *, kv_int8: bool = False,
            act_q8: bool = False, routing: list | None = None,
            normed_rows: bool = False) -> np.ndarray:
    """Logits (n_tokens, vocab) float64 for token ids at positions 0..n-1.

    kv_int8: round K (after norm and RoPE) and V through the int8 KV cache, and each query
    head to the 15 bits the attention's integer scores take (int16_round_heads).
    act_q8: round each matmul's input through Q8_0 with a float32 scale (what the engine's
    Q8_0 x Q8_0 product sees). Activation rounding is discontinuous: a last-bit difference
    upstream redraws it, so this is the same arithmetic, not the same numbers, as the engine's.
    routing: a list that gets each MoE layer's (n, k) expert choice, in layer order.
    normed_rows: return the rows after the final norm (n_tokens, hidden), not logits."""
    arch = config["model_type"]
    if arch not in ("qwen3", "qwen3_moe", "llama"):
        raise ValueError(f"reference.forward: unsupported model_type {arch!r}")
    hidden = config["hidden_size"]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or hidden // n_heads
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    W = lambda name: np.asarray(weights[name], np.float64)  # noqa: E731

    def linear(x, name):
        return (q8_0_round(x, fp16_scale=False) if act_q8 else x) @ W(name).T

    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    cos, sin = rope_tables(n, hd, theta)
    x = W("model.embed_tokens.weight")[ids]                       # (n, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, W(p + "input_layernorm.weight"), eps)
        q = linear(h, p + "self_attn.q_proj.weight").reshape(n, n_heads, hd)
        k = linear(h, p + "self_attn.k_proj.weight").reshape(n, n_kv, hd)
        v = linear(h, p + "self_attn.v_proj.weight").reshape(n, n_kv, hd)
        if arch != "llama":   # Qwen3: per-head RMSNorm on q and k, before RoPE
            q = rms_norm(q, W(p + "self_attn.q_norm.weight"), eps)
            k = rms_norm(k, W(p + "self_attn.k_norm.weight"), eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_int8:   # and the query as the attention's integer scores take it
            q, k, v = int16_round_heads(q), int8_round_heads(k), int8_round_heads(v)
        x = x + linear(causal_gqa_attention(q, k, v), p + "self_attn.o_proj.weight")
        h = rms_norm(x, W(p + "post_attention_layernorm.weight"), eps)
        if is_moe_layer(config, i):
            x = x + moe_ffn(h, p, config, W, linear, routing)
            continue
        gate = linear(h, p + "mlp.gate_proj.weight")
        up = linear(h, p + "mlp.up_proj.weight")
        x = x + linear(gate / (1.0 + np.exp(-gate)) * up, p + "mlp.down_proj.weight")
    x = rms_norm(x, W("model.norm.weight"), eps)
    if normed_rows:
        return x
    tied = config.get("tie_word_embeddings", False)
    return linear(x, "model.embed_tokens.weight" if tied else "lm_head.weight")


def greedy(weights: dict[str, np.ndarray], config: dict, ids, n_new: int, **opts) -> list[int]:
    """Greedy continuation of `ids` by `n_new` tokens (full recompute per token)."""
    seq = list(ids)
    for _ in range(n_new):
        seq.append(int(np.argmax(forward(weights, config, seq, **opts)[-1])))
    return seq[len(ids):]
