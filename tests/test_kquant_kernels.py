"""The K-quant weight types Q4_K, Q5_K and Q6_K (pyx/ks_kquants.h), computed in place, against
gguf-py's own dequantization (the independent reference; it has no quantizer for these types,
so tests/kquant_blocks.py writes the blocks):

- dequantize_rows == gguf.quants.dequantize bit for bit, on quantized floats and on random
  blocks with the edge cases (fp16 subnormal / zero / negative scales, all-0 and all-max codes,
  Q6_K scales -128 and 127);
- matmul == float64 of gguf's dequantized weights times the dequantized activations, to 1e-5
  of the sum of |terms|, and == matmul_plain bit for bit, with 1 and 2 threads, for decode and
  prefill tiles (odd token counts, edge rows) with the VNNI switch on and off;
- whole models: a dense Qwen3 and a Qwen3-MoE whose matrices mix the three types as llama.cpp's
  Q4_K_M / Q5_K_M files do, embedding rows and output head included: one chunk == chunks ==
  token by token bit for bit, and the logits match the float64 reference computed on gguf's
  dequantized weights (int8 KV, Q8_0 activations), with the same bars as the Q8_0 files
  (rel RMS <= 0.015, top-1 >= 99.5%; MoE: the same expert sets at >= 99% of (token, layer)
  pairs, the logits compared up to the first token whose choice flips).

Measured (200 tokens, 2 threads): vs the same-numbers reference, dense rel RMS 0.0056, top-1
1.0; MoE 0.0062 over the 61 tokens before the first flip, top-1 1.0, expert sets 0.995. The
4-bit error itself (vs the float weights the blocks were made from, printed) is rel RMS 0.12
dense and 0.35 MoE with kquant_blocks' simple min/max quantizer: a statement about that
quantizer and these random models, not about llama.cpp's Q4_K_M files.
"""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kestreld.kernels import K, ops
import kquant_blocks
import modelgen
import modelgen_moe
import reference
from kestreld.engine.forward import Forward
from kestreld.engine.kvcache import KVCache
from kestreld.model.config import ModelConfig
from kestreld.model.load import interleave_matrices
from kestreld.model.weights import LayerWeights, Matrix, ModelWeights, MoEWeights
from metrics import margin_top1_agreement, rel_rms_error
from test_kernels import assert_product_of_every_path, quantized_activations

O = ops()     # the per-op kernels (the test-only module kestreld._kernels_ops)

K_TYPES = kquant_blocks.K_TYPES


def dequantized(blocks, qtype):
    """gguf-py's float32 values of the blocks (rows, k)."""
    return gguf.quants.dequantize(blocks, qtype).astype(np.float32)


def test_the_kernels_compute_on_every_k_type():
    assert set(int(t) for t in K_TYPES) <= set(K.compute_types())


