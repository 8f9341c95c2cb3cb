"""A model's weights, typed: the Python side of the weight ABI (pyx/ks_weights.h).

Every weight matrix is a `Matrix`: its GGML quant type, its shape and its bytes. Those are
the rows as the file lays them out, a view of the file's memory map (no copy) where the file
holds a type the kernels compute on, or the loader's interleaved copy of them (`interleave`,
group_rows > 0) where the CPU has a product on interleaved groups: a buffer of its own, the
map's pages released. Matrices of different types stand side by side in one model. A stack of
MoE experts is one Matrix with n_mat > 1, its rows in the map, with `ExpertCopies` that the
forward pass fills as each expert is first chosen. pyx/forward.pxi builds the C structs
(ks_matrix, ks_layer, ks_model) from these dataclasses by field name.

    Q8_0 row of `cols` values = cols/32 blocks of 34 bytes: fp16 scale d, then 32 int8 q;
    value = d * q.          F32 row = cols little-endian float32 (MoE routers).

Norm weights are float32 vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..kernels import K

QType = GGMLQuantizationType
Q8_BLOCK = 32          # values per Q8_0 block (also the activations' quantization block)
Q8_BLOCK_BYTES = 34    # fp16 scale + 32 int8


def compute_types() -> tuple:
    """The types the kernels compute on in place (their list is the C side's,
    ks_weights.h); a matrix of any other type is converted at load."""
    return tuple(QType(t) for t in K.compute_types())


def computes_on(qtype: QType) -> bool:
    """Whether `qtype` is one of compute_types()."""
    return qtype in compute_types()


def row_bytes(qtype: QType, cols: int) -> int:
    """Bytes of one row of `cols` values of `qtype` (cols a multiple of its block)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} rows hold multiples of {block} values, not {cols}")
    return cols // block * size


@dataclass(frozen=True)
class ExpertCopies:
    """Interleaved copies of a stack of MoE experts, which the forward pass makes as each
    expert is first multiplied (pyx/ks_expert_copy.h), group by group: loading reads no
    expert, a request reads only the experts it chooses, and an expert's pages in the
    file's map are released once its copy is whole (`release`), so that the copy takes their
    place in memory rather than adding to it. `data` is anonymous memory that nothing touches
    before a copy is made."""
    data: np.ndarray              # uint8 (n_mat, groups * group_rows, row bytes)
    state: np.ndarray             # uint8 (n_mat, groups): 0 not made, 1 being made, 2 made
    left: np.ndarray              # int32 (n_mat,): groups of each expert not yet made
    group_rows: int
    release: bool                 # the rows are a file's map

    def made(self) -> np.ndarray:
        """Per expert, whether its copy is whole (bool (n_mat,))."""
        return self.left == 0


