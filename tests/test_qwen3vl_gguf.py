"""Qwen3-VL as llama.cpp splits it: a qwen3vl text GGUF + a vision mmproj GGUF, written by
kestreld.model.convert_vl from the generated HF directory (tests/modelgen_vl.py), loaded
with load_model(text, mmproj=...) and compared with the HF-directory load and transformers.

Measured (engine on 2 threads): the F32 pair gives the HF-directory load's logits, visual
embeddings and greedy ids exactly (the same float32 weights, the same Q8_0 requantization);
against transformers, text-only rel RMS 0.025-0.026 and top-1 1.0 (256 decided positions)
for F32, Q8_0, BF16 and F16 pairs; visual embeddings and DeepStack features cosine
0.99981-0.99996.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os

import gguf
import numpy as np
import pytest

import modelgen_vl
from modelgen_vl import chat_prompt
from kestreld.model.convert import _field_value
from kestreld.model.convert_vl import convert_qwen3vl, main as convert_main
from kestreld.engine.diskkv import kv_fingerprint
from kestreld.engine.generate import Engine
from kestreld.engine.prompt import Prompt
from kestreld.engine.sampler import SamplingOptions
from kestreld.vision.images import decode_image, preprocess
from kestreld.model.load import load_model
from kestreld.model.mmproj import PATCH_KERNELS, PROJECTOR_TYPE, vision_tensors
from kestreld.errors import BadRequest, ModelLoadError
from metrics import assert_logits_agree

MAX_REL = 0.03
MIN_AGREE = 0.99
MIN_COSINE = 0.999
QUESTION = "Describe the picture in a few words."


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("qwen3vl_gguf")
    gen = modelgen_vl.generate(root / "Qwen3-VL-tiny")
    pairs = {t: convert_qwen3vl(str(gen.dir), str(root / "gguf"), t)
             for t in ("f32", "q8_0", "bf16", "f16")}
    ref = Qwen3VLForConditionalGeneration.from_pretrained(
        str(gen.dir), dtype=torch.float32, attn_implementation="eager")
    return dict(gen=gen, pairs=pairs, root=root, torch=torch, ref=ref.eval(),
                proc=Qwen2VLImageProcessorPil.from_pretrained(str(gen.dir)),
                hf=load_model(str(gen.dir)),
                gguf=load_model(pairs["f32"][0], mmproj=pairs["f32"][1]),
                images=[modelgen_vl.test_image(1, 100, 75), modelgen_vl.test_image(2, 150, 130)])


def _cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _chat(image: bytes, text: str):
    return [{"role": "user", "content": ({"type": "image", "data": image},
                                         {"type": "text", "text": text})}]


# ---------------------------------------------------------------- the files

def test_pair_is_laid_out_as_llama_cpp_writes_it(vl):
    """Names and keys from gguf-py's own tables (what llama.cpp's converter uses); the two
    patch-kernel taps are the Conv3d's temporal slices."""
    text, mmproj = (gguf.GGUFReader(p) for p in vl["pairs"]["f32"])
    assert text.fields["general.architecture"].contents() == \
        gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3VL]
    assert text.fields["qwen3vl.rope.dimension_sections"].contents() == \
        modelgen_vl.MROPE_SECTION + [0]
    assert text.fields["qwen3vl.n_deepstack_layers"].contents() == 2
    assert not [t.name for t in text.tensors if t.name.startswith(("v.", "mm."))]

    f = mmproj.fields
    assert f["general.architecture"].contents() == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]
    assert f[gguf.Keys.Clip.PROJECTOR_TYPE].contents() == PROJECTOR_TYPE == \
        gguf.VisionProjectorType.QWEN3VL
    assert f[gguf.Keys.ClipVision.IS_DEEPSTACK_LAYERS].contents() == [True, True, False]
    assert f[gguf.Keys.ClipVision.PROJECTION_DIM].contents() == modelgen_vl.TEXT.hidden
    v = modelgen_vl.VISION
    names = vision_tensors(v.depth, v.deepstack)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v.depth)
    for hf, name in names.items():
        if ".blocks." in hf or "pos_embed" in hf:
            assert tmap.get_name(hf.removeprefix("model."), try_suffixes=(".weight", ".bias")) == name
    tensors = {t.name: t for t in mmproj.tensors}
    assert set(tensors) == set(names.values()) | set(PATCH_KERNELS)
    conv = vl["gen"].weights["model.visual.patch_embed.proj.weight"]
    for tap, name in enumerate(PATCH_KERNELS):
        np.testing.assert_array_equal(tensors[name].data, conv[:, :, tap])


# ---------------------------------------------------------------- text

def test_text_logits_equal_the_hf_dir_and_match_transformers(vl):
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 500, 256)]
    got = Engine(vl["gguf"], max_seq=320, threads=2).forward_logits(ids)
    hf = Engine(vl["hf"], max_seq=320, threads=2).forward_logits(ids)
    np.testing.assert_array_equal(got, hf)
    with vl["torch"].no_grad():
        exact = vl["ref"](vl["torch"].tensor([ids])).logits[0].double().numpy()
    assert_logits_agree(got, exact, MAX_REL, MIN_AGREE, 128)


