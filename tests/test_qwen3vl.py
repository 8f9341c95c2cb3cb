"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration on the same generated HF
directory (tests/modelgen_vl.py): text-only logits, the image processor's pixels, the vision
encoder's embeddings and DeepStack features, logits with one and two images, M-RoPE
positions, generation with images and prefix reuse keyed by the image, bad images, the
protocol's image parts and the KV figures of Qwen3-VL-2B.

Measured (engine on 2 threads): text-only rel RMS 0.026, top-1 1.0; visual embeddings
cosine 0.99983-0.99996 (Q8_0 block linears); with two images rel RMS 0.026, top-1 1.0 on
the text positions.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

import modelgen_vl
from modelgen_vl import chat_prompt
from kestreld.engine.kvcache import KVCache, KVLayout
from kestreld.engine.forward import rope_tables
from kestreld.engine.generate import Engine
from kestreld.engine.prompt import Prompt
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.hf_dir import _vl_text_config
from kestreld.vision.images import decode_image, preprocess
from kestreld.model.load import load_model
from kestreld.vision.prompt import MRopeTables, build_prompt
from kestreld.errors import BadRequest, PermissionDenied
from kestreld.protocol import validate_params
from metrics import assert_logits_agree

MAX_REL = 0.03
MIN_AGREE = 0.99
MIN_COSINE = 0.999
IMAGES = ((1, 100, 75), (2, 150, 130))     # (seed, width, height): 6 and 20 visual tokens


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(2)
    gen = modelgen_vl.generate(tmp_path_factory.mktemp("qwen3vl"))
    ref, info = Qwen3VLForConditionalGeneration.from_pretrained(
        str(gen.dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load_model(str(gen.dir))
    return dict(gen=gen, ref=ref.eval(), proc=Qwen2VLImageProcessorPil.from_pretrained(str(gen.dir)),
                model=model, torch=torch,
                images=[modelgen_vl.test_image(*spec) for spec in IMAGES])


def _cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _reference(vl, image_bytes: list):
    """transformers' processor output for the images: pixel_values, image_grid_thw."""
    from PIL import Image
    out = vl["proc"](images=[Image.open(io.BytesIO(b)) for b in image_bytes], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _text(rng, n):
    return [int(i) for i in rng.integers(0, 500, n)]   # below the special tokens


# ---------------------------------------------------------------- loading, text only

def test_kv_figures_of_qwen3vl_2b():
    """The design source's figures from Qwen3-VL-2B-Instruct's config.json text_config."""
    hf = {"architectures": ["Qwen3VLForConditionalGeneration"], "tie_word_embeddings": True,
          "text_config": {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                          "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
                          "vocab_size": 151936, "rope_scaling": {"mrope_interleaved": True,
                          "mrope_section": [24, 20, 20], "rope_type": "default"},
                          "rope_theta": 5000000}}
    flat = _vl_text_config(hf, "config.json")
    assert flat["mrope_section"] == [24, 20, 20] and flat["tie_word_embeddings"] is True
    arena = KVCache(KVLayout(flat["num_hidden_layers"], flat["num_key_value_heads"], flat["head_dim"], 8192))
    assert arena.bytes_per_token_layer == 2112
    assert arena.nbytes == 484_442_112


def test_loads_as_qwen3vl(vl):
    c = vl["model"].config
    assert (c.arch, c.n_layers, c.hidden, c.mrope_section, c.tied_embeddings) == \
        ("qwen3vl", 3, 64, (6, 5, 5), True)
    assert vl["model"].vision.cfg.deepstack == (0, 1)


def test_mrope_with_equal_components_is_plain_rope():
    cos, sin = rope_tables(300, 32, 10000.0)
    pos = np.broadcast_to(np.arange(100, 300), (3, 200))
    mc, ms = MRopeTables(32, 10000.0, (6, 5, 5), 256).tables(pos)
    np.testing.assert_allclose(mc, cos[100:300], atol=2e-6)
    np.testing.assert_allclose(ms, sin[100:300], atol=2e-6)


def test_text_only_logits_match_transformers(vl):
    ids = _text(np.random.default_rng(1), 256)
    got = Engine(vl["model"], max_seq=320, threads=2).forward_logits(ids)
    with vl["torch"].no_grad():
        exact = vl["ref"](vl["torch"].tensor([ids])).logits[0].double().numpy()
    assert_logits_agree(got, exact, MAX_REL, MIN_AGREE, 128)


# ---------------------------------------------------------------- images

def test_preprocessing_matches_the_processor(vl):
    spec = vl["model"].vision.cfg.image
    mine = [preprocess(decode_image(b), spec) for b in vl["images"]]
    pv, grid = _reference(vl, vl["images"])
    assert [[1, p.grid_h, p.grid_w] for p in mine] == grid.tolist()
    theirs = pv.numpy().reshape(pv.shape[0], 3, 2, -1)
    np.testing.assert_array_equal(theirs[:, :, 0], theirs[:, :, 1])   # the repeated frame
    np.testing.assert_allclose(np.concatenate([p.patches for p in mine]),
                               theirs[:, :, 0].reshape(pv.shape[0], -1), atol=1e-6)


def test_visual_embeddings_match_transformers(vl):
    spec = vl["model"].vision.cfg.image
    pv, grid = _reference(vl, vl["images"])
    with vl["torch"].no_grad():
        ref = vl["ref"].model.get_image_features(pv, grid, return_dict=True)
    for i, b in enumerate(vl["images"]):
        embeds, deepstack = vl["model"].vision.encode(preprocess(decode_image(b), spec), 2)
        assert embeds.shape == tuple(ref.pooler_output[i].shape)
        assert _cosine(embeds, ref.pooler_output[i].numpy()) >= MIN_COSINE
        assert len(deepstack) == 2
        for j, d in enumerate(deepstack):
            assert _cosine(d, ref.deepstack_features[j][i].numpy()) >= MIN_COSINE


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_match_transformers(vl, n_images):
    torch, vcfg = vl["torch"], vl["model"].vision.cfg
    rng = np.random.default_rng(10 + n_images)
    image = [vcfg.vision_start_id, vcfg.image_token_id, vcfg.vision_end_id]
    ids = _text(rng, 40)
    for _ in range(n_images):
        ids += image + _text(rng, 60)
    images = vl["images"][:n_images]
    prepared = [preprocess(decode_image(b), vcfg.image) for b in images]
    full, vp = build_prompt(ids, prepared, vcfg)
    vp.encode(vl["model"].vision, 0, 2)
    got = Engine(vl["model"], max_seq=320, threads=2, prefill_chunk=48).forward_logits(
        full, 0, vision=vp)     # chunks of 48 cut through the second image

    pv, grid = _reference(vl, images)
    mm = torch.tensor([[int(t == vcfg.image_token_id) for t in full]])
    with torch.no_grad():
        exact = vl["ref"](input_ids=torch.tensor([full]), pixel_values=pv, image_grid_thw=grid,
                          mm_token_type_ids=mm).logits[0].double().numpy()
        positions, _ = vl["ref"].model.get_rope_index(torch.tensor([full]), mm, grid)
    np.testing.assert_array_equal(vp.positions, positions[:, 0].numpy())
    after = np.arange(len(full)) >= vp.spans[0][1]     # text positions after the first image
    after &= np.asarray(full) != vcfg.image_token_id
    assert_logits_agree(got[after], exact[after], MAX_REL, MIN_AGREE, 50)


QUESTION = "Describe the picture in a few words."


def _chat(image: bytes, text: str):
    return [{"role": "user", "content": ({"type": "image", "data": image},
                                         {"type": "text", "text": text})}]


def test_generation_with_an_image_and_prefix_reuse(vl):
    """Greedy decode after an image (M-RoPE positions past the prompt) agrees with a
    prefill of the whole sequence; the same image is a prefix hit past its tokens, a
    different image of the same size misses from its first placeholder token."""
    model = vl["model"]
    engine = Engine(model, max_seq=320, threads=2, prefill_chunk=64)
    opts = SamplingOptions(max_tokens=12, ignore_eos=True)
    a, b = vl["images"][1], modelgen_vl.test_image(7, 150, 130)
    ids, vp = chat_prompt(engine, _chat(a, QUESTION))
    first = engine.generate(Prompt(ids, vp), opts)
    assert first.images.images == 1 and first.images.visual_tokens == 20
    assert len(first.ids) == 12

    # decode (positions index + delta) == a prefill over prompt + generated
    raw = engine.tokenize(engine.prompts.render_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]))
    seq, vseq = build_prompt(raw + first.ids[:-1], [preprocess(decode_image(a), model.vision.cfg.image)],
                             model.vision.cfg)
    assert seq[:len(ids)] == ids
    vseq.encode(model.vision, 0, 2)
    logits = engine.forward_logits(seq, 0, vision=vseq)
    np.testing.assert_array_equal(logits[len(ids) - 1:].argmax(-1), first.ids)

    ids2, vp2 = chat_prompt(engine, _chat(a, QUESTION))
    engine.generate(Prompt(ids, vp), opts)                       # state: last request = a
    hit = engine.generate(Prompt(ids2, vp2), opts)
    assert hit.cached_tokens >= vp2.spans[0][1] and hit.ids == first.ids
    assert hit.images.encoded == 0

    ids3, vp3 = chat_prompt(engine, _chat(b, QUESTION))
    assert ids3 == ids2                                          # same ids, other pixels
    miss = engine.generate(Prompt(ids3, vp3), opts)
    assert miss.cached_tokens <= vp3.spans[0][0]
    assert miss.images.encoded == 1


def test_speculation_after_an_image_gives_the_same_ids(vl):
    """Drafts from the text after an image (never its placeholder tokens), verified at M-RoPE
    positions shifted by the image: greedy and seeded answers are the same ids and logprobs
    as without speculation."""
    model = vl["model"]
    text = "The kestrel nests in the old tower by the river. " * 3 + "Say it again."
    for opts in (SamplingOptions(max_tokens=40, ignore_eos=True, logprobs=2),
                 SamplingOptions(max_tokens=40, ignore_eos=True, temperature=0.8, seed=3)):
        runs = []
        for speculate in (True, False):
            engine = Engine(model, max_seq=400, threads=2, prefill_chunk=64, speculate=speculate)
            ids, vp = chat_prompt(engine, _chat(vl["images"][1], text))
            runs.append(engine.generate(Prompt(ids, vp), opts))
        on, off = runs
        assert on.ids == off.ids and on.logprobs == off.logprobs
        assert on.accepted_tokens > 0 and off.drafted_tokens == 0


def test_text_prompt_with_placeholders_but_no_image_is_refused(vl):
    engine = Engine(vl["model"], max_seq=64, threads=1)
    with pytest.raises(BadRequest, match="no images"):
        engine.generate([1, 2, vl["model"].vision.cfg.image_token_id, 3], SamplingOptions(max_tokens=1))


# ---------------------------------------------------------------- bad images, protocol

def test_bad_images_are_clear_errors(vl, tmp_path):
    from PIL import Image
    engine = Engine(vl["model"], max_seq=64, threads=1)
    png = vl["images"][0]
    huge = io.BytesIO()
    Image.new("1", (10000, 6000)).save(huge, format="PNG")       # 60 Mpixel, a few kB
    cases = {
        b"this is not an image": "not an image",
        png[:len(png) // 2]: "truncated|corrupt",
        huge.getvalue(): "10000x6000 pixels",
    }
    for data, message in cases.items():
        with pytest.raises(BadRequest, match=message):
            chat_prompt(engine, _chat(data, "hi"))
    images = tmp_path / "images"
    images.mkdir()
    good = images / "good.png"
    good.write_bytes(png)
    os.mkfifo(images / "fifo.png")                                # must not block the engine
    secret = tmp_path / "secret.png"
    secret.write_bytes(png)
    os.symlink(secret, images / "link.png")                       # points out of the directory
    confined = Engine(vl["model"], max_seq=64, threads=1, image_dir=str(images))

    def part(path):
        return [{"role": "user", "content": ({"type": "image", "path": path},)}]

    for path, message in ((str(images / "missing.png"), "does not exist"),
                          ("relative.png", "must be absolute"),
                          (str(images), "not a regular file"),
                          (str(images / "fifo.png"), "not a regular file")):
        with pytest.raises(BadRequest, match=message):
            chat_prompt(confined, part(path))
    for path in (str(secret), str(images / "link.png"), str(images / ".." / "secret.png")):
        with pytest.raises(PermissionDenied, match="outside the image directory"):
            chat_prompt(confined, part(path))
    with pytest.raises(PermissionDenied, match="not accepted"):
        chat_prompt(engine, part(str(good)))                       # no --image-dir: no paths
    ids, vp = chat_prompt(confined, part(str(good)))
    assert vp.visual_tokens == 6


def test_protocol_image_parts():
    ok = validate_params("chat", [{"messages": [{"role": "user", "content": [
        {"type": "image", "path": "/tmp/x.png"}, {"type": "image", "data": b"\x89PNG"},
        {"type": "text", "text": "what is it?"}]}]}], 100)
    assert [p["type"] for p in ok.messages[0]["content"]] == ["image", "image", "text"]
    bad = ({"type": "image"}, {"type": "image", "data": "text"}, {"type": "video", "path": "/a"},
           {"type": "text", "text": "x", "path": "/a"}, {"type": "image", "path": ""})
    for part in bad:
        with pytest.raises(BadRequest):
            validate_params("chat", [{"messages": [{"role": "user", "content": [part]}]}], 100)
    with pytest.raises(BadRequest, match="at most 16"):
        validate_params("chat", [{"messages": [{"role": "user", "content": [
            {"type": "image", "data": b"x"}] * 17}]}], 100)


# ---------------------------------------------------------------- through the daemon

def test_chat_with_an_image_through_the_daemon(vl, tmp_path):
    """The real daemon on the generated Qwen3-VL directory: `kestrelctl chat --image` and the
    client library send the image; the answer equals the in-process engine's greedy ids; the
    same image again is a prefix hit that is not encoded twice."""
    import subprocess
    import sys

    from daemon import REPO, Daemon, daemon_env

    image = tmp_path / "picture.png"
    image.write_bytes(vl["images"][0])
    engine = Engine(vl["model"], max_seq=512, threads=1)
    ids, vp = chat_prompt(engine, _chat(vl["images"][0], QUESTION))
    want = engine.generate(Prompt(ids, vp), SamplingOptions(max_tokens=8, ignore_eos=True))

    with Daemon(tmp_path / "k.sock", "--cache-dir", str(tmp_path / "cache"),
                model=str(vl["gen"].dir)) as d:
        cli = subprocess.run(
            [sys.executable, "-m", "kestrelctl.cli", "--socket", d.socket, "chat", "-m", QUESTION,
             "--image", str(image), "--max-tokens", "8", "--ignore-eos", "--stats"],
            cwd=REPO, env=daemon_env(), capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        with d.client() as c:
            first = c.chat(_chat(vl["images"][0], QUESTION), max_tokens=8, ignore_eos=True)
            again = c.chat(_chat(vl["images"][0], QUESTION), max_tokens=8, ignore_eos=True)
        log = d.log()
    assert first.ids == want.ids and again.ids == want.ids
    assert first.usage["images"] == 1 and first.usage["visual_tokens"] == vp.visual_tokens
    assert again.usage["cached_tokens"] >= vp.spans[0][1]       # past the image's tokens
    assert "[VISION]" in log
