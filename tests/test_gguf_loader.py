"""GGUF loading: the real SmolLM2 Q4_1 file, generated Qwen3/Llama files, malformed files."""
import os
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants as gq

from kestreld.kernels import K
from kestreld.model.gguf_file import open_gguf
from kestreld.model.load import load_model
from kestreld.model.quant import dequantize_q8_0
from kestreld.errors import ModelLoadError
from _loader_models import Spec, random_weights, smollm2_gguf, write_gguf


@pytest.fixture(scope="module")
def smollm2():
    return load_model(smollm2_gguf(), interleave=False)


def test_smollm2_hyperparameters(smollm2):
    c = smollm2.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.ffn, c.vocab, c.context_length) == (64, 1536, 49152, 8192)
    assert c.tied_embeddings and smollm2.weights.output is smollm2.weights.tok_embd
    assert not c.qk_norm and not c.rope_neox          # llama GGUF: permuted Q/K rows
    assert c.rope_theta == 100000.0 and c.norm_eps == pytest.approx(1e-5)
    assert c.n_params == 134_515_008                  # SmolLM2-135M
    assert (smollm2.source_format, smollm2.source_dtype) == ("gguf", "q4_1")
    assert smollm2.chat_template.startswith("{% for message in messages %}")
    assert len(smollm2.weights.layers) == 30 and smollm2.weights.layers[0].q_norm is None


def test_smollm2_weights_match_the_file(smollm2):
    reader = smollm2.keepalive[0]
    tensors = {t.name: t for t in reader.tensors}
    # token_embd is Q8_0 in this file: used in place, no copy
    embd = smollm2.weights.tok_embd
    assert embd.data.shape == (49152, 576 // 32 * 34)
    assert np.shares_memory(embd.data, reader.data) and not embd.data.flags.owndata
    # Q4_1 matrices are computed on in place too: the file's bytes, no conversion
    t = tensors["blk.7.ffn_down.weight"]
    got = smollm2.weights.layers[7].w_down
    assert (got.rows, got.cols, got.qtype) == (576, 1536, T.Q4_1)
    assert np.shares_memory(got.data, reader.data) and not got.data.flags.owndata
    np.testing.assert_array_equal(got.data, np.asarray(t.data))
    assert smollm2.conversion is None and smollm2.weights.type_shares()["q4_1"] > 0.5
    np.testing.assert_array_equal(smollm2.weights.layers[3].ffn_norm,
                                  tensors["blk.3.ffn_norm.weight"].data)
    assert smollm2.weights.out_norm.dtype == np.float32


def test_smollm2_matrices_interleaved_where_the_cpu_has_the_product(smollm2):
    """By default the loader copies matrices into interleaved groups where the CPU has that
    product (Q4_1 on x86 and on aarch64 with sdot; the tied Q8_0 embedding, which is the
    output matrix, on AVX512-VNNI and aarch64 with sdot): the same rows, interleaved, and the
    same embedding rows read from them."""
    il = load_model(smollm2_gguf())
    dense = [m for L in smollm2.weights.layers for m in (L.wq, L.wk, L.wv, L.wo, L.w_gate,
                                                         L.w_up, L.w_down) if m.qtype == T.Q4_1]
    embd = smollm2.weights.tok_embd
    want = {}
    if K.interleaves(int(T.Q4_1)):
        want["q4_1"] = sum(m.data.nbytes for m in dense)
        got = il.weights.layers[7].w_down
        assert got.interleaved and got.data.ctypes.data % 64 == 0
        np.testing.assert_array_equal(got.data, K.interleave_rows(
            smollm2.weights.layers[7].w_down.data, int(T.Q4_1), 1536))
    if K.interleaves(int(T.Q8_0)):
        want["q8_0"] = embd.data.nbytes                 # 49152 rows: whole groups
    assert il.weights.interleaved_bytes() == want
    assert il.weights.output is il.weights.tok_embd
    assert il.weights.tok_embd.interleaved == ("q8_0" in want)
    assert il.weights.type_shares() == smollm2.weights.type_shares()


def test_interleaved_copies_lie_in_one_buffer_in_the_order_a_pass_reads_them(smollm2):
    """The loader puts every interleaved copy in one buffer aligned to a 2 MiB huge page,
    layer by layer in the order a pass reads the matrices, each start 64-byte aligned right
    after the one before: decode streams them as one run of huge pages."""
    il = load_model(smollm2_gguf()).weights
    order = [m for L in il.layers for m in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)]
    order.append(il.output)
    copies = [m for m in order if m.interleaved]
    if not copies:
        pytest.skip("no matrix of this file is interleaved on this CPU")
    assert copies[0].data.ctypes.data % (2 << 20) == 0
    for a, b in zip(copies, copies[1:]):
        assert b.data.ctypes.data == a.data.ctypes.data + -(-a.data.nbytes // 64) * 64


def test_metadata_parse_equals_gguf_reader():
    """Our fast metadata parse (one field per array) gives GGUFReader's values, key order,
    tensors and data offset on the real file."""
    path = smollm2_gguf()
    ours, ref = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    tokens, types = ours.fields["tokenizer.ggml.tokens"], ours.fields["tokenizer.ggml.token_type"]
    assert len(tokens.contents()) == 49152
    assert tokens.contents(300) == ref.fields["tokenizer.ggml.tokens"].contents(300)
    assert tokens.contents(slice(5, 9)) == ref.fields["tokenizer.ggml.tokens"].contents(slice(5, 9))
    assert types.contents(0) == ref.fields["tokenizer.ggml.token_type"].contents(0)
    assert ours.data_offset == ref.data_offset
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors]


