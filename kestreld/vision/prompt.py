"""Qwen3-VL prompts: image placeholders, M-RoPE positions, prefix keys, per-chunk inputs.

A chat with images renders (the model's template) to `<|vision_start|><|image_pad|>
<|vision_end|>` per image; `build_prompt` widens each pad to the image's n_tok placeholder
tokens (n_tok = gh*gw/merge^2), as the processor does. Then, for prompt token t:

    positions[:, t]  (3,) M-RoPE (t, h, w) position: text tokens count on from the last
                     position (all three equal); the tokens of an image at offset s are
                     (s, s + row, s + col) over its merged grid, and the text after it
                     resumes at s + max(rows, cols)  (transformers' get_rope_index)
    delta            position - index of every token after the prompt (decode)
    keys[t]          the prefix-match key: the token id, except for an image's placeholder
                     tokens, whose keys come from a hash of the image's pixels, so a
                     different image never matches and the same image always does

`MRopeTables.tables` turns positions into the rope kernel's cos/sin tables (interleaved
sections: frequency j follows h if j % 3 == 1 and j < 3*section[1], w if j % 3 == 2 and
j < 3*section[2], else t).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import BadRequest
from .images import PreparedImage

log = logging.getLogger("kestreld")


@dataclass
class ChunkVision:
    """What a forward pass over prompt tokens [a, b) needs beyond their ids."""
    positions: np.ndarray         # (3, n) int64 M-RoPE positions
    rows: np.ndarray              # (r,) indices in the chunk of visual tokens
    embeds: Optional[np.ndarray]  # (r, hidden) f32 replacing their token embeddings
    deepstack: list               # per early layer: (r, hidden) f32 added after that layer


@dataclass(frozen=True)
class ImageFigures:
    """What a request's images cost: how many, their placeholder tokens, how many ran
    through the encoder (the others were in the reused KV) and the encoder's time."""
    images: int
    visual_tokens: int
    encoded: int
    encode_ms: float


@dataclass
class VisionPrompt:
    """The images of one prompt and everything derived from where they sit in it."""
    images: list                  # [PreparedImage]
    spans: list                   # [(start, end)] placeholder tokens of each image
    positions: np.ndarray         # (3, n_prompt) int64
    delta: int                    # decode position = index + delta
    keys: list                    # prefix-match keys, one per prompt token
    embeds: list = field(default_factory=list)      # per image (n_tok, hidden) once encoded
    deepstack: list = field(default_factory=list)   # per image [per layer (n_tok, hidden)]
    encode_ms: float = 0.0
    encoded: int = 0              # images run through the encoder by this request

    @property
    def visual_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def encode(self, encoder, keep: int, threads: int) -> None:
        """Run the encoder on every image with placeholder tokens at or after `keep` (the
        ones before it are in the reused KV already)."""
        t0 = time.perf_counter()
        self.embeds = [None] * len(self.images)
        self.deepstack = [None] * len(self.images)
        for i, ((s, e), img) in enumerate(zip(self.spans, self.images)):
            if e > keep:
                self.embeds[i], self.deepstack[i] = encoder.encode(img, threads)
                self.encoded += 1
        self.encode_ms = (time.perf_counter() - t0) * 1e3
        f = self.figures()
        log.info("[VISION] images=%d visual_tokens=%d encoded=%d encode=%.0fms",
                 f.images, f.visual_tokens, f.encoded, f.encode_ms)

    def chunk(self, a: int, b: int) -> ChunkVision:
        """Inputs of prompt tokens [a, b)."""
        rows, embeds, ds = [], [], []
        for (s, e), emb, deep in zip(self.spans, self.embeds, self.deepstack):
            lo, hi = max(s, a), min(e, b)
            if lo >= hi:
                continue
            rows.append(np.arange(lo - a, hi - a))
            embeds.append(emb[lo - s:hi - s])
            ds.append([d[lo - s:hi - s] for d in deep])
        if not rows:
            return ChunkVision(self.positions[:, a:b], np.zeros(0, np.int64), None, [])
        n_layers = min(len(d) for d in ds)
        return ChunkVision(
            self.positions[:, a:b], np.concatenate(rows), np.concatenate(embeds),
            [np.concatenate([d[j] for d in ds]) for j in range(n_layers)])

    def figures(self) -> ImageFigures:
        return ImageFigures(len(self.images), self.visual_tokens, self.encoded,
                            round(self.encode_ms, 3))


