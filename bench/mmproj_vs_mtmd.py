"""Kestrel's mmproj reading against llama.cpp's own: the same converted pair, the same image.

    .venv/bin/python bench/mmproj_vs_mtmd.py            # needs llama-cpp-python (with libmtmd)

Generates the small random Qwen3-VL of tests/modelgen_vl.py, writes its text GGUF + mmproj
GGUF pair with kestreld.model.convert_vl (F32), then encodes one image twice:

  - llama.cpp: llama-cpp-python's mtmd (tools/mtmd: clip.cpp, PROJECTOR_TYPE_QWEN3VL) loads
    the pair; mtmd_encode_chunk on the image chunk of "<__media__>"; its output rows are
    the merged tokens, each [merger | DeepStack 0 | DeepStack 1 ...] (n_embd each);
  - Kestrel: load_model(text, mmproj=...) and VisionEncoder.encode.

The image is 128 x 96 pixels (8 x 6 patches of 16, 12 merged tokens): already on the
32-pixel grid and within both preprocessors' limits, so neither resizes it and the pixels
fed to both encoders are the same. Prints the cosine similarity of each part and exits 1
below 0.999. Not run by `make test` (CI does not install llama-cpp-python).

Measured with llama-cpp-python 0.3.36: merger cosine 0.99989, DeepStack 0.99996 and 0.99994.
"""
from __future__ import annotations

import ctypes
import io
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.join(ROOT, "tests"))   # modelgen_vl: the generated model

MIN_COSINE = 0.999
WIDTH, HEIGHT = 128, 96


def _cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def llama_cpp_embeddings(text_gguf: str, mmproj: str, rgb: np.ndarray, threads: int) -> np.ndarray:
    """(n_tokens, n_embd * (1 + n_deepstack)) from llama.cpp's mtmd for one RGB image."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(text_gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {text_gguf}")
    cparams = mtmd.mtmd_context_params_default()
    cparams.use_gpu = False
    cparams.n_threads = threads
    cparams.warmup = False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), model, cparams)
    if not ctx:
        raise RuntimeError(f"llama.cpp's mtmd cannot load {mmproj}")
    data = np.ascontiguousarray(rgb, np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0],
                                   data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    chunks = mtmd.mtmd_input_chunks_init()
    prompt = mtmd.mtmd_default_marker()
    text = mtmd.mtmd_input_text(prompt, len(prompt), False, True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        raise RuntimeError("mtmd_tokenize failed")
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            break
    else:
        raise RuntimeError("no image chunk")
    n_tok = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
    if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
        raise RuntimeError("mtmd_encode_chunk failed")
    width = llama_cpp.llama_model_n_embd_inp(model)     # n_embd * (1 + n_deepstack_layers)
    out = mtmd.mtmd_get_output_embd(ctx)
    emb = np.ctypeslib.as_array(out, shape=(n_tok * width,)).reshape(n_tok, width).copy()
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    llama_cpp.llama_model_free(model)
    return emb


def main() -> int:
    from PIL import Image

    import modelgen_vl
    from kestreld.model.convert_vl import convert_qwen3vl
    from kestreld.vision.images import decode_image, preprocess
    from kestreld.model.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        gen = modelgen_vl.generate(os.path.join(tmp, "Qwen3-VL-tiny"))
        text, mmproj = convert_qwen3vl(str(gen.dir), os.path.join(tmp, "gguf"), "f32")
        png = modelgen_vl.test_image(3, WIDTH, HEIGHT)
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        theirs = llama_cpp_embeddings(text, mmproj, rgb, threads=2)
        model = load_model(text, mmproj=mmproj)
        img = preprocess(decode_image(png), model.vision.cfg.image)
        embeds, deepstack = model.vision.encode(img, 2)
    mine = np.concatenate([embeds] + deepstack, axis=1)
    print(f"image {WIDTH}x{HEIGHT}: Kestrel {mine.shape}, llama.cpp mtmd {theirs.shape}")
    if mine.shape != theirs.shape:
        print("shapes differ")
        return 1
    n = embeds.shape[1]
    worst = 1.0
    for j, part in enumerate(["merger"] + [f"deepstack {k}" for k in range(len(deepstack))]):
        c = _cosine(mine[:, j * n:(j + 1) * n], theirs[:, j * n:(j + 1) * n])
        worst = min(worst, c)
        print(f"{part:12s} cosine {c:.6f}")
    return 0 if worst >= MIN_COSINE else 1


if __name__ == "__main__":
    sys.exit(main())
