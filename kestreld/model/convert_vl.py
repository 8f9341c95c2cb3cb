"""Split a Qwen3-VL Hugging Face directory into llama.cpp's pair: text GGUF + mmproj GGUF.

What llama.cpp's convert_hf_to_gguf.py writes for Qwen3VLForConditionalGeneration, once
without and once with `--mmproj` (its Qwen3VLTextModel and Qwen3VLVisionModel):

    <name>-<TYPE>.gguf          architecture qwen3vl: Qwen3's keys and tensors (blk.N.attn_q,
                                ...), qwen3vl.rope.dimension_sections = M-RoPE (t, h, w, 0),
                                qwen3vl.n_deepstack_layers; the tokenizer (gpt2 BPE, pre
                                qwen2) and chat template
    mmproj-<name>-<TYPE>.gguf   architecture clip, projector qwen3vl_merger: the vision tower
                                (names and keys in mmproj.py), the Conv3d patch kernel split
                                into its two temporal taps; plus clip.vision.image_min/
                                max_pixels from preprocessor_config.json, llama.cpp keys its
                                Qwen3-VL converter leaves out, so that the pair preprocesses
                                images as the directory does

TYPE (--outtype) is that of the weight matrices: F32, F16, BF16 or Q8_0. Vectors (norms,
biases) and the position embedding stay F32; the patch kernel is F16 unless TYPE is F32, and
a matrix whose rows are not whole Q8_0 blocks is F16 (as llama.cpp falls back).

CLI: python -m kestreld.model.convert_vl HF_DIR OUT_DIR [--outtype f16]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import gguf
import numpy as np

from ..errors import ModelLoadError
from .convert import cache_stem, cached_conversion, find_cached, write_and_close
from .gguf_file import TENSOR_NAMES as GGUF_NAMES
from .hf_dir import HFSource
from .mmproj import HF_PATCH_KERNEL, PATCH_KERNELS, PROJECTOR_TYPE, vision_tensors
from .vision_encoder import hf_vision_config

log = logging.getLogger("kestreld")
QT = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
            "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
            "bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
            "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
LAYER_ROLES = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "ffn_norm",
               "w_gate", "w_up", "w_down")
# Tensors kept in float when the matrices are quantized: the patch kernel's rows are p = 16
# values (no whole Q8_0 block), so F16; the learned position grid is interpolated, not
# multiplied, and llama.cpp's mtmd interpolates only F32 (ggml_interpolate), so F32.
_F16_VISION = PATCH_KERNELS
_F32_VISION = ("v.position_embd.weight",)
# What the cached pair is made as: a new value re-converts older caches once.
_PAIR_LAYOUT = {"position_embd": "f32"}


def convert_qwen3vl(hf_dir: str, out_dir: str, outtype: str = "f16") -> tuple[str, str]:
    """Write the text GGUF and the mmproj GGUF of the Qwen3-VL directory `hf_dir` into
    `out_dir`; return their paths. Faults in the directory raise ModelLoadError."""
    src = _open_qwen3vl(hf_dir)
    name = os.path.basename(os.path.normpath(hf_dir))
    os.makedirs(out_dir, exist_ok=True)
    text_path = os.path.join(out_dir, f"{name}-{outtype.upper()}.gguf")
    mmproj_path = os.path.join(out_dir, f"mmproj-{name}-{outtype.upper()}.gguf")
    _write_pair(src, text_path, mmproj_path, outtype)
    return text_path, mmproj_path


def cached_qwen3vl_pair(hf_dir: str, cache_dir: str) -> tuple[str, str]:
    """The Q8_0 pair of the Qwen3-VL directory `hf_dir`, converted once into `cache_dir`
    and memory-mapped from there on later starts (as for non-Q8_0 GGUFs; convert.py's
    cached_conversion). Raises OSError if cache_dir is not writable."""
    stem = cache_stem(hf_dir)
    names = [f"{stem}.Q8_0.gguf", f"mmproj-{stem}.Q8_0.gguf"]
    found = find_cached(hf_dir, cache_dir, names, _PAIR_LAYOUT)
    if found:
        return found[0], found[1]
    src = _open_qwen3vl(hf_dir)
    log.info("converting %s to a Q8_0 GGUF + mmproj pair once, into %s", hf_dir, cache_dir)
    text, mmproj = cached_conversion(hf_dir, cache_dir, names,
                                     lambda paths: _write_pair(src, *paths, "q8_0"), _PAIR_LAYOUT)
    return text, mmproj


def _open_qwen3vl(hf_dir: str) -> HFSource:
    src = HFSource(hf_dir)
    if src.config.arch != "qwen3vl":
        raise ModelLoadError(f"{hf_dir}: a {src.config.arch} model, not Qwen3-VL "
                             "(Qwen3VLForConditionalGeneration)")
    return src


def _write_pair(src: HFSource, text_path: str, mmproj_path: str, outtype: str) -> None:
    qtype, ftype = OUTTYPES[outtype]
    vcfg = hf_vision_config(src)
    if vcfg.temporal_patch != len(PATCH_KERNELS):
        raise ModelLoadError(f"{src.path}/config.json: temporal_patch_size {vcfg.temporal_patch}; "
                             f"the mmproj layout holds {len(PATCH_KERNELS)} temporal taps")
    _write(_text_writer(src, text_path, ftype, len(vcfg.deepstack)), _text_tensors(src), qtype)
    _write(_mmproj_writer(src, vcfg, mmproj_path, ftype), _vision_tensors(src, vcfg), qtype)


def _text_writer(src: HFSource, path: str, ftype, n_deepstack: int) -> gguf.GGUFWriter:
    c = src.config
    w = gguf.GGUFWriter(path, "qwen3vl")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(c.name)
    w.add_file_type(ftype)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_sections(list(c.mrope_section) + [0] * (4 - len(c.mrope_section)))
    w.add_num_deepstack_layers(n_deepstack)
    _add_vocab(w, src.path, c.vocab)
    return w


def _add_vocab(w: gguf.GGUFWriter, hf_dir: str, n_vocab: int) -> None:
    """The byte-level BPE vocabulary as llama.cpp's gpt2 vocab: ids past the tokenizer are
    [PAD{id}] (UNUSED), added tokens CONTROL (special) or USER_DEFINED; merges, special ids
    and the chat template through gguf's SpecialVocab, as llama.cpp's converter does."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(w, quiet=True)


