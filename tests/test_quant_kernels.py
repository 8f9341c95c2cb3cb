"""The weight types the kernels compute on in place (Q8_0: pyx/ks_q8.h; Q4_0, Q4_1, Q5_0:
pyx/ks_q4.h), against gguf-py, an implementation independent of the project's:

- dequantized rows equal gguf.quants.dequantize exactly, on blocks from gguf-py's own
  quantizer and on random bytes with edge cases (fp16 zero / subnormal / negative / huge
  scales, extreme codes);
- the product matches float64 of gguf's dequantized weights times the dequantized activations
  (to 1e-5 of the sum of |terms|), and the SIMD paths equal the plain C twin bit for bit, on 1
  and 2 threads, decode and prefill tiles, odd shapes, VNNI on and off;
- a whole model (dense tied / untied, and MoE experts) held in a low-bit type gives the float64
  reference's logits on the same numbers, and a prompt in one chunk gives the same bits as
  token by token (the decode and prefill tiles agree through the forward pass).

A type joins by its entry in TYPES (and its fp16 scale fields in ggml_blocks.F16_FIELDS).
"""
from __future__ import annotations


import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from kestreld.kernels import K, ops
import modelgen
import modelgen_moe
import reference
import kquant_blocks
from ggml_blocks import F16_FIELDS, random_blocks
from kestreld.engine.generate import Engine
from kestreld.model.gguf_file import TENSOR_NAMES, GGUFFile
from kestreld.model.load import load_model
from metrics import assert_logits_agree, rel_rms_error
from test_kernels import assert_product_of_every_path, quantized_activations

O = ops()     # the per-op kernels (the test-only module kestreld._kernels_ops)

QK = 32
TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0)
TYPE_IDS = [t.name for t in TYPES]
LOW_BIT = (QT.Q4_0, QT.Q4_1, QT.Q5_0)     # the 4- and 5-bit types computed in place
LOW_BIT_IDS = [t.name for t in LOW_BIT]


def gguf_blocks(rng, qtype, m, k) -> np.ndarray:
    """(m, row bytes) uint8 from gguf-py's quantizer on random rows, a few of them special:
    all zero, constant, one large outlier."""
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 3.0, size=(m, 1))).astype(np.float32)
    x[0, :QK] = 0.0
    if m > 2:
        x[1] = 0.25
        x[2, 5] = 100.0
    return gguf.quants.quantize(x, qtype)


BLOCK_SOURCES = {"gguf-quantizer": gguf_blocks,
                 "random-bytes": lambda rng, qtype, m, k: random_blocks(rng, qtype, m, k, True)}


def test_every_type_the_kernels_compute_on_is_tested():
    """Here, or (the 256-value superblock types) in test_kquant_kernels.py."""
    assert {QT(t) for t in K.compute_types()} == set(TYPES) | set(kquant_blocks.K_TYPES)


@pytest.mark.arm64
@pytest.mark.parametrize("source", list(BLOCK_SOURCES))
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_dequantize_rows_equals_gguf(qtype, source):
    rng = np.random.default_rng(int(qtype) * 10 + len(source))
    m, k = 41, 256
    w = BLOCK_SOURCES[source](rng, qtype, m, k)
    want = gguf.quants.dequantize(w, qtype)
    ids = np.array([3, 0, m - 1, 3, 17, 1, 2], np.int32)
    out = np.full((len(ids), k), np.nan, np.float32)
    O.dequantize_rows(w, int(qtype), ids, out)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(out, want[ids])
    # the same bits, not only equal values (-0.0 stays -0.0)
    assert np.array_equal(out.view(np.uint32), want[ids].astype(np.float32).view(np.uint32))
    if K.interleaves(int(qtype)):                  # the rows read back from interleaved groups
        again = np.full_like(out, np.nan)
        O.dequantize_rows(K.interleave_rows(w, int(qtype), k), int(qtype), ids, again, True, m)
        assert np.array_equal(again.view(np.uint32), out.view(np.uint32))