def test_text_gguf_without_mmproj_is_text_only(vl, caplog):
    with caplog.at_level(logging.INFO, logger="kestreld"):
        model = load_model(vl["pairs"]["q8_0"][0])
    assert model.vision is None and model.config.mrope_section == (6, 5, 5)
    assert "--mmproj" in caplog.text
    engine = Engine(model, max_seq=256, threads=1)
    assert len(engine.generate(engine.tokenize("hello"), SamplingOptions(max_tokens=3)).ids) <= 3
    with pytest.raises(BadRequest, match="takes no images.*--mmproj"):
        chat_prompt(engine, _chat(vl["images"][0], QUESTION))


def test_a_cached_q8_0_conversion_keeps_the_pair_working(vl, tmp_path):
    text, mmproj = vl["pairs"]["f16"]
    model = load_model(text, cache_dir=str(tmp_path), mmproj=mmproj)
    assert list(tmp_path.glob("*.kestrel.gguf")) and model.config.mrope_section == (6, 5, 5)
    assert model.conversion.startswith("converted to q8_0 once, cached as")
    assert model.vision.cfg.deepstack == (0, 1)


def test_an_hf_dir_with_a_cache_dir_loads_its_cached_q8_0_pair(vl, tmp_path, caplog):
    """With a cache directory, a Qwen3-VL HF directory is converted once to a Q8_0 pair and
    memory-mapped from it afterwards (weights used in place); editing the directory makes a
    new conversion. Its logits stay within the bars against transformers."""
    gen, cache = vl["gen"], tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="kestreld"):
        model = load_model(str(gen.dir), cache_dir=str(cache))
    assert "converting" in caplog.text
    text, mmproj = sorted(cache.glob("*.Q8_0.gguf"), key=lambda p: p.name.startswith("mmproj"))
    assert model.source_format == "gguf" and model.mmproj == str(mmproj)
    assert model.vision is not None and model.vision.cfg == vl["hf"].vision.cfg
    assert not model.weights.layers[0].wq.data.flags.owndata      # a view of the map
    assert not model.vision.blocks[0].fc1.data.flags.owndata  # the mmproj's too
    caplog.clear()
    mtime = text.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="kestreld"):
        again = load_model(str(gen.dir), cache_dir=str(cache))
    assert "converting" not in caplog.text and text.stat().st_mtime_ns == mtime

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 200, size=256).tolist()
    got = Engine(again, max_seq=320, threads=2).forward_logits(ids, 0)
    with vl["torch"].no_grad():
        exact = vl["ref"](input_ids=vl["torch"].tensor([ids])).logits[0].double().numpy()
    assert_logits_agree(got, exact, MAX_REL, MIN_AGREE, 128)

    cfg = gen.dir / "config.json"
    st = cfg.stat()
    try:
        os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # the model "changed"
        with caplog.at_level(logging.INFO, logger="kestreld"):
            load_model(str(gen.dir), cache_dir=str(cache))
        assert "converting" in caplog.text
    finally:
        os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))


# ---------------------------------------------------------------- images

@pytest.mark.parametrize("outtype", ["f32", "q8_0", "bf16", "f16"])
def test_visual_embeddings(vl, outtype):
    """F32: the HF-directory encoder's output exactly; every type: transformers' within the
    bar of test_qwen3vl."""
    from PIL import Image

    text, mmproj = vl["pairs"][outtype]
    model = vl["gguf"] if outtype == "f32" else load_model(text, mmproj=mmproj)
    spec = model.vision.cfg.image
    assert model.vision.cfg == vl["hf"].vision.cfg
    pv = vl["proc"](images=[Image.open(io.BytesIO(b)) for b in vl["images"]], return_tensors="pt")
    with vl["torch"].no_grad():
        ref = vl["ref"].model.get_image_features(pv["pixel_values"], pv["image_grid_thw"],
                                                 return_dict=True)
    for i, b in enumerate(vl["images"]):
        img = preprocess(decode_image(b), spec)
        embeds, deepstack = model.vision.encode(img, 2)
        if outtype == "f32":
            want, want_ds = vl["hf"].vision.encode(img, 2)
            np.testing.assert_array_equal(embeds, want)
            for d, w in zip(deepstack, want_ds, strict=True):
                np.testing.assert_array_equal(d, w)
        assert _cosine(embeds, ref.pooler_output[i].numpy()) >= MIN_COSINE
        assert len(deepstack) == 2
        for j, d in enumerate(deepstack):
            assert _cosine(d, ref.deepstack_features[j][i].numpy()) >= MIN_COSINE