def _text_tensors(src: HFSource):
    """(GGUF name, float32 array) of the language model."""
    c = src.config
    roles = [("tok_embd", None), ("out_norm", None)]
    if not c.tied_embeddings:
        roles.append(("output", None))
    roles += [(role, i) for i in range(c.n_layers) for role in LAYER_ROLES]
    for role, layer in roles:
        hf = src.name(role, layer)
        yield GGUF_NAMES[role].format(i=layer), src.tensor_f32(hf, src.shape(hf))


def _mmproj_writer(src: HFSource, v, path: str, ftype) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(path, "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(src.config.name)
    w.add_file_type(ftype)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(PROJECTOR_TYPE)
    w.add_vision_projection_dim(v.out_hidden)
    w.add_vision_image_size(v.pos_side * v.patch)
    w.add_vision_patch_size(v.patch)
    w.add_vision_embedding_length(v.hidden)
    w.add_vision_feed_forward_length(v.ffn)
    w.add_vision_block_count(v.depth)
    w.add_vision_head_count(v.n_heads)
    w.add_vision_image_mean(list(v.image.mean))
    w.add_vision_image_std(list(v.image.std))
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(v.merge)
    w.add_vision_attention_layernorm_eps(src.config.norm_eps)   # llama.cpp's converter's choice
    w.add_vision_is_deepstack_layers([i in v.deepstack for i in range(v.depth)])
    w.add_vision_min_pixels(v.image.min_pixels)
    w.add_vision_max_pixels(v.image.max_pixels)
    return w


def _vision_tensors(src: HFSource, v):
    """(mmproj name, float32 array) of the vision tower."""
    kernel = src.tensor_f32(HF_PATCH_KERNEL, src.shape(HF_PATCH_KERNEL))   # (H, 3, 2, p, p)
    for tap, name in enumerate(PATCH_KERNELS):
        yield name, np.ascontiguousarray(kernel[:, :, tap])
    for hf, name in vision_tensors(v.depth, v.deepstack).items():
        yield name, src.tensor_f32(hf, src.shape(hf))


def _write(w: gguf.GGUFWriter, tensors, qtype) -> None:
    write_and_close(w, ((name, arr, _tensor_type(name, arr, qtype)) for name, arr in tensors))


def _tensor_type(name: str, arr: np.ndarray, qtype):
    if arr.ndim == 1 or qtype == QT.F32 or name in _F32_VISION:
        return QT.F32
    if name in _F16_VISION:
        return QT.F16
    if qtype == QT.Q8_0 and arr.shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0]:
        return QT.F16
    return qtype


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kestreld.model.convert_vl",
                                description="Write llama.cpp's text GGUF + mmproj GGUF pair "
                                            "of a Qwen3-VL Hugging Face directory.")
    p.add_argument("hf_dir", help="Qwen3-VL model directory (config.json, safetensors, tokenizer)")
    p.add_argument("out_dir", help="directory to write the two GGUF files into")
    p.add_argument("--outtype", choices=sorted(OUTTYPES), default="f16",
                   help="type of the weight matrices (default f16)")
    args = p.parse_args(argv)
    try:
        paths = convert_qwen3vl(args.hf_dir, args.out_dir, args.outtype)
    except (ModelLoadError, OSError) as exc:
        print(f"convert_vl: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
