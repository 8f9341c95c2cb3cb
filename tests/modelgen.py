"""Small random-weight Qwen3 / Llama models, written both as a Hugging Face directory and as
GGUF files, deterministic from a seed.

The two forms hold the same weights laid out the way each ecosystem writes them:

- HF dir: config.json (the keys transformers writes for Qwen3ForCausalLM / LlamaForCausalLM),
  model.safetensors (float32, HF tensor names; no lm_head when tied), tokenizer.json,
  tokenizer_config.json (with a ChatML chat_template), generation_config.json.
- GGUF: the layout llama.cpp's convert_hf_to_gguf.py produces: `{arch}.*` hyperparameters,
  `tokenizer.ggml.*` (model "gpt2", pre "qwen2" / "smollm"), tensors token_embd,
  blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,attn_q_norm,attn_k_norm,ffn_norm,
  ffn_gate,ffn_up,ffn_down}, output_norm, output (untied only). For llama, the Q and K rows
  are permuted as `LlamaModel.permute` does (llama.cpp's llama graph rotates adjacent
  pairs). 2-D tensors are F32, F16, Q8_0, Q4_0, Q4_1 or Q5_0 (gguf.quants' quantizers);
  norm vectors stay F32.

Run `python tests/modelgen.py OUT_DIR [NAME ...]` to write models for manual use.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from kestreld.model.convert import write_and_close


@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of one generated model."""
    name: str
    arch: str                 # "qwen3" | "llama"
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int                # rows of the embedding / output matrices
    tied: bool
    seed: int
    rope_theta: float = 10000.0   # low theta: positions vary fast, so RoPE errors show
    norm_eps: float = 1e-6
    max_pos: int = 4096


SPECS: dict[str, ModelSpec] = {s.name: s for s in (
    # head_dim * n_heads (128) != hidden (64), GQA 2:1, tied, tokenizer smaller than vocab
    ModelSpec("qwen3_tied", "qwen3", hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
              head_dim=32, ffn=192, vocab=512, tied=True, seed=11),
    # untied, GQA 4:1, head_dim 64, hidden not a power of two
    ModelSpec("qwen3_untied", "qwen3", hidden=96, n_layers=3, n_heads=4, n_kv_heads=1,
              head_dim=64, ffn=256, vocab=640, tied=False, seed=12),
    # SmolLM2-like: head_dim = hidden / heads, GQA 3:1, untied, tokenizer fills the vocab
    ModelSpec("llama", "llama", hidden=96, n_layers=3, n_heads=3, n_kv_heads=1,
              head_dim=32, ffn=256, vocab=1024, tied=False, seed=13, norm_eps=1e-5),
)}

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The pre-tokenizer regex of Qwen2/Qwen3's tokenizer.json (llama.cpp pre "qwen2").
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

GGUF_ARCH_PRE = {"qwen3": "qwen2", "llama": "smollm"}


# ---------------------------------------------------------------- weights

def make_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Random float32 weights in HF naming, scaled so the model is neither trivial nor chaotic.

    Linear layers have std gain/sqrt(fan_in) (unit-scale activations). The residual branches
    (o_proj, down_proj) have gain 0.4, so a layer moves the stream without swamping it: at
    gain 1 these nets are chaotic and turn Q8_0's 0.5% weight error into >4% logit error.
    Logits have std ~1 (tied: embedding rows of RMS 0.5 and a final norm of ~0.25), so a
    0.05 top-1 margin is a real decision. q and k are sharpened (Qwen3 q/k norms ~1.6, Llama
    q/k gain 1.6) so attention is peaked and the logits depend on the context: replacing the
    first half of a 1,000-token prompt moves the second half's logits by ~25% RMS. Norm
    weights are their mean times (1 + 0.1 noise)."""
    rng = np.random.default_rng(spec.seed)
    h, hd = spec.hidden, spec.head_dim
    qwen = spec.arch == "qwen3"
    qk_gain = 1.0 if qwen else 1.6
    branch_gain = 0.4

    def linear(rows, cols, gain=1.0):
        return rng.normal(0.0, gain / np.sqrt(cols), (rows, cols))

    def norm(n, mean=1.0):
        return mean * (1.0 + 0.1 * rng.normal(0.0, 1.0, n))

    w = {}
    w["model.embed_tokens.weight"] = (linear(spec.vocab, h, 4.0) if spec.tied
                                      else rng.normal(0.0, 1.0, (spec.vocab, h)))
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(spec.n_heads * hd, h, qk_gain)
        w[p + "self_attn.k_proj.weight"] = linear(spec.n_kv_heads * hd, h, qk_gain)
        w[p + "self_attn.v_proj.weight"] = linear(spec.n_kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, spec.n_heads * hd, branch_gain)
        if qwen:
            w[p + "self_attn.q_norm.weight"] = norm(hd, 1.6)
            w[p + "self_attn.k_norm.weight"] = norm(hd, 1.6)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = linear(spec.ffn, h)
        w[p + "mlp.up_proj.weight"] = linear(spec.ffn, h)
        w[p + "mlp.down_proj.weight"] = linear(h, spec.ffn, branch_gain)
    w["model.norm.weight"] = norm(h, 0.25 if spec.tied else 1.0)
    if not spec.tied:
        w["lm_head.weight"] = linear(spec.vocab, h)
    return {k: v.astype(np.float32) for k, v in w.items()}


def hf_config(spec: ModelSpec, tok: "GenTokenizer") -> dict:
    """config.json with the keys transformers writes for this architecture."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if spec.arch == "qwen3" else "LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.ffn,
        "max_position_embeddings": spec.max_pos,
        "model_type": spec.arch,
        "num_attention_heads": spec.n_heads,
        "num_hidden_layers": spec.n_layers,
        "num_key_value_heads": spec.n_kv_heads,
        "rms_norm_eps": spec.norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": spec.vocab,
    }
    if spec.arch == "qwen3":
        cfg.update(max_window_layers=spec.n_layers, sliding_window=None, use_sliding_window=False)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, rows (half, pair) -> (pair, half),
    i.e. HF's rotate-half layout to llama.cpp's adjacent-pair layout."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ---------------------------------------------------------------- tokenizer

