# Typed interface of the per-op kernels (pyx/_kernels_ops.pyx and its .pxi files), the
# test-only module (KESTREL_TEST_KERNELS=1). Arrays are C-contiguous numpy arrays; float means
# float32. Every function checks shapes (ValueError) and computes with the GIL released on
# `nthreads` OpenMP threads; results do not depend on nthreads.
# Shapes: n tokens, k columns, m weight rows, hd head_dim, kv_bs key block.
import numpy as np

def simd_path() -> str:
    """Which compute path this build uses: "avx2", "neon-dotprod", "neon" or "plain"."""

# ---- products and quantization (products.pxi, ks_matmul.h, ks_q8.h) -------------------------

def quantize_q8_0(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, nthreads: int) -> None:
    """x (n, k) -> xq int8 (n, k), xd (n, k/32)."""
def matmul(w: np.ndarray, qtype: int, xq: np.ndarray, xd: np.ndarray, out: np.ndarray,
           nthreads: int, interleaved: bool = False) -> None:
    """out (n, m) = w (uint8 rows of GGML type qtype, or their interleave_rows copy) . (xq, xd)^T."""
def matmul_plain(w: np.ndarray, qtype: int, xq: np.ndarray, xd: np.ndarray, out: np.ndarray,
                 nthreads: int, interleaved: bool = False) -> None: ...
def set_matmul_vnni(enabled: bool) -> bool: ...
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

# ---- int8 KV and attention, the vision encoder's attention (attention.pxi) ------------------

def kv_store(k: np.ndarray, v: np.ndarray, kq: np.ndarray, ks: np.ndarray, vq: np.ndarray,
             vs: np.ndarray, pos0: int, nthreads: int) -> None:
    """k, v (n, n_kv, hd) into one layer's kq, vq int8 (n_kv, max_seq, hd), ks, vs (n_kv, max_seq)."""
def set_attention_tiles(enabled: bool) -> bool: ...
def attention(q: np.ndarray, kq: np.ndarray, ks: np.ndarray, vq: np.ndarray, vs: np.ndarray,
              pos0: int, scale: float, kv_bs: int, out: np.ndarray, nthreads: int) -> None:
    """Causal GQA attention of q (n, n_heads, hd) at pos0.. over one layer's int8 KV."""
def full_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray,
                   nthreads: int) -> None:
    """Bidirectional attention: q, k, v, out (n, heads, hd)."""

# ---- MoE routing (moe.pxi, ks_moe.h) ---------------------------------------------------------

def moe_route(x: np.ndarray, router: np.ndarray, norm_topk: bool, probs: np.ndarray,
              top_idx: np.ndarray, top_w: np.ndarray, nthreads: int) -> None: ...
def moe_group(top_idx: np.ndarray, counts: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
              slot_pos: np.ndarray, active: np.ndarray) -> int: ...
def moe_combine(y: np.ndarray, slot_pos: np.ndarray, top_w: np.ndarray, out: np.ndarray,
                nthreads: int) -> None: ...