def ref_matmul(w, qtype, xq, xd):
    """float64 of gguf's dequantized weights times the dequantized activations, and a bound on
    the magnitude of every float term the kernels add: sum over j of |x_j| (|w_j| + 2 |m|)
    (m: Q4_1's block offset, whose two terms d*q*x and m*x may cancel)."""
    m, k = w.shape[0], xq.shape[1]
    wf = gguf.quants.dequantize(w, qtype).astype(np.float64)
    x = (xq.reshape(len(xq), -1, QK) * xd.astype(np.float64)[:, :, None]).reshape(len(xq), k)
    offset = np.zeros_like(wf)
    if qtype == QT.Q4_1:
        size, at = GGML_QUANT_SIZES[qtype][1], F16_FIELDS[qtype][1]
        mins = w.reshape(m, -1, size)[:, :, at:at + 2].copy().view(np.float16)[:, :, 0]
        offset = np.repeat(np.abs(mins.astype(np.float64)), QK, axis=1)
    return x @ wf.T, np.abs(x) @ (np.abs(wf) + 2 * offset).T


@pytest.mark.arm64
@pytest.mark.parametrize("n,m,k", [(1, 1, 32), (1, 67, 2048), (1, 129, 256), (3, 33, 64),
                                   (3, 5, 1024), (67, 65, 512), (67, 9, 2048), (2, 130, 96),
                                   (33, 17, 160), (5, 45, 256), (11, 37, 128), (42, 19, 64)])
@pytest.mark.parametrize("source", list(BLOCK_SOURCES))
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_matmul_against_float64_and_plain_twin(qtype, source, n, m, k, vnni):
    rng = np.random.default_rng(n * 7 + m * 13 + k + int(qtype))
    w = BLOCK_SOURCES[source](rng, qtype, m, k)
    xq, xd = quantized_activations(rng, n, k)
    out = np.full((n, m), np.nan, np.float32)
    O.matmul(w, int(qtype), xq, xd, out, 2)
    want, mag = ref_matmul(w, qtype, xq, xd)
    assert_product_of_every_path(out, want, mag, w, qtype, xq, xd,
                                 f"{qtype.name} {source} n={n} m={m} k={k}, VNNI {vnni}")


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_matmul_checks_the_row_bytes_of_the_type(qtype):
    rng = np.random.default_rng(3)
    w = gguf_blocks(rng, qtype, 8, 64)
    xq, xd = quantized_activations(rng, 2, 64)
    out = np.empty((2, 8), np.float32)
    with pytest.raises(ValueError, match="bytes per row"):
        O.matmul(np.ascontiguousarray(w[:, :-1]), int(qtype), xq, xd, out, 1)
    with pytest.raises(ValueError, match="bytes per row"):
        O.dequantize_rows(np.ascontiguousarray(w[:, :-1]), int(qtype), np.zeros(1, np.int32),
                          np.empty((1, 64), np.float32))


# ---- whole models held in the type ------------------------------------------------------------