def _load(tmp_path, spec, weights=None, interleave=True, **kw):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, spec, random_weights(spec) if weights is None else weights, **kw)
    return path, load_model(path, interleave=interleave)


def test_qwen3_q8_0_in_place(tmp_path):
    spec = Spec()                                     # head_dim 32 != 64/4, untied
    w = random_weights(spec)
    path, m = _load(tmp_path, spec, w, interleave=False)   # the interleaved copy: below
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn) == \
        ("qwen3", 2, 64, 4, 2, 32, 96)
    assert (c.vocab, c.rope_theta, c.norm_eps, c.context_length) == (288, 1e6, pytest.approx(1e-6), 4096)
    assert c.qk_norm and c.rope_neox and not c.tied_embeddings
    assert c.n_params == sum(a.size for a in w.values())
    assert m.source_dtype == "q8_0" and m.chat_template.startswith("{% for m in messages %}")
    mm = m.keepalive[0].data
    layer = m.weights.layers[1]
    for q8 in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down,
               m.weights.tok_embd, m.weights.output):
        assert np.shares_memory(q8.data, mm) and not q8.data.flags.owndata
    assert (layer.wq.rows, layer.wq.cols, layer.wo.rows, layer.wo.cols) == (128, 64, 64, 128)
    np.testing.assert_array_equal(layer.wk.data,
                                  gq.quantize(w["model.layers.1.self_attn.k_proj.weight"], T.Q8_0))
    np.testing.assert_array_equal(m.weights.output.data, gq.quantize(w["lm_head.weight"], T.Q8_0))
    np.testing.assert_array_equal(layer.q_norm, w["model.layers.1.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(layer.k_norm, w["model.layers.1.self_attn.k_norm.weight"])
    # by default the dense matrices are interleaved where the CPU has that product; the
    # embedding stays in the map
    il = load_model(path)
    group = K.interleaves(int(T.Q8_0))
    assert il.weights.layers[1].wq.group_rows == group and il.weights.output.group_rows == group
    assert np.shares_memory(il.weights.tok_embd.data, il.keepalive[0].data)
    assert il.weights.interleaved_bytes() == ({"q8_0": sum(x.data.nbytes for x in (
        *(getattr(L, f) for L in m.weights.layers for f in ("wq", "wk", "wv", "wo", "w_gate",
                                                           "w_up", "w_down")),
        m.weights.output))} if group else {})


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q5_1], ids=lambda q: q.name)
def test_llama_converted_types_and_defaults(tmp_path, qtype):
    spec = Spec(arch="llama", hidden=128, head_dim=32, tied=True)   # head_dim = hidden / heads
    w = random_weights(spec)
    path, m = _load(tmp_path, spec, w, interleave=False, qtype=qtype, minimal_meta=True)
    c = m.config
    assert c.head_dim == 32 and c.rope_theta == 10000.0 and c.norm_eps == pytest.approx(1e-5)
    assert c.tied_embeddings and m.weights.output is m.weights.tok_embd
    assert not c.rope_neox and not c.qk_norm and m.source_dtype == qtype.name.lower()
    src = w["model.layers.0.mlp.down_proj.weight"]
    stored = src.astype(np.float16) if qtype == T.F16 else src if qtype == T.F32 else gq.quantize(src, qtype)
    want = gq.quantize(gq.dequantize(stored, qtype), T.Q8_0)
    np.testing.assert_array_equal(m.weights.layers[0].w_down.data, want)
    assert np.abs(dequantize_q8_0(m.weights.layers[0].w_down.data) - src).max() < 0.03


# ---- malformed files ------------------------------------------------------------------

