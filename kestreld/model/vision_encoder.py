"""Qwen3-VL's vision encoder: one image's patches -> visual embeddings + DeepStack features.

Data flow for one image of gh x gw patches (N = gh*gw, in merge-block order), width H:

    patches (N, 3*p*p) --patch_embed (the Conv3d as a matmul; its two temporal taps summed,
      since the processor repeats the frame)--> x (N, H) += pos_embed bilinearly interpolated
      (align_corners) from its side x side grid to gh x gw
    depth x block:  x += proj(attn(rope2d(qkv(LN1(x)))));  x += fc2(gelu_tanh(fc1(LN2(x))))
      attention is bidirectional over the image's N patches; 2-D RoPE: the first half of each
      head's frequencies turns with the patch row, the second with its column (rotate-half)
      after block i in deepstack_visual_indexes: deepstack.append(merger_i(x))
    merger(x): LN per patch, 4 patches (a merge block) -> one row (N/4, 4H) -> fc1, GELU,
      fc2 -> (N/4, out_hidden);  DeepStack mergers: the same with LN over the 4H row

What runs where (on `threads` threads):
  - the blocks: one C call for all of them (K.VisionBlocks, pyx/ks_vision.h), their linears
    (the bulk of the work) on the weight-type kernels of the language model, LayerNorm, GELU
    (tanh), 2-D RoPE and the bidirectional attention (online softmax over key blocks, no
    N x N scores) in float32 C;
  - the patch embedding and the mergers: float32 numpy BLAS, with the C LayerNorm and GELU
    (erf). They are under a tenth of the FLOPs (2B: 20 of 260 GMAC per image) and set the
    embeddings the language model sees: on Q8_0 they would spend a large part of the error
    margin to save little time (docs/speed.md, "The vision mergers in float").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import ModelLoadError
from ..kernels import K
from ..vision.images import ImageSpec, PreparedImage
from .quant import float_to_q8_0
from .weights import Q8_BLOCK, Matrix, QType

LN_EPS = 1e-6
VISUAL = "model.visual."


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden: int
    n_heads: int
    ffn: int
    patch: int
    temporal_patch: int
    merge: int
    out_hidden: int
    pos_side: int                 # the learned position grid is pos_side x pos_side
    deepstack: tuple              # block indices whose output feeds a DeepStack merger
    rope_theta: float
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    image: ImageSpec


class Linear:
    """y = x @ W.T + b on numpy's BLAS, W (out, in) float32 (the patch embedding and the
    mergers, see the module docstring)."""

    def __init__(self, w: np.ndarray, b: np.ndarray):
        self.b = np.ascontiguousarray(b, np.float32)
        self.rows, self.cols = w.shape
        # W.T as a view: BLAS takes a transposed operand as it is, and a contiguous copy of
        # the transpose cost seconds at load for the mergers' 4096 x 4096 matrices
        self.wt = np.ascontiguousarray(w, np.float32).T

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (n, rows) = x (n, cols) @ W.T + b; returns out."""
        np.matmul(x, self.wt, out=out)
        out += self.b
        return out


@dataclass(frozen=True)
class VisionBlock:
    """One block of the vision tower: pre-norm attention and MLP, LayerNorms and linears with
    bias; the linears' weights (out, in) in a type the kernels compute on."""
    norm1_w: np.ndarray           # (hidden,) f32
    norm1_b: np.ndarray
    qkv: Matrix                   # (3*hidden, hidden): q, k, v stacked as rows
    qkv_b: np.ndarray             # (3*hidden,) f32
    proj: Matrix                  # (hidden, hidden)
    proj_b: np.ndarray
    norm2_w: np.ndarray
    norm2_b: np.ndarray
    fc1: Matrix                   # (ffn, hidden)
    fc1_b: np.ndarray
    fc2: Matrix                   # (hidden, ffn)
    fc2_b: np.ndarray