def _image_keys(digest: bytes, n: int) -> list:
    """n negative keys (token ids are >= 0) derived from the image hash."""
    base = int.from_bytes(digest[:7], "little")
    return [-1 - ((base + j) & ((1 << 56) - 1)) for j in range(n)]


def build_prompt(ids: list, images: list, vcfg) -> tuple[list, VisionPrompt]:
    """Widen each `<|image_pad|>` of `ids` to its image's placeholder tokens; return the new
    ids and their VisionPrompt. `images` ([PreparedImage]) in the order of the pads."""
    pad, merge = vcfg.image_token_id, vcfg.merge
    n_pads = sum(1 for t in ids if t == pad)
    if n_pads != len(images):
        raise BadRequest(f"the prompt has {n_pads} image placeholders for {len(images)} images")
    out, keys, spans, pos_parts = [], [], [], []
    cur = 0          # next M-RoPE position
    run_start = 0    # first index of the current text run in `out`
    it = iter(images)
    for t in ids:
        if t != pad:
            out.append(t)
            keys.append(t)
            continue
        img: PreparedImage = next(it)
        text_len = len(out) - run_start
        pos_parts.append(np.broadcast_to(np.arange(cur, cur + text_len), (3, text_len)))
        cur += text_len
        gh, gw = img.grid_h // merge, img.grid_w // merge
        rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        pos_parts.append(np.stack([np.full(gh * gw, cur), cur + rows.reshape(-1),
                                   cur + cols.reshape(-1)]))
        cur += max(gh, gw)
        spans.append((len(out), len(out) + gh * gw))
        out.extend([pad] * (gh * gw))
        keys.extend(_image_keys(img.digest, gh * gw))
        run_start = len(out)
    text_len = len(out) - run_start
    pos_parts.append(np.broadcast_to(np.arange(cur, cur + text_len), (3, text_len)))
    positions = np.ascontiguousarray(np.concatenate(pos_parts, axis=1), dtype=np.int64)
    delta = int(positions.max()) + 1 - len(out) if len(out) else 0
    return out, VisionPrompt(list(images), spans, positions, delta, keys)


class MRopeTables:
    """Per-chunk cos/sin tables (n, head_dim/2) from M-RoPE positions, in buffers allocated
    once for `max_chunk` tokens."""

    def __init__(self, head_dim: int, theta: float, section: tuple, max_chunk: int):
        half = head_dim // 2
        self.inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # (half,)
        comp = np.zeros(half, np.int64)
        j = np.arange(half)
        comp[(j % 3 == 1) & (j < 3 * section[1])] = 1
        comp[(j % 3 == 2) & (j < 3 * section[2])] = 2
        self.component = comp          # which of (t, h, w) frequency j follows
        self.cos = np.zeros((max_chunk, half), np.float32)
        self.sin = np.zeros((max_chunk, half), np.float32)

    def tables(self, positions: np.ndarray):
        """cos, sin views (n, head_dim/2) for positions (3, n)."""
        n = positions.shape[1]
        ang = positions[self.component, :].T * self.inv[None, :]   # (n, half)
        cos, sin = self.cos[:n], self.sin[:n]
        np.cos(ang, out=cos, casting="same_kind")
        np.sin(ang, out=sin, casting="same_kind")
        return cos, sin


def chat_images(messages) -> tuple[list, list]:
    """Messages as the template wants them ({"type": "image"} parts stay, without their
    bytes) and the image parts in order."""
    rendered, parts = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            rendered.append(dict(m))
            continue
        items = []
        for part in content:
            if part["type"] == "image":
                parts.append(part)
                items.append({"type": "image"})
            else:
                items.append({"type": "text", "text": part["text"]})
        rendered.append(dict(m, content=items))
    return rendered, parts