@dataclass(frozen=True)
class Matrix:
    """A (rows, cols) matrix, or n_mat stacked ones: `data` is uint8 (rows, row_bytes) or
    (n_mat, rows, row_bytes), C-contiguous rows of GGML type `qtype`; or, group_rows > 0, one
    matrix's copy in interleaved groups of that many rows (`interleave()`), its rows rounded up
    to whole groups. Stacked experts may have `copies` (`with_expert_copies()`)."""
    data: np.ndarray
    qtype: QType
    rows: int
    cols: int
    group_rows: int = 0
    copies: Optional[ExpertCopies] = None

    def __post_init__(self):
        g = self.group_rows
        rows = -(-self.rows // g) * g if g else self.rows
        want = (rows, row_bytes(self.qtype, self.cols))
        got = self.data.shape[-2:] if self.data.ndim in (2, 3) else None
        if self.data.dtype != np.uint8 or got != want or not self.data.flags.c_contiguous:
            raise ValueError(f"Matrix: data {self.data.dtype}{self.data.shape} does not hold "
                             f"{self.qtype.name} ({self.rows}, {self.cols}) rows (want "
                             f"C-contiguous uint8 (..., {want[0]}, {want[1]}))")
        c = self.copies
        if c is not None and (c.data.shape != self.expert_copies_shape(c.group_rows)
                              or c.state.shape != (self.n_mat, c.data.shape[1] // c.group_rows)
                              or c.left.shape != (self.n_mat,)):
            raise ValueError(f"Matrix: expert copies {c.data.shape} do not fit "
                             f"{self.n_mat} x ({self.rows}, {self.cols}) {self.qtype.name}")

    @property
    def n_mat(self) -> int:
        """1, or the number of stacked matrices (MoE experts)."""
        return self.data.shape[0] if self.data.ndim == 3 else 1

    @property
    def interleaved(self) -> bool:
        """Whether `data` is an interleaved copy rather than the rows."""
        return self.group_rows > 0

    def interleave_shape(self) -> Optional[tuple]:
        """The shape of this matrix's interleaved copy (its rows rounded up to whole groups,
        its row bytes), or None where interleave() returns the matrix itself."""
        group = K.interleaves(int(self.qtype))
        if self.interleaved or self.n_mat != 1 or not group:
            return None
        return -(-self.rows // group) * group, row_bytes(self.qtype, self.cols)

    def interleave(self, out: Optional[np.ndarray] = None) -> "Matrix":
        """This matrix's interleaved copy where the CPU has a product on it (K.interleaves:
        groups of as many rows as its tiles take, 16, 8 or 4), else itself: a new buffer, or
        `out` (C-contiguous uint8 of interleave_shape(), 64-byte aligned), in which the tiles
        load each block field of a group's rows as one vector (pyx/ks_interleave.h gives the
        layout). Same values, same result bits."""
        if self.interleave_shape() is None:
            return self
        return Matrix(K.interleave_rows(self.data, int(self.qtype), self.cols, out), self.qtype,
                      self.rows, self.cols, K.interleaves(int(self.qtype)))

    def expert_copies_shape(self, group_rows: Optional[int] = None) -> Optional[tuple]:
        """The shape of these stacked experts' copies in groups of `group_rows` (by default as
        many rows as the CPU's interleaved product takes), or None where with_expert_copies()
        returns the matrix itself (one matrix, or no interleaved product of its type)."""
        group = group_rows or K.interleaves(int(self.qtype))
        if self.n_mat == 1 or self.interleaved or not group:
            return None
        return self.n_mat, -(-self.rows // group) * group, row_bytes(self.qtype, self.cols)

    def with_expert_copies(self, out: np.ndarray, release: bool) -> "Matrix":
        """These stacked experts with copies made as they are first used (ExpertCopies) in
        `out` (untouched C-contiguous uint8 of expert_copies_shape()'s size), or this matrix
        itself where expert_copies_shape() is None. `release`: the rows are a file's map, whose
        pages each finished copy releases."""
        shape = self.expert_copies_shape()
        if shape is None:
            return self
        group = K.interleaves(int(self.qtype))
        groups = shape[1] // group
        copies = ExpertCopies(out.reshape(shape), np.zeros((shape[0], groups), np.uint8),
                              np.full(shape[0], groups, np.int32), group, release)
        return replace(self, copies=copies)

    @classmethod
    def of_floats(cls, x: np.ndarray) -> "Matrix":
        """An F32 matrix holding a copy of the float (rows, cols) array x."""
        x = np.ascontiguousarray(x, dtype="<f4")
        return cls(x.view(np.uint8).reshape(x.shape[0], -1), QType.F32, *x.shape)

    def floats(self) -> np.ndarray:
        """An F32 matrix's values, (rows, cols) float32 (a view)."""
        if self.qtype != QType.F32:
            raise ValueError(f"floats() of a {self.qtype.name} matrix")
        return self.data.view("<f4").reshape(self.data.shape[:-1] + (self.cols,))


@dataclass(frozen=True)
class MoEWeights:
    """The sparse feed-forward of one MoE layer: a router and n_expert SwiGLU experts."""
    router: Matrix                # F32 (n_expert, hidden): router logits = xn @ router.T
    gate: Matrix                  # n_expert x (expert_ffn, hidden)
    up: Matrix                    # n_expert x (expert_ffn, hidden)
    down: Matrix                  # n_expert x (hidden, expert_ffn)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are (out, in)."""
    attn_norm: np.ndarray         # (hidden,) f32
    wq: Matrix                    # (n_heads*head_dim, hidden)
    wk: Matrix                    # (n_kv_heads*head_dim, hidden)
    wv: Matrix                    # (n_kv_heads*head_dim, hidden)
    wo: Matrix                    # (hidden, n_heads*head_dim)
    q_norm: Optional[np.ndarray]  # (head_dim,) f32, Qwen3 only
    k_norm: Optional[np.ndarray]  # (head_dim,) f32, Qwen3 only
    ffn_norm: np.ndarray          # (hidden,) f32
    w_gate: Optional[Matrix]      # (ffn, hidden); None in a MoE layer
    w_up: Optional[Matrix]        # (ffn, hidden); None in a MoE layer
    w_down: Optional[Matrix]      # (hidden, ffn); None in a MoE layer
    moe: Optional[MoEWeights] = None  # the layer's feed-forward when it is MoE


@dataclass(frozen=True)
class ModelWeights:
    tok_embd: Matrix              # (vocab, hidden)
    layers: list[LayerWeights]
    out_norm: np.ndarray          # (hidden,) f32
    output: Matrix                # (vocab, hidden); the same object as tok_embd when tied

    def type_shares(self) -> dict:
        """Share of the matrix parameters held in each type, largest first, e.g.
        {"q4_k": 0.62, "q6_k": 0.09, ...}: what the kernels compute on, as the memory holds
        it (norm vectors are not matrices; a tied output matrix counts once)."""
        counts: dict = {}
        for m in self.matrices():
            name = m.qtype.name.lower()
            counts[name] = counts.get(name, 0) + m.n_mat * m.rows * m.cols
        total = sum(counts.values())
        return {t: round(n / total, 6) for t, n in sorted(counts.items(), key=lambda kv: -kv[1])}

    def interleaved_bytes(self) -> dict:
        """Bytes of the interleaved copies (Matrix.interleave) by type name, e.g.
        {"q4_k": 677117952}; {} when every matrix is used as the file lays it out."""
        out: dict = {}
        for m in self.matrices():
            if m.interleaved:
                name = m.qtype.name.lower()
                out[name] = out.get(name, 0) + m.data.nbytes
        return out

    def copies_experts(self) -> bool:
        """Whether MoE experts get copies as they are first chosen (ExpertCopies)."""
        return any(m.copies is not None for m in self.matrices())

    def expert_copies_bytes(self) -> dict:
        """Bytes of the MoE experts' copies made so far (ExpertCopies: an expert's copy is
        made when it is first chosen) by type name, e.g. {"q4_k": 442368}; {} when none is."""
        out: dict = {}
        for m in self.matrices():
            made = int(m.copies.made().sum()) if m.copies is not None else 0
            if made:
                name = m.qtype.name.lower()
                out[name] = out.get(name, 0) + made * m.copies.data[0].nbytes
        return out

    def main_type(self) -> str:
        """The type holding the most matrix parameters, e.g. "q4_k"."""
        return next(iter(self.type_shares()))

    def matrices(self) -> list:
        """Every matrix once (the tied output is the embedding)."""
        out = [self.tok_embd] + ([] if self.output is self.tok_embd else [self.output])
        for L in self.layers:
            out += [L.wq, L.wk, L.wv, L.wo]
            out += ([L.moe.router, L.moe.gate, L.moe.up, L.moe.down] if L.moe
                    else [L.w_gate, L.w_up, L.w_down])
        return out
