"""Benchmark helpers: the models to measure, memory bandwidth, RSS.

- `qwen3_shaped_q8_0_path`: a random-weight Q8_0 GGUF with exactly Qwen3-0.6B's shapes,
  written once into the cache (a 0.6B model's real weights cannot be downloaded here, and
  speed does not depend on the values).
- `qwen3moe_shaped_q8_0_path`: the same for a small Qwen3-MoE (`QWEN3MOE_SMALL`: 64
  experts, top-8, like Qwen3-30B-A3B's routing at a fraction of its size). Its routers are
  F32 as in llama.cpp's files, random, so tokens spread over all experts.
- `weight_bytes_per_token`: bytes of weights one decode step reads; with `copy_bandwidth`
  it gives the memory-bound ceiling of decode tokens/s.
- `qwen3_shaped_path(..., "Q4_K_M")` etc.: the same shapes in llama.cpp's 4-bit mixes, made
  by llama.cpp's own quantizer (`llama_quantized`) from the Q8_0 file, so the type of each
  tensor is what `llama-quantize` picks.
- `write_qwen3_shaped_gguf(..., recipe=Q4_K_M_RECIPE)`: a file of Qwen3-30B-A3B's size written
  directly in llama.cpp's Q4_K_M mix (random valid blocks), with no 60 GB float file first.
- `open_llama`: llama-cpp-python's `Llama`, with ggml's extra weight buffer types (AMX,
  repacking) switchable, which llama-cpp-python does not expose.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager

import gguf
import numpy as np
import psutil

Q8_0 = gguf.GGMLQuantizationType.Q8_0
T = gguf.GGMLQuantizationType

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(n_layers=28, hidden=1024, n_heads=16, n_kv_heads=8, head_dim=128, ffn=3072,
                  vocab=151936, rope_theta=1e6, norm_eps=1e-6, context_length=40960)
# A small Qwen3-MoE: Qwen3-30B-A3B's head_dim (128) and routing (top-8), with 64 experts of
# 384 at hidden 1024, 16 layers, 4 query heads per KV head; ffn is metadata only.
# Qwen3-Embedding-0.6B: Qwen3-0.6B's shapes, no output matrix, last-token pooling
QWEN3_EMBEDDING_0_6B = dict(QWEN3_0_6B, pooling=3)
QWEN3MOE_SMALL = dict(n_layers=16, hidden=1024, n_heads=16, n_kv_heads=4, head_dim=128,
                      ffn=3072, vocab=151936, rope_theta=1e6, norm_eps=1e-6,
                      context_length=40960, n_experts=64, n_experts_used=8, expert_ffn=384)
# Qwen3-1.7B (Qwen3-VL-2B's language model): 28 layers, hidden 2048, 16 / 8 heads, FFN 6144.
QWEN3_1_7B = dict(n_layers=28, hidden=2048, n_heads=16, n_kv_heads=8, head_dim=128, ffn=6144,
                  vocab=151936, rope_theta=1e6, norm_eps=1e-6, context_length=40960)
# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 48 layers, 128 experts of 768, top-8.
QWEN3_30B_A3B = dict(n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                     ffn=6144, vocab=151936, rope_theta=1e6, norm_eps=1e-6,
                     context_length=40960, n_experts=128, n_experts_used=8, expert_ffn=768,
                     untied=True)
QWEN3_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
# Bump when the generator below changes, so cached files are rewritten.
QWEN3_FILE_VERSION = 1
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A few merges, so that the BPE has some (llama.cpp requires the key); results are tokens too.
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġ", "a"),
           ("r", "e")]


def _byte_level_chars() -> list:
    """GPT-2's byte -> printable character map, as a list indexed by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def synthetic_qwen_vocab(n_vocab: int) -> tuple[list, list, list]:
    """(tokens, token_types, merges) of a byte-level BPE vocabulary of n_vocab tokens:
    the 256 byte tokens, the merge results, fillers, and Qwen's three control tokens at
    their real ids. Normal = 1, control = 3 (gguf.TokenType)."""
    tokens = _byte_level_chars() + [a + b for a, b in _MERGES]
    tokens += [f"[filler{i}]" for i in range(len(tokens), n_vocab)]
    types = [1] * n_vocab
    for i, text in QWEN3_SPECIAL.items():
        tokens[i], types[i] = text, 3
    return tokens, types, [f"{a} {b}" for a, b in _MERGES]


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q8_0 matrix, uint8 (rows, cols/32*34): int8 uniform in [-127, 127] times one
    fp16 scale, so values have standard deviation `std`."""
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    d = np.float16(std / np.sqrt((127 * 128) / 3))   # std of uniform ints in [-127, 127]
    blocks[:, :, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, size=(rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the first and last eighth of the layers
    and every third one between."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def Q4_K_M_RECIPE(name: str, layer) -> "gguf.GGMLQuantizationType":
    """The type llama.cpp's quantizer gives a tensor of a Q4_K_M file whose rows are
    multiples of 256: Q6_K for the output matrix and for attn_v / ffn_down(_exps) of the
    layers where it uses more bits, Q4_K elsewhere."""
    if name == "output.weight":
        return T.Q6_K
    if layer is not None and ("attn_v" in name or "ffn_down" in name) and \
            _use_more_bits(layer, Q4_K_M_RECIPE.n_layers):
        return T.Q6_K
    return T.Q4_K


def _random_blocks(rng: np.random.Generator, qtype, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, row bytes) uint8 of random valid blocks of a quantized type: random codes, and
    finite fp16 scales that give values of about `std` (speed does not depend on them)."""
    if qtype == Q8_0:
        return _random_q8_0(rng, rows, cols, std)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * (cols // block), size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        raw[:, off:off + 2] = np.frombuffer(np.float16(std / 64).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


# byte offsets of the fp16 scales in one block of each type (ggml-common.h)
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
               T.Q6_K: (208,)}


