"""Hugging Face directories: generated Qwen3/Llama models in BF16/F16/F32, malformed ones."""
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from kestreld.model.hf_dir import read_safetensors
from kestreld.model.load import load_model
from kestreld.model.quant import bf16_to_f32
from kestreld.errors import ModelLoadError
from _loader_models import (CHATML, Spec, random_weights, write_hf_dir, write_safetensors)


def _bf16(x):
    """float32 rounded to bfloat16 (nearest even) and back, independently of kestreld."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_qwen3_bf16(tmp_path):
    spec = Spec()                                     # head_dim 32 != 64/4, untied
    w = random_weights(spec)
    write_hf_dir(str(tmp_path), spec, w, dtype="BF16")
    m = load_model(str(tmp_path), interleave=False)  # the converted rows as they are
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == \
        ("qwen3", 2, 64, 4, 2, 32, 96, 288)
    assert c.rope_neox and c.qk_norm and not c.tied_embeddings
    assert (c.rope_theta, c.norm_eps, c.context_length) == (1e6, 1e-6, 4096)
    assert c.n_params == sum(a.size for a in w.values())
    assert (m.source_format, m.source_dtype, m.chat_template) == ("hf", "bf16", CHATML)
    layer = m.weights.layers[1]
    np.testing.assert_array_equal(
        layer.wq.data, gq.quantize(_bf16(w["model.layers.1.self_attn.q_proj.weight"]), T.Q8_0))
    np.testing.assert_array_equal(
        m.weights.output.data, gq.quantize(_bf16(w["lm_head.weight"]), T.Q8_0))
    np.testing.assert_array_equal(layer.k_norm, _bf16(w["model.layers.1.self_attn.k_norm.weight"]))
    assert layer.k_norm.dtype == np.float32 and (layer.wo.rows, layer.wo.cols) == (64, 128)
    # 256 byte tokens, merges he=256 ll=257 hell=258, specials from 260
    assert m.tokenizer.encode("<|im_start|>hello<|im_end|>") == [261, 258, ord("o"), 262]
    assert m.tokenizer.eos_id == 262 and m.tokenizer.bos_id is None
    assert m.tokenizer.eos_ids == {262, 260}          # <|im_end|>, <|endoftext|>


def test_llama_f16_tied_sharded(tmp_path):
    spec = Spec(arch="llama", hidden=128, head_dim=32, tied=True, rope_theta=10000.0)
    w = random_weights(spec)
    write_hf_dir(str(tmp_path), spec, w, dtype="F16", shards=3)
    m = load_model(str(tmp_path), interleave=False)  # the converted rows as they are
    c = m.config
    assert c.arch == "llama" and c.rope_neox and not c.qk_norm and c.tied_embeddings
    assert m.weights.output is m.weights.tok_embd and m.source_dtype == "f16"
    assert m.keepalive == []                          # all converted: no map stays open
    assert m.weights.layers[0].wq.data.flags.owndata
    want = gq.quantize(w["model.layers.0.mlp.down_proj.weight"].astype(np.float16).astype(np.float32),
                       T.Q8_0)
    np.testing.assert_array_equal(m.weights.layers[0].w_down.data, want)


def test_reads_files_written_by_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "b": np.linspace(-1, 1, 64).astype(np.float16).reshape(2, 32)}
    st.save_file(arrays, str(tmp_path / "x.safetensors"))
    tensors, _ = read_safetensors(str(tmp_path / "x.safetensors"))
    for name, arr in arrays.items():
        np.testing.assert_array_equal(tensors[name].data, arr)
        assert tensors[name].data.dtype == arr.dtype


def test_our_writer_is_read_by_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"x": np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)}
    write_safetensors(str(tmp_path / "f.safetensors"), arrays, "F32")
    np.testing.assert_array_equal(st.load_file(str(tmp_path / "f.safetensors"))["x"], arrays["x"])
    write_safetensors(str(tmp_path / "b.safetensors"), arrays, "BF16")
    tensors, _ = read_safetensors(str(tmp_path / "b.safetensors"))
    np.testing.assert_array_equal(bf16_to_f32(tensors["x"].data), _bf16(arrays["x"]))


def test_chat_template_jinja_file_wins(tmp_path):
    spec = Spec(n_layers=1)
    write_hf_dir(str(tmp_path), spec, random_weights(spec))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_model(str(tmp_path)).chat_template == "{{ messages[0]['content'] }}"


# ---- malformed directories ------------------------------------------------------------

def _fails(path, *words, where=None):
    """Loading `path` fails with one message naming `where` (default `path`) and `words`."""
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert str(where or path) in msg, msg
    for word in words:
        assert word in msg, msg
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)
    return msg


def _model_dir(tmp_path, spec=None, weights=None, **kw):
    spec = spec or Spec(n_layers=2)
    write_hf_dir(str(tmp_path), spec, random_weights(spec) if weights is None else weights, **kw)
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory_and_config(tmp_path):
    _fails(tmp_path / "absent", "no such file or directory")
    _fails(tmp_path, "config.json: missing file")


def test_bad_config_json(tmp_path):
    d = _model_dir(tmp_path)
    (d / "config.json").write_text("{not json")
    _fails(d, "not valid JSON", where=d / "config.json")


def test_unsupported_architecture(tmp_path):
    d = _model_dir(tmp_path)
    _edit_config(d, architectures=["MistralForCausalLM"])
    _fails(d, "unsupported architecture 'MistralForCausalLM'", "Qwen3ForCausalLM, LlamaForCausalLM")


def test_missing_tensor(tmp_path):
    spec = Spec()
    w = random_weights(spec)
    del w["model.layers.1.mlp.up_proj.weight"]
    _fails(_model_dir(tmp_path, spec, w), "missing tensor model.layers.1.mlp.up_proj.weight")


def test_untied_without_lm_head(tmp_path):
    spec = Spec(tied=True)
    d = _model_dir(tmp_path, spec)
    _edit_config(d, tie_word_embeddings=False)
    _fails(d, "missing tensor lm_head.weight")


def test_wrong_shape(tmp_path):
    d = _model_dir(tmp_path)
    _edit_config(d, intermediate_size=128)
    _fails(d, "wrong shape for tensor model.layers.0.mlp.gate_proj.weight", "got (96, 64)",
           "want (128, 64)")


def test_unsupported_dtype(tmp_path):
    _fails(_model_dir(tmp_path, dtype="F64"), "unsupported dtype F64", "F32, F16, BF16")


def test_truncated_safetensors(tmp_path):
    d = _model_dir(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) - 100])
    _fails(d, "truncated", where=f)
    f.write_bytes(data[:5])
    _fails(d, "truncated", where=f)


def test_corrupt_safetensors_header(tmp_path):
    d = _model_dir(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"@@@@@@@@@@@@"
    f.write_bytes(bytes(data))
    _fails(d, "corrupt safetensors header", where=f)


def test_missing_shard(tmp_path):
    d = _model_dir(tmp_path, shards=2)
    os.remove(d / "model-00002-of-00002.safetensors")
    _fails(d, "missing file", where=d / "model-00002-of-00002.safetensors")


def test_no_weights(tmp_path):
    d = _model_dir(tmp_path)
    os.remove(d / "model.safetensors")
    _fails(d, "missing file", where=d / "model.safetensors")


# ---------------------------------------------------------------- as transformers saves them

def _saved_by_transformers(tmp_path, zoo, model_type: str, drop_architectures: bool = False):
    """A random tiny model of `model_type` built and saved by the installed transformers
    (5.x: rope_theta inside rope_parameters, Qwen3-MoE's num_local_experts), with the
    generated test tokenizer beside it; (directory, the transformers model)."""
    import shutil

    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    tok_dir = zoo.get("qwen3_tied").hf_dir
    vocab = json.load(open(tok_dir / "config.json"))["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  rope_parameters={"rope_type": "default", "rope_theta": 30000.0})
    config, cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[model_type]
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True) if model_type == "qwen3_moe" else {}
    torch.manual_seed(0)
    model = cls(config(**common, **extra)).eval()
    out = tmp_path / model_type
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    saved = json.load(open(out / "config.json"))
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 30000.0
    if model_type == "qwen3_moe":
        assert "num_local_experts" in saved and "num_experts" not in saved
    if drop_architectures:             # as a config saved without its model has it
        del saved["architectures"]
        json.dump(saved, open(out / "config.json", "w"))
    return out, model


@pytest.mark.parametrize("model_type,drop", [("qwen3", False), ("llama", False),
                                              ("qwen3_moe", False), ("qwen3", True)])
def test_configs_as_transformers_5_saves_them(tmp_path, zoo, model_type, drop):
    import torch
    from kestreld.engine.generate import Engine
    from metrics import rel_rms_error
    path, ref = _saved_by_transformers(tmp_path, zoo, model_type, drop)
    loaded = load_model(str(path))
    c = loaded.config
    assert c.rope_theta == 30000.0 and c.head_dim == 32 and c.n_layers == 2
    if model_type == "qwen3_moe":
        assert (c.n_experts, c.n_experts_used, c.expert_ffn) == (4, 2, 64)
    ids = list(range(5, 5 + 40))
    got = Engine(loaded, max_seq=64).forward_logits(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    rel = rel_rms_error(got, want)
    print(f"{model_type}: rel RMS {rel:.4f} vs transformers")
    assert rel <= 0.03 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_scaled_rope_is_refused(tmp_path, zoo):
    path, _ = _saved_by_transformers(tmp_path, zoo, "llama")
    saved = json.load(open(path / "config.json"))
    saved["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    json.dump(saved, open(path / "config.json", "w"))
    with pytest.raises(ModelLoadError, match="RoPE scaling 'llama3' is not supported"):
        load_model(str(path))


def test_shapes_the_forward_pass_cannot_compute_are_refused_at_load(tmp_path, zoo):
    path, _ = _saved_by_transformers(tmp_path, zoo, "qwen3")
    saved = json.load(open(path / "config.json"))
    saved["head_dim"] = 16
    json.dump(saved, open(path / "config.json", "w"))
    with pytest.raises(ModelLoadError, match="head_dim 16 is not a multiple of 32"):
        load_model(str(path))
