"""vision/images.py: image paths confined to --image-dir against a racing swap, and the
memory an image takes to decode checked before it is decoded. (Decoding, preprocessing
and the other bad images are in test_qwen3vl.py.)"""
from __future__ import annotations

import ctypes
import io
import os
import threading
from collections import Counter

import pytest
from PIL import Image

from kestreld.errors import BadRequest, PermissionDenied
from kestreld.vision import images
from kestreld.vision.images import decode_image, read_image_part

RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(a: str, b: str) -> None:
    """renameat2(RENAME_EXCHANGE): swap two names atomically."""
    if _libc.renameat2(-100, a.encode(), -100, b.encode(), RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def test_a_swapped_directory_never_lets_a_read_out(tmp_path):
    """The attack: sub/ inside the image dir and a symlink to a directory outside, swapped
    with RENAME_EXCHANGE while requests read sub/x.png. Checking realpath() and then
    opening let 844 of 14,191 reads out, an outside file's size leak in an error, and an
    EINVAL come back as internal; now every read is the inside file or a client error."""
    root, outside = tmp_path / "images", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "x.png").write_bytes(b"inside")
    (outside / "x.png").write_bytes(b"OUTSIDE")
    os.symlink(outside, root / "swap")
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            exchange(str(root / "sub"), str(root / "swap"))

    t = threading.Thread(target=swapper)
    t.start()
    seen = Counter()
    try:
        for _ in range(5000):
            try:
                seen[read_image_part({"path": str(root / "sub" / "x.png")}, str(root))] += 1
            except (BadRequest, PermissionDenied) as e:
                assert "OUTSIDE" not in str(e) and "7 bytes" not in str(e)
                seen[type(e).__name__] += 1
    finally:
        stop.set()
        t.join()
    assert seen[b"OUTSIDE"] == 0, seen
    assert seen[b"inside"] > 0 and sum(seen.values()) == 5000, seen


def test_paths_that_climb_or_leave_are_refused(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(b"secret")
    for path in (str(root / ".." / "secret.png"), str(tmp_path / "secret.png"), "/etc/passwd"):
        with pytest.raises(PermissionDenied, match="outside the image directory"):
            read_image_part({"path": path}, str(root))


def test_an_error_never_tells_the_size_of_what_it_read():
    with pytest.raises(BadRequest) as e:
        decode_image(b"x" * 31337)
    assert "31337" not in str(e.value)


def test_pixels_are_checked_against_the_memory_available(monkeypatch):
    """A 7,071 x 7,071 PNG of a few kB peaked near 1 GB: with less than twice what it
    needs available it is refused before decoding."""
    png = io.BytesIO()
    Image.new("1", (7071, 7071)).save(png, format="PNG")
    need = 7071 * 7071 * images.DECODE_BYTES_PER_PIXEL

    class Memory:
        available = 2 * need - 1
    monkeypatch.setattr(images.psutil, "virtual_memory", lambda: Memory)
    with pytest.raises(BadRequest, match="7071x7071 pixels: decoding it takes about"):
        decode_image(png.getvalue())
    small = io.BytesIO()
    Image.new("RGB", (64, 48), (255, 0, 0)).save(small, format="PNG")
    assert decode_image(small.getvalue()).shape == (48, 64, 3)
