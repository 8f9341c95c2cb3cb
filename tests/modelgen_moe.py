"""Small random-weight Qwen3-MoE models, written as a Hugging Face directory and as GGUF
files, deterministic from a seed (the MoE counterpart of modelgen.py, whose tokenizer,
attention weights and HF directory writer it reuses).

- HF dir: config.json as transformers writes it for Qwen3MoeForCausalLM (num_experts,
  num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
  mlp_only_layers), model.safetensors with one tensor per expert as Qwen3-MoE checkpoints
  are published: model.layers.N.mlp.gate.weight (router, (E, hidden)) and
  model.layers.N.mlp.experts.J.{gate,up,down}_proj.weight; dense layers keep mlp.*_proj.
- GGUF: llama.cpp's qwen3moe layout: qwen3moe.expert_count, .expert_used_count,
  .expert_feed_forward_length (and .expert_weights_norm = false when norm_topk_prob is
  off; llama.cpp's converter writes no such key and its graph always renormalizes);
  blk.N.ffn_gate_inp (router, always F32 as llama.cpp keeps it), blk.N.ffn_{gate,up,down}_exps
  stacked (E, rows, cols), 2-D/3-D tensors of any type of modelgen.GGUF_TYPES.

Run `python tests/modelgen_moe.py OUT_DIR [NAME ...]` to write models for manual use.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

import modelgen
from kestreld.model.convert import write_and_close
from modelgen import CHAT_TEMPLATE, GGUF_TYPES, GeneratedModel, ModelSpec


@dataclass(frozen=True)
class MoESpec:
    """A Qwen3-MoE model: attention, vocab and dense-layer shapes in `base`, plus experts."""
    base: ModelSpec               # arch "qwen3"; base.ffn is the dense layers' FFN
    n_experts: int
    n_used: int                   # top-k
    expert_ffn: int
    norm_topk_prob: bool
    mlp_only_layers: tuple = ()
    decoder_sparse_step: int = 1
    router_gain: float = 2.0      # router logits of std ~2: a clear but not certain choice

    @property
    def name(self) -> str:
        return self.base.name

    def moe_layers(self) -> list[int]:
        """Layers with experts, by transformers' Qwen3MoeDecoderLayer rule."""
        return [i for i in range(self.base.n_layers)
                if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]


SPECS: dict[str, MoESpec] = {s.name: s for s in (
    # 8 experts top-2, renormalized; layer 1 dense (mlp_only_layers)
    MoESpec(ModelSpec("qwen3moe_norm", "qwen3", hidden=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      head_dim=32, ffn=128, vocab=512, tied=False, seed=21),
            n_experts=8, n_used=2, expert_ffn=64, norm_topk_prob=True, mlp_only_layers=(1,)),
    # 8 experts top-3, raw softmax weights; GQA 4:1, all layers MoE
    MoESpec(ModelSpec("qwen3moe_raw", "qwen3", hidden=96, n_layers=2, n_heads=4, n_kv_heads=1,
                      head_dim=64, ffn=256, vocab=640, tied=False, seed=22),
            n_experts=8, n_used=3, expert_ffn=96, norm_topk_prob=False),
    # bigger experts (34 pages each in Q8_0), for watching which pages get resident
    MoESpec(ModelSpec("qwen3moe_pages", "qwen3", hidden=256, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=64, ffn=256, vocab=512, tied=True, seed=23),
            n_experts=16, n_used=2, expert_ffn=512, norm_topk_prob=True),
)}


def make_moe_weights(spec: MoESpec) -> dict[str, np.ndarray]:
    """modelgen.make_weights for attention, norms, embeddings and dense layers; MoE layers
    get a router (gain `router_gain`) and experts scaled like modelgen's dense FFN (unit
    gate/up, down gain 0.4), from a separate seeded generator."""
    w = modelgen.make_weights(spec.base)
    rng = np.random.default_rng(spec.base.seed + 1000)
    h, f, E = spec.base.hidden, spec.expert_ffn, spec.n_experts

    def linear(rows, cols, gain=1.0):
        return rng.normal(0.0, gain / np.sqrt(cols), (rows, cols)).astype(np.float32)

    for i in spec.moe_layers():
        p = f"model.layers.{i}.mlp."
        for dense in ("gate_proj", "up_proj", "down_proj"):
            del w[p + dense + ".weight"]
        w[p + "gate.weight"] = linear(E, h, spec.router_gain)
        for e in range(E):
            w[p + f"experts.{e}.gate_proj.weight"] = linear(f, h)
            w[p + f"experts.{e}.up_proj.weight"] = linear(f, h)
            w[p + f"experts.{e}.down_proj.weight"] = linear(h, f, 0.4)
    return w


