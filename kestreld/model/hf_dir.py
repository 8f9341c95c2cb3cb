"""A Hugging Face model directory as a weight source: config.json + safetensors, to Q8_0.

Safetensors files are parsed here with numpy.memmap (8-byte little-endian header length,
a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian data), so the
daemon needs no `safetensors` package. F32/F16/BF16 matrices are converted to Q8_0 at load;
norm vectors become float32. Every fault becomes one ModelLoadError naming the file.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from typing import Optional

import numpy as np

from ..errors import ModelLoadError
from .config import ModelConfig
from .weights import Q8_BLOCK, Q8_BLOCK_BYTES, Matrix, QType
from .quant import bf16_to_f32, float_to_q8_0
from ..text.tokenizer import Tokenizer

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                 "Qwen3MoeForCausalLM": "qwen3moe", "Qwen3VLForConditionalGeneration": "qwen3vl",
                 "Qwen3Model": "qwen3"}     # Qwen3-Embedding saved by sentence-transformers
# A config saved from a bare config object (no model) has no `architectures`: its model_type
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
# Qwen3-VL nests its language model: config.json's text_config, tensors under this prefix.
VL_TEXT_PREFIX = "model.language_model."
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # BF16 as raw bits
_MAX_HEADER_BYTES = 100 << 20

# Weight role -> tensor name ({i}: layer index).
TENSOR_NAMES = {
    "tok_embd": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
    "router": "model.layers.{i}.mlp.gate.weight",
    # one tensor per expert ({e}), as Qwen3-MoE checkpoints are published
    "gate_exps": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "up_exps": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "down_exps": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "out_norm": "model.norm.weight",
    "output": "lm_head.weight",
}


class _Tensor:
    """One tensor of a safetensors file: where it is and what it holds."""

    def __init__(self, file: str, dtype: str, shape: tuple, data: np.ndarray):
        self.file = file
        self.dtype = dtype
        self.shape = shape
        self.data = data  # memmap view, dtype per SAFETENSORS_DTYPES, shaped `shape`


@contextlib.contextmanager
def _read_faults(path: str, corrupt: str):
    """Turns what reading and parsing `path` may raise into one ModelLoadError line: a
    missing or unreadable file, or content that does not parse (`corrupt` names what)."""
    try:
        yield
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing file") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: {corrupt}: {e}") from None


def _json_object(text, path: str, corrupt: str) -> dict:
    """The JSON object in `text` (ModelLoadError naming `corrupt` if it is not one)."""
    with _read_faults(path, corrupt):
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: {corrupt}: not a JSON object")
    return data


def read_safetensors(path: str) -> tuple[dict, np.memmap]:
    """{name: _Tensor} of one safetensors file, views into its memory map."""
    with _read_faults(path, "corrupt safetensors header"):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"{path}: truncated file: {len(prefix)} bytes, no header")
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelLoadError(f"{path}: truncated or corrupt safetensors file: header "
                                     f"length {header_len}, file size {size}")
            raw = f.read(header_len)
    header = _json_object(raw, path, "corrupt safetensors header")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt safetensors header entry for {name}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {dtype}; "
                                 f"supported: {', '.join(SAFETENSORS_DTYPES)}")
        np_dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
        if base + end > size:
            raise ModelLoadError(f"{path}: truncated file: tensor {name} needs bytes up to "
                                 f"{base + end}, the file has {size}")
        if end - begin != int(np.prod(shape)) * np_dtype.itemsize:
            raise ModelLoadError(f"{path}: corrupt safetensors entry {name}: {end - begin} bytes "
                                 f"for {dtype}{list(shape)}")
        data = mm[base + begin:base + end].view(np_dtype).reshape(shape)
        tensors[name] = _Tensor(path, dtype, shape, data)
    return tensors, mm


class HFSource:
    """An opened Hugging Face model directory: config, tokenizer, template, tensors."""

    source_format = "hf"

    def __init__(self, path: str):
        self.path = path
        self._config_file = os.path.join(path, "config.json")
        hf = self._read_json(self._config_file)
        self.hf_config = hf
        self.keepalive = []  # every weight is converted (a copy): the file maps can close
        self._tensors = self._open_weights()
        # Qwen3-Embedding (saved from Qwen3Model by sentence-transformers): no "model." prefix
        bare = ("embed_tokens.weight" in self._tensors
                and TENSOR_NAMES["tok_embd"] not in self._tensors)
        self._text_prefix = VL_TEXT_PREFIX if _is_vl(hf) else "" if bare else "model."
        self.pooling = _read_pooling(path)
        self.rerank_template = self.rank_head = None    # GGUF only (llama.cpp's conversion)
        self.config = self._read_config(hf)
        self.tokenizer = Tokenizer.from_hf_dir(path)
        self.chat_template, self.chat_template_source = self._read_chat_template()
        counts = Counter()
        for t in self._tensors.values():
            counts[t.dtype.lower()] += int(np.prod(t.shape))
        self.source_dtype = counts.most_common(1)[0][0] if counts else "unknown"

    # ---- files ------------------------------------------------------------------------

    @staticmethod
    def _read_json(path: str) -> dict:
        with _read_faults(path, "not valid JSON"):
            with open(path, "rb") as f:
                text = f.read()
        return _json_object(text, path, "not valid JSON")

    def _open_weights(self) -> dict:
        """All tensors of model.safetensors, or of the shards the index names."""
        single = os.path.join(self.path, "model.safetensors")
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(single):
            files = [single]
        elif os.path.exists(index):
            weight_map = self._read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no weight_map")
            files = sorted({os.path.join(self.path, f) for f in weight_map.values()})
        else:
            raise ModelLoadError(f"{single}: missing file (and no model.safetensors.index.json)")
        tensors = {}
        for file in files:
            if not os.path.exists(file):
                raise ModelLoadError(f"{file}: missing file (named by {index})")
            found, _ = read_safetensors(file)
            tensors.update(found)
        return tensors

    def _read_chat_template(self) -> tuple[Optional[str], Optional[str]]:
        """(template, the file it came from): chat_template.jinja if present, else
        tokenizer_config.json's chat_template; (None, None) without one."""
        jinja_file = os.path.join(self.path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read(), "chat_template.jinja"
        tok_config = os.path.join(self.path, "tokenizer_config.json")
        if not os.path.exists(tok_config):
            return None, None
        template = self._read_json(tok_config).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            return None, None
        return template, "tokenizer_config.json"

    # ---- config -----------------------------------------------------------------------

    def _read_config(self, hf: dict) -> ModelConfig:
        if _is_vl(hf):
            hf = _vl_text_config(hf, self._config_file)
        else:
            hf = dict(hf, rope_theta=_rope_theta(hf, self._config_file))
        arch_name = _architecture(hf)
        if arch_name not in ARCHITECTURES:
            raise ModelLoadError(f"{self._config_file}: unsupported architecture {arch_name!r}; "
                                 f"supported: {', '.join(ARCHITECTURES)}")
        arch = ARCHITECTURES[arch_name]

        def need(key):
            if key not in hf:
                raise ModelLoadError(f"{self._config_file}: missing key {key}")
            return hf[key]

        try:
            hidden = int(need("hidden_size"))
            n_heads = int(need("num_attention_heads"))
            # an embedding model may have no output matrix at all: it is never used
            tied = bool(hf.get("tie_word_embeddings", False)) or (
                bool(self.pooling) and TENSOR_NAMES["output"] not in self._tensors)
            return ModelConfig(
                arch=arch,
                name=os.path.basename(os.path.normpath(self.path)),
                n_layers=int(need("num_hidden_layers")),
                hidden=hidden,
                n_heads=n_heads,
                n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                head_dim=int(hf.get("head_dim") or hidden // n_heads),
                ffn=int(need("intermediate_size")),
                vocab=int(need("vocab_size")),
                rope_theta=float(hf["rope_theta"] or (10000.0 if arch == "llama" else 1000000.0)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tied_embeddings=tied,
                qk_norm=arch in ("qwen3", "qwen3moe", "qwen3vl"),
                rope_neox=True,  # Hugging Face weights rotate halves (rotate_half)
                context_length=int(hf.get("max_position_embeddings", 0)),
                n_params=sum(int(np.prod(t.shape)) for name, t in self._tensors.items()
                             if not (tied and name == TENSOR_NAMES["output"])),
                **(self._moe_hyperparameters(hf, need) if arch == "qwen3moe" else {}),
                mrope_section=tuple(int(v) for v in hf.get("mrope_section") or ()),
                pooling=self.pooling,
            )
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{self._config_file}: bad value: {e}") from None

    @staticmethod
    def _moe_hyperparameters(hf: dict, need) -> dict:
        """Qwen3MoeConfig's expert fields, with its defaults. Layer i is MoE unless it is in
        mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (as
        transformers' Qwen3MoeDecoderLayer decides); other layers have a dense FFN. The
        expert count is `num_experts` (transformers 4) or `num_local_experts` (5)."""
        n_layers = int(need("num_hidden_layers"))
        n_experts = int(hf["num_experts"] if "num_experts" in hf else need("num_local_experts"))
        n_used = int(need("num_experts_per_tok"))
        if not 0 < n_used <= n_experts:
            raise ValueError(f"num_experts_per_tok {n_used} must be in 1..num_experts={n_experts}")
        step = int(hf.get("decoder_sparse_step", 1))
        dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
        return dict(
            n_experts=n_experts, n_experts_used=n_used,
            expert_ffn=int(need("moe_intermediate_size")),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=tuple(i for i in range(n_layers)
                             if i not in dense and step > 0 and (i + 1) % step == 0),
        )

    # ---- tensors ----------------------------------------------------------------------

    def name(self, role: str, layer: Optional[int] = None) -> str:
        """The directory's tensor name for a weight role (experts: `*` for the expert)."""
        name = TENSOR_NAMES[role].format(i=layer, e="*")
        return self._text_prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def _tensor(self, name: str, want: tuple) -> _Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        if t.shape != want:
            raise ModelLoadError(f"{t.file}: wrong shape for tensor {name}: "
                                 f"got {t.shape}, want {want}")
        return t

    def matrix(self, role: str, layer: Optional[int], rows: int, cols: int) -> Matrix:
        """The (rows, cols) matrix for `role`, converted to Q8_0."""
        name = self.name(role, layer)
        t = self._tensor(name, (rows, cols))
        if cols % Q8_BLOCK:
            raise ModelLoadError(f"{t.file}: tensor {name} has {cols} columns, "
                                 f"not a multiple of {Q8_BLOCK} (Q8_0 blocks)")
        return Matrix(float_to_q8_0(t.data, bf16=t.dtype == "BF16"), QType.Q8_0, rows, cols)

    def experts(self, role: str, layer: int, n_expert: int, rows: int, cols: int) -> Matrix:
        """The n_expert per-expert (rows, cols) tensors of `role`, converted to Q8_0 and
        stacked (n_expert, rows, cols/32*34)."""
        if cols % Q8_BLOCK:
            raise ModelLoadError(f"{self.path}: {self.name(role, layer)} has {cols} columns, "
                                 f"not a multiple of {Q8_BLOCK} (Q8_0 blocks)")
        out = np.empty((n_expert, rows, cols // Q8_BLOCK * Q8_BLOCK_BYTES), dtype=np.uint8)
        for e in range(n_expert):
            t = self._tensor(TENSOR_NAMES[role].format(i=layer, e=e), (rows, cols))
            out[e] = float_to_q8_0(t.data, bf16=t.dtype == "BF16")
        return Matrix(out, QType.Q8_0, rows, cols)

    def float_matrix(self, role: str, layer: Optional[int], rows: int, cols: int) -> Matrix:
        """The (rows, cols) matrix for `role` as an F32 Matrix (a copy)."""
        return Matrix.of_floats(self.tensor_f32(self.name(role, layer), (rows, cols)))

    def resident_bytes(self) -> int:
        """What the weights take in memory: every matrix converted to Q8_0, vectors float32."""
        return sum(int(np.prod(t.shape)) // Q8_BLOCK * Q8_BLOCK_BYTES if len(t.shape) >= 2
                   else 4 * int(np.prod(t.shape)) for t in self._tensors.values())

    def shape(self, name: str) -> tuple:
        """The shape of the tensor `name` as the file holds it."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        return t.shape

    def tensor_f32(self, name: str, shape: tuple) -> np.ndarray:
        """The tensor `name` (by its file name, e.g. a vision weight) as float32 (a copy)."""
        t = self._tensor(name, tuple(shape))
        return np.array(bf16_to_f32(t.data) if t.dtype == "BF16" else t.data, dtype=np.float32)

    def vector(self, role: str, layer: Optional[int], n: int) -> np.ndarray:
        """The float32 (n,) vector for `role` (a norm weight)."""
        t = self._tensor(self.name(role, layer), (n,))
        values = bf16_to_f32(t.data) if t.dtype == "BF16" else t.data
        return np.array(values, dtype=np.float32)


# sentence-transformers' Pooling config flag -> POOLINGS name
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls"}


def _read_pooling(path: str) -> str:
    """The pooling sentence-transformers' files name (modules.json, then the Pooling
    module's config.json, e.g. 1_Pooling/config.json), or "" without modules.json."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.exists(modules_file):
        return ""
    with _read_faults(modules_file, "not valid JSON"):
        with open(modules_file, "rb") as f:
            modules = json.loads(f.read())
    pools = [m for m in modules if isinstance(m, dict)
             and str(m.get("type", "")).endswith(".Pooling")] if isinstance(modules, list) else []
    if len(pools) != 1:
        raise ModelLoadError(f"{modules_file}: want one sentence_transformers Pooling module, "
                             f"found {len(pools)}")
    config_file = os.path.join(path, str(pools[0].get("path", "")), "config.json")
    with _read_faults(config_file, "not valid JSON"):
        with open(config_file, "rb") as f:
            config = _json_object(f.read(), config_file, "not valid JSON")
    chosen = [name for flag, name in _ST_POOLING.items() if config.get(flag)]
    other = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                   and k not in _ST_POOLING)
    if len(chosen) != 1 or other:
        raise ModelLoadError(f"{config_file}: want exactly one of "
                             f"{', '.join(_ST_POOLING)}; got {chosen + other}")
    return chosen[0]


def _architecture(hf: dict):
    """The config's model class: `architectures[0]` (saved with a model), else the class of
    its `model_type`."""
    archs = hf.get("architectures") or []
    return archs[0] if archs else MODEL_TYPES.get(hf.get("model_type"))


def _is_vl(hf: dict) -> bool:
    return _architecture(hf) == "Qwen3VLForConditionalGeneration"


def _rope_parameters(hf: dict) -> dict:
    """RoPE settings: `rope_parameters` (transformers 5) or `rope_scaling` (4.x), or {}."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope if isinstance(rope, dict) else {}


def _rope_theta(hf: dict, config_file: str):
    """RoPE's base: top-level `rope_theta` (transformers 4) or inside rope_parameters (5);
    None if neither says. Only plain RoPE is computed: a scaled one (llama3, yarn, ...) is
    refused rather than run wrong."""
    rope = _rope_parameters(hf)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(f"{config_file}: RoPE scaling {kind!r} is not supported "
                             "(only the default RoPE)")
    return hf.get("rope_theta") or rope.get("rope_theta")


def is_qwen3vl_dir(path: str) -> bool:
    """True if the directory's config.json names Qwen3-VL (any fault: False; opening the
    directory with HFSource reports it)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        return isinstance(hf, dict) and _is_vl(hf)
    except (OSError, ValueError):
        return False


def _vl_text_config(hf: dict, config_file: str) -> dict:
    """Qwen3-VL's text_config as a flat Qwen3 config: architectures and tie_word_embeddings
    from the top level, rope_theta and mrope_section out of rope_parameters (transformers 5)
    or rope_scaling (older files)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{config_file}: Qwen3-VL config without a text_config map")
    rope = _rope_parameters(text)
    flat = dict(text, architectures=[_architecture(hf)],
                tie_word_embeddings=hf.get("tie_word_embeddings",
                                           text.get("tie_word_embeddings", False)),
                rope_theta=_rope_theta(text, config_file))
    flat["mrope_section"] = rope.get("mrope_section") or ()
    if flat["mrope_section"] and not rope.get("mrope_interleaved", True):
        raise ModelLoadError(f"{config_file}: only interleaved M-RoPE (Qwen3-VL) is supported")
    return flat
