"""Images for Qwen3-VL: bytes or a file -> checked RGB pixels -> the processor's patches.

    read_image_part(part, image_dir)   {"path"} (confined to image_dir) or {"data"} -> bytes, bounded
    decode_image(data)      bytes -> (H, W, 3) uint8 RGB (transparency composited onto white),
                            dimensions checked before any pixel is decoded
    preprocess(rgb, spec)   -> PreparedImage: resized as the model's processor does (both sides
                            multiples of patch*merge, pixels within [min, max]; PIL bicubic),
                            rescaled to [0, 1], normalized, cut into patches in merge-block order

This is what transformers' Qwen2VLImageProcessorPil does for Qwen3-VL, except that the two
identical temporal copies of each patch are not materialized (the encoder folds them into
its patch-embedding weight). Every fault is a BadRequest that says what is wrong.
"""
from __future__ import annotations

import errno
import hashlib
import io
import math
import os
import stat
from dataclasses import dataclass
from typing import Optional

import numpy as np
import psutil

from ..errors import BadRequest, PermissionDenied

MAX_IMAGE_BYTES = 32 << 20        # one encoded image
MAX_SOURCE_PIXELS = 50_000_000    # before resizing (a 7071 x 7071 image); decompression bombs
MAX_ASPECT = 200                  # the processor's own limit
# Peak bytes per source pixel while decoding: the decoded pixels, then RGBA, the white
# background it is composited on and the RGB result (a 7,071 x 7,071 PNG of 10 kB peaked
# near 1 GB). An image needing more than half the memory available is refused.
DECODE_BYTES_PER_PIXEL = 16


@dataclass(frozen=True)
class ImageSpec:
    """preprocessor_config.json of a Qwen3-VL model."""
    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class PreparedImage:
    patches: np.ndarray    # (gh*gw, 3*patch*patch) f32, merge-block order, (C, ph, pw) per row
    grid_h: int            # patches down
    grid_w: int            # patches across
    digest: bytes          # sha256 of the decoded RGB pixels and their shape
    source_size: tuple     # (width, height) as decoded

    def n_tokens(self, merge: int) -> int:
        """Placeholder tokens (= merged visual embeddings) of this image."""
        return self.grid_h * self.grid_w // (merge * merge)


def read_image_part(part: dict, image_dir: Optional[str]) -> bytes:
    """The encoded bytes of an image part: {"data": bytes} as sent, or {"path": str} read
    from inside `image_dir` (the daemon's --image-dir) with the daemon's permissions.

    Paths are confined: without an image_dir every path is refused; with one, the path
    must name a file under it, and it is opened one component at a time from a descriptor
    of the directory, each with O_NOFOLLOW (no symlink is followed, no `..` accepted), the
    file with O_NONBLOCK and checked to be regular on its descriptor. Checking a resolved
    path and then opening it could be raced (a directory swapped for a symlink between
    the two); a walk of descriptors cannot be."""
    if "data" in part:
        data = part["data"]
    else:
        data = _read_confined(part["path"], image_dir)
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRequest(f"image of more than {MAX_IMAGE_BYTES} bytes; the limit is {MAX_IMAGE_BYTES}")
    return bytes(data)