class _Merger:
    """Four patches of a merge block -> one language-model embedding."""

    def __init__(self, get, prefix: str, c: VisionConfig, postshuffle: bool):
        wide = c.hidden * c.merge * c.merge
        norm_n = wide if postshuffle else c.hidden
        self.postshuffle, self.wide = postshuffle, wide
        self.norm_w, self.norm_b = get(prefix + "norm.weight", (norm_n,)), get(prefix + "norm.bias", (norm_n,))
        self.fc1 = Linear(get(prefix + "linear_fc1.weight", (wide, wide)),
                           get(prefix + "linear_fc1.bias", (wide,)))
        self.fc2 = Linear(get(prefix + "linear_fc2.weight", (c.out_hidden, wide)),
                           get(prefix + "linear_fc2.bias", (c.out_hidden,)))

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        """(n / merge^2, out_hidden) embeddings of x (n, hidden), a new array."""
        normed = np.empty((x.shape[0] * x.shape[1] // self.wide, self.wide), np.float32)
        if self.postshuffle:
            K.layernorm(x.reshape(-1, self.wide), self.norm_w, self.norm_b, LN_EPS, normed, threads)
        else:
            K.layernorm(x, self.norm_w, self.norm_b, LN_EPS, normed.reshape(x.shape), threads)
        h = self.fc1(normed, np.empty_like(normed))
        K.gelu_erf(h, h, threads)
        return self.fc2(h, np.empty((h.shape[0], self.fc2.rows), np.float32))


class VisionEncoder:
    """The loaded vision tower of a Qwen3-VL model. `encode` is called on the engine thread."""

    def __init__(self, c: VisionConfig, get, get_q8=None):
        """`get(name, shape)` returns a float32 tensor (by its Hugging Face name);
        `get_q8(name, shape)` a block linear's weight as a Matrix (a Q8_0 mmproj's in
        place; by default `get`'s float32, quantized here)."""
        self.cfg = c
        H, p = c.hidden, c.patch
        if get_q8 is None:
            def get_q8(name, shape):
                return Matrix(float_to_q8_0(get(name, shape)), QType.Q8_0, *shape)

        def f32(name, shape):
            return np.ascontiguousarray(get(name, shape), np.float32)

        conv = get(VISUAL + "patch_embed.proj.weight", (H, 3, c.temporal_patch, p, p))
        # The processor repeats the frame over the temporal taps: sum them once here.
        self.patch_embed = Linear(conv.sum(axis=2).reshape(H, 3 * p * p),
                                   get(VISUAL + "patch_embed.proj.bias", (H,)))
        self.pos_embed = get(VISUAL + "pos_embed.weight", (c.pos_side * c.pos_side, H))
        self.blocks = []
        for i in range(c.depth):
            b = f"{VISUAL}blocks.{i}."
            self.blocks.append(VisionBlock(
                norm1_w=f32(b + "norm1.weight", (H,)), norm1_b=f32(b + "norm1.bias", (H,)),
                qkv=get_q8(b + "attn.qkv.weight", (3 * H, H)),
                qkv_b=f32(b + "attn.qkv.bias", (3 * H,)),
                proj=get_q8(b + "attn.proj.weight", (H, H)),
                proj_b=f32(b + "attn.proj.bias", (H,)),
                norm2_w=f32(b + "norm2.weight", (H,)), norm2_b=f32(b + "norm2.bias", (H,)),
                fc1=get_q8(b + "mlp.linear_fc1.weight", (c.ffn, H)),
                fc1_b=f32(b + "mlp.linear_fc1.bias", (c.ffn,)),
                fc2=get_q8(b + "mlp.linear_fc2.weight", (H, c.ffn)),
                fc2_b=f32(b + "mlp.linear_fc2.bias", (H,)),
            ))
        self.run_blocks = K.VisionBlocks(self.blocks, c.n_heads, LN_EPS, c.deepstack)
        self.merger = _Merger(get, VISUAL + "merger.", c, postshuffle=False)
        self.deepstack_mergers = [_Merger(get, f"{VISUAL}deepstack_merger_list.{j}.", c, True)
                                  for j in range(len(c.deepstack))]
        self.head_dim = H // c.n_heads

    # ---- per-image tables -------------------------------------------------------
    def _block_order_rows_cols(self, gh: int, gw: int):
        """Row and column of each patch, in the processor's merge-block order."""
        m = self.cfg.merge
        rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        order = lambda a: a.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        return order(rows), order(cols)

    def _pos_embed(self, rows, cols, gh: int, gw: int) -> np.ndarray:
        """Bilinear (align_corners) interpolation of the learned grid at each patch."""
        side = self.cfg.pos_side

        def taps(idx, size):
            src = idx.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            f = np.floor(src)
            d = src - f
            lo = np.clip(f.astype(np.int64), 0, side - 1)
            hi = np.clip(f.astype(np.int64) + 1, 0, side - 1)
            return (lo, hi), (1.0 - d, d)

        (h0, h1), (wh0, wh1) = taps(rows, gh)
        (w0, w1), (ww0, ww1) = taps(cols, gw)
        E = self.pos_embed
        return (E[h0 * side + w0] * (wh0 * ww0)[:, None] + E[h0 * side + w1] * (wh0 * ww1)[:, None]
                + E[h1 * side + w0] * (wh1 * ww0)[:, None] + E[h1 * side + w1] * (wh1 * ww1)[:, None])

    def _rope_tables(self, rows, cols):
        """cos, sin (N, head_dim/2): rotate-half pair i turns by row*inv[i] (first half of
        the pairs) or col*inv[i - head_dim/4] (second half)."""
        quarter = self.head_dim // 4
        inv = 1.0 / (self.cfg.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32)
                                             / np.float32(2 * quarter)))
        ang = np.concatenate([rows[:, None] * inv[None, :], cols[:, None] * inv[None, :]], axis=1)
        return (np.ascontiguousarray(np.cos(ang), np.float32),
                np.ascontiguousarray(np.sin(ang), np.float32))

    # ---- the encoder ------------------------------------------------------------
    def encode(self, img: PreparedImage, threads: int):
        """(embeds (n_tok, out_hidden), [deepstack_j (n_tok, out_hidden)]) of one image,
        n_tok = gh*gw / merge^2, rows in the order of its placeholder tokens."""
        c, gh, gw = self.cfg, img.grid_h, img.grid_w
        rows, cols = self._block_order_rows_cols(gh, gw)
        x = self.patch_embed(img.patches, np.empty((gh * gw, c.hidden), np.float32))
        x += self._pos_embed(rows, cols, gh, gw)
        cos, sin = self._rope_tables(rows.astype(np.float32), cols.astype(np.float32))
        deep = np.empty((len(c.deepstack), gh * gw, c.hidden), np.float32)
        self.run_blocks.run(x, cos, sin, deep, threads)
        ds = c.deepstack        # the features in block order, as transformers makes them
        return (self.merger(x, threads),
                [self.deepstack_mergers[ds.index(i)](deep[ds.index(i)], threads)
                 for i in sorted(set(ds))])


