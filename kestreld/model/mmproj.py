"""A llama.cpp mmproj GGUF as Qwen3-VL's vision encoder (the vision half of a split Qwen3-VL).

llama.cpp's convert_hf_to_gguf.py (Qwen3VLVisionModel, with `--mmproj`) writes the vision
tower of a Qwen3VLForConditionalGeneration into a GGUF of architecture "clip", read by
llama.cpp's tools/mtmd (clip.cpp, PROJECTOR_TYPE_QWEN3VL):

    metadata  clip.projector_type = "qwen3vl_merger", clip.has_vision_encoder,
              clip.vision.{block_count, embedding_length, feed_forward_length, patch_size,
              projection_dim (= the language model's hidden), attention.head_count,
              spatial_merge_size, image_mean, image_std, is_deepstack_layers (one bool per
              block)}; optional clip.vision.image_{min,max}_pixels
    tensors   (gguf-py's tensor_mapping names; `vision_tensors` below)
              v.patch_embd.weight, v.patch_embd.weight.1   the Conv3d's two temporal taps,
                                                           each (H, 3, p, p)
              v.blk.N.attn_qkv  q, k, v stacked as rows (3H, H), as in transformers
              v.deepstack.N.*   N is the vision block the merger reads (not its list index)
              v.post_ln, mm.0, mm.2   the final merger's LayerNorm, fc1, fc2

`load_mmproj` turns the file into the same `VisionEncoder` a Hugging Face directory gives,
through getters that answer the encoder's Hugging Face names from the mmproj's tensors:
vectors and the patch kernel as float32, the blocks' matrices as GGUFFile.matrix_of gives
them (in place where the kernels compute on their type, else converted to Q8_0).
The image token ids come from the text GGUF's vocabulary (`<|image_pad|>`, ...), since the
mmproj holds none.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelLoadError
from ..vision.images import ImageSpec
from .gguf_file import GGUFFile
from .vision_encoder import VISUAL, VisionConfig, VisionEncoder, check_vision_config
from .weights import Matrix

PROJECTOR_TYPE = "qwen3vl_merger"      # gguf VisionProjectorType.QWEN3VL
PATCH_KERNELS = ("v.patch_embd.weight", "v.patch_embd.weight.1")   # temporal taps 0 and 1
HF_PATCH_KERNEL = VISUAL + "patch_embed.proj.weight"               # (H, 3, 2, p, p)
# The placeholder tokens of Qwen3-VL's chat template, looked up in the text vocabulary.
IMAGE_TOKEN, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
# transformers' Qwen3-VL vision rotary embedding and LayerNorms use these constants; the
# mmproj's clip.vision.attention.layer_norm_epsilon is the text model's RMSNorm epsilon
# (the converter copies it), so it is not read.
VISION_ROPE_THETA = 10000.0

# Per block: Hugging Face name -> mmproj name (gguf-py tensor_mapping, MODEL_ARCH.MMPROJ).
_BLOCK_TENSORS = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv",
                  "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up",
                  "mlp.linear_fc2": "ffn_down"}
_MERGER_TENSORS = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK_TENSORS = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def vision_tensors(depth: int, deepstack: tuple) -> dict:
    """{Hugging Face name: mmproj name} of every vision tensor but the patch kernel (which
    the mmproj splits in two, PATCH_KERNELS), as llama.cpp's converter names them."""
    names = {VISUAL + "patch_embed.proj.bias": "v.patch_embd.bias",
             VISUAL + "pos_embed.weight": "v.position_embd.weight"}
    for i in range(depth):
        for hf, gg in _BLOCK_TENSORS.items():
            for kind in ("weight", "bias"):
                names[f"{VISUAL}blocks.{i}.{hf}.{kind}"] = f"v.blk.{i}.{gg}.{kind}"
    for hf, gg in _MERGER_TENSORS.items():
        for kind in ("weight", "bias"):
            names[f"{VISUAL}merger.{hf}.{kind}"] = f"{gg}.{kind}"
    for j, block in enumerate(deepstack):
        for hf, gg in _DEEPSTACK_TENSORS.items():
            for kind in ("weight", "bias"):
                names[f"{VISUAL}deepstack_merger_list.{j}.{hf}.{kind}"] = \
                    f"v.deepstack.{block}.{gg}.{kind}"
    return names


