"""The references are right before anything is judged by them: the float64 numpy forward
pass agrees with Hugging Face transformers on the generated HF dirs, the GGUF files hold the
same weights in llama.cpp's layout, the tokenizer files agree, and the metrics compute what
they say."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import modelgen
import reference
from metrics import margin_top1_agreement, rel_rms_error
from modelgen import SPECS, prompt_ids

NAMES = list(SPECS)


# ---------------------------------------------------------------- reference vs transformers

@pytest.mark.parametrize("name", NAMES)
def test_reference_matches_transformers(zoo, hf, name):
    m = zoo.get(name)
    ids = prompt_ids(name, 300, seed=1)
    ref = reference.forward(m.weights, m.config, ids)
    got = hf.logits(name, ids)
    rel = rel_rms_error(got, ref)
    agree, count = margin_top1_agreement(got, ref)
    # float32 torch vs float64 numpy: measured 4e-7 .. 9e-7
    assert rel <= 1e-5, f"{name}: transformers vs reference rel RMS {rel:.2e} > 1e-5"
    assert count >= 200 and agree == 1.0, f"{name}: top-1 agreement {agree} on {count} positions"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(zoo, hf, name):
    m = zoo.get(name)
    ids = prompt_ids(name, 200, seed=2)
    want = hf.greedy(name, ids, 12)      # incremental, transformers' KV cache
    got = reference.greedy(m.weights, m.config, ids, 12)
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_generated_models_are_not_trivial(zoo, name):
    """The engine tests mean something only if the logits are spread, decided, and depend on
    the context and on positions (RoPE)."""
    m = zoo.get(name)
    ids = prompt_ids(name, 400, seed=3)
    base = reference.forward(m.weights, m.config, ids)
    spread = base.std(axis=-1).mean()
    assert 0.5 < spread < 3.0, f"{name}: logit std {spread:.2f}"
    top2 = np.sort(base, axis=-1)[:, -2:]
    assert np.mean(top2[:, 1] - top2[:, 0] > 0.05) > 0.7, f"{name}: too few decided positions"
    other_prefix = prompt_ids(name, 200, seed=4) + ids[200:]
    moved = rel_rms_error(reference.forward(m.weights, m.config, other_prefix)[200:], base[200:])
    assert moved > 0.1, f"{name}: a new 200-token prefix moves later logits by only {moved:.3f}"
    # Without positions, attention is blind to the order of the keys: reversing the first 200
    # tokens would leave every later logit unchanged.
    reordered = reference.forward(m.weights, m.config, ids[:200][::-1] + ids[200:])
    moved = rel_rms_error(reordered[200:], base[200:])
    assert moved > 0.05, f"{name}: reordering the prefix moves later logits by only {moved:.3f}"


# ---------------------------------------------------------------- Q8_0 emulation

def test_q8_0_round_matches_ggml():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (64, 96)).astype(np.float32)
    x[0, :32] = 0.0                                   # an all-zero block: d = 0
    x[1, :32] = np.arange(32) - 15.5                  # halves after scaling
    x[2, :32] = 127 * np.linspace(-1, 1, 32)          # d = 1 exactly
    weights = [x] + [w for w in modelgen.make_weights(SPECS["llama"]).values() if w.ndim == 2]
    for w in weights:
        q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(reference.q8_0_round(w), want)


def test_int8_kv_rounding():
    x = np.array([[[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]])   # (1 token, 2 heads, 4)
    got = reference.int8_round_heads(x)
    s = np.float32(1.0) / np.float32(127)
    want_q = np.array([127, -64, 32, 0])             # -63.5 and 31.75 round away from zero
    np.testing.assert_allclose(got[0, 0], want_q * np.float64(s), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got[0, 1], 0.0)


# ---------------------------------------------------------------- GGUF files

def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation, from its definition: within each head of
    d rows, GGUF row 2i + j holds HF row j*d/2 + i (j = 0, 1; i < d/2)."""
    d = w.shape[0] // n_head
    hf_rows = [h * d + j * (d // 2) + i for h in range(n_head) for i in range(d // 2)
               for j in range(2)]
    out = np.empty_like(w)
    out[hf_rows] = w
    return out


def _gguf_tensors(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {t.name: t for t in r.tensors}, r


def _hf_name(spec, gguf_name: str) -> str:
    table = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, role, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{table[role]}.weight"


@pytest.mark.parametrize("name", NAMES)
def test_gguf_holds_the_hf_weights(zoo, tmp_path, name):
    """F32 GGUF, un-permuted, == the HF weights exactly; the F16 and Q8_0 files == their
    rounding of the (permuted) weights; tensor types and names as convert_hf_to_gguf writes."""
    m = zoo.get(name)
    spec = m.spec
    f32_path = tmp_path / "model-f32.gguf"
    modelgen.write_gguf(spec, m.weights, m.tokenizer, f32_path, "f32")
    files = {"f32": f32_path, **m.gguf}
    expected_names = set(modelgen.gguf_tensors(spec, m.weights))
    assert ("output.weight" in expected_names) == (not spec.tied)
    assert len(expected_names) == len(m.weights)
    for ttype, path in files.items():
        tensors, _ = _gguf_tensors(path)
        assert set(tensors) == expected_names, ttype
        for gname, t in tensors.items():
            hf_w = m.weights[_hf_name(spec, gname)]
            data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(hf_w.shape)
            if spec.arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
                n_head = spec.n_heads if "attn_q" in gname else spec.n_kv_heads
                data = _unpermute_rows(data, n_head)
            if hf_w.ndim == 1 or ttype == "f32":
                assert t.tensor_type == gguf.GGMLQuantizationType.F32, (ttype, gname)
                np.testing.assert_array_equal(data, hf_w, err_msg=f"{ttype} {gname}")
            elif ttype == "f16":
                assert t.tensor_type == gguf.GGMLQuantizationType.F16, gname
                np.testing.assert_array_equal(data, hf_w.astype(np.float16), err_msg=gname)
            else:   # Q8_0 rounds along rows, so it commutes with the row permutation
                assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, gname
                np.testing.assert_array_equal(data, reference.q8_0_round(hf_w), err_msg=gname)


def _rope_adjacent(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """llama.cpp's normal (non-NeoX) RoPE: pairs (x[2i], x[2i+1]) turn by pos*theta^(-2i/d)."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def test_llama_permutation_turns_rotate_half_into_adjacent_pairs(zoo):
    """Why the permutation exists: adjacent-pair RoPE on the GGUF rows == rotate-half RoPE
    on the HF rows, up to the same row order."""
    m = zoo.get("llama")
    spec = m.spec
    w_hf = m.weights["model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
    w_gg = modelgen.gguf_tensors(spec, m.weights)["blk.0.attn_q.weight"].astype(np.float64)
    x = np.random.default_rng(0).normal(0, 1, (50, spec.hidden))
    pos = np.arange(1000, 1050, dtype=np.float64)
    cos, sin = reference.rope_tables(50, spec.head_dim, spec.rope_theta, start_pos=1000)
    q_hf = reference.apply_rope((x @ w_hf.T).reshape(50, spec.n_heads, -1), cos, sin)
    q_gg = _rope_adjacent((x @ w_gg.T).reshape(50, spec.n_heads, -1), pos, spec.rope_theta)
    back = _unpermute_rows(q_gg.reshape(50, -1).T, spec.n_heads).T
    np.testing.assert_allclose(back, q_hf.reshape(50, -1), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_metadata(zoo, name):
    m = zoo.get(name)
    spec, tok = m.spec, m.tokenizer
    _, r = _gguf_tensors(m.gguf["q8_0"])
    f = {k: v.contents() for k, v in r.fields.items()}
    a = spec.arch
    want = {
        "general.architecture": a,
        f"{a}.block_count": spec.n_layers, f"{a}.embedding_length": spec.hidden,
        f"{a}.attention.head_count": spec.n_heads, f"{a}.attention.head_count_kv": spec.n_kv_heads,
        f"{a}.attention.key_length": spec.head_dim, f"{a}.attention.value_length": spec.head_dim,
        f"{a}.feed_forward_length": spec.ffn, f"{a}.rope.freq_base": spec.rope_theta,
        f"{a}.context_length": spec.max_pos,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": modelgen.GGUF_ARCH_PRE[a],
        "tokenizer.ggml.bos_token_id": tok.bos_id, "tokenizer.ggml.eos_token_id": tok.eos_id,
        "tokenizer.chat_template": modelgen.CHAT_TEMPLATE,
    }
    for k, v in want.items():
        assert f[k] == v, (k, f[k], v)
    assert f[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(spec.norm_eps, rel=1e-6)
    assert f["tokenizer.ggml.tokens"] == tok.tokens and len(tok.tokens) == spec.vocab
    assert f["tokenizer.ggml.token_type"] == tok.token_types
    assert f["tokenizer.ggml.merges"] == tok.merges and len(tok.merges) > 200


# ---------------------------------------------------------------- tokenizer files

@pytest.mark.parametrize("name", NAMES)
def test_hf_tokenizer_files(zoo, name):
    from transformers import AutoTokenizer
    m = zoo.get(name)
    tok = AutoTokenizer.from_pretrained(str(m.hf_dir))
    vocab = tok.get_vocab()
    assert all(m.tokenizer.tokens[i] == t for t, i in vocab.items())   # same ids as the GGUF
    assert len(vocab) == (m.spec.vocab - 8 if m.spec.arch == "qwen3" else m.spec.vocab)
    assert tok.eos_token_id == m.tokenizer.eos_id
    text = "Hello world, 12345 tokens!\n  indented"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)      # merges are used
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode(chat, add_special_tokens=False)
    assert chat_ids[0] == vocab["<|im_start|>"] and vocab["<|im_end|>"] in chat_ids


# ---------------------------------------------------------------- metrics

def test_metrics_on_known_values():
    ref = np.array([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    # spread: rows centered -> [-1.5,-.5,.5,1.5] and [2.25,-.75,-.75,-.75]; mean square 1.25, 1.6875
    spread = np.sqrt((1.25 + 1.6875) / 2)
    assert rel_rms_error(ref, ref) == 0.0
    assert rel_rms_error(ref + 0.1, ref) == pytest.approx(0.1 / spread)
    other = ref.copy()
    other[0, 2] = 5.0                                  # flips row 0's argmax (3 -> 2)
    assert margin_top1_agreement(other, ref) == (0.5, 2)
    close = np.array([[1.0, 1.02, 0.0]])                # margin 0.02 <= 0.05: not counted
    swapped = np.array([[1.02, 1.0, 0.0]])
    assert margin_top1_agreement(swapped, close) == (1.0, 0)
    assert margin_top1_agreement(swapped, close, margin=0.01) == (0.0, 1)
