"""One forward pass of a Qwen3 / Llama decoder over a chunk of tokens, on the kernels.

Data flow per layer (n tokens of the chunk, positions pos0 .. pos0+n-1):

    x (n, hidden) --rmsnorm--> xn --q8--> Q, K, V --q/k norm, rope--> kv_store -> attention
      --q8--> wo --> x += ;   x --rmsnorm--> xn --q8--> gate, up --swiglu--> --q8--> down --> x +=

Every buffer is allocated here, once, for the largest chunk; a forward pass allocates
nothing. Orchestration only: all arithmetic is in `kestreld._kernels`.
"""
from __future__ import annotations

import numpy as np

from ..kernels import K
from .kvcache import KVCache
from ..model.load import LoadedModel
from ..model.weights import Q8Matrix
from .moe import MoEFeedForward
from ..vision.prompt import ChunkVision, MRopeTables


def rope_tables(max_pos: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (max_pos, head_dim/2): angle[p, i] = p * theta**(-2i/head_dim)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class _Scratch:
    """Flat buffers sized for `rows` tokens; `get(name, n, k)` is a contiguous (n, k) view."""

    def __init__(self, rows: int, widths: dict, dtypes: dict):
        self._bufs = {name: np.zeros(rows * w, dtype=dtypes.get(name, np.float32))
                      for name, w in widths.items()}

    def get(self, name: str, n: int, k: int) -> np.ndarray:
        return self._bufs[name][: n * k].reshape(n, k)


class Forward:
    """The model's forward pass over a KV cache: each call runs tokens after the cache's
    valid rows, writes their KV there and appends their keys."""

    def __init__(self, model: LoadedModel, kv: KVCache, max_chunk: int, threads: int):
        arena = kv
        c = model.config
        self.cfg = c
        self.w = model.weights
        self.kv = kv
        self.max_chunk = max_chunk
        self.threads = threads
        self.q_dim = c.n_heads * c.head_dim
        self.kv_dim = c.n_kv_heads * c.head_dim
        self.scale = float(1.0 / np.sqrt(c.head_dim))
        self.cos, self.sin = rope_tables(arena.max_seq, c.head_dim, c.rope_theta)
        # Qwen3-VL: chunk tables from 3-D positions when a prompt has images
        self.mrope = (MRopeTables(c.head_dim, c.rope_theta, c.mrope_section, max_chunk)
                      if c.mrope_section else None)
        widest = max(c.hidden, self.q_dim, c.ffn)
        rows = max_chunk
        self.s = _Scratch(rows, {
            "x": c.hidden, "xn": c.hidden, "q": self.q_dim, "k": self.kv_dim, "v": self.kv_dim,
            "att": self.q_dim, "proj": c.hidden, "gate": c.ffn, "up": c.ffn,
            "xq": widest, "xd": widest // 32,
        }, {"xq": np.int8})
        self.logits = np.zeros((1, c.vocab), dtype=np.float32)   # (1, vocab) last position
        self.ids = np.zeros(max_chunk, dtype=np.int32)
        self.moe = MoEFeedForward(c, max_chunk, threads) if c.moe_layers else None
        # Decode (one token) runs every layer in one kernel call: the same kernels in the same
        # order as `forward` below, without a Python call and a thread fork/join per kernel.
        w = self.w
        self.decode_step = K.DecodeStep(
            w.tok_embd.data, w.output.data, w.out_norm, self.cos, self.sin,
            [(L.wq.data, L.wk.data, L.wv.data, L.wo.data,
              *((None,) * 3 if L.moe else (L.w_gate.data, L.w_up.data, L.w_down.data)),
              L.attn_norm, L.ffn_norm, L.q_norm if c.qk_norm else None,
              L.k_norm if c.qk_norm else None,
              (L.moe.router, L.moe.gate.data, L.moe.up.data, L.moe.down.data) if L.moe else None)
             for L in w.layers],
            [arena.layer(li) for li in range(c.n_layers)],
            c.n_heads, c.n_kv_heads, c.norm_eps, self.scale, arena.kv_bs, c.rope_neox, threads,
            c.n_experts_used if c.moe_layers else 0, bool(c.norm_topk_prob))

    # ---- small helpers ------------------------------------------------------------
    def _matmul(self, w: Q8Matrix, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (n, w.rows) = x (n, w.cols) @ w.T, with x quantized to Q8_0 first."""
        n, k = x.shape
        xq = self.s.get("xq", n, k)
        xd = self.s.get("xd", n, k // 32)
        K.quantize_q8_0(x, xq, xd, self.threads)
        K.matmul_q8_0(w.data, xq, xd, out, self.threads)
        return out

    def _matmul_quantized(self, w: Q8Matrix, n: int, k: int, out: np.ndarray) -> np.ndarray:
        """Like `_matmul`, reusing the activation quantized by the previous call."""
        K.matmul_q8_0(w.data, self.s.get("xq", n, k), self.s.get("xd", n, k // 32), out, self.threads)
        return out

    # ---- the pass -----------------------------------------------------------------
    def __call__(self, ids, keys=None, logits_out: np.ndarray | None = None,
                 vision: ChunkVision | None = None, rope_pos0: int | None = None) -> np.ndarray:
        """Run tokens `ids` (n <= max_chunk) at positions pos0 = cache_len.., store their
        KV and append `keys` (default: the ids) to the cache.

        `vision` (Qwen3-VL, a prompt with images): the chunk's M-RoPE positions (3, n), which
        replace pos0.. in RoPE (the KV still goes to pos0..), and its visual tokens' input
        embeddings and DeepStack features. `rope_pos0` (Qwen3-VL text after images): RoPE
        positions start there instead of pos0 (all three M-RoPE components are equal).

        Returns logits of the last token (1, vocab), or fills `logits_out` (n, vocab)
        with every position's logits when given (tests and diagnostics)."""
        pos0 = self.kv.cache_len
        logits = self._forward(ids, pos0, logits_out, vision, rope_pos0)
        self.kv.append(ids if keys is None else keys)
        return logits

    def _forward(self, ids, pos0, logits_out, vision, rope_pos0):
        c, s, t = self.cfg, self.s, self.threads
        n = len(ids)
        if not 0 < n <= self.max_chunk:
            raise ValueError(f"chunk of {n} tokens; 1..{self.max_chunk} allowed")
        if pos0 + n > self.kv.max_seq:
            raise ValueError(f"positions up to {pos0 + n} exceed max_seq={self.kv.max_seq}")
        if rope_pos0 is None:
            rope_pos0 = pos0
        if n == 1 and logits_out is None and vision is None:
            self.decode_step.step(int(ids[0]), pos0, self.logits, rope_pos0)
            return self.logits
        ids_arr = self.ids[:n]
        ids_arr[:] = ids
        x = s.get("x", n, c.hidden)
        xn = s.get("xn", n, c.hidden)
        K.dequantize_rows_q8_0(self.w.tok_embd.data, ids_arr, x)
        rope_cos, rope_sin = self.cos, self.sin
        if vision is not None:
            rope_cos, rope_sin = self.mrope.tables(vision.positions)
            rope_pos0 = 0
            if vision.embeds is not None:
                x[vision.rows] = vision.embeds

        for li, L in enumerate(self.w.layers):
            # attention block
            K.rmsnorm(x, L.attn_norm, c.norm_eps, xn, t)
            q = self._matmul(L.wq, xn, s.get("q", n, self.q_dim))
            k = self._matmul_quantized(L.wk, n, c.hidden, s.get("k", n, self.kv_dim))
            v = self._matmul_quantized(L.wv, n, c.hidden, s.get("v", n, self.kv_dim))
            if c.qk_norm:
                qh = q.reshape(n * c.n_heads, c.head_dim)
                kh = k.reshape(n * c.n_kv_heads, c.head_dim)
                K.rmsnorm(qh, L.q_norm, c.norm_eps, qh, t)
                K.rmsnorm(kh, L.k_norm, c.norm_eps, kh, t)
            q3 = q.reshape(n, c.n_heads, c.head_dim)
            k3 = k.reshape(n, c.n_kv_heads, c.head_dim)
            K.rope(q3, rope_cos, rope_sin, rope_pos0, c.rope_neox, t)
            K.rope(k3, rope_cos, rope_sin, rope_pos0, c.rope_neox, t)
            kq, ks, vq, vs = self.kv.layer(li)
            K.kv_store(k3, v.reshape(n, c.n_kv_heads, c.head_dim), kq, ks, vq, vs, pos0, t)
            att = s.get("att", n, self.q_dim)
            K.attention(q3, kq, ks, vq, vs, pos0, self.scale, self.kv.kv_bs,
                        att.reshape(n, c.n_heads, c.head_dim), t)
            proj = self._matmul(L.wo, att, s.get("proj", n, c.hidden))
            x += proj
            # feed-forward block
            K.rmsnorm(x, L.ffn_norm, c.norm_eps, xn, t)
            if L.moe is not None:   # Qwen3-MoE: routed experts (moe.py)
                self.moe.add(L.moe, xn, x)
            else:
                gate = self._matmul(L.w_gate, xn, s.get("gate", n, c.ffn))
                up = self._matmul_quantized(L.w_up, n, c.hidden, s.get("up", n, c.ffn))
                K.swiglu(gate, up, gate, t)
                proj = self._matmul(L.w_down, gate, s.get("proj", n, c.hidden))
                x += proj
            if vision is not None and li < len(vision.deepstack):
                x[vision.rows] += vision.deepstack[li]

        if logits_out is not None:
            K.rmsnorm(x, self.w.out_norm, c.norm_eps, xn, t)
            return self._matmul(self.w.output, xn, logits_out)
        last = xn[n - 1:n]
        K.rmsnorm(x[n - 1:n], self.w.out_norm, c.norm_eps, last, t)
        return self._matmul(self.w.output, last, self.logits)
