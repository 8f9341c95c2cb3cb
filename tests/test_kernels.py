"""The compiled kernels (the build kestreld.kernels chose for this CPU) against plain numpy
references.

Integer results (quantization, the int8 KV, embedding rows) must match exactly (the weight x
activation product of each weight type: test_quant_kernels.py); float kernels match float64 references within a tolerance and print their
largest difference. Every kernel also gives the same bits with 1 and 2 threads.
"""
import hashlib
import platform
import struct

import numpy as np
import pytest

from kestreld import kernels
from kestreld.kernels import K, ops   # build first: KESTREL_TEST_KERNELS=1 python setup.py ...

O = ops()     # the per-op kernels (the test-only module kestreld._kernels_ops)

pytestmark = pytest.mark.arm64

QK = 32
Q8_0 = 8      # GGML type ids


# ---- references ---------------------------------------------------------------------------

def round_half_away(v):
    """C roundf on float32, exactly: v - trunc(v) is exact in float32."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0)).astype(v.dtype)


def ref_quantize_q8_0(x):
    """llama.cpp quantize_row_q8_0_ref, float32 scales: (q int8 (n, k), d f32 (n, k/32))."""
    n, k = x.shape
    xb = x.reshape(n, k // QK, QK)
    d = np.abs(xb).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = round_half_away(xb * inv[:, :, None])
    return q.astype(np.int8).reshape(n, k), d.astype(np.float32)


def make_q8_weights(rng, m, k, special_scales=False, scale=0.01):
    """Random GGUF Q8_0 rows: (bytes (m, k/32*34), q int8 (m, k), d f32 (m, k/32)), block
    scales in scale * [0.5, 2). q covers the full int8 range, -128 included; special_scales
    adds fp16 subnormals and 0."""
    nb = k // QK
    q = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
    d16 = (rng.uniform(0.5, 2.0, size=(m, nb)) * scale).astype(np.float16)
    if special_scales:
        flat = d16.reshape(-1)
        flat[::7] = np.float16(3e-6)       # subnormal in fp16
        flat[1::11] = np.float16(0)
        flat[2::13] = np.float16(-0.02)
    blocks = np.empty((m, nb, 2 + QK), np.uint8)
    blocks[:, :, :2] = d16.view(np.uint8).reshape(m, nb, 2)
    blocks[:, :, 2:] = q.view(np.uint8).reshape(m, nb, QK)
    return blocks.reshape(m, nb * (2 + QK)), q, d16.astype(np.float32)


def ref_matmul_q8_0(wq, wd, xq, xd):
    """float64 of the same Q8_0 numbers, and the sum of |terms| (the scale of rounding error)."""
    m, k = wq.shape
    n = xq.shape[0]
    isum = np.einsum("rbj,tbj->trb", wq.reshape(m, -1, QK).astype(np.int64),
                     xq.reshape(n, -1, QK).astype(np.int64))
    terms = isum * (wd.astype(np.float64)[None, :, :] * xd.astype(np.float64)[:, None, :])
    return terms.sum(axis=2), np.abs(terms).sum(axis=2)


def ref_rmsnorm(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * w


def rope_tables(max_pos, hd, base=10000.0):
    inv = base ** (-np.arange(0, hd // 2, dtype=np.float64) * 2 / hd)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def ref_rope(x, cos_t, sin_t, pos0, neox):
    n, _, hd = x.shape
    c = cos_t[pos0:pos0 + n].astype(np.float64)[:, None, :]
    s = sin_t[pos0:pos0 + n].astype(np.float64)[:, None, :]
    x64 = x.astype(np.float64)
    if neox:
        x0, x1 = x64[..., :hd // 2], x64[..., hd // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    x0, x1 = x64[..., 0::2], x64[..., 1::2]
    out = np.empty_like(x64)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def ref_kv_quantize(x):
    """x (..., hd) -> (q int8, s f32): s = absmax/127, q = roundf(x / s)."""
    s = np.abs(x).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s[..., None] != 0, round_half_away(x / s[..., None]), 0)
    return q.astype(np.int8), s.astype(np.float32)


def ref_query_quantize(x):
    """x (..., hd) float32 -> the value the attention's scores use, float64: codes hi as a
    key's (ref_kv_quantize, scale s) and the rest lo = roundf((x / s - hi) * 254), so
    x = s * (hi + lo / 254) to 15 bits."""
    hi, s = ref_kv_quantize(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s[..., None] != 0, x / s[..., None], np.float32(0)).astype(np.float32)
    lo = round_half_away((v - hi) * np.float32(254))
    return (hi.astype(np.float64) * 254 + lo) * (s[..., None].astype(np.float64) / 254)


def ref_attention(q, kq, ks, vq, vs, pos0, scale):
    """float64 causal GQA softmax attention over the dequantized int8 KV, each query times
    the scale as the kernels' integer scores take it (ref_query_quantize)."""
    n, n_heads, hd = q.shape
    n_kv = kq.shape[0]
    group = n_heads // n_kv
    k = kq.astype(np.float64) * ks[:, :, None]
    v = vq.astype(np.float64) * vs[:, :, None]
    qx = ref_query_quantize(q * np.float32(scale))
    out = np.empty((n, n_heads, hd))
    for t in range(n):
        ctx = pos0 + t + 1
        for h in range(n_heads):
            g = h // group
            s = k[g, :ctx] @ qx[t, h]
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[g, :ctx]
    return out


def report(name, got, want):
    diff = np.abs(got.astype(np.float64) - want).max()
    rel = diff / max(np.abs(want).max(), 1e-30)
    print(f"{name}: max |diff| {diff:.3e}, relative to max |ref| {rel:.3e}")
    return rel


