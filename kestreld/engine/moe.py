"""The sparse feed-forward of a Qwen3-MoE layer, on the kernels. Orchestration only.

For a chunk of n tokens, xn (n, hidden) the normed residual stream, k experts per token:

    route:   probs = softmax(xn @ router^T) (n, E); top_idx, top_w (n, k): each token's k
             most probable experts, weights rescaled to sum to 1 when norm_topk_prob
    group:   the n*k (token, slot) pairs sorted by expert; expert e owns sorted rows
             offsets[e] .. offsets[e] + counts[e] - 1
    gather:  xn quantized to Q8_0 once, its rows copied into that order (n*k, hidden)
    experts: per chosen expert, one matmul over all its rows for gate and for up (so its
             weights are read once per chunk); swiglu and Q8_0 over all n*k rows at once;
             down per expert -> y (n*k, hidden)
    combine: x[t] += sum_j top_w[t, j] * y[sorted row of (t, j)]

Experts that no token chose are not read, so their pages of a memory-mapped GGUF are
never touched. Buffers are allocated once, for the largest chunk.
"""
from __future__ import annotations

import numpy as np

from ..kernels import K
from ..model.config import ModelConfig
from ..model.weights import MoEWeights, Q8_BLOCK


class MoEFeedForward:
    """Scratch buffers and the steps above, shared by all MoE layers of one Transformer.

    After `add`, `top_idx[:n]` holds the chunk's routing (diagnostics and tests)."""

    def __init__(self, c: ModelConfig, max_chunk: int, threads: int):
        E, k, h, f = c.n_experts, c.n_experts_used, c.hidden, c.expert_ffn
        rows = max_chunk * k                        # (token, slot) pairs of a full chunk
        self.k = k
        self.norm_topk = c.norm_topk_prob
        self.threads = threads
        self.probs = np.zeros((max_chunk, E), np.float32)       # router softmax
        self.top_idx = np.zeros((max_chunk, k), np.int32)       # chosen experts
        self.top_w = np.zeros((max_chunk, k), np.float32)       # their weights
        self.counts = np.zeros(E, np.int32)                     # pairs per expert
        self.offsets = np.zeros(E, np.int32)                    # first sorted row per expert
        self.active = np.zeros(E, np.int32)                     # chosen experts, ascending
        self.rows = np.zeros(rows, np.int32)                    # sorted row -> token
        self.slot_pos = np.zeros((max_chunk, k), np.int32)      # (token, slot) -> sorted row
        self.xq = np.zeros((max_chunk, h), np.int8)             # xn as Q8_0: int8 values
        self.xd = np.zeros((max_chunk, h // Q8_BLOCK), np.float32)   # and block scales
        self.gxq = np.zeros((rows, h), np.int8)                 # xn rows in sorted order
        self.gxd = np.zeros((rows, h // Q8_BLOCK), np.float32)
        self.gate = np.zeros((rows, f), np.float32)             # gate, then swiglu(gate, up)
        self.up = np.zeros((rows, f), np.float32)
        self.hq = np.zeros((rows, f), np.int8)                  # swiglu output as Q8_0
        self.hd = np.zeros((rows, f // Q8_BLOCK), np.float32)
        self.y = np.zeros((rows, h), np.float32)                # expert outputs, sorted order

    def add(self, w: MoEWeights, xn: np.ndarray, x: np.ndarray) -> None:
        """x (n, hidden) += the MoE feed-forward of xn (n, hidden), both float32."""
        n, t = xn.shape[0], self.threads
        m = n * self.k
        top_idx, top_w, slot_pos = self.top_idx[:n], self.top_w[:n], self.slot_pos[:n]
        K.moe_route(xn, w.router, self.norm_topk, self.probs[:n], top_idx, top_w, t)
        n_active = K.moe_group(top_idx, self.counts, self.offsets, self.rows[:m], slot_pos,
                               self.active)
        K.quantize_q8_0(xn, self.xq[:n], self.xd[:n], t)
        K.gather_rows_q8_0(self.xq[:n], self.xd[:n], self.rows[:m], self.gxq[:m], self.gxd[:m], t)
        spans = [(e, int(self.offsets[e]), int(self.offsets[e] + self.counts[e]))
                 for e in self.active[:n_active].tolist()]
        for e, a, b in spans:
            K.matmul_q8_0(w.gate.data[e], self.gxq[a:b], self.gxd[a:b], self.gate[a:b], t)
            K.matmul_q8_0(w.up.data[e], self.gxq[a:b], self.gxd[a:b], self.up[a:b], t)
        gate = self.gate[:m]
        K.swiglu(gate, self.up[:m], gate, t)
        K.quantize_q8_0(gate, self.hq[:m], self.hd[:m], t)
        for e, a, b in spans:
            K.matmul_q8_0(w.down.data[e], self.hq[a:b], self.hd[a:b], self.y[a:b], t)
        K.moe_combine(self.y[:m], slot_pos, top_w, x, t)