def load_mmproj(path: str, text) -> VisionEncoder:
    """The vision encoder in the mmproj GGUF `path`, for the opened qwen3vl text GGUF `text`
    (a GGUFSource). Any fault is a ModelLoadError naming the file and what is wrong."""
    f = GGUFFile(path)
    c = _vision_config(f, text)
    names = vision_tensors(c.depth, c.deepstack)

    def get(name: str, shape: tuple) -> np.ndarray:
        if name == HF_PATCH_KERNEL:        # (H, 3, 2, p, p) from the two (H, 3, p, p) taps
            tap = shape[:2] + shape[3:]
            return np.stack([f.tensor_f32(k, tap) for k in PATCH_KERNELS], axis=2)
        return f.tensor_f32(names[name], shape)

    def get_q8(name: str, shape: tuple) -> Matrix:   # in place where the kernels compute on it
        return f.matrix_of(names[name], shape)

    return VisionEncoder(c, get, get_q8)


def _vision_config(f: GGUFFile, text) -> VisionConfig:
    path = f.path
    arch = f.meta("general.architecture")
    if arch != "clip":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not an mmproj "
                             "(llama.cpp's vision projector GGUF, architecture 'clip')")
    projector = f.meta("clip.projector_type", None) or f.meta("clip.vision.projector_type", None)
    if projector != PROJECTOR_TYPE:
        raise ModelLoadError(f"{path}: unsupported projector type {projector!r}; "
                             f"supported: {PROJECTOR_TYPE!r} (Qwen3-VL)")
    if not f.meta("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{path}: no vision encoder (clip.has_vision_encoder is not set)")
    for kernel in PATCH_KERNELS:
        f.shape(kernel)                    # both temporal taps present (temporal patch 2)
    try:
        depth = int(f.meta("clip.vision.block_count"))
        patch = int(f.meta("clip.vision.patch_size"))
        merge = int(f.meta("clip.vision.spatial_merge_size", 2))
        is_deepstack = [bool(b) for b in f.meta("clip.vision.is_deepstack_layers", [])]
        if len(is_deepstack) not in (0, depth):
            raise ValueError(f"clip.vision.is_deepstack_layers has {len(is_deepstack)} "
                             f"entries for {depth} blocks")
        n_pos = f.shape("v.position_embd.weight")[0]
        side = math.isqrt(n_pos)
        if side * side != n_pos:
            raise ValueError(f"v.position_embd.weight has {n_pos} rows, not a square grid")
        d = ImageSpec()
        c = VisionConfig(
            depth=depth, hidden=int(f.meta("clip.vision.embedding_length")),
            n_heads=int(f.meta("clip.vision.attention.head_count")),
            ffn=int(f.meta("clip.vision.feed_forward_length")), patch=patch,
            temporal_patch=len(PATCH_KERNELS), merge=merge,
            out_hidden=int(f.meta("clip.vision.projection_dim")), pos_side=side,
            deepstack=tuple(i for i, b in enumerate(is_deepstack) if b),
            rope_theta=VISION_ROPE_THETA,
            image_token_id=_token_id(text, IMAGE_TOKEN),
            vision_start_id=_token_id(text, VISION_START),
            vision_end_id=_token_id(text, VISION_END),
            image=ImageSpec(
                patch=patch, merge=merge, temporal_patch=len(PATCH_KERNELS),
                min_pixels=int(f.meta("clip.vision.image_min_pixels", d.min_pixels)),
                max_pixels=int(f.meta("clip.vision.image_max_pixels", d.max_pixels)),
                mean=tuple(float(x) for x in f.meta("clip.vision.image_mean", d.mean)),
                std=tuple(float(x) for x in f.meta("clip.vision.image_std", d.std))))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad vision metadata: {e}") from None
    if len(c.image.mean) != 3 or len(c.image.std) != 3 or c.patch <= 0 or c.merge <= 0:
        raise ModelLoadError(f"{path}: bad vision metadata: patch {c.patch}, merge {c.merge}, "
                             f"mean {c.image.mean}, std {c.image.std}")
    check_vision_config(c, text.config, path)
    n_text = text.meta(f"{text.config.arch}.n_deepstack_layers", None)
    if n_text is not None and int(n_text) != len(c.deepstack):
        raise ModelLoadError(f"{path}: {len(c.deepstack)} DeepStack layers, but the text "
                             f"model {text.path} was converted with {int(n_text)}")
    return c


def _token_id(text, token: str) -> int:
    token_id = text.tokenizer.token_id(token)
    if token_id is None:
        raise ModelLoadError(f"{text.path}: no {token} token in the vocabulary "
                             "(Qwen3-VL's image placeholder)")
    return token_id