@dataclass
class GenTokenizer:
    """A trained byte-level BPE and the facts both file formats record about it."""
    tokenizer: Tokenizer
    tokens: list[str]         # id -> token text, len == spec.vocab (GGUF padding included)
    token_types: list[int]    # gguf.TokenType per id
    merges: list[str]         # "a b"
    bos_id: int
    eos_id: int
    pad_id: int


def _corpus() -> list[str]:
    """A fixed training text: some English and code, plus seeded pseudo-words so that the
    trainer finds enough merges for any vocab size we ask for."""
    base = [
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "A small board computer runs a language model from its own memory.",
        "def forward(self, x):\n    return self.norm(x + self.attn(x))\n",
        "Numbers like 12, 345 and 6789 are split digit by digit; so are 2024-05-17.",
        "Questions? Answers! Lists: one, two, three. \"Quotes\" and 'apostrophes' it's we're.",
        "    indented lines\n\ttabs\n\nblank lines and   runs of   spaces",
        "Caches keep keys and values for every token that was already seen.",
    ]
    rng = np.random.default_rng(1234)
    onsets = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "st", "tr", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng"]
    words = []
    for _ in range(6000):
        n = int(rng.integers(1, 4))
        words.append("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                             + codas[rng.integers(len(codas))] for _ in range(n)))
    lines = [" ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]
    return base * 20 + lines


def build_tokenizer(spec: ModelSpec) -> GenTokenizer:
    """Train a byte-level BPE with ChatML specials.

    qwen3: Qwen2's split regex, specials after the trained tokens, and 8 ids at the top of the
    vocab that no token uses (as Qwen3's vocab_size exceeds its tokenizer; GGUF names them
    [PAD{id}], type UNUSED). llama: SmolLM2's digits + GPT-2 regex, specials at ids 0-2,
    the tokenizer fills the vocab exactly."""
    tok = Tokenizer(models.BPE())
    if spec.arch == "qwen3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        n_unused = 8
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab - len(SPECIALS) - n_unused,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        n_unused = 0
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=list(SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    if n_tok != spec.vocab - n_unused:
        raise RuntimeError(f"{spec.name}: tokenizer has {n_tok} tokens, want {spec.vocab - n_unused}")

    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(spec.vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in SPECIALS else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    if spec.arch == "qwen3":   # Qwen3: bos = <|endoftext|>, eos = <|im_end|>, pad = <|endoftext|>
        bos, eos, pad = ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"]
    else:                      # SmolLM2-Instruct: bos = <|im_start|>, eos = pad = <|im_end|>
        bos, eos, pad = ids["<|im_start|>"], ids["<|im_end|>"], ids["<|im_end|>"]
    return GenTokenizer(tok, tokens, [int(t) for t in types], merges, bos, eos, pad)


# ---------------------------------------------------------------- writers

def write_hf_dir(spec: ModelSpec, weights: dict[str, np.ndarray], tok: GenTokenizer,
                 out_dir: Path) -> dict:
    """Write the Hugging Face directory; return its config dict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(spec, tok)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "do_sample": False}, indent=2))
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.tokenizer.save(str(out_dir / "tokenizer.json"))
    id_of = {t: i for i, t in enumerate(tok.tokens)}
    tok_cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(id_of[s]): {"content": s, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False,
                                                 "special": True} for s in SPECIALS},
        "bos_token": tok.tokens[tok.bos_id] if spec.arch == "llama" else None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": tok.tokens[tok.eos_id],
        "errors": "replace",
        "model_max_length": spec.max_pos,
        "pad_token": tok.tokens[tok.pad_id],
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return cfg


GGUF_TYPES = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
              "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
              "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
              "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
              "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
              "q5_0": (gguf.GGMLQuantizationType.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0)}


def gguf_tensors(spec: ModelSpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF weights -> GGUF tensor names (float32, llama Q/K permuted), in convert's order."""
    t = {"token_embd.weight": weights["model.embed_tokens.weight"]}
    for i in range(spec.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = weights[p + "self_attn.q_proj.weight"]
        k = weights[p + "self_attn.k_proj.weight"]
        if spec.arch == "llama":
            q, k = permute_qk(q, spec.n_heads), permute_qk(k, spec.n_kv_heads)
        t[b + "attn_norm.weight"] = weights[p + "input_layernorm.weight"]
        t[b + "attn_q.weight"] = q
        t[b + "attn_k.weight"] = k
        t[b + "attn_v.weight"] = weights[p + "self_attn.v_proj.weight"]
        t[b + "attn_output.weight"] = weights[p + "self_attn.o_proj.weight"]
        if spec.arch == "qwen3":
            t[b + "attn_q_norm.weight"] = weights[p + "self_attn.q_norm.weight"]
            t[b + "attn_k_norm.weight"] = weights[p + "self_attn.k_norm.weight"]
        t[b + "ffn_norm.weight"] = weights[p + "post_attention_layernorm.weight"]
        t[b + "ffn_gate.weight"] = weights[p + "mlp.gate_proj.weight"]
        t[b + "ffn_up.weight"] = weights[p + "mlp.up_proj.weight"]
        t[b + "ffn_down.weight"] = weights[p + "mlp.down_proj.weight"]
    t["output_norm.weight"] = weights["model.norm.weight"]
    if not spec.tied:
        t["output.weight"] = weights["lm_head.weight"]
    return t


def write_gguf(spec: ModelSpec, weights: dict[str, np.ndarray], tok: GenTokenizer,
               path: Path, tensor_type: str, chat_template: str = CHAT_TEMPLATE,
               extra=None, extra_tensors: dict | None = None) -> None:
    """Write a GGUF file whose 2-D tensors are `tensor_type` (a key of GGUF_TYPES);
    `extra(writer)`, if given, adds metadata of its own; `extra_tensors` ({name: float
    array}) tensors of its own after the model's."""
    qtype, ftype = GGUF_TYPES[tensor_type]
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(spec.name)
    w.add_context_length(spec.max_pos)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if spec.arch == "llama":
        w.add_vocab_size(spec.vocab)
        w.add_rope_dimension_count(spec.head_dim)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(GGUF_ARCH_PRE[spec.arch])
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)
    if extra is not None:
        extra(w)
    write_and_close(w, ((name, arr, gguf.GGMLQuantizationType.F32 if arr.ndim == 1 else qtype)
                        for name, arr in {**gguf_tensors(spec, weights),
                                          **(extra_tensors or {})}.items()))


# ---------------------------------------------------------------- one call

def prompt_ids(name: str, n: int, seed: int = 0) -> list[int]:
    """A deterministic random prompt of n ids over the whole vocab of model `name`."""
    return [int(i) for i in np.random.default_rng(seed).integers(0, SPECS[name].vocab, n)]


@dataclass
class GeneratedModel:
    """A generated model on disk, with the arrays it was written from."""
    spec: ModelSpec
    config: dict                      # the HF config.json dict
    weights: dict[str, np.ndarray]    # HF names, float32
    tokenizer: GenTokenizer
    hf_dir: Path
    gguf: dict[str, Path] = field(default_factory=dict)   # tensor type -> file


def generate(name: str, out_root: Path, tensor_types=("q8_0", "f16")) -> GeneratedModel:
    """Write model `name` of SPECS under out_root/name/ (HF dir `hf/`, `model-<type>.gguf`)."""
    spec = SPECS[name]
    root = Path(out_root) / name
    weights = make_weights(spec)
    tok = build_tokenizer(spec)
    cfg = write_hf_dir(spec, weights, tok, root / "hf")
    model = GeneratedModel(spec, cfg, weights, tok, root / "hf")
    for tt in tensor_types:
        path = root / f"model-{tt}.gguf"
        write_gguf(spec, weights, tok, path, tt)
        model.gguf[tt] = path
    return model


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/modelgen.py OUT_DIR [NAME ...]   names: " + " ".join(SPECS))
    for n in sys.argv[2:] or SPECS:
        m = generate(n, Path(sys.argv[1]), tensor_types=("f32", "f16", "q8_0"))
        print(n, m.hf_dir, *m.gguf.values())
