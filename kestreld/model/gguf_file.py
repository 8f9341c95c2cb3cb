"""A GGUF file as a weight source: header checks, hyperparameters, weight matrices.

The file is memory-mapped by gguf's GGUFReader. Matrices of a type the kernels compute on
(weights.compute_types(): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) are used in place (uint8
views of the map); the other types quant.py reads (F32, F16, BF16, Q5_1, Q2_K, Q3_K, the IQ
types) are converted to Q8_0 once. Every fault becomes one ModelLoadError naming the file and
what is wrong.
"""
from __future__ import annotations

import os
import struct
from collections import Counter
from typing import Any, Optional

import numpy as np
from gguf import GGUFEndian, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from ..errors import ModelLoadError
from .config import GGUF_POOLING, ModelConfig
from .weights import Q8_BLOCK, Q8_BLOCK_BYTES, Matrix, QType, computes_on
from .quant import SUPPORTED_TYPES, dequantize_gguf, gguf_to_q8_0
from ..text.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# qwen3vl: the language model of a Qwen3-VL split by llama.cpp's converter (its vision
# encoder is in a separate mmproj GGUF, see mmproj.py): Qwen3 tensors plus M-RoPE sections.
SUPPORTED_ARCHS = ("llama", "qwen3", "qwen3moe", "qwen3vl")
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen3": 1000000.0, "qwen3moe": 1000000.0,
                       "qwen3vl": 5000000.0}
_DEFAULT_NORM_EPS = {"llama": 1e-5, "qwen3": 1e-6, "qwen3moe": 1e-6, "qwen3vl": 1e-6}

# Weight role -> GGUF tensor name ({i}: layer index).
TENSOR_NAMES = {
    "tok_embd": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    "router": "blk.{i}.ffn_gate_inp.weight",       # MoE: (n_expert, hidden)
    "gate_exps": "blk.{i}.ffn_gate_exps.weight",   # MoE: (n_expert, expert_ffn, hidden)
    "up_exps": "blk.{i}.ffn_up_exps.weight",
    "down_exps": "blk.{i}.ffn_down_exps.weight",   # MoE: (n_expert, hidden, expert_ffn)
    "out_norm": "output_norm.weight",
    "output": "output.weight",
}


class _ArrayField:
    """A metadata array of fixed-size scalars: one numpy view of the map (GGUFReader makes one
    part per element, which is seconds for a 150k-token vocabulary)."""

    def __init__(self, name: str, values: np.ndarray):
        self.name = name
        self.types = [GGUFValueType.ARRAY]
        self._values = values

    def contents(self, index_or_slice=slice(None)) -> Any:
        return self._values[index_or_slice].tolist()


class _StringArrayField:
    """A metadata array of strings: their byte ranges in the map, decoded when asked for
    (so invalid UTF-8 surfaces where the value is used, as with GGUFReader)."""

    def __init__(self, name: str, buf: memoryview, starts: list, ends: list):
        self.name = name
        self.types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
        self._buf, self._starts, self._ends = buf, starts, ends

    def contents(self, index_or_slice=slice(None)) -> Any:
        buf = self._buf
        if isinstance(index_or_slice, int):
            return str(buf[self._starts[index_or_slice]:self._ends[index_or_slice]], "utf-8")
        return [str(buf[a:b], "utf-8")
                for a, b in zip(self._starts[index_or_slice], self._ends[index_or_slice])]