def held_numbers(weights, qtype):
    """The reference's weights: every matrix (not MoE routers) through gguf-py's quantizer and
    dequantizer of `qtype`, row by row (so Llama's Q/K row permutation in the file does not
    matter)."""
    return {name: (gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
                   if w.ndim == 2 and not name.endswith(reference.ROUTER_SUFFIX) else w)
            for name, w in weights.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Generated models written as Q8_0 and as each of LOW_BIT, by name (written on first use)."""
    root, made = tmp_path_factory.mktemp("lowbit_models"), {}
    kinds = ["q8_0"] + [t.name.lower() for t in LOW_BIT]

    def get(name):
        if name not in made:
            made[name] = (modelgen_moe.generate(name, root, kinds, hf=False)
                          if name in modelgen_moe.SPECS else modelgen.generate(name, root, kinds))
        return made[name]
    return get


def _engine(loaded, n, prefill_chunk):
    return Engine(loaded, max_seq=n + 16, threads=2, prefill_chunk=prefill_chunk, kv_bs=32,
                  prefix_kv=False, prefix_min=16)


@pytest.mark.parametrize("name", ["qwen3_tied", "llama", "qwen3moe_norm"])
@pytest.mark.parametrize("qtype", LOW_BIT, ids=LOW_BIT_IDS)
def test_model_in_the_type_matches_the_reference(models, qtype, name):
    m = models(name)
    loaded = load_model(str(m.gguf[qtype.name.lower()]))
    assert loaded.conversion is None                  # every matrix in place from the map
    kinds = {mat.qtype for mat in loaded.weights.matrices()}
    assert kinds == ({qtype, QT.F32} if loaded.config.moe_layers else {qtype})
    n = 200
    spec = m.spec.base if name in modelgen_moe.SPECS else m.spec
    ids = [int(i) for i in np.random.default_rng(1).integers(0, spec.vocab, n)]
    got = _engine(loaded, n, 256).forward_logits(ids, 0)
    assert got.shape == (n, spec.vocab) and np.isfinite(got).all()

    same = reference.forward(held_numbers(m.weights, qtype), m.config, ids, kv_int8=True,
                             act_q8=True)
    # the float weights' logits: transformers' fp32 within 1e-5 (tests/test_reference.py)
    exact = reference.forward(m.weights, m.config, ids)
    own, ours = rel_rms_error(same, exact), rel_rms_error(got, exact)
    print(f"{name} {qtype.name}: rel RMS {rel_rms_error(got, same):.4f} vs the float64 "
          f"reference on the same numbers; vs the float weights {ours:.4f}, the type's own "
          f"error {own:.4f}")
    assert_logits_agree(got, same, max_rel=0.015, min_agree=0.99, min_count=n // 2)
    assert ours <= own + 0.005         # Kestrel adds next to nothing to the type's own error

    # token by token (decode tiles) == one chunk (prefill tiles), bit for bit
    step = _engine(loaded, n, 1).forward_logits(ids[:40], 0)
    assert np.array_equal(step.view(np.uint32), got[:40].view(np.uint32))

    # the dense matrices interleaved (where the CPU has that product) or in the map: same bits
    in_map = load_model(str(m.gguf[qtype.name.lower()]), interleave=False)
    assert in_map.weights.interleaved_bytes() == {}
    assert bool(loaded.weights.interleaved_bytes()) == bool(K.interleaves(int(qtype)))
    flat = _engine(in_map, n, 256).forward_logits(ids, 0)
    assert np.array_equal(flat.view(np.uint32), got.view(np.uint32))
    # MoE experts: copied as they were chosen (where the CPU has the product), or in the map
    for L in (L for L in loaded.weights.layers if L.moe):
        for m in (L.moe.gate, L.moe.up, L.moe.down):
            copied = m.copies is not None and m.copies.made().any()
            assert copied == bool(K.interleaves(int(qtype)))


@pytest.mark.arm64
def test_every_type_is_interleaved_as_wide_as_the_tiles(vnni):
    """Groups of 16 rows for the AVX512-VNNI tiles, 8 for the AVX2 ones (Q8_0: none, its AVX2
    tiles keep rows), 4 for NEON's with sdot, none on other CPUs (ks_interleave.h)."""
    every = set(TYPES) | set(kquant_blocks.K_TYPES)
    group = 16 if vnni else {"avx2": 8, "neon-dotprod": 4}.get(K.simd_path(), 0)
    assert {t: K.interleaves(int(t)) for t in every} == \
        {t: 0 if t == QT.Q8_0 and group == 8 else group for t in every}


@pytest.mark.parametrize("qtype", LOW_BIT, ids=LOW_BIT_IDS)
def test_loader_keeps_the_type_in_place(models, qtype):
    path = models("qwen3_untied").gguf[qtype.name.lower()]
    f = GGUFFile(str(path))
    name = TENSOR_NAMES["wq"].format(i=0)
    mat = f.matrix_of(name, f.shape(name))
    mapped = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    assert mat.qtype == qtype
    assert np.array_equal(mat.data.reshape(-1), np.asarray(mapped.data).reshape(-1))
    base = mat.data                                   # a view of the file's map, not a copy
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap) and base.filename == str(path)
