# Typed interface of the daemon's compiled kernels (pyx/_kernels.pyx and its .pxi files; the
# per-op ones: _kernels_ops.pyi). Arrays are C-contiguous numpy arrays; float means float32.
# Every function checks shapes (ValueError) and computes with the GIL released on `nthreads`
# threads (OpenMP's for the functions, a ks_team of its own for Forward and VisionBlocks);
# results do not depend on nthreads.
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
        vis_embd (r, hidden), deep (d, r, hidden); routing int32 (MoE layers, n, top-k) out;
        hidden (1 | n, hidden) out: the rows after the output norm instead of logits
        (embeddings)."""

# ---- the weight ABI (matmul.pxi, ks_weights.h, ks_interleave.h) ---------------------------

def compute_types() -> tuple:
    """The GGML type ids the kernels compute on in place."""
def interleaves(qtype: int) -> int:
    """Rows per interleaved group of the type on this CPU: 16 (AVX512-VNNI), 8 (AVX2), 4 (NEON
    with sdot), 0."""
def interleave_rows(w: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """w's rows in interleaved groups of interleaves(qtype) (a new 64-byte-aligned array)."""
def set_matmul_vnni(enabled: bool) -> bool: ...

# ---- the vision encoder (vision.pxi, ks_vision.h) -------------------------------------------

class VisionBlocks:
    def __init__(self, blocks: list, n_heads: int, eps: float, deepstack: tuple) -> None:
        """blocks: kestreld.model.vision_encoder.VisionBlock, in order; deepstack: the indices of
        the blocks whose outputs are DeepStack features."""
    def run(self, x: np.ndarray, rope_cos: np.ndarray, rope_sin: np.ndarray, deep: np.ndarray,
            nthreads: int) -> None:
        """x (n, hidden) in place: every block; deep (len(deepstack), n, hidden) out;
        rope_cos/sin (n, hd/2)."""

def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray,
              nthreads: int) -> None: ...
def gelu_tanh(x: np.ndarray, out: np.ndarray, nthreads: int) -> None: ...
def gelu_erf(x: np.ndarray, out: np.ndarray, nthreads: int) -> None: ...
