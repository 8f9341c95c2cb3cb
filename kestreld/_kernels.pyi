# Typed interface of the compiled kernels (pyx/_kernels.pyx and its .pxi files). Arrays are
# C-contiguous numpy arrays; float means float32. Every function checks shapes (ValueError)
# and computes with the GIL released on `nthreads` threads (OpenMP's for the per-op functions,
# a ks_team of its own for Forward and VisionBlocks); results do not depend on nthreads.
# Shapes: n tokens, k columns, m weight rows, hd head_dim, kv_bs key block.
import numpy as np

from .engine.forward import Batch
from .engine.kvcache import KVCache
from .model.config import ModelConfig
from .model.weights import ModelWeights

def simd_path() -> str:
    """Which compute path this build uses: "avx2", "neon-dotprod", "neon" or "plain"."""

# ---- the forward pass (forward.pxi, ks_forward.h) -------------------------------------------

class Forward:
    max_chunk: int
    nthreads: int
    scratch_bytes: int
    working_threads: int
    def __init__(self, config: ModelConfig, weights: ModelWeights, kv: KVCache, max_chunk: int,
                 nthreads: int) -> None: ...
    def run(self, batch: Batch) -> None:
        """One chunk, ks_batch's fields read from the Batch by name: tokens int32 (n,) at KV
        rows pos0..; rope_cos/sin (n, hd/2); logits (1 | n, vocab) out; vis_rows int32 (r,),
        vis_embd (r, hidden), deep (d, r, hidden); routing int32 (MoE layers, n, top-k) out."""

# ---- products and quantization (matmul.pxi, ks_weights.h, ks_q8.h) --------------------------

def compute_types() -> tuple:
    """The GGML type ids the kernels compute on in place."""
def quantize_q8_0(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, nthreads: int) -> None:
    """x (n, k) -> xq int8 (n, k), xd (n, k/32)."""
def matmul(w: np.ndarray, qtype: int, xq: np.ndarray, xd: np.ndarray, out: np.ndarray,
           nthreads: int, interleaved: bool = False) -> None:
    """out (n, m) = w (uint8 rows of GGML type qtype, or their interleave_rows copy) . (xq, xd)^T."""
def matmul_plain(w: np.ndarray, qtype: int, xq: np.ndarray, xd: np.ndarray, out: np.ndarray,
                 nthreads: int, interleaved: bool = False) -> None: ...
def set_matmul_vnni(enabled: bool) -> bool: ...
def interleaves(qtype: int) -> int:
    """Rows per interleaved group of the type on this CPU: 16 (AVX512-VNNI), 8 (AVX2), 4 (NEON
    with sdot), 0."""
def interleave_rows(w: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """w's rows in interleaved groups of interleaves(qtype) (a new 64-byte-aligned array)."""
def dequantize_rows(w: np.ndarray, qtype: int, ids: np.ndarray, out: np.ndarray,
                    interleaved: bool = False, rows: int = -1) -> None:
    """out (n, k) = rows ids (int32 (n,)) of w as float; rows: the matrix's (needed when w is
    an interleave_rows copy, its last group padded)."""

# ---- row and element kernels (elementwise.pxi, ks_rows.h, ks_common.h) ----------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray, nthreads: int) -> None: ...
def rope(x: np.ndarray, cos_t: np.ndarray, sin_t: np.ndarray, pos0: int, neox: bool,
         nthreads: int) -> None:
    """x (n, heads, hd) rotated in place by rows pos0.. of the tables (max_pos, hd/2)."""
def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray, nthreads: int) -> None: ...

# ---- int8 KV and attention (attention.pxi, ks_attention.h) ----------------------------------

def kv_store(k: np.ndarray, v: np.ndarray, kq: np.ndarray, ks: np.ndarray, vq: np.ndarray,
             vs: np.ndarray, pos0: int, nthreads: int) -> None:
    """k, v (n, n_kv, hd) into one layer's kq, vq int8 (n_kv, max_seq, hd), ks, vs (n_kv, max_seq)."""
def set_attention_tiles(enabled: bool) -> bool: ...
def attention(q: np.ndarray, kq: np.ndarray, ks: np.ndarray, vq: np.ndarray, vs: np.ndarray,
              pos0: int, scale: float, kv_bs: int, out: np.ndarray, nthreads: int) -> None:
    """Causal GQA attention of q (n, n_heads, hd) at pos0.. over one layer's int8 KV."""

# ---- MoE routing (moe.pxi, ks_moe.h) ---------------------------------------------------------

def moe_route(x: np.ndarray, router: np.ndarray, norm_topk: bool, probs: np.ndarray,
              top_idx: np.ndarray, top_w: np.ndarray, nthreads: int) -> None: ...
def moe_group(top_idx: np.ndarray, counts: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
              slot_pos: np.ndarray, active: np.ndarray) -> int: ...
def moe_combine(y: np.ndarray, slot_pos: np.ndarray, top_w: np.ndarray, out: np.ndarray,
                nthreads: int) -> None: ...

# ---- the vision encoder (vision.pxi, ks_vision.h) -------------------------------------------

class VisionBlocks:
    def __init__(self, blocks: list, n_heads: int, eps: float, deepstack: tuple) -> None:
        """blocks: kestreld.vision.encoder.VisionBlock, in order; deepstack: the indices of
        the blocks whose outputs are DeepStack features."""
    def run(self, x: np.ndarray, rope_cos: np.ndarray, rope_sin: np.ndarray, deep: np.ndarray,
            nthreads: int) -> None:
        """x (n, hidden) in place: every block; deep (len(deepstack), n, hidden) out;
        rope_cos/sin (n, hd/2)."""

def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray,
              nthreads: int) -> None: ...
def gelu_tanh(x: np.ndarray, out: np.ndarray, nthreads: int) -> None: ...
def gelu_erf(x: np.ndarray, out: np.ndarray, nthreads: int) -> None: ...
def full_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray,
                   nthreads: int) -> None:
    """Bidirectional attention: q, k, v, out (n, heads, hd)."""