def hwcap_from_auxv() -> int:
    """AT_HWCAP read from /proc/self/auxv (pairs of native unsigned longs), not as kernels.py
    reads it."""
    with open("/proc/self/auxv", "rb") as f:
        data = f.read()
    pairs = struct.iter_unpack("@LL", data[: len(data) // 16 * 16])
    return next(value for key, value in pairs if key == kernels.AT_HWCAP)


def test_the_build_for_this_cpu_is_loaded_and_takes_its_simd_path():
    # the bit-identity tests below only mean something if the SIMD path is the one compiled in
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        dotprod = bool(hwcap_from_auxv() & kernels.HWCAP_ASIMDDP)
        assert kernels.cpu_has_dotprod() == dotprod
        expected = ("kestreld._kernels", "neon-dotprod") if dotprod else \
            ("kestreld._kernels_armv8", "neon")
    elif machine in ("x86_64", "amd64"):
        expected = ("kestreld._kernels", "avx2")
    else:
        expected = ("kestreld._kernels", "plain")
    assert (K.__name__, K.simd_path()) == expected
    assert (O.__name__, O.simd_path()) == (expected[0].replace("_kernels", "_kernels_ops"),
                                           expected[1])
    kernels.require()


# ---- quantization ------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 32), (3, 96), (67, 2048)])
def test_quantize_q8_0_matches_reference_exactly(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    x = (rng.standard_normal((n, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    x[0, :QK] = 0.0                                   # all-zero block: d = 0, q = 0
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, k // QK), np.float32)
    O.quantize_q8_0(x, xq, xd, 2)
    q_ref, d_ref = ref_quantize_q8_0(x)
    np.testing.assert_array_equal(xq, q_ref)
    np.testing.assert_array_equal(xd, d_ref)
    assert xd[0, 0] == 0 and not xq[0, :QK].any()


def test_quantize_q8_0_rounds_halves_away_from_zero():
    # amax 127 gives d = 1 and 1/d = 1 exactly, so x * (1/d) hits the .5 ties
    x = np.zeros((1, QK), np.float32)
    x[0, :6] = [127.0, 2.5, -2.5, 0.5, -0.5, 3.5]
    xq = np.empty((1, QK), np.int8)
    xd = np.empty((1, 1), np.float32)
    O.quantize_q8_0(x, xq, xd, 1)
    assert xd[0, 0] == 1.0
    assert xq[0, :6].tolist() == [127, 3, -3, 1, -1, 4]


# ---- the Q8_0 product (each type's against gguf-py: test_quant_kernels.py) ---------------

def quantized_activations(rng, n, k):
    x = rng.standard_normal((n, k)).astype(np.float32)
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, k // QK), np.float32)
    O.quantize_q8_0(x, xq, xd, 1)
    return xq, xd


def assert_product_of_every_path(out, want, mag, w, qtype, xq, xd, label: str) -> None:
    """A weight type's product `out` (2 threads) within 1e-5 of sum|terms| of the float64
    `want`, and bit for bit what the plain C twin and one thread give."""
    n, m = out.shape
    err = np.abs(out - want)
    print(f"{label} [{K.simd_path()}]: max |diff| {err.max():.3e}, max |diff|/sum|terms| "
          f"{(err / np.maximum(mag, 1e-30)).max():.3e}")
    assert np.all(err <= 1e-5 * mag + 1e-30)
    plain = np.full((n, m), np.nan, np.float32)
    O.matmul_plain(w, int(qtype), xq, xd, plain, 1)
    assert np.array_equal(out.view(np.uint32), plain.view(np.uint32)), \
        f"SIMD ({K.simd_path()}) and plain differ in {np.sum(out != plain)} places"
    one = np.full((n, m), np.nan, np.float32)
    O.matmul(w, int(qtype), xq, xd, one, 1)
    assert np.array_equal(out.view(np.uint32), one.view(np.uint32))
    group = K.interleaves(int(qtype))
    if group:                                          # the same rows interleaved, both paths
        il = K.interleave_rows(w, int(qtype), xq.shape[1])
        assert il.shape == (-(-m // group) * group, w.shape[1]) and il.ctypes.data % 64 == 0
        for product in (O.matmul, O.matmul_plain):
            got = np.full((n, m), np.nan, np.float32)
            product(il, int(qtype), xq, xd, got, 2, True)
            assert np.array_equal(out.view(np.uint32), got.view(np.uint32)), product.__name__


def test_matmul_reads_read_only_weights_and_rejects_bad_shapes():
    rng = np.random.default_rng(5)
    w, wq, wd = make_q8_weights(rng, 8, 64)
    w.setflags(write=False)                            # like a memory-mapped GGUF
    xq, xd = quantized_activations(rng, 2, 64)
    out = np.empty((2, 8), np.float32)
    O.matmul(w, Q8_0, xq, xd, out, 1)
    np.testing.assert_allclose(out, ref_matmul_q8_0(wq, wd, xq, xd)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="out must be"):
        O.matmul(w, Q8_0, xq, xd, np.empty((2, 7), np.float32), 1)
    with pytest.raises(ValueError, match="bytes per row"):
        O.matmul(np.ascontiguousarray(w[:, :-34]), Q8_0, xq, xd, out, 1)
    with pytest.raises(ValueError, match="xd must be"):
        O.matmul(w, Q8_0, xq, xd[:1], out, 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        O.matmul_plain(np.ascontiguousarray(w[:, :50]), Q8_0, np.ascontiguousarray(xq[:, :48]),
                            xd, out, 1)
    with pytest.raises(ValueError, match="nthreads"):
        O.matmul(w, Q8_0, xq, xd, out, 0)
    with pytest.raises(ValueError, match="weight type"):
        O.matmul(w, 1, xq, xd, out, 1)          # F16: converted at load, never computed on


def test_dequantize_rows_is_an_exact_embedding_lookup():
    rng = np.random.default_rng(11)
    w, wq, wd = make_q8_weights(rng, 50, 96, special_scales=True)
    ids = np.array([3, 0, 49, 3, 17], np.int32)
    out = np.empty((5, 96), np.float32)
    O.dequantize_rows(w, Q8_0, ids, out)
    want = (np.repeat(wd, QK, axis=1) * wq.astype(np.float32))[ids]
    np.testing.assert_array_equal(out, want)
    for bad in (50, -1):
        with pytest.raises(ValueError, match="outside"):
            O.dequantize_rows(w, Q8_0, np.array([1, bad], np.int32), np.empty((2, 96), np.float32))
    with pytest.raises(ValueError, match="one per id"):
        O.dequantize_rows(w, Q8_0, ids, np.empty((4, 96), np.float32))


def test_dequantize_rows_rejects_the_padding_of_an_interleaved_copy():
    """50 rows fill no whole group of 16, 8 or 4: the interleaved copy's last group ends in
    padding rows, which are no rows of the matrix; its real rows read back as w's."""
    if not K.interleaves(Q8_0):
        pytest.skip("Q8_0 is not interleaved on this CPU")
    rng = np.random.default_rng(12)
    w, _, _ = make_q8_weights(rng, 50, 96)
    il = K.interleave_rows(w, Q8_0, 96)
    assert il.shape[0] > 50
    ids = np.array([49, 0, 33, 48], np.int32)
    want, got = np.empty((len(ids), 96), np.float32), np.full((len(ids), 96), np.nan, np.float32)
    O.dequantize_rows(w, Q8_0, ids, want)
    O.dequantize_rows(il, Q8_0, ids, got, True, 50)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    for bad in range(50, il.shape[0] + 1):     # every padding row, then the first past them
        with pytest.raises(ValueError, match=r"outside \[0, 50\)"):
            O.dequantize_rows(il, Q8_0, np.array([1, bad], np.int32),
                              np.empty((2, 96), np.float32), True, 50)
    with pytest.raises(ValueError, match="needs rows"):
        O.dequantize_rows(il, Q8_0, ids, got, True)
    for data, interleaved in ((w, False), (il, True)):
        with pytest.raises(ValueError, match="rows must be"):
            O.dequantize_rows(data, Q8_0, ids, got, interleaved, 40)


def test_interleave_rows_into_a_given_buffer():
    """out: the copy lands in the caller's buffer (the loader's one buffer for all of them),
    byte for byte the copy interleave_rows makes on its own; a buffer of another shape or
    type, or not 64-byte aligned, is refused and left as it was."""
    if not K.interleaves(Q8_0):
        pytest.skip("Q8_0 is not interleaved on this CPU")
    rng = np.random.default_rng(13)
    w, _, _ = make_q8_weights(rng, 50, 96)
    want = K.interleave_rows(w, Q8_0, 96)
    raw = np.zeros(want.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + want.nbytes].reshape(want.shape)
    assert K.interleave_rows(w, Q8_0, 96, out) is out
    np.testing.assert_array_equal(out, want)
    before = raw.copy()
    for bad in (raw[start + 1:start + 1 + want.nbytes].reshape(want.shape),      # misaligned
                raw[start:start + want.nbytes - want.shape[1]].reshape(-1, want.shape[1]),
                np.zeros(want.shape, np.int8)):
        with pytest.raises(ValueError, match="out must be"):
            K.interleave_rows(w, Q8_0, 96, bad)
    np.testing.assert_array_equal(raw, before)


# ---- float kernels ----------------------------------------------------------------------------

@pytest.mark.parametrize("n,d", [(1, 2048), (67, 576), (3 * 16, 128), (5, 13)])
def test_rmsnorm(n, d):
    rng = np.random.default_rng(n + d)
    x = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    out = np.empty_like(x)
    O.rmsnorm(x, w, 1e-6, out, 2)
    want = ref_rmsnorm(x, w, 1e-6)
    assert report(f"rmsnorm ({n}, {d})", out, want) < 2e-6
    inplace = x.copy()
    O.rmsnorm(inplace, w, 1e-6, inplace, 1)          # out aliases x
    np.testing.assert_array_equal(inplace, out)
    with pytest.raises(ValueError, match="w must have"):
        O.rmsnorm(x, w[:-1], 1e-6, out, 1)


@pytest.mark.parametrize("neox", [True, False])
def test_rope(neox):
    rng = np.random.default_rng(int(neox))
    n, heads, hd, pos0 = 7, 3, 64, 40
    cos_t, sin_t = rope_tables(64, hd, base=1e6)
    x = rng.standard_normal((n, heads, hd)).astype(np.float32)
    want = ref_rope(x, cos_t, sin_t, pos0, neox)
    got = x.copy()
    O.rope(got, cos_t, sin_t, pos0, neox, 2)
    assert report(f"rope neox={neox}", got, want) < 1e-6
    one = x.copy()
    O.rope(one, cos_t, sin_t, pos0, neox, 1)
    np.testing.assert_array_equal(got, one)
    with pytest.raises(ValueError, match="outside the tables"):
        O.rope(x, cos_t, sin_t, 60, neox, 1)
    with pytest.raises(ValueError, match="cos_t and sin_t"):
        O.rope(x, np.ascontiguousarray(cos_t[:, :8]), sin_t, 0, neox, 1)


def test_swiglu():
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal((3, 5000)) * 4).astype(np.float32)
    gate[0, :4] = [-100.0, 100.0, 0.0, -90.0]         # saturated sigmoid both ways
    up = rng.standard_normal((3, 5000)).astype(np.float32)
    out = np.empty_like(gate)
    O.swiglu(gate, up, out, 2)
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    assert report("swiglu", out, want) < 1e-6
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)
    inplace = gate.copy()
    O.swiglu(inplace, up, inplace, 1)                 # out aliases gate
    np.testing.assert_array_equal(inplace, out)
    with pytest.raises(ValueError, match="must all be"):
        O.swiglu(gate, up[:2], out, 1)


# ---- KV store and attention -------------------------------------------------------------------

def empty_kv_layer(rng, n_kv, max_seq, hd):
    """A layer of the arena as a previous request left it: stale bytes and NaN scales, so a
    kernel that reads a position it must not read shows it."""
    kq = rng.integers(-127, 128, size=(n_kv, max_seq, hd), dtype=np.int8)
    vq = rng.integers(-127, 128, size=(n_kv, max_seq, hd), dtype=np.int8)
    ks = np.full((n_kv, max_seq), np.nan, np.float32)
    vs = np.full((n_kv, max_seq), np.nan, np.float32)
    return kq, ks, vq, vs


def test_kv_store_quantizes_each_token_and_head_exactly():
    rng = np.random.default_rng(21)
    n, n_kv, hd, max_seq, pos0 = 5, 3, 64, 16, 9
    k = (rng.standard_normal((n, n_kv, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    k[2, 1] = 0.0                                     # zero row: scale 0, all q 0
    kq, ks, vq, vs = empty_kv_layer(rng, n_kv, max_seq, hd)
    before = kq.copy()
    O.kv_store(k, v, kq, ks, vq, vs, pos0, 2)
    for x, xq, xs in ((k, kq, ks), (v, vq, vs)):
        q_ref, s_ref = ref_kv_quantize(x)             # (n, n_kv, hd), (n, n_kv)
        np.testing.assert_array_equal(xq[:, pos0:pos0 + n], q_ref.transpose(1, 0, 2))
        np.testing.assert_array_equal(xs[:, pos0:pos0 + n], s_ref.T)
        assert np.isnan(xs[:, :pos0]).all() and np.isnan(xs[:, pos0 + n:]).all()
    np.testing.assert_array_equal(kq[:, :pos0], before[:, :pos0])
    assert ks[1, pos0 + 2] == 0 and not kq[1, pos0 + 2].any()
    with pytest.raises(ValueError, match="do not fit max_seq=16"):
        O.kv_store(k, v, kq, ks, vq, vs, 12, 1)
    with pytest.raises(ValueError, match="v must be"):
        O.kv_store(k, np.ascontiguousarray(v[:, :2]), kq, ks, vq, vs, 0, 1)


def store_prompt(rng, n_tokens, n_kv, hd, max_seq):
    kq, ks, vq, vs = empty_kv_layer(rng, n_kv, max_seq, hd)
    k = (rng.standard_normal((n_tokens, n_kv, hd)) * 1.5).astype(np.float32)
    v = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    O.kv_store(k, v, kq, ks, vq, vs, 0, 2)
    return kq, ks, vq, vs


def run_attention(q, kv, pos0, kv_bs, nthreads):
    out = np.full(q.shape, np.nan, np.float32)
    O.attention(q, *kv, pos0, 1.0 / np.sqrt(q.shape[2]), kv_bs, out, nthreads)
    return out


@pytest.mark.parametrize("n,pos0,n_heads,n_kv,hd,kv_bs", [
    (1, 0, 4, 2, 64, 32),          # first token
    (1, 700, 6, 2, 64, 32),        # decode, 701 keys: several key splits
    (1, 4999, 2, 1, 16, 64),       # decode, 5000 keys: the maximum of 16 splits
    (67, 0, 6, 2, 64, 32),         # prefill, GQA 3:1
    (20, 90, 4, 4, 128, 16),       # chunk after a prefix, no GQA, small blocks
    (3, 37, 9, 3, 64, 128),        # SmolLM2 shape, block longer than the context
])
def test_attention_against_float64(n, pos0, n_heads, n_kv, hd, kv_bs):
    rng = np.random.default_rng(n + pos0 + hd)
    max_seq = pos0 + n + 5
    kv = store_prompt(rng, pos0 + n, n_kv, hd, max_seq)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    out = run_attention(q, kv, pos0, kv_bs, 2)
    want = ref_attention(q, *kv, pos0, 1.0 / np.sqrt(hd))
    assert report(f"attention n={n} pos0={pos0} heads={n_heads}/{n_kv} hd={hd} kv_bs={kv_bs}",
                  out, want) < 2e-5
    np.testing.assert_array_equal(out, run_attention(q, kv, pos0, kv_bs, 1))
    np.testing.assert_array_equal(out, run_attention(q, kv, pos0, kv_bs, 3))


@pytest.mark.arm64
def test_attention_chunked_prefill_and_decode_equal_one_full_prefill():
    """A query's keys go in 256-key segments from key 0, folded in order, however its tokens
    came: prefill chunks of any size, short passes (split by segment, as decode) and decode
    steps give one full prefill's bits, past the segment boundaries at 256, 512 and 1,024
    keys."""
    rng = np.random.default_rng(8)
    n_heads, n_kv, hd, total = 4, 2, 64, 1100
    kv = store_prompt(rng, total, n_kv, hd, total + 10)
    q = rng.standard_normal((total, n_heads, hd)).astype(np.float32)
    full = run_attention(q, kv, 0, 32, 2)
    pieces, pos = [], 0
    for size in (40, 33, 1, 70, 1, 1, 4, 150, 1, 255, 1, 2, 8, 192, 1, 1, 300, 1, 1, 1, 5, 31):
        pieces.append(run_attention(q[pos:pos + size].copy(), kv, pos, 32, 1 + pos % 3))
        pos += size
    assert pos == total
    np.testing.assert_array_equal(np.concatenate(pieces).view(np.uint32), full.view(np.uint32))
    want = ref_attention(q, *kv, 0, 1.0 / np.sqrt(hd))
    assert report("attention full prefill", full, want) < 2e-5


ATTENTION_SHAPES = pytest.mark.parametrize("n,pos0,n_heads,n_kv,hd,kv_bs", [
    (37, 101, 6, 2, 48, 32),       # odd sizes, hd an odd multiple of 16: the 1-query value strips
    (70, 300, 16, 8, 128, 32),     # Qwen3-0.6B heads: pairs of heads, tiles across tokens
    (45, 260, 9, 3, 64, 32),       # SmolLM2 heads: GQA 3:1, tiles cross token boundaries
    (33, 0, 8, 2, 32, 16),         # first chunk (diagonal blocks only), GQA 4:1
    (1, 900, 16, 4, 64, 32),       # decode: the 4 heads of a KV head form one tile
    (19, 40, 4, 2, 80, 16),        # hd an odd multiple of 16 and of 32 (the wide 1-vector strips)
])


def attention_off_and_on(switch, n, pos0, n_heads, n_kv, hd, kv_bs):
    """A random attention case run with switch(False), then with switch(True) (left on):
    the queries, the KV, both outputs and the state switch(True) returned."""
    rng = np.random.default_rng(n * pos0 + hd)
    kv = store_prompt(rng, pos0 + n, n_kv, hd, pos0 + n + 3)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    try:
        assert switch(False) is False
        off = run_attention(q, kv, pos0, kv_bs, 2)
    finally:
        on = switch(True)
    return q, kv, off, run_attention(q, kv, pos0, kv_bs, 2), on


@ATTENTION_SHAPES
def test_attention_query_tiles_give_the_same_bits(n, pos0, n_heads, n_kv, hd, kv_bs):
    """Tiles of queries share K / V loads but keep each query's arithmetic and its order, so
    attention with tiles equals attention with every query alone, bit for bit (-0.0 included)."""
    q, kv, alone, tiled, on = attention_off_and_on(O.set_attention_tiles, n, pos0, n_heads,
                                                   n_kv, hd, kv_bs)
    assert on is True
    np.testing.assert_array_equal(tiled.view(np.uint32), alone.view(np.uint32))
    want = ref_attention(q, *kv, pos0, 1.0 / np.sqrt(hd))
    assert report(f"attention tiles n={n} pos0={pos0} hd={hd}", tiled, want) < 2e-5


@ATTENTION_SHAPES
def test_attention_wide_vectors_give_the_same_bits(n, pos0, n_heads, n_kv, hd, kv_bs):
    """On AVX512 CPUs attention runs on 16-float vectors (two keys a vector in the scores) with
    each query's arithmetic and its order unchanged, so it equals the 8-float path bit for bit."""
    _, _, narrow, wide, on = attention_off_and_on(O.set_matmul_vnni, n, pos0, n_heads, n_kv,
                                                  hd, kv_bs)
    if not on:
        pytest.skip("no AVX512-VNNI on this CPU: only the 8-float path exists here")
    np.testing.assert_array_equal(wide.view(np.uint32), narrow.view(np.uint32))


# The first 16 hex digits of the sha256 of each ATTENTION_SHAPES case's output (run_attention,
# 2 threads) as x86-64 computes it, AVX2 and AVX512 alike: aarch64's 4-float core must give
# the same bits (make test-arm64 runs this as the A76 and the A72).
X86_64_ATTENTION = {
    (37, 101, 6, 2, 48, 32): "5fee3a52d95a181d",
    (70, 300, 16, 8, 128, 32): "efd789ba770b0a9a",
    (45, 260, 9, 3, 64, 32): "8dac56d982c4c9eb",
    (33, 0, 8, 2, 32, 16): "ff5983c9a49a9275",
    (1, 900, 16, 4, 64, 32): "d56644e974d94c75",
    (19, 40, 4, 2, 80, 16): "345698827e90b7da",
}


@ATTENTION_SHAPES
def test_attention_gives_x86_64s_bits(n, pos0, n_heads, n_kv, hd, kv_bs):
    """Each query's arithmetic is in a fixed order at every vector width, so attention gives
    the same bits on every target."""
    rng = np.random.default_rng(n * pos0 + hd)
    kv = store_prompt(rng, pos0 + n, n_kv, hd, pos0 + n + 3)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    out = run_attention(q, kv, pos0, kv_bs, 2)
    digest = hashlib.sha256(out.tobytes()).hexdigest()[:16]
    assert digest == X86_64_ATTENTION[(n, pos0, n_heads, n_kv, hd, kv_bs)]


def test_attention_rejects_bad_arguments():
    rng = np.random.default_rng(1)
    kv = store_prompt(rng, 8, 2, 64, 8)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="do not fit max_seq=8"):
        O.attention(q, *kv, 7, 0.125, 32, out, 1)
    with pytest.raises(ValueError, match="power of two"):
        O.attention(q, *kv, 0, 0.125, 48, out, 1)
    with pytest.raises(ValueError, match="not a multiple of n_kv"):
        O.attention(rng.standard_normal((2, 3, 64)).astype(np.float32), *kv, 0, 0.125, 32,
                    np.empty((2, 3, 64), np.float32), 1)
    with pytest.raises(ValueError, match="out must be"):
        O.attention(q, *kv, 0, 0.125, 32, out[:1], 1)


# ---- the forward pass -----------------------------------------------------------------------

def tiny_model(rng, qwen):
    """A random dense model (Qwen3-like: q/k norms, NeoX RoPE, untied; else Llama-like)."""
    from types import SimpleNamespace
    from kestreld.model.config import ModelConfig
    from kestreld.model.weights import LayerWeights, Matrix, ModelWeights, QType
    hidden, n_heads, n_kv, hd, ffn, vocab = 128, 4, 2, 32, 192, 300
    cfg = ModelConfig(arch="qwen3" if qwen else "llama", name="tiny", n_layers=2, hidden=hidden,
                      n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, ffn=ffn, vocab=vocab,
                      rope_theta=10000.0, norm_eps=1e-6, tied_embeddings=not qwen, qk_norm=qwen,
                      rope_neox=qwen, context_length=4096)

    def q8(rows, cols):
        return Matrix(make_q8_weights(rng, rows, cols)[0], QType.Q8_0, rows, cols)

    def norm(d):
        return rng.uniform(0.5, 1.5, d).astype(np.float32)

    layers = [LayerWeights(attn_norm=norm(hidden), wq=q8(n_heads * hd, hidden),
                           wk=q8(n_kv * hd, hidden), wv=q8(n_kv * hd, hidden),
                           wo=q8(hidden, n_heads * hd), q_norm=norm(hd) if qwen else None,
                           k_norm=norm(hd) if qwen else None, ffn_norm=norm(hidden),
                           w_gate=q8(ffn, hidden), w_up=q8(ffn, hidden), w_down=q8(hidden, ffn))
              for _ in range(cfg.n_layers)]
    embd = q8(vocab, hidden)
    weights = ModelWeights(tok_embd=embd, layers=layers, out_norm=norm(hidden),
                           output=q8(vocab, hidden) if qwen else embd)
    return SimpleNamespace(config=cfg, weights=weights)


def _run_in_chunks(model, tokens, chunk, nthreads, max_seq=1024, rope_shift=0):
    """Every token's logits (n, vocab) and the KV cache after running `tokens` in chunks of
    `chunk` (1: token by token, as decode does); RoPE turns token i by i + rope_shift."""
    from kestreld.engine.forward import Forward
    from kestreld.engine.kvcache import KVCache
    kv = KVCache.for_model(model.config, max_seq, 32)
    fwd = Forward(model, kv, chunk, nthreads)
    out = np.full((len(tokens), model.config.vocab), np.nan, np.float32)
    for p0 in range(0, len(tokens), chunk):
        part = tokens[p0:p0 + chunk]
        rope = p0 + rope_shift if rope_shift else None
        if len(part) == 1:
            out[p0] = fwd(part, rope_pos0=rope)[0]
        else:
            fwd(part, logits_out=out[p0:p0 + len(part)], rope_pos0=rope)
    return out, kv


@pytest.mark.parametrize("qwen", [True, False])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_one_forward_for_every_chunking(qwen, nthreads):
    """The one forward pass: a prompt in one chunk, in chunks of 7 and token by token (the
    decode step) gives the same logits and the same stored KV, bit for bit, while the
    context fits one attention key range (256 keys); beyond it decode splits the keys into
    ranges merged at the end, so only float rounding differs. Also with RoPE positions
    shifted (Qwen3-VL text after images)."""
    rng = np.random.default_rng(11)
    model = tiny_model(rng, qwen)
    tokens = rng.integers(0, model.config.vocab, size=250).tolist()
    for shift in (0, 9):
        whole, kv1 = _run_in_chunks(model, tokens, 256, nthreads, rope_shift=shift)
        assert np.isfinite(whole).all() and whole.std() > 0
        for chunk in (7, 1):
            got, kv2 = _run_in_chunks(model, tokens, chunk, nthreads, rope_shift=shift)
            assert np.array_equal(got, whole), (chunk, np.abs(got - whole).max())
            for a, b in ((kv1.k_q, kv2.k_q), (kv1.v_q, kv2.v_q), (kv1.k_s, kv2.k_s), (kv1.v_s, kv2.v_s)):
                assert np.array_equal(a[:, :, :250], b[:, :, :250])
    # RoPE is relative: only a token turned apart from the others changes its logits
    from kestreld.engine.forward import Forward
    fwd = Forward(model, kv1, 256, nthreads)
    kv1.truncate(249)
    turned = fwd(tokens[249:], rope_pos0=240)[0]
    assert np.isfinite(turned).all() and not np.array_equal(turned, whole[249])
    long = rng.integers(0, model.config.vocab, size=600).tolist()
    whole, _ = _run_in_chunks(model, long, 64, nthreads)
    steps, _ = _run_in_chunks(model, long, 1, nthreads)
    rel = np.sqrt(np.mean((steps - whole) ** 2) / np.mean(whole ** 2))
    print(f"600 tokens, decode vs chunks of 64: rel RMS {rel:.2e}")
    assert rel < 1e-5 and np.array_equal(steps.argmax(-1), whole.argmax(-1))


def test_forward_rejects_bad_arguments():
    from dataclasses import replace
    from kestreld.engine.forward import Batch
    from kestreld.engine.kvcache import KVCache
    from kestreld.model.weights import Matrix, QType
    model = tiny_model(np.random.default_rng(1), True)
    c = model.config
    kv = KVCache.for_model(c, 256, 32)
    fwd = K.Forward(c, model.weights, kv, 16, 1)
    cos = np.zeros((1, c.head_dim // 2), np.float32)
    logits = np.zeros((1, c.vocab), np.float32)
    tok = np.array([1], np.int32)
    ok = Batch(tokens=tok, pos0=0, rope_cos=cos, rope_sin=cos, logits=logits)
    fwd.run(ok)
    with pytest.raises(ValueError, match="token"):
        fwd.run(replace(ok, tokens=np.array([c.vocab], np.int32)))
    with pytest.raises(ValueError, match="do not fit max_seq"):
        fwd.run(replace(ok, pos0=256))
    with pytest.raises(ValueError, match="logits"):
        fwd.run(replace(ok, logits=np.zeros((1, c.vocab + 1), np.float32)))
    with pytest.raises(ValueError, match="rope tables"):
        fwd.run(replace(ok, rope_cos=np.zeros((2, c.head_dim // 2), np.float32)))
    with pytest.raises(ValueError, match="chunk of 17"):
        fwd.run(replace(ok, tokens=np.ones(17, np.int32)))
    f16 = Matrix(np.zeros((c.hidden, c.hidden * 2), np.uint8), QType.F16, c.hidden, c.hidden)
    bad = replace(model.weights, layers=[replace(model.weights.layers[0], wo=f16)] + model.weights.layers[1:])
    with pytest.raises(ValueError, match="layer 0 wo is F16"):
        K.Forward(c, bad, kv, 16, 1)
    wrong = replace(model.weights, layers=[replace(model.weights.layers[0], wk=model.weights.layers[0].wq)]
                    + model.weights.layers[1:])
    with pytest.raises(ValueError, match="layer 0 wk must be"):
        K.Forward(c, wrong, kv, 16, 1)
    with pytest.raises(ValueError, match="2 layers, the config says 3"):
        K.Forward(replace(c, n_layers=3), model.weights, KVCache.for_model(replace(c, n_layers=3), 64), 16, 1)


# ---- the vision encoder's kernels -------------------------------------------------------------

def ref_layernorm(x, w, b, eps):
    x64 = x.astype(np.float64)
    xc = x64 - x64.mean(axis=1, keepdims=True)
    return xc / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + eps) * w + b


def ref_gelu(x, use_erf):
    """In forms without the cancellation of 1 + erf(.) and 1 + tanh(.) in the negative tail,
    which would leave float64 itself with few correct digits there."""
    from math import erfc
    x64 = x.astype(np.float64)
    if use_erf:
        return 0.5 * x64 * np.vectorize(erfc)(-x64 / np.sqrt(2))
    with np.errstate(over="ignore"):                  # exp(inf): the -0 of the far tail
        return x64 / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))


def ref_full_attention(q, k, v, scale):
    q64, k64, v64 = (a.astype(np.float64).transpose(1, 0, 2) for a in (q, k, v))   # heads first
    s = scale * q64 @ k64.transpose(0, 2, 1)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    return ((p / p.sum(axis=2, keepdims=True)) @ v64).transpose(1, 0, 2)


@pytest.mark.parametrize("n,d,offset", [(1, 1024, 0.0), (67, 4096, 0.0), (5, 13, 0.0),
                                        (9, 1152, 40.0)])
def test_layernorm(n, d, offset):
    """Against float64, also with a large row mean (two passes keep the variance's digits)."""
    rng = np.random.default_rng(n + d)
    x = (rng.standard_normal((n, d)) * 3 + offset).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    b = rng.standard_normal(d).astype(np.float32)
    out = np.empty_like(x)
    K.layernorm(x, w, b, 1e-6, out, 2)
    assert report(f"layernorm ({n}, {d}) offset {offset}", out, ref_layernorm(x, w, b, 1e-6)) < 2e-6
    one = np.empty_like(x)
    K.layernorm(x, w, b, 1e-6, one, 1)
    np.testing.assert_array_equal(one, out)
    inplace = x.copy()
    K.layernorm(inplace, w, b, 1e-6, inplace, 2)      # out aliases x
    np.testing.assert_array_equal(inplace, out)
    with pytest.raises(ValueError, match="w and b must have"):
        K.layernorm(x, w, b[:-1], 1e-6, out, 1)
    with pytest.raises(ValueError, match="out must be"):
        K.layernorm(x, w, b, 1e-6, out[:, :-1].copy(), 1)


@pytest.mark.parametrize("use_erf", [False, True], ids=["tanh", "erf"])
def test_gelu(use_erf):
    """To a relative 2e-6 of float64 where |gelu| >= 1e-3, and 2e-5 down the negative tail to
    1e-36 (there the input's own rounding is amplified ~x^2 times); a row length that is no
    multiple of 8 or of the work chunk."""
    rng = np.random.default_rng(int(use_erf))
    x = (rng.standard_normal((3, 5003)) * 3).astype(np.float32)
    x[0, :9] = [-100.0, 100.0, 0.0, -0.0, -9.0, -5.5, -4.0, 1e-20, -1e-20]
    x[1] = np.linspace(-12, 12, x.shape[1], dtype=np.float32)
    gelu = K.gelu_erf if use_erf else K.gelu_tanh
    out = np.empty_like(x)
    gelu(x, out, 2)
    want = ref_gelu(x, use_erf)
    main = np.abs(want) >= 1e-3
    rel = np.abs(out - want)[main] / np.abs(want[main])
    print(f"gelu {'erf' if use_erf else 'tanh'}: max relative error {rel.max():.3e} where >= 1e-3")
    assert rel.max() < 2e-6
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-36)
    one = np.empty_like(x)
    gelu(x, one, 1)
    np.testing.assert_array_equal(one, out)
    inplace = x.copy()
    gelu(inplace, inplace, 2)                          # out aliases x
    np.testing.assert_array_equal(inplace, out)
    with pytest.raises(ValueError, match="out must be"):
        gelu(x, out[:2], 1)


def run_full_attention(q, k, v, scale, nthreads):
    out = np.full_like(q, np.nan)
    O.full_attention(q, k, v, scale, out, nthreads)
    return out


@pytest.mark.parametrize("n,heads,hd", [
    (1, 1, 64),          # one patch: the output is its value row
    (37, 3, 64),         # one partial key block, one partial query tile
    (300, 2, 80),        # several key blocks and query tiles, none full at the end; 5 strips
    (129, 4, 128),       # one key past a block, one query past two tiles
    (196, 16, 64),       # Qwen3-VL-2B heads, a 14 x 14 patch image
    (70, 2, 72),         # Qwen3-VL-8B's head_dim, padded to 80
    (50, 2, 20),         # a head_dim under one strip
])
def test_full_attention_against_float64(n, heads, hd):
    rng = np.random.default_rng(n * heads + hd)
    q, k, v = (rng.standard_normal((n, heads, hd)).astype(np.float32) for _ in range(3))
    q *= 3                                             # peaked softmax rows, not near-uniform ones
    scale = hd ** -0.5
    out = run_full_attention(q, k, v, scale, 2)
    rel = report(f"full_attention n={n} heads={heads} hd={hd}", out, ref_full_attention(q, k, v, scale))
    assert rel < 1e-5
    np.testing.assert_array_equal(out, run_full_attention(q, k, v, scale, 1))
    np.testing.assert_array_equal(out, run_full_attention(q, k, v, scale, 3))


def test_full_attention_sees_every_key_and_no_other_head():
    """A key far ahead of or behind a query gets its weight (not causal); changing one head's
    keys changes that head's output only."""
    rng = np.random.default_rng(4)
    n, heads, hd = 260, 3, 32
    q, k, v = (rng.standard_normal((n, heads, hd)).astype(np.float32) for _ in range(3))
    k[-1, 1] = q[0, 1] * 50                            # query 0 of head 1 looks at the last key
    k[0, 2] = q[-1, 2] * 50                            # the last query of head 2 at the first
    out = run_full_attention(q, k, v, 1.0, 2)
    np.testing.assert_allclose(out[0, 1], v[-1, 1], atol=1e-6)
    np.testing.assert_allclose(out[-1, 2], v[0, 2], atol=1e-6)
    k2 = k.copy()
    k2[:, 0] = rng.standard_normal((n, hd))
    out2 = run_full_attention(q, k2, v, 1.0, 2)
    assert not np.array_equal(out2[:, 0], out[:, 0])
    np.testing.assert_array_equal(out2[:, 1:], out[:, 1:])


def test_full_attention_rejects_bad_arguments():
    q = np.zeros((4, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"k must be \(4, 2, 16\) like q"):
        O.full_attention(q, np.zeros((4, 2, 8), np.float32), q, 1.0, q.copy(), 1)
    with pytest.raises(ValueError, match="out must be"):
        O.full_attention(q, q, q, 1.0, np.zeros((3, 2, 16), np.float32), 1)
    with pytest.raises(ValueError, match="nthreads"):
        O.full_attention(q, q, q, 1.0, q.copy(), 0)


def random_vision_blocks(rng, depth, H, ffn):
    """VisionBlocks of random Q8_0 linears (outputs of about unit scale) and norms, and the
    float64 weights they hold: [(VisionBlock, {name: float64 (rows, cols)})]."""
    from kestreld.model.weights import Matrix, QType
    from kestreld.model.vision_encoder import VisionBlock

    def linear(rows, cols):
        data, q, d = make_q8_weights(rng, rows, cols, scale=1 / (64 * np.sqrt(cols)))
        w64 = (q.reshape(rows, -1, QK).astype(np.float64) * d[:, :, None]).reshape(rows, cols)
        return Matrix(data, QType.Q8_0, rows, cols), w64

    def vec(n, lo, hi):
        return rng.uniform(lo, hi, n).astype(np.float32)

    out = []
    for _ in range(depth):
        (qkv, wqkv), (proj, wproj) = linear(3 * H, H), linear(H, H)
        (fc1, wfc1), (fc2, wfc2) = linear(ffn, H), linear(H, ffn)
        out.append((VisionBlock(norm1_w=vec(H, 0.5, 1.5), norm1_b=vec(H, -0.2, 0.2), qkv=qkv,
                                qkv_b=vec(3 * H, -0.2, 0.2), proj=proj, proj_b=vec(H, -0.2, 0.2),
                                norm2_w=vec(H, 0.5, 1.5), norm2_b=vec(H, -0.2, 0.2), fc1=fc1,
                                fc1_b=vec(ffn, -0.2, 0.2), fc2=fc2, fc2_b=vec(H, -0.2, 0.2)),
                    dict(qkv=wqkv, proj=wproj, fc1=wfc1, fc2=wfc2)))
    return out


def ref_vision_blocks(blocks, x, cos, sin, n_heads, eps, deepstack, quantized):
    """float64 of the vision blocks: (x out, [x after block j]). quantized: each linear's
    input rounded to Q8_0 first (ref_quantize_q8_0), as the kernels' product takes it."""
    n, H = x.shape
    hd = H // n_heads
    x, deep = x.astype(np.float64), {}

    def act(a):
        if not quantized:
            return a
        q, d = ref_quantize_q8_0(a.astype(np.float32))
        return (q.reshape(a.shape[0], -1, QK).astype(np.float64) * d[:, :, None]).reshape(a.shape)

    for i, (b, w) in enumerate(blocks):
        qkv = act(ref_layernorm(x, b.norm1_w, b.norm1_b, eps)) @ w["qkv"].T + b.qkv_b
        qkv = qkv.reshape(n, 3, n_heads, hd)
        q, k = (ref_rope(qkv[:, j], cos, sin, 0, True) for j in (0, 1))
        att = ref_full_attention(q, k, qkv[:, 2], hd ** -0.5).reshape(n, H)
        x = x + act(att) @ w["proj"].T + b.proj_b
        h = ref_gelu(act(ref_layernorm(x, b.norm2_w, b.norm2_b, eps)) @ w["fc1"].T + b.fc1_b, False)
        x = x + act(h) @ w["fc2"].T + b.fc2_b
        deep[i] = x
    return x, [deep[i] for i in deepstack]


def rms_rel(got, want):
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def per_op_vision_blocks(blocks, x, cos, sin, n_heads, eps, deepstack):
    """The same blocks through the per-op kernels, one call each (the encoder's Python loop
    before VisionBlocks): VisionBlocks must give these exact bits."""
    n, H = x.shape
    hd, x, deep = H // n_heads, x.copy(), {}

    def linear(m, bias, a):
        xq, xd = np.empty(a.shape, np.int8), np.empty((a.shape[0], a.shape[1] // QK), np.float32)
        O.quantize_q8_0(a, xq, xd, 2)
        out = np.empty((a.shape[0], m.rows), np.float32)
        O.matmul(m.data, int(m.qtype), xq, xd, out, 2)
        out += bias
        return out

    xn = np.empty_like(x)
    for i, (b, _) in enumerate(blocks):
        K.layernorm(x, b.norm1_w, b.norm1_b, eps, xn, 2)
        qkv = linear(b.qkv, b.qkv_b, xn).reshape(n, 3, n_heads, hd)
        q, k, v = (np.ascontiguousarray(qkv[:, j]) for j in range(3))
        O.rope(q, cos, sin, 0, True, 2)
        O.rope(k, cos, sin, 0, True, 2)
        att = np.empty_like(q)
        O.full_attention(q, k, v, hd ** -0.5, att, 2)
        x += linear(b.proj, b.proj_b, att.reshape(n, H))
        K.layernorm(x, b.norm2_w, b.norm2_b, eps, xn, 2)
        h = linear(b.fc1, b.fc1_b, xn)
        K.gelu_tanh(h, h, 2)
        x += linear(b.fc2, b.fc2_b, h)
        deep[i] = x.copy()
    return x, [deep[i] for i in deepstack]


@pytest.mark.parametrize("n,H,n_heads,ffn", [(12, 64, 2, 128), (70, 128, 4, 96)])
def test_vision_blocks_against_float64_and_the_per_op_kernels(n, H, n_heads, ffn):
    """All blocks in one call: float64 to float rounding where its activations are rounded to
    Q8_0 as the product's are, within that rounding's error of float64 on exact activations,
    and the exact bits of the per-op kernels called one by one, whatever the thread count;
    DeepStack outputs taken after the named blocks (given out of order)."""
    rng = np.random.default_rng(n)
    blocks, deepstack, eps = random_vision_blocks(rng, 3, H, ffn), (2, 0), 1e-6
    x0 = rng.standard_normal((n, H)).astype(np.float32)
    ang = rng.uniform(0, 20, (n, H // n_heads // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    run = K.VisionBlocks([b for b, _ in blocks], n_heads, eps, deepstack)
    outs = []
    for nthreads in (1, 2, 3):
        x, deep = x0.copy(), np.full((2, n, H), np.nan, np.float32)
        run.run(x, cos, sin, deep, nthreads)
        outs.append((x, deep))
    x, deep = outs[0]
    for quantized, bound in ((True, 1e-5), (False, 0.05)):   # measured 1.4e-7..1.8e-7; 1.3-2.7%
        want, want_deep = ref_vision_blocks(blocks, x0, cos, sin, n_heads, eps, deepstack, quantized)
        for got, ref in zip((x, deep[0], deep[1]), (want, *want_deep)):
            assert rms_rel(got, ref) < bound, (quantized, rms_rel(got, ref))
    exact, exact_deep = per_op_vision_blocks(blocks, x0, cos, sin, n_heads, eps, deepstack)
    for x, deep in outs:
        np.testing.assert_array_equal(x, exact)
        np.testing.assert_array_equal(deep, np.stack(exact_deep))


def test_vision_blocks_reject_bad_arguments():
    rng = np.random.default_rng(5)
    blocks = [b for b, _ in random_vision_blocks(rng, 2, 64, 128)]
    with pytest.raises(ValueError, match="DeepStack block 2 of 2"):
        K.VisionBlocks(blocks, 2, 1e-6, (2,))
    with pytest.raises(ValueError, match="heads"):
        K.VisionBlocks(blocks, 3, 1e-6, ())
    with pytest.raises(ValueError, match="vision block 1 fc1 must be"):
        K.VisionBlocks([blocks[0], blocks[1].__class__(**{**blocks[1].__dict__, "fc1": blocks[0].qkv})],
                       2, 1e-6, ())
    run = K.VisionBlocks(blocks, 2, 1e-6, (0,))
    x, cs = np.zeros((8, 64), np.float32), np.zeros((8, 16), np.float32)
    with pytest.raises(ValueError, match="deep must be"):
        run.run(x, cs, cs, np.zeros((2, 8, 64), np.float32), 1)
    with pytest.raises(ValueError, match="rope tables"):
        run.run(x, cs[:, :8].copy(), cs, np.zeros((1, 8, 64), np.float32), 1)
    with pytest.raises(ValueError, match="x must be"):
        run.run(np.zeros((8, 32), np.float32), cs, cs, np.zeros((1, 8, 64), np.float32), 1)
    with pytest.raises(ValueError, match="nthreads"):
        run.run(x, cs, cs, np.zeros((1, 8, 64), np.float32), 0)


@pytest.mark.parametrize("module, stub", [(K, "_kernels.pyi"), (O, "_kernels_ops.pyi")],
                         ids=["daemon", "per-op"])
def test_the_typed_stub_lists_the_compiled_module(module, stub):
    """kestreld/_kernels.pyi and _kernels_ops.pyi name exactly their module's public functions
    and classes."""
    import ast
    import pathlib
    tree = ast.parse((pathlib.Path(module.__file__).parent / stub).read_text())
    declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    public = {n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))
              and getattr(getattr(module, n), "__module__", "") == module.__name__}
    assert declared == public