def _read_confined(path: str, image_dir: Optional[str]) -> bytes:
    if image_dir is None:
        raise PermissionDenied("image paths are not accepted by this daemon (start it with "
                               "--image-dir DIR); send the image's bytes instead")
    if not os.path.isabs(path):
        raise BadRequest(f"image path must be absolute, got {path!r}")
    outside = PermissionDenied(f"image path {path!r} is outside the image directory "
                               f"{image_dir} (symlinks and .. are not followed)")
    parts = _below(path, image_dir)
    if parts is None:
        raise outside
    if not parts:
        raise BadRequest(f"image path {path!r} is not a regular file")
    try:
        fd = os.open(image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise BadRequest(f"the image directory cannot be opened: {e.strerror}") from None
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (
                os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                next_fd = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                raise _open_error(e, path, outside) from None
            os.close(fd)
            fd = next_fd
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadRequest(f"image path {path!r} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            try:
                return f.read(MAX_IMAGE_BYTES + 1)
            except OSError as e:
                raise BadRequest(f"image file {path!r} cannot be read: {e.strerror}") from None
    finally:
        if fd >= 0:
            os.close(fd)


def _below(path: str, image_dir: str) -> Optional[list]:
    """The components of `path` under `image_dir` (as configured or as resolved), or None
    if it is not under it or climbs with `..`."""
    for root in {os.path.normpath(image_dir), os.path.realpath(image_dir)}:
        if path == root or path.startswith(root.rstrip("/") + "/"):
            parts = [p for p in path[len(root):].split("/") if p not in ("", ".")]
            return None if ".." in parts else parts
    return None


def _open_error(e: OSError, path: str, outside: PermissionDenied) -> Exception:
    """The client's error for a failed open along the walk (never `internal`)."""
    if e.errno == errno.ELOOP:               # a symlink, possibly swapped in just now
        return outside
    if e.errno == errno.ENOENT:
        return BadRequest(f"image file {path!r} does not exist")
    if e.errno in (errno.EACCES, errno.EPERM):
        return BadRequest(f"image file {path!r} is not readable by the daemon")
    if e.errno == errno.ENOTDIR:
        return BadRequest(f"image path {path!r} goes through something that is not a directory")
    return BadRequest(f"image file {path!r} cannot be opened: {e.strerror}")


def decode_image(data: bytes) -> np.ndarray:
    """(H, W, 3) uint8 RGB of an encoded image (PNG, JPEG, ... whatever Pillow reads)."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadRequest("not an image: Pillow cannot identify its format") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many types on corrupt headers
        raise BadRequest(f"not a readable image: {type(e).__name__}: {e}") from None
    w, h = im.size
    if w < 1 or h < 1 or w * h > MAX_SOURCE_PIXELS:
        raise BadRequest(f"image of {w}x{h} pixels; at most {MAX_SOURCE_PIXELS} pixels are accepted")
    if max(w, h) / min(w, h) > MAX_ASPECT:
        raise BadRequest(f"image of {w}x{h}: aspect ratio above {MAX_ASPECT}")
    need, available = w * h * DECODE_BYTES_PER_PIXEL, psutil.virtual_memory().available
    if need > available // 2:
        raise BadRequest(f"image of {w}x{h} pixels: decoding it takes about {need >> 20} MB, "
                         f"more than half the {available >> 20} MB of memory available")
    try:
        im.load()
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise BadRequest(f"corrupt or truncated image ({im.format} {w}x{h}): {e}") from None
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), rgba)
    return np.asarray(im.convert("RGB"), dtype=np.uint8)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """The processor's target size: sides multiples of `factor`, area in [min, max] pixels,
    aspect ratio kept as closely as possible (transformers' smart_resize)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(rgb: np.ndarray, spec: ImageSpec) -> PreparedImage:
    """Resize, normalize and patchify one RGB image (H, W, 3) uint8."""
    from PIL import Image

    h, w = rgb.shape[:2]
    rh, rw = smart_resize(h, w, spec.patch * spec.merge, spec.min_pixels, spec.max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.Resampling.BICUBIC))
    x = resized.astype(np.float64) * (1.0 / 255.0)
    x = ((x.astype(np.float32) - np.asarray(spec.mean, np.float32))
         / np.asarray(spec.std, np.float32))                       # (rh, rw, 3)
    p, m = spec.patch, spec.merge
    gh, gw = rh // p, rw // p
    # (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m, m, C, p, p): merge blocks, then patches
    x = x.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = np.ascontiguousarray(x.reshape(gh * gw, 3 * p * p), dtype=np.float32)
    digest = hashlib.sha256(np.asarray(rgb.shape, np.int64).tobytes() + rgb.tobytes()).digest()
    return PreparedImage(patches, gh, gw, digest, (w, h))