def load_vision(source) -> VisionEncoder:
    """The vision encoder of an opened Qwen3-VL HF directory (an HFSource)."""
    return VisionEncoder(hf_vision_config(source), source.tensor_f32)


def hf_vision_config(source) -> VisionConfig:
    """The VisionConfig of an opened Qwen3-VL HF directory: config.json's vision_config and
    image token ids, preprocessor_config.json."""
    hf, path = source.hf_config, source.path
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError(f"{path}/config.json: Qwen3-VL config without a vision_config map")
    try:
        c = VisionConfig(
            depth=int(v["depth"]), hidden=int(v["hidden_size"]), n_heads=int(v["num_heads"]),
            ffn=int(v["intermediate_size"]), patch=int(v["patch_size"]),
            temporal_patch=int(v.get("temporal_patch_size", 2)),
            merge=int(v.get("spatial_merge_size", 2)), out_hidden=int(v["out_hidden_size"]),
            pos_side=int(round(int(v["num_position_embeddings"]) ** 0.5)),
            deepstack=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=int(hf["image_token_id"]),
            vision_start_id=int(hf["vision_start_token_id"]),
            vision_end_id=int(hf["vision_end_token_id"]),
            image=_image_spec(path, int(v["patch_size"]), int(v.get("spatial_merge_size", 2))),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}/config.json: missing key {e.args[0]} for Qwen3-VL") from None
    check_vision_config(c, source.config, f"{path}/config.json")
    return c


def check_vision_config(c: VisionConfig, text, where: str) -> None:
    """Shapes the encoder can run and that fit the language model (`text`, a ModelConfig);
    a fault is a ModelLoadError naming `where`."""
    if (c.hidden % c.n_heads or (c.hidden // c.n_heads) % 4 or c.hidden % Q8_BLOCK
            or c.ffn % Q8_BLOCK or c.out_hidden != text.hidden):
        raise ModelLoadError(f"{where}: unsupported vision shape: hidden {c.hidden}, "
                             f"{c.n_heads} heads, ffn {c.ffn}, out {c.out_hidden} "
                             f"(language model hidden {text.hidden})")
    if len(c.deepstack) > text.n_layers:
        raise ModelLoadError(f"{where}: {len(c.deepstack)} DeepStack features for "
                             f"{text.n_layers} language-model layers")


def _image_spec(path: str, patch: int, merge: int) -> ImageSpec:
    """preprocessor_config.json (the processor's min/max pixels, mean, std); the vision
    config's patch and merge sizes where it is absent."""
    file = os.path.join(path, "preprocessor_config.json")
    if not os.path.exists(file):
        return ImageSpec(patch=patch, merge=merge)
    try:
        with open(file, encoding="utf-8") as f:
            pp = json.load(f)
        size = pp.get("size") or {}
        d = ImageSpec()
        return ImageSpec(
            patch=int(pp.get("patch_size", patch)), merge=int(pp.get("merge_size", merge)),
            temporal_patch=int(pp.get("temporal_patch_size", 2)),
            min_pixels=int(pp.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
            max_pixels=int(pp.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
            mean=tuple(float(x) for x in pp.get("image_mean", d.mean)),
            std=tuple(float(x) for x in pp.get("image_std", d.std)))
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{file}: cannot use: {e}") from None