class _Reader(GGUFReader):
    """GGUFReader with a fast metadata parse.

    The header is read through a plain ndarray view of the memory map (indexing np.memmap
    costs microseconds per call in memmap.__array_finalize__), and metadata arrays (the
    vocabulary, merges, token types) are parsed in one pass each into `_ArrayField` /
    `_StringArrayField` instead of GGUFReader's one-part-per-element fields: start-up does
    not grow with the vocabulary by seconds. Tensor infos and tensor views are GGUFReader's
    (views of the same map, no copy)."""

    _plain: Optional[np.ndarray] = None

    def _get(self, offset, dtype, count=1, override_order=None):
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = self._plain[offset:end].view(dtype)[:count]
        if len(arr) != count:
            raise ValueError(f"{count} values at byte {offset} run past the end of the file")
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            key_len = int(self._get(offs, np.uint64)[0])
            name = str(self._get(offs + 8, np.uint8, key_len).tobytes(), "utf-8")
            offs += 8 + key_len
            raw_type = int(self._get(offs, np.uint32)[0])
            offs += 4
            if raw_type == GGUFValueType.ARRAY:
                item_type = int(self._get(offs, np.uint32)[0])
                fast = self._array_field(name, item_type, offs + 4)
                if fast is not None:
                    field, offs = fast
                    self._push_field(field, skip_sum=True)
                    continue
            # scalars, single strings, nested arrays: GGUFReader's parts (cheap: few fields)
            size, parts, idxs, types = self._get_field_parts(offs, raw_type)
            self._push_field(ReaderField(offs, name, parts, idxs, types), skip_sum=True)
            offs += size
        return offs

    def _array_field(self, name: str, item_type: int, offs: int):
        """(field, offset after it) for an array of scalars or strings at offs (its length
        first); None for other item types."""
        n = int(self._get(offs, np.uint64)[0])
        offs += 8
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
        if scalar is not None:
            values = self._get(offs, scalar, n)
            return _ArrayField(name, values), offs + values.nbytes
        if item_type != GGUFValueType.STRING:
            return None
        buf = memoryview(self._plain)
        size = len(buf)
        u64 = struct.Struct("<Q" if self.endianess == GGUFEndian.LITTLE else ">Q").unpack_from
        starts, ends = [0] * n, [0] * n
        for i in range(n):
            start = offs + 8
            offs = start + u64(buf, offs)[0]
            if offs > size:
                raise ValueError(f"string {i} of {name} runs past the end of the file")
            starts[i], ends[i] = start, offs
        return _StringArrayField(name, buf, starts, ends), offs