def _qwen3_tensors(s: dict):
    """(name, kind, shape, layer) of every tensor, in file order; kind is "q" (rows, cols),
    "q_experts" (n_experts, rows, cols), "router" (n_experts, hidden) F32 or "ones".
    With `n_experts` in s, every layer's feed-forward is MoE (llama.cpp's qwen3moe); with
    `untied`, an output matrix of its own."""
    q_dim, kv_dim = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    yield "token_embd.weight", "q", (s["vocab"], s["hidden"]), None
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", "ones", (s["hidden"],), i
        yield p + "attn_q.weight", "q", (q_dim, s["hidden"]), i
        yield p + "attn_k.weight", "q", (kv_dim, s["hidden"]), i
        yield p + "attn_v.weight", "q", (kv_dim, s["hidden"]), i
        yield p + "attn_output.weight", "q", (s["hidden"], q_dim), i
        yield p + "attn_q_norm.weight", "ones", (s["head_dim"],), i
        yield p + "attn_k_norm.weight", "ones", (s["head_dim"],), i
        yield p + "ffn_norm.weight", "ones", (s["hidden"],), i
        if "n_experts" in s:
            e, f = s["n_experts"], s["expert_ffn"]
            yield p + "ffn_gate_inp.weight", "router", (e, s["hidden"]), i
            yield p + "ffn_gate_exps.weight", "q_experts", (e, f, s["hidden"]), i
            yield p + "ffn_down_exps.weight", "q_experts", (e, s["hidden"], f), i
            yield p + "ffn_up_exps.weight", "q_experts", (e, f, s["hidden"]), i
            continue
        yield p + "ffn_gate.weight", "q", (s["ffn"], s["hidden"]), i
        yield p + "ffn_up.weight", "q", (s["ffn"], s["hidden"]), i
        yield p + "ffn_down.weight", "q", (s["hidden"], s["ffn"]), i
    yield "output_norm.weight", "ones", (s["hidden"],), None
    if s.get("untied"):
        yield "output.weight", "q", (s["vocab"], s["hidden"]), None