def test_greedy_ids_with_an_image_equal_the_hf_dir(vl):
    opts = SamplingOptions(max_tokens=12, ignore_eos=True)
    outs = []
    for model in (vl["gguf"], vl["hf"]):
        engine = Engine(model, max_seq=320, threads=2, prefill_chunk=64)
        ids, vp = chat_prompt(engine, _chat(vl["images"][1], QUESTION))
        outs.append((ids, engine.generate(Prompt(ids, vp), opts).ids))
    assert outs[0] == outs[1] and len(outs[0][1]) == 12


def test_disk_kv_fingerprint_covers_the_mmproj(vl):
    other = dataclasses.replace(vl["gguf"], mmproj=vl["pairs"]["q8_0"][1])
    assert kv_fingerprint(vl["gguf"], 256) != kv_fingerprint(other, 256)


# ---------------------------------------------------------------- faults

def _rewrite(src: str, dst, meta: dict = None, drop: tuple = (), arch: str = None) -> str:
    """A copy of the GGUF `src` with metadata values replaced (`meta`), tensors left out
    (`drop`) or another architecture (`arch`: its keys renamed too)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = (meta or {}).get(field.name, _field_value(field))
        key = f"{arch}.{field.name[len(old) + 1:]}" if arch and field.name.startswith(old + ".") \
            else field.name
        w.add_key_value(key, value, field.types[0], sub)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_bad_mmproj_files_are_one_clear_line(vl, tmp_path):
    text, mmproj = vl["pairs"]["q8_0"]
    data = open(mmproj, "rb").read()
    (tmp_path / "truncated.gguf").write_bytes(data[:len(data) // 2])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, no")
    cases = {
        str(tmp_path / "missing.gguf"): "cannot read",
        str(tmp_path / "junk.gguf"): "bad magic",
        str(tmp_path / "truncated.gguf"): "truncated",
        text: "architecture 'qwen3vl' is not an mmproj",
        _rewrite(mmproj, tmp_path / "mlp.gguf", {"clip.projector_type": "mlp"}):
            "unsupported projector type 'mlp'; supported: 'qwen3vl_merger'",
        _rewrite(mmproj, tmp_path / "nokernel.gguf", drop=("v.patch_embd.weight.1",)):
            "missing tensor v.patch_embd.weight.1",
        _rewrite(mmproj, tmp_path / "nomerger.gguf", drop=("mm.2.weight",)):
            "missing tensor mm.2.weight",
        _rewrite(mmproj, tmp_path / "proj.gguf", {"clip.vision.projection_dim": 32}):
            "unsupported vision shape",
        _rewrite(mmproj, tmp_path / "ds.gguf",
                 {"clip.vision.is_deepstack_layers": [True, False, False]}):
            "1 DeepStack layers, but the text model",
        _rewrite(mmproj, tmp_path / "dslen.gguf", {"clip.vision.is_deepstack_layers": [True]}):
            "bad vision metadata: clip.vision.is_deepstack_layers has 1 entries for 3 blocks",
    }
    for path, message in cases.items():
        with pytest.raises(ModelLoadError) as e:
            load_model(text, mmproj=path)
        assert path in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_mmproj_only_goes_with_a_qwen3vl_gguf(vl, tmp_path):
    text, mmproj = vl["pairs"]["q8_0"]
    with pytest.raises(ModelLoadError, match="Hugging Face directory, which holds its own"):
        load_model(str(vl["gen"].dir), mmproj=mmproj)
    qwen3 = _rewrite(text, tmp_path / "qwen3.gguf", arch="qwen3")
    with pytest.raises(ModelLoadError, match="is qwen3, which takes no images"):
        load_model(qwen3, mmproj=mmproj)


def test_converter_cli(vl, tmp_path, capsys):
    assert convert_main([str(vl["gen"].dir), str(tmp_path), "--outtype", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-VL-tiny-Q8_0.gguf" in out and "mmproj-Qwen3-VL-tiny-Q8_0.gguf" in out
    assert convert_main([str(tmp_path / "nowhere"), str(tmp_path)]) == 1
    assert "missing file" in capsys.readouterr().err


# ---------------------------------------------------------------- through the daemon

def test_chat_with_an_image_through_the_daemon(vl, tmp_path):
    """The real daemon started with --model TEXT.gguf --mmproj MMPROJ.gguf answers a chat
    with an image as the in-process engine on the HF directory does."""
    from daemon import Daemon

    engine = Engine(vl["hf"], max_seq=512, threads=1)
    ids, vp = chat_prompt(engine, _chat(vl["images"][0], QUESTION))
    want = engine.generate(Prompt(ids, vp), SamplingOptions(max_tokens=8, ignore_eos=True))
    text, mmproj = vl["pairs"]["f32"]
    with Daemon(tmp_path / "k.sock", "--mmproj", mmproj, "--cache-dir", str(tmp_path / "cache"),
                model=text) as d:
        with d.client() as c:
            got = c.chat(_chat(vl["images"][0], QUESTION), max_tokens=8, ignore_eos=True)
    assert got.ids == want.ids
    assert got.usage["images"] == 1 and got.usage["visual_tokens"] == vp.visual_tokens
