"""Benchmark helpers: the models to measure, memory bandwidth, RSS.

- `qwen3_shaped_q8_0_path`: a random-weight Q8_0 GGUF with exactly Qwen3-0.6B's shapes,
  written once into the cache (a 0.6B model's real weights cannot be downloaded here, and
  speed does not depend on the values).
- `qwen3moe_shaped_q8_0_path`: the same for a small Qwen3-MoE (`QWEN3MOE_SMALL`: 64
  experts, top-8, like Qwen3-30B-A3B's routing at a fraction of its size). Its routers are
  F32 as in llama.cpp's files, random, so tokens spread over all experts.
- `weight_bytes_per_token`: bytes of weights one decode step reads; with `copy_bandwidth`
  it gives the memory-bound ceiling of decode tokens/s.
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

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(n_layers=28, hidden=1024, n_heads=16, n_kv_heads=8, head_dim=128, ffn=3072,
                  vocab=151936, rope_theta=1e6, norm_eps=1e-6, context_length=40960)
# A small Qwen3-MoE: Qwen3-30B-A3B's head_dim (128) and routing (top-8), with 64 experts of
# 384 at hidden 1024, 16 layers, 4 query heads per KV head; ffn is metadata only.
QWEN3MOE_SMALL = dict(n_layers=16, hidden=1024, n_heads=16, n_kv_heads=4, head_dim=128,
                      ffn=3072, vocab=151936, rope_theta=1e6, norm_eps=1e-6,
                      context_length=40960, n_experts=64, n_experts_used=8, expert_ffn=384)
QWEN3_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
QWEN3_FILE = "qwen3-0.6b-shaped-random.Q8_0.gguf"
QWEN3MOE_FILE = "qwen3moe-small-shaped-random.Q8_0.gguf"
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


def _qwen3_tensors(s: dict):
    """(name, kind, shape) of every tensor, in file order; kind is "q8" (rows, cols),
    "q8_experts" (n_experts, rows, cols), "router" (n_experts, hidden) F32 or "ones".
    With `n_experts` in s, every layer's feed-forward is MoE (llama.cpp's qwen3moe)."""
    q_dim, kv_dim = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    yield "token_embd.weight", "q8", (s["vocab"], s["hidden"])
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", "ones", (s["hidden"],)
        yield p + "attn_q.weight", "q8", (q_dim, s["hidden"])
        yield p + "attn_k.weight", "q8", (kv_dim, s["hidden"])
        yield p + "attn_v.weight", "q8", (kv_dim, s["hidden"])
        yield p + "attn_output.weight", "q8", (s["hidden"], q_dim)
        yield p + "attn_q_norm.weight", "ones", (s["head_dim"],)
        yield p + "attn_k_norm.weight", "ones", (s["head_dim"],)
        yield p + "ffn_norm.weight", "ones", (s["hidden"],)
        if "n_experts" in s:
            e, f = s["n_experts"], s["expert_ffn"]
            yield p + "ffn_gate_inp.weight", "router", (e, s["hidden"])
            yield p + "ffn_gate_exps.weight", "q8_experts", (e, f, s["hidden"])
            yield p + "ffn_down_exps.weight", "q8_experts", (e, s["hidden"], f)
            yield p + "ffn_up_exps.weight", "q8_experts", (e, f, s["hidden"])
            continue
        yield p + "ffn_gate.weight", "q8", (s["ffn"], s["hidden"])
        yield p + "ffn_up.weight", "q8", (s["ffn"], s["hidden"])
        yield p + "ffn_down.weight", "q8", (s["hidden"], s["ffn"])
    yield "output_norm.weight", "ones", (s["hidden"],)   # no output.weight: tied embeddings


def write_qwen3_shaped_gguf(path: str, shapes: dict = QWEN3_0_6B, seed: int = 0) -> None:
    """Write a qwen3 (qwen3moe when shapes has n_experts) GGUF with random Q8_0 weights of
    the given shapes (tensors are generated and written one at a time, so memory stays at
    one tensor)."""
    s, arch = shapes, "qwen3moe" if "n_experts" in shapes else "qwen3"
    w = gguf.GGUFWriter(path, arch)
    w.add_string("general.name", os.path.basename(path).split(".")[0])
    w.add_uint32("general.file_type", gguf.LlamaFileType.MOSTLY_Q8_0)
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
    w.add_uint32("tokenizer.ggml.eos_token_id", 151645)
    w.add_uint32("tokenizer.ggml.padding_token_id", 151643)
    w.add_uint32("tokenizer.ggml.bos_token_id", 151643)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML_TEMPLATE)
    specs = list(_qwen3_tensors(s))
    for name, kind, shape in specs:
        if kind in ("q8", "q8_experts"):
            byte_shape = (*shape[:-1], shape[-1] // 32 * 34)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=Q8_0)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, shape in specs:
        if kind in ("q8", "q8_experts"):
            rows = int(np.prod(shape[:-1]))
            data = _random_q8_0(rng, rows, shape[-1], std=0.02)
            w.write_tensor_data(data.reshape(*shape[:-1], -1))
        elif kind == "router":   # logits of std 1 on a unit-RMS input
            w.write_tensor_data(rng.normal(0, 1 / np.sqrt(shape[1]), shape).astype(np.float32))
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()


def qwen3_shaped_q8_0_path(cache_dir: str) -> str:
    """The random Qwen3-0.6B-shaped Q8_0 GGUF in cache_dir, written once (~640 MB)."""
    return _shaped_q8_0_path(cache_dir, QWEN3_FILE, QWEN3_0_6B)


def qwen3moe_shaped_q8_0_path(cache_dir: str) -> str:
    """The random small Qwen3-MoE Q8_0 GGUF in cache_dir, written once (~1.5 GB)."""
    return _shaped_q8_0_path(cache_dir, QWEN3MOE_FILE, QWEN3MOE_SMALL)


def _shaped_q8_0_path(cache_dir: str, file_name: str, shapes: dict) -> str:
    """cache_dir/file_name, (re)written by write_qwen3_shaped_gguf unless its stamp matches."""
    path = os.path.join(cache_dir, file_name)
    stamp_path = path + ".stamp"
    want = {"version": QWEN3_FILE_VERSION, "shapes": shapes}
    try:
        with open(stamp_path) as f:
            if json.load(f) == want and os.path.isfile(path):
                return path
    except (OSError, ValueError):
        pass
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".gguf.part")
    os.close(fd)
    try:
        write_qwen3_shaped_gguf(tmp, shapes)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(stamp_path, "w") as f:
        json.dump(want, f)
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