def write_qwen3_shaped_gguf(path: str, shapes: dict = QWEN3_0_6B, seed: int = 0,
                            recipe=None) -> None:
    """Write a qwen3 (qwen3moe when shapes has n_experts) GGUF with random weights of the
    given shapes: Q8_0, or each matrix in the type recipe(name, layer) gives (Q4_K_M_RECIPE).
    Tensors are generated and written one at a time, so memory stays at one tensor."""
    s, arch = shapes, "qwen3moe" if "n_experts" in shapes else "qwen3"
    if recipe is not None:
        recipe.n_layers = s["n_layers"]
    kind_of = (lambda name, layer: Q8_0) if recipe is None else recipe
    w = gguf.GGUFWriter(path, arch)
    w.add_string("general.name", os.path.basename(path).split(".")[0])
    w.add_uint32("general.file_type", gguf.LlamaFileType.MOSTLY_Q8_0 if recipe is None
                 else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{arch}.block_count", s["n_layers"])
    w.add_uint32(f"{arch}.context_length", s["context_length"])
    w.add_uint32(f"{arch}.embedding_length", s["hidden"])
    w.add_uint32(f"{arch}.feed_forward_length", s["ffn"])
    w.add_uint32(f"{arch}.attention.head_count", s["n_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", s["n_kv_heads"])
    w.add_uint32(f"{arch}.attention.key_length", s["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", s["head_dim"])
    w.add_float32(f"{arch}.rope.freq_base", s["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", s["norm_eps"])
    if "n_experts" in s:
        w.add_uint32(f"{arch}.expert_count", s["n_experts"])
        w.add_uint32(f"{arch}.expert_used_count", s["n_experts_used"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", s["expert_ffn"])
    tokens, types, merges = synthetic_qwen_vocab(s["vocab"])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    if "pooling" in s:     # an embedding model: llama.cpp's pooling, EOS appended to a text
        w.add_uint32(f"{arch}.pooling_type", s["pooling"])
        w.add_bool("tokenizer.ggml.add_eos_token", True)
    w.add_uint32("tokenizer.ggml.eos_token_id", 151643 if "pooling" in s else 151645)
    w.add_uint32("tokenizer.ggml.padding_token_id", 151643)
    w.add_uint32("tokenizer.ggml.bos_token_id", 151643)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML_TEMPLATE)
    specs = list(_qwen3_tensors(s))
    for name, kind, shape, layer in specs:
        if kind in ("q", "q_experts"):
            qtype = kind_of(name, layer)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, shape, layer in specs:
        if kind in ("q", "q_experts"):
            rows = int(np.prod(shape[:-1]))
            data = _random_blocks(rng, kind_of(name, layer), rows, shape[-1], std=0.02)
            w.write_tensor_data(data.reshape(*shape[:-1], -1))
        elif kind == "router":   # logits of std 1 on a unit-RMS input
            w.write_tensor_data(rng.normal(0, 1 / np.sqrt(shape[1]), shape).astype(np.float32))
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()


SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3moe": QWEN3MOE_SMALL, "qwen3-1.7b": QWEN3_1_7B,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-embedding-0.6b": QWEN3_EMBEDDING_0_6B}


def qwen3_shaped_q8_0_path(cache_dir: str) -> str:
    """The random Qwen3-0.6B-shaped Q8_0 GGUF in cache_dir, written once (~640 MB)."""
    return shaped_path(cache_dir, "qwen3-0.6b", "Q8_0")


def qwen3moe_shaped_q8_0_path(cache_dir: str) -> str:
    """The random small Qwen3-MoE Q8_0 GGUF in cache_dir, written once (~1.5 GB)."""
    return shaped_path(cache_dir, "qwen3moe", "Q8_0")


def shaped_path(cache_dir: str, name: str, ftype: str) -> str:
    """The random GGUF of SHAPES[name] in `ftype` ("Q8_0", "Q4_K_M", "Q4_0"), written once
    into cache_dir: Q8_0 directly; the 4-bit mixes by llama.cpp's own quantizer from the Q8_0
    file, except Qwen3-30B-A3B's Q4_K_M (~18 GB), written directly in llama.cpp's mix."""
    shapes = SHAPES[name]
    file_name = f"{name}-shaped-random.{ftype}.gguf"
    if ftype == "Q8_0":
        return written_once(cache_dir, file_name, {"version": QWEN3_FILE_VERSION, "shapes": shapes},
                            lambda tmp: write_qwen3_shaped_gguf(tmp, shapes))
    if name == "qwen3-30b-a3b" and ftype == "Q4_K_M":
        return written_once(cache_dir, file_name, {"version": QWEN3_FILE_VERSION, "shapes": shapes,
                                                   "recipe": ftype},
                            lambda tmp: write_qwen3_shaped_gguf(tmp, shapes, recipe=Q4_K_M_RECIPE))
    return llama_quantized(shaped_path(cache_dir, name, "Q8_0"), ftype, cache_dir)


def llama_quantized(src: str, ftype: str, cache_dir: str) -> str:
    """`src` quantized to `ftype` ("Q4_K_M", "Q4_0", ...) by llama.cpp's own quantizer
    (llama_model_quantize, from llama-cpp-python), written once into cache_dir."""
    import ctypes

    import llama_cpp
    stem = os.path.basename(src).rsplit(".", 2)[0]

    def quantize(tmp: str) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize = True             # the source is already Q8_0
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    st = os.stat(src)
    return written_once(cache_dir, f"{stem}.{ftype}.gguf",
                        {"source": src, "size": st.st_size, "mtime": st.st_mtime_ns,
                         "llama_cpp": llama_cpp.__version__}, quantize)


def written_once(cache_dir: str, file_name: str, stamp: dict, write) -> str:
    """cache_dir/file_name, (re)made by write(tmp_path) unless the stamp beside it matches."""
    path = os.path.join(cache_dir, file_name)
    stamp_path = path + ".stamp"
    try:
        with open(stamp_path) as f:
            if json.load(f) == stamp and os.path.isfile(path):
                return path
    except (OSError, ValueError):
        pass
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".gguf.part")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return path


def weight_bytes_per_token(path: str) -> int:
    """Bytes of weights one decode step reads: every tensor except the token embedding (one
    row is read), which counts in full when it doubles as the output matrix (tied), and
    MoE experts, of which expert_used_count / expert_count are read."""
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    arch = reader.get_field("general.architecture").contents()
    n_exp, n_used = (reader.get_field(f"{arch}.{key}") for key in ("expert_count",
                                                                      "expert_used_count"))
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not tied:
            total += int(t.n_bytes) // int(t.shape[1])  # one row
        elif t.name.endswith("_exps.weight"):
            total += int(t.n_bytes) * n_used.contents() // n_exp.contents()
        else:
            total += int(t.n_bytes)
    return total


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s measured like STREAM's Copy: (read + written bytes) / time of
    numpy copying an `nbytes` array, best of `repeats` (one thread)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def rss_mb() -> float:
    """Resident set size of this process, in MB (10^6 bytes)."""
    return psutil.Process().memory_info().rss / 1e6


def cpu_has_amx() -> bool:
    """True if the CPU reports AMX-INT8 (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


@contextmanager
def _llama_model_params(**overrides):
    """Make llama_cpp's default model params carry `overrides` while a model loads."""
    import llama_cpp.llama_cpp as C
    default = C.llama_model_default_params

    def patched():
        params = default()
        for key, value in overrides.items():
            setattr(params, key, value)
        return params

    C.llama_model_default_params = patched
    try:
        yield
    finally:
        C.llama_model_default_params = default


def open_llama(path: str, extra_buffer_types: bool, **kwargs):
    """`llama_cpp.Llama(model_path=path, **kwargs)`; `extra_buffer_types=False` keeps the
    weights in plain CPU buffers (no AMX, no repacking). Needed where ggml's AMX matmul
    crashes: on this project's x86 VMs it segfaults on any batch of more than one token."""
    import llama_cpp
    with _llama_model_params(use_extra_bufts=extra_buffer_types):
        return llama_cpp.Llama(model_path=path, **kwargs)