class GGUFFile:
    """An opened GGUF file: checked header, metadata values and tensors by name."""

    def __init__(self, path: str):
        self.path = path
        self._reader = open_gguf(path)
        self._fields = self._reader.fields
        self._tensors = {t.name: t for t in self._reader.tensors}

    def meta(self, key: str, default: Any = ...) -> Any:
        """The metadata value of `key`; `default` when absent (no default: an error)."""
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self.path}: missing metadata key {key}")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{self.path}: bad metadata value for {key}: {e}") from None

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported type "
                                 f"{t.tensor_type.name}; supported: "
                                 f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
        return t

    def shape(self, name: str) -> tuple:
        """The tensor's shape, slowest dimension first (numpy order; GGUF lists the fastest
        first)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def tensor_f32(self, name: str, shape: tuple) -> np.ndarray:
        """The tensor `name`, checked to be `shape` (numpy order), as float32 (a copy)."""
        t = self._tensor(name)
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelLoadError(f"{self.path}: wrong shape for tensor {name}: "
                                 f"got {got}, want {tuple(shape)}")
        return np.array(dequantize_gguf(t.data, t.tensor_type).reshape(shape), dtype=np.float32)

    def matrix_of(self, name: str, shape: tuple) -> Matrix:
        """The tensor `name` of `shape` ((rows, cols), or (n_mat, rows, cols) for stacked
        experts) as a Matrix: in place from the map when the kernels compute on its type,
        converted to Q8_0 otherwise."""
        t = self._tensor(name)
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelLoadError(f"{self.path}: wrong shape for tensor {name}: "
                                 f"got {got}, want {tuple(shape)}")
        rows, cols = shape[-2:]
        if cols % Q8_BLOCK:
            raise ModelLoadError(f"{self.path}: tensor {name} has {cols} columns, "
                                 f"not a multiple of {Q8_BLOCK} (Q8_0 blocks)")
        data = np.asarray(t.data).reshape(int(np.prod(shape[:-1])), -1)
        if computes_on(t.tensor_type):
            return Matrix(data.reshape(shape[:-1] + (-1,)), t.tensor_type, rows, cols)
        q8 = gguf_to_q8_0(data, t.tensor_type)
        return Matrix(q8.reshape(shape[:-1] + (-1,)), QType.Q8_0, rows, cols)


class GGUFSource(GGUFFile):
    """An opened GGUF model: its config, tokenizer, template and tensor accessors."""

    source_format = "gguf"

    def __init__(self, path: str):
        super().__init__(path)
        self.config = self._read_config()
        try:
            self.tokenizer = Tokenizer.from_gguf_metadata(self._fields)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        except Exception as e:  # tokenizers raises bare Exceptions on inconsistent vocabularies
            raise ModelLoadError(f"{path}: bad tokenizer metadata: {type(e).__name__}: {e}") from None
        self.chat_template = self.meta("tokenizer.chat_template", None)
        self.chat_template_source = "gguf" if self.chat_template else None
        # llama.cpp's reranker conversion: the prompt ({query}, {document}) and the head
        self.rerank_template = self.meta("tokenizer.chat_template.rerank", None)
        self.rank_head = (self.tensor_f32(RANK_HEAD, (2, self.config.hidden))
                          if self.config.pooling == "rank" and RANK_HEAD in self._tensors
                          else None)
        self.source_dtype = self._dominant_type()
        self.keepalive = [self._reader]  # the memory map the in-place matrices point into

    # ---- metadata ---------------------------------------------------------------------

    def _read_config(self) -> ModelConfig:
        arch = self.meta("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"{self.path}: unsupported architecture {arch!r}; "
                                 f"supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            return self._hyperparameters(arch)
        except (TypeError, ValueError, ZeroDivisionError) as e:  # e.g. a per-layer array
            raise ModelLoadError(f"{self.path}: bad hyperparameter metadata: {e}") from None

    def _hyperparameters(self, arch: str) -> ModelConfig:
        hidden = int(self.meta(f"{arch}.embedding_length"))
        n_heads = int(self.meta(f"{arch}.attention.head_count"))
        embd = self._tensor(TENSOR_NAMES["tok_embd"])
        n_layers = int(self.meta(f"{arch}.block_count"))
        moe = arch == "qwen3moe"
        ffn = int(self.meta(f"{arch}.feed_forward_length", 0 if moe else ...))
        return ModelConfig(
            arch=arch,
            name=str(self.meta("general.name", os.path.basename(self.path))),
            n_layers=n_layers,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(self.meta(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=int(self.meta(f"{arch}.attention.key_length", hidden // n_heads)),
            ffn=ffn,
            vocab=int(embd.shape[1]) if len(embd.shape) == 2 else 0,
            rope_theta=float(self.meta(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA[arch])),
            norm_eps=float(self.meta(f"{arch}.attention.layer_norm_rms_epsilon",
                                      _DEFAULT_NORM_EPS[arch])),
            tied_embeddings=TENSOR_NAMES["output"] not in self._tensors,
            qk_norm=arch in ("qwen3", "qwen3moe", "qwen3vl"),
            # llama.cpp's converter permutes Llama's Q/K rows for adjacent-pair rotation;
            # Qwen3 GGUFs keep the Hugging Face (rotate-halves) order.
            rope_neox=arch != "llama",
            context_length=int(self.meta(f"{arch}.context_length", 0)),
            n_params=sum(int(t.n_elements) for t in self._reader.tensors),
            **(self._moe_hyperparameters(arch, n_layers, ffn) if moe else {}),
            mrope_section=self._mrope_section(arch) if arch == "qwen3vl" else (),
            pooling=self._pooling(arch),
        )

    def _pooling(self, arch: str) -> str:
        """`{arch}.pooling_type` as a POOLINGS name ("" when absent or NONE)."""
        kind = int(self.meta(f"{arch}.pooling_type", 0))
        if kind not in GGUF_POOLING:
            raise ValueError(f"{arch}.pooling_type {kind} is none of llama.cpp's "
                             f"{sorted(GGUF_POOLING)}")
        return GGUF_POOLING[kind]

    def _mrope_section(self, arch: str) -> tuple:
        """Qwen3-VL's M-RoPE sections (t, h, w): llama.cpp's converter writes them as
        {arch}.rope.dimension_sections padded with 0 to four; its qwen3vl graph always
        interleaves them (LLAMA_ROPE_TYPE_IMROPE), as transformers' Qwen3-VL does."""
        sections = [int(s) for s in self.meta(f"{arch}.rope.dimension_sections")]
        if len(sections) < 3 or any(sections[3:]) or min(sections[:3]) < 0:
            raise ValueError(f"{arch}.rope.dimension_sections {sections}: want (t, h, w) "
                             "frequency counts, padded with zeros")
        return tuple(sections[:3])

    def _moe_hyperparameters(self, arch: str, n_layers: int, ffn: int) -> dict:
        """Expert counts and sizes as llama.cpp reads them for qwen3moe: expert FFN defaults
        to feed_forward_length / expert_used_count, and the top-k weights are renormalized
        (llama.cpp's qwen3moe graph always does; `expert_weights_norm` can say otherwise).
        A layer is MoE when it has a router tensor, else it must have a dense FFN."""
        n_experts = int(self.meta(f"{arch}.expert_count"))
        n_used = int(self.meta(f"{arch}.expert_used_count"))
        if not 0 < n_used <= n_experts:
            raise ValueError(f"expert_used_count {n_used} must be in 1..expert_count={n_experts}")
        expert_ffn = int(self.meta(f"{arch}.expert_feed_forward_length", ffn // n_used))
        if expert_ffn <= 0:
            raise ValueError(f"no {arch}.expert_feed_forward_length (and no feed_forward_length)")
        return dict(
            n_experts=n_experts, n_experts_used=n_used, expert_ffn=expert_ffn,
            norm_topk_prob=bool(self.meta(f"{arch}.expert_weights_norm", True)),
            moe_layers=tuple(i for i in range(n_layers)
                             if self.name("router", i) in self._tensors),
        )

    def _dominant_type(self) -> str:
        """The tensor type that holds most of the matrix elements, e.g. "q4_1"."""
        counts: Counter = Counter()
        for t in self._reader.tensors:
            if len(t.shape) >= 2:
                counts[t.tensor_type.name.lower()] += int(t.n_elements)
        return counts.most_common(1)[0][0] if counts else "unknown"

    def resident_bytes(self) -> int:
        """What the weights take in memory once every page is touched: the file's bytes of
        matrices used in place, Q8_0's size for those converted, float32 copies of vectors
        and routers."""
        total = 0
        for t in self._reader.tensors:
            n = int(t.n_elements)
            if len(t.shape) < 2 or _is_router(t.name):
                total += 4 * n
            else:
                total += int(t.n_bytes) if computes_on(t.tensor_type) else n // Q8_BLOCK * Q8_BLOCK_BYTES
        return total

    def needs_conversion(self) -> bool:
        """True when some matrix is of a type the kernels do not compute on (it is then
        converted to Q8_0); False when every matrix is used in place from the map."""
        return any(not computes_on(t.tensor_type)
                   for t in self._reader.tensors if len(t.shape) >= 2 and not _is_router(t.name))

    # ---- tensors ----------------------------------------------------------------------

    def name(self, role: str, layer: Optional[int] = None) -> str:
        """The file's tensor name for a weight role."""
        return TENSOR_NAMES[role].format(i=layer)

    def matrix(self, role: str, layer: Optional[int], rows: int, cols: int) -> Matrix:
        """The (rows, cols) matrix for `role` (in place when the kernels compute on its type)."""
        return self.matrix_of(self.name(role, layer), (rows, cols))

    def experts(self, role: str, layer: int, n_expert: int, rows: int, cols: int) -> Matrix:
        """The n_expert stacked (rows, cols) expert matrices for `role` (in place, one view
        of the memory map, when the kernels compute on its type)."""
        return self.matrix_of(self.name(role, layer), (n_expert, rows, cols))

    def float_matrix(self, role: str, layer: Optional[int], rows: int, cols: int) -> Matrix:
        """The (rows, cols) matrix for `role` as an F32 Matrix (a copy; small matrices only)."""
        return Matrix.of_floats(self.tensor_f32(self.name(role, layer), (rows, cols)))

    def vector(self, role: str, layer: Optional[int], n: int) -> np.ndarray:
        """The float32 (n,) vector for `role` (a norm weight; a copy, independent of the map)."""
        return self.tensor_f32(self.name(role, layer), (n,))


# llama.cpp's reranker head: the output matrix's rows of "yes" and "no", in that order
RANK_HEAD = "cls.output.weight"


def _is_router(name: str) -> bool:
    """MoE router tensors stay float in quantized files (llama.cpp's converter and quantizer
    keep them F32), and are read as float32."""
    return name.endswith(".ffn_gate_inp.weight")


def open_gguf(path: str) -> GGUFReader:
    """A GGUFReader on `path` (memory-mapped), after checking magic, version and that every
    tensor lies inside the file; any fault is a ModelLoadError naming the file."""
    _check_header(path)
    try:
        reader = _Reader(path, "r")
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad data
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file "
                             f"({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: truncated file: tensor {t.name} needs bytes "
                                 f"{t.data_offset}..{t.data_offset + t.n_bytes}, "
                                 f"the file has {size}")
    return reader


def _check_header(path: str) -> None:
    """Magic and version, read directly so the message can say which is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: bad magic {head[:4]!r}, not a GGUF file (want {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise ModelLoadError(f"{path}: truncated file: {len(head)} bytes, "
                             "shorter than the 24-byte GGUF header")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}; "
                             f"supported: {', '.join(map(str, GGUF_VERSIONS))}")

