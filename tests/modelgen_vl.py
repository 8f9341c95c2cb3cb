"""A small random-weight Qwen3-VL model written as a Hugging Face directory, deterministic
from a seed, laid out as transformers' Qwen3VLForConditionalGeneration saves it:

    config.json               Qwen3VLConfig.to_dict (text_config with rope_parameters and
                              mrope_section, vision_config, image/vision token ids)
    model.safetensors         model.language_model.*, model.visual.* (float32; tied: no lm_head)
    tokenizer.json, tokenizer_config.json (a Qwen3-VL-like chat template: image parts become
                              <|vision_start|><|image_pad|><|vision_end|>)
    preprocessor_config.json  the Qwen2VL image processor's settings (patch 16, merge 2,
                              mean/std 0.5, small min/max pixels so the test images are cheap)

The language model's weights are modelgen's Qwen3 scheme (scaled so logits are decided but not
chaotic); the vision weights are drawn here with the same idea. Also `test_image(seed, w, h)`:
PNG bytes of a smooth random picture (so resizing matters but is not noise).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import modelgen
from kestreld.vision.images import ImageSpec

VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEXT = modelgen.ModelSpec("qwen3vl_text", "qwen3", hidden=64, n_layers=3, n_heads=4, n_kv_heads=2,
                          head_dim=32, ffn=192, vocab=512, tied=True, seed=21)
MROPE_SECTION = [6, 5, 5]          # sums to head_dim/2


@dataclass(frozen=True)
class VisionSpec:
    depth: int = 3
    hidden: int = 64
    n_heads: int = 2
    ffn: int = 128
    n_pos: int = 64                 # an 8 x 8 learned grid
    deepstack: tuple = (0, 1)
    seed: int = 22
    # Qwen3-VL's patches and merge, with images kept small
    image: ImageSpec = ImageSpec(min_pixels=32 * 32, max_pixels=256 * 256)


VISION = VisionSpec()


@dataclass
class GeneratedVL:
    dir: Path
    config: dict
    weights: dict
    token_ids: dict                 # special token -> id


def vision_weights(v: VisionSpec, out_hidden: int) -> dict:
    rng = np.random.default_rng(v.seed)
    H, p = v.hidden, v.image.patch

    def linear(rows, cols, gain=1.0):
        return rng.normal(0.0, gain / np.sqrt(cols), (rows, cols))

    def bias(n):
        return 0.05 * rng.normal(0.0, 1.0, n)

    def norm(n):
        return 1.0 + 0.1 * rng.normal(0.0, 1.0, n)

    w = {}
    pre = "model.visual."
    w[pre + "patch_embed.proj.weight"] = rng.normal(0.0, 1.0 / np.sqrt(3 * 2 * p * p),
                                                    (H, 3, v.image.temporal_patch, p, p))
    w[pre + "patch_embed.proj.bias"] = bias(H)
    w[pre + "pos_embed.weight"] = 0.5 * rng.normal(0.0, 1.0, (v.n_pos, H))
    for i in range(v.depth):
        b = f"{pre}blocks.{i}."
        qkv = linear(3 * H, H)
        qkv[:2 * H] *= 1.5          # peaked attention: the 2-D RoPE matters
        w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"] = qkv, bias(3 * H)
        w[b + "attn.proj.weight"], w[b + "attn.proj.bias"] = linear(H, H, 0.5), bias(H)
        w[b + "mlp.linear_fc1.weight"], w[b + "mlp.linear_fc1.bias"] = linear(v.ffn, H), bias(v.ffn)
        w[b + "mlp.linear_fc2.weight"], w[b + "mlp.linear_fc2.bias"] = linear(H, v.ffn, 0.5), bias(H)
        for n in ("norm1", "norm2"):
            w[b + n + ".weight"], w[b + n + ".bias"] = norm(H), bias(H)
    wide = H * v.image.merge * v.image.merge
    mergers = [("merger.", H, 1.0)] + [(f"deepstack_merger_list.{j}.", wide, 0.5)
                                       for j in range(len(v.deepstack))]
    for name, norm_n, gain in mergers:
        m = pre + name
        w[m + "norm.weight"], w[m + "norm.bias"] = norm(norm_n), bias(norm_n)
        w[m + "linear_fc1.weight"], w[m + "linear_fc1.bias"] = linear(wide, wide), bias(wide)
        w[m + "linear_fc2.weight"], w[m + "linear_fc2.bias"] = linear(out_hidden, wide, gain), bias(out_hidden)
    return w


def hf_config(token_ids: dict, tok) -> dict:
    from transformers import Qwen3VLConfig
    t, v = TEXT, VISION
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.ffn,
            num_hidden_layers=t.n_layers, num_attention_heads=t.n_heads,
            num_key_value_heads=t.n_kv_heads, head_dim=t.head_dim,
            max_position_embeddings=t.max_pos, rms_norm_eps=t.norm_eps,
            bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                             "mrope_section": MROPE_SECTION, "mrope_interleaved": True}),
        vision_config=dict(
            depth=v.depth, hidden_size=v.hidden, intermediate_size=v.ffn, num_heads=v.n_heads,
            patch_size=v.image.patch, spatial_merge_size=v.image.merge,
            temporal_patch_size=v.image.temporal_patch,
            out_hidden_size=t.hidden, num_position_embeddings=v.n_pos,
            deepstack_visual_indexes=list(v.deepstack)),
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=t.tied)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3VLForConditionalGeneration"]
    return d


def generate(out_dir: Path) -> GeneratedVL:
    from tokenizers import AddedToken

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = modelgen.build_tokenizer(TEXT)
    tok.tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                      for s in VL_SPECIALS])
    token_ids = {s: tok.tokenizer.token_to_id(s) for s in modelgen.SPECIALS + VL_SPECIALS}
    assert max(token_ids.values()) < TEXT.vocab
    weights = {"model.language_model." + k.removeprefix("model."): v
               for k, v in modelgen.make_weights(TEXT).items()}
    weights.update(vision_weights(VISION, TEXT.hidden))
    weights = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
    cfg = hf_config(token_ids, tok)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for s, i in token_ids.items()}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": TEXT.max_pos, "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False, "split_special_tokens": False}, indent=2))
    im = VISION.image
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "resample": 3,
        "image_mean": list(im.mean), "image_std": list(im.std),
        "patch_size": im.patch, "temporal_patch_size": im.temporal_patch, "merge_size": im.merge,
        "size": {"shortest_edge": im.min_pixels, "longest_edge": im.max_pixels}}, indent=2))
    return GeneratedVL(out_dir, cfg, weights, token_ids)


def test_image(seed: int, width: int, height: int, fmt: str = "PNG") -> bytes:
    """Encoded bytes of a smooth random RGB picture (low-frequency blobs plus a gradient)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    im = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
    a = np.asarray(im).astype(np.int32)
    a = np.clip(a + np.linspace(-40, 40, width)[None, :, None].astype(np.int32), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def chat_prompt(engine, messages) -> tuple:
    """(ids, VisionPrompt) of a chat request, as the engine builds it."""
    from kestreld.engine.prompt import ChatInput
    p = engine.prompt(ChatInput(tuple(messages)))
    return p.ids, p.vision