@pytest.mark.arm64
@pytest.mark.parametrize("blocks", ["quantized", "random", "edge-cases"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf_bit_for_bit(qtype, blocks):
    rng = np.random.default_rng(int(qtype))
    m, k = 37, 768
    if blocks == "quantized":
        w = kquant_blocks.quantize(rng.standard_normal((m, k)) * 0.02, qtype)
    else:
        w = kquant_blocks.random_blocks(rng, qtype, m, k, special=blocks == "edge-cases")
    ids = np.array([5, 0, 36, 5, 17, 2], np.int32)
    out = np.full((len(ids), k), np.nan, np.float32)
    O.dequantize_rows(w, int(qtype), ids, out)
    want = dequantized(w, qtype)[ids]
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), \
        f"{np.sum(out.view(np.uint32) != want.view(np.uint32))} values differ"
    if K.interleaves(int(qtype)):                  # the rows read back from interleaved groups
        again = np.full_like(out, np.nan)
        O.dequantize_rows(K.interleave_rows(w, int(qtype), k), int(qtype), ids, again, True, m)
        assert np.array_equal(again.view(np.uint32), out.view(np.uint32))


@pytest.mark.arm64
@pytest.mark.parametrize("n,m,k", [(1, 1, 256), (1, 67, 2048), (1, 129, 512), (1, 29, 512),
                                   (2, 9, 256), (3, 33, 768), (5, 130, 256), (7, 45, 256),
                                   (11, 37, 512), (33, 20, 512), (42, 19, 256),
                                   (67, 65, 1024)])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_matmul_against_float64_and_plain_twin(qtype, n, m, k, vnni):
    rng = np.random.default_rng(n * 7 + m * 13 + k + int(qtype))
    w = kquant_blocks.random_blocks(rng, qtype, m, k, special=True)
    xq, xd = quantized_activations(rng, n, k)
    out = np.full((n, m), np.nan, np.float32)
    O.matmul(w, int(qtype), xq, xd, out, 2)

    wf = dequantized(w, qtype).astype(np.float64)
    xf = (xq.reshape(n, -1, 32) * xd[:, :, None].astype(np.float64)).reshape(n, k)
    want, mag = xf @ wf.T, np.abs(xf) @ np.abs(wf).T
    assert_product_of_every_path(out, want, mag, w, qtype, xq, xd,
                                 f"{qtype.name} n={n} m={m} k={k}, VNNI switch {vnni}")


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_matmul_and_lookup_want_whole_superblocks(qtype):
    rng = np.random.default_rng(3)
    w = kquant_blocks.random_blocks(rng, qtype, 4, 256)
    xq, xd = quantized_activations(rng, 2, 288)      # 9 Q8_0 blocks: not a superblock's 8
    with pytest.raises(ValueError, match="multiple of 256"):
        O.matmul(w, int(qtype), xq, xd, np.empty((2, 4), np.float32), 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        O.dequantize_rows(w, int(qtype), np.zeros(1, np.int32), np.empty((1, 288), np.float32))


# ---- whole models ---------------------------------------------------------------------------

DENSE = modelgen.ModelSpec("qwen3_kquants", "qwen3", hidden=256, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=64, ffn=512, vocab=384, tied=False, seed=31)
MOE = modelgen_moe.SPECS["qwen3moe_pages"]    # hidden 256, expert FFN 512, tied embeddings


def _qtype(name: str, tied: bool) -> QT:
    """The type of each matrix, as llama.cpp's Q4_K_M mixes them: Q4_K, with Q6_K for the
    output head (a tied embedding is the head) and for V / down in the first layer; the
    second layer has those in Q5_K, as Q5_K_M files do."""
    if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
        return QT.Q6_K
    if "v_proj" in name or "down_proj" in name:
        return QT.Q6_K if ".layers.0." in name else QT.Q5_K
    return QT.Q4_K


def _model(kind: str):
    """(engine model, HF config, float weights, gguf-dequantized weights) of the dense or MoE
    test model, its matrices quantized per _qtype."""
    moe = kind == "moe"
    spec = MOE.base if moe else DENSE
    floats = modelgen_moe.make_moe_weights(MOE) if moe else modelgen.make_weights(DENSE)
    tok = SimpleNamespace(bos_id=0, eos_id=1)
    hf_cfg = modelgen_moe.hf_moe_config(MOE, tok) if moe else modelgen.hf_config(DENSE, tok)
    held, mats = {}, {}
    for name, w in floats.items():
        if w.ndim == 1 or name.endswith(reference.ROUTER_SUFFIX):
            held[name] = w.astype(np.float64)
            continue
        qtype = _qtype(name, spec.tied)
        blocks = kquant_blocks.quantize(w, qtype)
        held[name] = dequantized(blocks, qtype).astype(np.float64)
        mats[name] = Matrix(blocks, qtype, *w.shape)

    def experts(p, proj):
        parts = [mats[p + f"mlp.experts.{e}.{proj}_proj.weight"] for e in range(MOE.n_experts)]
        assert len({m.qtype for m in parts}) == 1
        return Matrix(np.stack([m.data for m in parts]), parts[0].qtype, parts[0].rows, parts[0].cols)

    layers = []
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        ffn = dict(w_gate=None, w_up=None, w_down=None, moe=MoEWeights(
            router=Matrix.of_floats(floats[p + "mlp.gate.weight"]), gate=experts(p, "gate"),
            up=experts(p, "up"), down=experts(p, "down"))) if moe else dict(
            w_gate=mats[p + "mlp.gate_proj.weight"], w_up=mats[p + "mlp.up_proj.weight"],
            w_down=mats[p + "mlp.down_proj.weight"])
        layers.append(LayerWeights(
            attn_norm=floats[p + "input_layernorm.weight"], wq=mats[p + "self_attn.q_proj.weight"],
            wk=mats[p + "self_attn.k_proj.weight"], wv=mats[p + "self_attn.v_proj.weight"],
            wo=mats[p + "self_attn.o_proj.weight"], q_norm=floats[p + "self_attn.q_norm.weight"],
            k_norm=floats[p + "self_attn.k_norm.weight"],
            ffn_norm=floats[p + "post_attention_layernorm.weight"], **ffn))
    embd = mats["model.embed_tokens.weight"]
    weights = ModelWeights(tok_embd=embd, layers=layers, out_norm=floats["model.norm.weight"],
                           output=embd if spec.tied else mats["lm_head.weight"])
    moe_fields = dict(n_experts=MOE.n_experts, n_experts_used=MOE.n_used,
                      expert_ffn=MOE.expert_ffn, norm_topk_prob=MOE.norm_topk_prob,
                      moe_layers=tuple(MOE.moe_layers())) if moe else {}
    config = ModelConfig(
        arch="qwen3moe" if moe else "qwen3", name=spec.name, n_layers=spec.n_layers,
        hidden=spec.hidden, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, ffn=spec.ffn, vocab=spec.vocab, rope_theta=spec.rope_theta,
        norm_eps=spec.norm_eps, tied_embeddings=spec.tied, qk_norm=True, rope_neox=True,
        context_length=spec.max_pos, **moe_fields)
    return SimpleNamespace(config=config, weights=weights), hf_cfg, floats, held


def _logits(model, ids, chunk: int, nthreads: int):
    """Every token's logits (n, vocab) and the MoE layers' expert choices, in chunks."""
    c = model.config
    kv = KVCache.for_model(c, len(ids) + 8, 32)
    fwd = Forward(model, kv, chunk, nthreads)
    out = np.full((len(ids), c.vocab), np.nan, np.float32)
    routing = np.zeros((len(c.moe_layers), len(ids), max(c.n_experts_used, 1)), np.int32)
    for p0 in range(0, len(ids), chunk):
        part = ids[p0:p0 + chunk]
        route = np.zeros((len(c.moe_layers), len(part), routing.shape[2]), np.int32)
        fwd(part, logits_out=out[p0:p0 + len(part)], routing=route if c.moe_layers else None)
        routing[:, p0:p0 + len(part)] = route
    return out, routing


@pytest.mark.arm64
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_model_on_k_quants_matches_the_reference(kind):
    model, hf_cfg, floats, held = _model(kind)
    kinds = {m.qtype for m in model.weights.matrices()}
    assert {QT.Q4_K, QT.Q5_K, QT.Q6_K} <= kinds
    ids = np.random.default_rng(2).integers(0, model.config.vocab, 200).tolist()
    got, routes = _logits(model, ids, 256, 2)
    assert np.isfinite(got).all() and got.std() > 0
    for chunk, threads in ((7, 1), (1, 2)):          # prefill chunks, then decode steps
        again, again_routes = _logits(model, ids, chunk, threads)
        assert np.array_equal(again, got) and np.array_equal(again_routes, routes), chunk
    # the dense matrices interleaved, and the experts copied as they are chosen, where the
    # CPU has that product: the same bits
    il_weights = interleave_matrices(model.weights)
    assert bool(il_weights.interleaved_bytes()) == bool(K.interleaves(int(QT.Q4_K)))
    for chunk in (256, 1):
        again, again_routes = _logits(SimpleNamespace(config=model.config, weights=il_weights),
                                      ids[:64], chunk, 2)
        assert np.array_equal(again, got[:64]) and np.array_equal(again_routes, routes[:, :64])
    for L in il_weights.layers if K.interleaves(int(QT.Q4_K)) else ():
        experts = (L.moe.gate, L.moe.up, L.moe.down) if L.moe else ()
        assert all(m.copies.made().any() and not m.copies.release for m in experts)

    ref_routes = []
    same = reference.forward(held, hf_cfg, ids, kv_int8=True, act_q8=True, routing=ref_routes)
    # An expert choice that flips between near-tied router probabilities (a last-bit
    # difference upstream can do it) changes that token's state and, through its KV, every
    # later token's: the logits are compared up to the first flip, the choices throughout.
    flips = [np.flatnonzero(np.any(np.sort(a, -1) != np.sort(b, -1), axis=-1))
             for a, b in zip(routes, ref_routes)]
    same_sets = 1.0 - sum(len(f) for f in flips) / max(1, len(ids) * len(flips))
    upto = min([len(ids)] + [int(f[0]) for f in flips if len(f)])
    rel = rel_rms_error(got[:upto], same[:upto])
    agree, count = margin_top1_agreement(got, same)
    # the float weights' logits: transformers' fp32 within 1e-5 (tests/test_reference.py),
    # up to the first expert flip, as above
    exact = reference.forward(floats, hf_cfg, ids)[:upto]
    own, ours = rel_rms_error(same[:upto], exact), rel_rms_error(got[:upto], exact)
    print(f"{kind}: vs the same numbers rel RMS {rel:.4f} over {upto} tokens, top-1 "
          f"{agree:.4f} ({count}), expert sets {same_sets:.4f}; vs the float weights "
          f"{ours:.4f}, the 4-bit types' own error {own:.4f}")
    assert upto >= 48 and rel <= 0.015 and same_sets >= 0.99
    assert ours <= own + 0.005         # Kestrel adds next to nothing to the types' own error
    assert count >= len(ids) // 2 and agree >= 0.995


def test_the_loader_keeps_k_quant_matrices_in_place(tmp_path):
    from kestreld.model.gguf_file import GGUFFile
    rng = np.random.default_rng(4)
    blocks = {qt: kquant_blocks.quantize(rng.standard_normal((8, 512)), qt) for qt in K_TYPES}
    path = tmp_path / "k_quants.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    for qt, b in blocks.items():
        w.add_tensor(f"m.{qt.name}", b, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(str(path))
    for qt, b in blocks.items():
        m = f.matrix_of(f"m.{qt.name}", (8, 512))
        assert m.qtype == qt and np.array_equal(m.data, b)
        assert np.shares_memory(m.data, f._reader.data), "a copy, not a view of the map"