def _fails(path, *words):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert str(path) in msg
    for word in words:
        assert word in msg, msg
    # no chained traceback of gguf/numpy/json internals
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)
    return msg


def _good_file(tmp_path, **kw):
    spec = kw.pop("spec", Spec())
    path = tmp_path / "m.gguf"
    write_gguf(str(path), spec, kw.pop("weights", None) or random_weights(spec), **kw)
    return path


def test_missing_file(tmp_path):
    _fails(tmp_path / "nope.gguf", "no such file")


def test_truncated_file(tmp_path):
    path = _good_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    _fails(path, "truncated")
    path.write_bytes(data[:12])
    _fails(path, "truncated")
    path.write_bytes(data[:3000])                     # inside the metadata
    _fails(path, "truncated")


def test_bad_magic(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    _fails(path, "bad magic", "not a GGUF file")
    path.write_text("hello, not a model at all\n")
    _fails(path, "bad magic")


def test_unsupported_version(tmp_path):
    path = _good_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 7)
    path.write_bytes(bytes(data))
    _fails(path, "unsupported GGUF version 7", "2, 3")


def test_unsupported_architecture(tmp_path):
    path = _good_file(tmp_path, arch="gemma2")
    _fails(path, "unsupported architecture 'gemma2'", "llama, qwen3")


def test_missing_tensor(tmp_path):
    path = _good_file(tmp_path, skip=("blk.1.ffn_up.weight",))
    _fails(path, "missing tensor blk.1.ffn_up.weight")


def test_wrong_shape(tmp_path):
    weights = random_weights(Spec(ffn=96))
    path = _good_file(tmp_path, spec=Spec(ffn=128), weights=weights)  # metadata says 128
    _fails(path, "wrong shape for tensor blk.0.ffn_gate.weight", "got (96, 64)", "want (128, 64)")


def test_unsupported_tensor_type(tmp_path):
    path = _good_file(tmp_path, types={"blk.0.attn_v.weight": T.MXFP4})
    _fails(path, "tensor blk.0.attn_v.weight", "unsupported type MXFP4", "Q8_0", "Q6_K", "IQ4_XS")


@pytest.mark.parametrize("qtype", [T.Q5_1], ids=lambda q: q.name)
def test_more_types_are_converted(tmp_path, qtype):
    """A type the kernels do not compute on (Q5_1) in a file of computed types loads,
    converted to Q8_0 from gguf-py's own dequantization; the rest stays in place."""
    spec = Spec()
    w = random_weights(spec)
    path = _good_file(tmp_path, spec=spec, weights=w, types={"blk.0.attn_v.weight": qtype})
    m = load_model(str(path), interleave=False)      # the rows, not their interleaved copy
    src = gq.quantize(w["model.layers.0.self_attn.v_proj.weight"], qtype)
    np.testing.assert_array_equal(m.weights.layers[0].wv.data,
                                  gq.quantize(gq.dequantize(src, qtype), T.Q8_0))
    assert m.conversion == "converted to q8_0 in memory at load"
    assert m.weights.layers[0].wq.qtype == T.Q8_0 and not m.weights.layers[0].wq.data.flags.owndata


def test_unsupported_tokenizer_pre(tmp_path):
    path = _good_file(tmp_path, pre="no-such-pre")
    _fails(path, "unsupported pre-tokenizer 'no-such-pre'", "qwen2", "smollm")


def test_reader_is_kept_alive(tmp_path):
    path = _good_file(tmp_path)
    m = load_model(str(path))
    assert any(isinstance(k, GGUFReader) for k in m.keepalive)
    assert os.path.samefile(m.keepalive[0].data.filename, path)


def _mapped_rss_kb(path: str) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:        # a mapping's first line
                ours = head[-1] == os.path.realpath(path)
            elif ours and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_released_pages_of_a_map_leave_memory_and_keep_their_bytes(tmp_path):
    from kestreld.model.load import _release_mapped
    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 256, 1 << 22, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, mode="r")
    view = np.asarray(mapped)[4096 * 3 + 100:]        # the loader's views: not page-aligned
    assert int(view.sum(dtype=np.int64)) == int(data[4096 * 3 + 100:].sum(dtype=np.int64))
    before = _mapped_rss_kb(str(path))
    _release_mapped(view)
    after = _mapped_rss_kb(str(path))
    assert before >= 4000 and after <= before - 4000 + 8, (before, after)
    assert np.array_equal(view, data[4096 * 3 + 100:])   # read back from the file
    anon = data.copy()
    _release_mapped(anon)                                  # anonymous memory: left alone
    assert np.array_equal(anon, data)