def hf_moe_config(spec: MoESpec, tok: modelgen.GenTokenizer) -> dict:
    """config.json with the keys transformers writes for Qwen3MoeForCausalLM."""
    cfg = modelgen.hf_config(spec.base, tok)
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        num_experts=spec.n_experts, num_experts_per_tok=spec.n_used,
        moe_intermediate_size=spec.expert_ffn, norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=spec.decoder_sparse_step, mlp_only_layers=list(spec.mlp_only_layers),
        output_router_logits=False, router_aux_loss_coef=0.001)
    return cfg


def gguf_moe_tensors(spec: MoESpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF weights -> GGUF names in convert_hf_to_gguf's order; experts stacked (E, rows, cols)."""
    moe = set(spec.moe_layers())
    t = {"token_embd.weight": weights["model.embed_tokens.weight"]}
    for i in range(spec.base.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for src, dst in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                         ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
                         ("self_attn.k_norm", "attn_k_norm"),
                         ("post_attention_layernorm", "ffn_norm")):
            t[b + dst + ".weight"] = weights[p + src + ".weight"]
        if i in moe:
            t[b + "ffn_gate_inp.weight"] = weights[p + "mlp.gate.weight"]
            for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                               ("down_proj", "ffn_down_exps")):
                t[b + name + ".weight"] = np.stack(
                    [weights[p + f"mlp.experts.{e}.{proj}.weight"] for e in range(spec.n_experts)])
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                               ("down_proj", "ffn_down")):
                t[b + name + ".weight"] = weights[p + f"mlp.{proj}.weight"]
    t["output_norm.weight"] = weights["model.norm.weight"]
    if not spec.base.tied:
        t["output.weight"] = weights["lm_head.weight"]
    return t


def write_moe_gguf(spec: MoESpec, weights: dict[str, np.ndarray], tok: modelgen.GenTokenizer,
                   path: Path, tensor_type: str) -> None:
    """Write a qwen3moe GGUF whose matrices are `tensor_type` (the router stays F32)."""
    s, arch = spec.base, "qwen3moe"
    qtype, ftype = GGUF_TYPES[tensor_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(s.name)
    w.add_context_length(s.max_pos)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.norm_eps)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_expert_count(spec.n_experts)
    w.add_expert_used_count(spec.n_used)
    w.add_expert_feed_forward_length(spec.expert_ffn)
    if not spec.norm_topk_prob:
        w.add_expert_weights_norm(False)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    f32 = gguf.GGMLQuantizationType.F32      # norms and the router stay float
    write_and_close(w, ((name, arr, f32 if arr.ndim == 1 or name.endswith("ffn_gate_inp.weight")
                         else qtype) for name, arr in gguf_moe_tensors(spec, weights).items()))


def prompt_ids(name: str, n: int, seed: int = 0) -> list[int]:
    """A deterministic random prompt of n ids over the whole vocab of model `name`."""
    return [int(i) for i in np.random.default_rng(seed).integers(0, SPECS[name].base.vocab, n)]


def generate(name: str, out_root: Path, tensor_types=("q8_0",), hf: bool = True) -> GeneratedModel:
    """Write MoE model `name` under out_root/name/ (HF dir `hf/` if `hf`, `model-<type>.gguf`).
    The returned GeneratedModel's spec is the MoESpec."""
    spec = SPECS[name]
    root = Path(out_root) / name
    weights = make_moe_weights(spec)
    tok = modelgen.build_tokenizer(spec.base)
    cfg = hf_moe_config(spec, tok)
    if hf:
        modelgen.write_hf_dir(spec.base, weights, tok, root / "hf")   # the dense config ...
        (root / "hf" / "config.json").write_text(json.dumps(cfg, indent=2))  # ... replaced
    root.mkdir(parents=True, exist_ok=True)
    model = GeneratedModel(spec, cfg, weights, tok, root / "hf")
    for tt in tensor_types:
        path = root / f"model-{tt}.gguf"
        write_moe_gguf(spec, weights, tok, path, tt)
        model.gguf[tt] = path
    return model


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/modelgen_moe.py OUT_DIR [NAME ...]   names: " + " ".join(SPECS))
    for n in sys.argv[2:] or SPECS:
        m = generate(n, Path(sys.argv[1]), tensor_types=("f32", "f16", "q8_0"))
        print(n, m.hf_dir, *m.gguf.values())
