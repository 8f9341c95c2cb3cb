"""Qwen3-VL, one image + a question: image preprocessing, vision encode, prefill, decode, and
a second question on the same image (a prefix hit: the encoder is skipped).

    .venv/bin/python bench/vision.py --threads 2            # `make bench-vision`
    .venv/bin/python bench/vision.py --small                # a small model: checks the harness
    .venv/bin/python bench/vision.py --text-type Q4_K_M     # the language model as users get it

Model: random weights with exactly Qwen3-VL-2B-Instruct's shapes (`QWEN3VL_2B`, from the
published config.json: vision tower of 24 blocks of width 1024, 16 heads, MLP 4096, patch 16,
merge 2, DeepStack after blocks 5, 11, 17; language model of 28 layers, hidden 2048, 16 / 8
KV heads of 128, FFN 6144, vocab 151936, tied, RoPE theta 5e6, M-RoPE [24, 20, 20]), written
once into the cache as a Hugging Face directory (bf16 safetensors, ~4.3 GB, tensor by tensor)
with a synthetic byte-level vocabulary holding Qwen's special tokens at their real ids. Speed
does not depend on the weight values.

Each repetition takes a fresh 448 x 448 JPEG (28 x 28 patches -> 196 visual tokens), so its
first request is a prefix miss (asserted), and runs in the in-process `Engine`:
  1. image decode and preprocess, timed alone (the request does them again when its prompt is built);
  2. request 1: image + question, greedy, 64 tokens (ignore_eos): vision encode ms,
     prefill of the whole prompt (language model only: encode excluded) and decode tok/s;
  3. request 2: another question on the same image: the image's KV is reused (asserted:
     nothing encoded, the cached tokens cover the image) and its time to first token.
The median of `--reps` repetitions is reported, after one warm-up request that pages the
weights in; RSS after load, after that first request and after the first prefix hit.

llama.cpp beside it, in the same run and on the same files: the cached Q8_0 text GGUF +
mmproj pair that Kestrel maps (kestreld.model.convert_vl writes it in llama.cpp's layout;
bench/mmproj_vs_mtmd.py checks that both encoders agree), through llama-cpp-python's libllama
and libmtmd, chunk by chunk as llama-server evaluates a prompt, with its repacking on, flash
attention on and n_batch = n_ubatch = 2048. Each repetition asks Kestrel, then llama.cpp,
the same two questions on the same image; llama.cpp's second request keeps the KV up to the
image's end (llama-server's cache_prompt). `--no-llamacpp` (or no llama-cpp-python
installed) measures Kestrel alone. `--text-type Q4_K_M` (or Q4_0) runs both on llama.cpp's
quantizer's output from that text GGUF instead (bench/common.py), beside the same mmproj: the
4-bit language model that users download with an F16 or Q8_0 mmproj.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

# runnable from a checkout whether or not the package is installed into the venv
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.join(ROOT, "tests"))   # modelgen_vl: the chat template, test pictures

from common import llama_quantized, rss_mb, synthetic_qwen_vocab
from modelgen_vl import CHAT_TEMPLATE, test_image

from kestreld.service.config import default_cache_dir

# Qwen's special tokens at their real ids (tokenizer.json of Qwen3-VL).
SPECIAL_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
               151652: "<|vision_start|>", 151653: "<|vision_end|>",
               151655: "<|image_pad|>", 151656: "<|video_pad|>"}
IMAGE_SIDE = 448
DECODE_TOKENS = 64
QUESTION_1 = "Describe this picture: what is in it, and what colours dominate?"
QUESTION_2 = "Is there any text in this picture? If so, read it."
# Bump when the generator below changes, so cached directories are rewritten.
FILE_VERSION = 1


@dataclass(frozen=True)
class VLShapes:
    """The shapes of a Qwen3-VL model (config.json's text_config and vision_config)."""
    name: str
    # language model
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    mrope_section: tuple         # sums to head_dim / 2
    # vision tower
    v_depth: int
    v_hidden: int
    v_heads: int
    v_ffn: int
    v_pos: int                   # learned position grid: sqrt(v_pos) per side
    deepstack: tuple             # blocks whose output feeds a DeepStack merger
    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2


# Qwen/Qwen3-VL-2B-Instruct config.json. (transformers' Qwen3VLVisionConfig defaults are the
# larger models' tower: depth 27, width 1152, MLP 4304, DeepStack 8/16/24; not these.)
QWEN3VL_2B = VLShapes("qwen3vl-2b", n_layers=28, hidden=2048, n_heads=16, n_kv_heads=8,
                      head_dim=128, ffn=6144, vocab=151936, rope_theta=5e6,
                      mrope_section=(24, 20, 20), v_depth=24, v_hidden=1024, v_heads=16,
                      v_ffn=4096, v_pos=2304, deepstack=(5, 11, 17))
# --small: the same structure at a fraction of the size (the vocabulary stays: real token ids).
QWEN3VL_SMALL = VLShapes("qwen3vl-small", n_layers=4, hidden=256, n_heads=4, n_kv_heads=2,
                         head_dim=64, ffn=512, vocab=151936, rope_theta=5e6,
                         mrope_section=(12, 10, 10), v_depth=4, v_hidden=128, v_heads=2,
                         v_ffn=256, v_pos=2304, deepstack=(1, 2, 3))


# ---- the model directory ------------------------------------------------------------------

def tensor_specs(s: VLShapes):
    """(name, shape, kind) of every tensor, in file order; kind: "matrix" (random, std
    1/sqrt(fan-in)), "embed" (random, std 0.02), "ones" or "zeros"."""
    lm = "model.language_model."
    yield lm + "embed_tokens.weight", (s.vocab, s.hidden), "embed"
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    for i in range(s.n_layers):
        p = f"{lm}layers.{i}."
        yield p + "input_layernorm.weight", (s.hidden,), "ones"
        yield p + "self_attn.q_proj.weight", (q_dim, s.hidden), "matrix"
        yield p + "self_attn.k_proj.weight", (kv_dim, s.hidden), "matrix"
        yield p + "self_attn.v_proj.weight", (kv_dim, s.hidden), "matrix"
        yield p + "self_attn.o_proj.weight", (s.hidden, q_dim), "matrix"
        yield p + "self_attn.q_norm.weight", (s.head_dim,), "ones"
        yield p + "self_attn.k_norm.weight", (s.head_dim,), "ones"
        yield p + "post_attention_layernorm.weight", (s.hidden,), "ones"
        yield p + "mlp.gate_proj.weight", (s.ffn, s.hidden), "matrix"
        yield p + "mlp.up_proj.weight", (s.ffn, s.hidden), "matrix"
        yield p + "mlp.down_proj.weight", (s.hidden, s.ffn), "matrix"
    yield lm + "norm.weight", (s.hidden,), "ones"       # tied: no lm_head.weight
    v, H = "model.visual.", s.v_hidden
    yield v + "patch_embed.proj.weight", (H, 3, s.temporal_patch, s.patch, s.patch), "matrix"
    yield v + "patch_embed.proj.bias", (H,), "zeros"
    yield v + "pos_embed.weight", (s.v_pos, H), "embed"
    for i in range(s.v_depth):
        b = f"{v}blocks.{i}."
        for norm in ("norm1", "norm2"):
            yield b + norm + ".weight", (H,), "ones"
            yield b + norm + ".bias", (H,), "zeros"
        for name, rows, cols in (("attn.qkv", 3 * H, H), ("attn.proj", H, H),
                                 ("mlp.linear_fc1", s.v_ffn, H), ("mlp.linear_fc2", H, s.v_ffn)):
            yield b + name + ".weight", (rows, cols), "matrix"
            yield b + name + ".bias", (rows,), "zeros"
    wide = H * s.merge * s.merge
    mergers = [("merger.", H)] + [(f"deepstack_merger_list.{j}.", wide)
                                  for j in range(len(s.deepstack))]
    for m, norm_n in mergers:
        yield v + m + "norm.weight", (norm_n,), "ones"
        yield v + m + "norm.bias", (norm_n,), "zeros"
        yield v + m + "linear_fc1.weight", (wide, wide), "matrix"
        yield v + m + "linear_fc1.bias", (wide,), "zeros"
        yield v + m + "linear_fc2.weight", (s.hidden, wide), "matrix"
        yield v + m + "linear_fc2.bias", (s.hidden,), "zeros"


def _bf16_chunks(rng: np.random.Generator, shape: tuple, kind: str, chunk: int = 1 << 23):
    """The tensor's bf16 bit patterns (uint16), at most `chunk` values at a time; matrices
    and embeddings are uniform with the kind's standard deviation."""
    n = int(np.prod(shape))
    if kind in ("ones", "zeros"):
        value = np.float32(1.0 if kind == "ones" else 0.0)
        yield np.full(n, value.view(np.uint32) >> 16, dtype=np.uint16)
        return
    std = 0.02 if kind == "embed" else 1.0 / np.sqrt(int(np.prod(shape[1:])))
    half_width = np.float32(std * np.sqrt(3.0))        # uniform [-a, a] has std a/sqrt(3)
    for start in range(0, n, chunk):
        x = rng.random(min(chunk, n - start), dtype=np.float32)
        x = (x * 2 - 1) * half_width
        yield (x.view(np.uint32) >> 16).astype(np.uint16)   # truncation: values are random anyway


def write_safetensors(path: str, s: VLShapes, seed: int = 0) -> None:
    """model.safetensors of random bf16 weights, generated and written one chunk at a time
    (memory stays at one chunk; the whole 2B model never is in memory)."""
    specs = list(tensor_specs(s))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                       # data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, shape, kind in specs:
            for part in _bf16_chunks(rng, shape, kind):
                f.write(part.tobytes())


def hf_config(s: VLShapes) -> dict:
    """config.json as Qwen3-VL-2B-Instruct publishes it (rope_scaling in text_config)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": s.vocab, "hidden_size": s.hidden,
            "intermediate_size": s.ffn, "num_hidden_layers": s.n_layers,
            "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads,
            "head_dim": s.head_dim, "hidden_act": "silu", "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "rope_theta": s.rope_theta, "tie_word_embeddings": True,
            "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True,
                             "mrope_section": list(s.mrope_section)}},
        "vision_config": {
            "model_type": "qwen3_vl", "depth": s.v_depth, "hidden_size": s.v_hidden,
            "hidden_act": "gelu_pytorch_tanh", "intermediate_size": s.v_ffn,
            "num_heads": s.v_heads, "in_channels": 3, "patch_size": s.patch,
            "spatial_merge_size": s.merge, "temporal_patch_size": s.temporal_patch,
            "out_hidden_size": s.hidden, "num_position_embeddings": s.v_pos,
            "deepstack_visual_indexes": list(s.deepstack)},
    }


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """tokenizer.json (a byte-level BPE over common.synthetic_qwen_vocab, with Qwen3-VL's
    special tokens at their ids) and tokenizer_config.json (the tests' Qwen3-VL template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = synthetic_qwen_vocab(vocab_size)
    for i, text in SPECIAL_IDS.items():
        tokens[i] = text
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_IDS.values()])
    assert all(tok.token_to_id(t) == i for i, t in SPECIAL_IDS.items())
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
                   "tokenizer_class": "Qwen2TokenizerFast"}, f, indent=2)


def preprocessor_config(s: VLShapes) -> dict:
    """preprocessor_config.json of Qwen3-VL-2B-Instruct (65536..16777216 pixels)."""
    return {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": 65536, "longest_edge": 16777216},
            "patch_size": s.patch, "temporal_patch_size": s.temporal_patch, "merge_size": s.merge,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def model_dir(cache_dir: str, s: VLShapes) -> str:
    """cache_dir/<name>-shaped-random: the model's Hugging Face directory, written once
    (into a temporary directory renamed into place) unless its stamp matches."""
    path = os.path.join(cache_dir, f"{s.name}-shaped-random")
    stamp = {"version": FILE_VERSION, "shapes": asdict(s)}
    try:
        with open(os.path.join(path, "kestrel-bench.stamp")) as f:
            if json.load(f) == json.loads(json.dumps(stamp)):
                return path
    except (OSError, ValueError):
        pass
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir, suffix=".part")
    try:
        t0 = time.perf_counter()
        print(f"writing {path} once ...", file=sys.stderr)
        write_safetensors(os.path.join(tmp, "model.safetensors"), s)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(s), f, indent=2)
        with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor_config(s), f, indent=2)
        write_tokenizer(tmp, s.vocab)
        with open(os.path.join(tmp, "kestrel-bench.stamp"), "w") as f:
            json.dump(stamp, f)
        os.chmod(tmp, 0o755)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        print(f"  written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- measurement --------------------------------------------------------------------------

def question(image: bytes, text: str) -> list:
    return [{"role": "user", "content": [{"type": "image", "data": image},
                                         {"type": "text", "text": text}]}]


def preprocess_ms(engine, image: bytes) -> tuple[float, float]:
    """(decode ms, preprocess ms) of one encoded image, as building the prompt does them."""
    from kestreld.vision.images import decode_image, preprocess
    t0 = time.perf_counter()
    rgb = decode_image(image)
    t1 = time.perf_counter()
    preprocess(rgb, engine.model.vision.cfg.image)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def ask(engine, image: bytes, text: str, max_tokens: int) -> dict:
    """One chat request (image + text): its prompt built, then generated; its figures."""
    from kestreld.engine.prompt import ChatInput
    from kestreld.engine.sampler import SamplingOptions
    t0 = time.perf_counter()
    prompt = engine.prompt(ChatInput(tuple(question(image, text))))
    vision = prompt.vision
    prompt_ms = (time.perf_counter() - t0) * 1e3
    c = engine.generate(prompt, SamplingOptions(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True))
    assert c.completion_tokens == max_tokens, c.completion_tokens
    encode_ms = c.images.encode_ms
    lm_prefill_ms = c.prefill_ms - encode_ms
    return {"chat_prompt_ms": prompt_ms, "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens, "prefill_tokens": c.prefill_tokens,
            "visual_tokens": c.images.visual_tokens, "encoded": c.images.encoded,
            "image_end": vision.spans[-1][1], "encode_ms": encode_ms,
            "prefill_ms": lm_prefill_ms, "prefill_tps": c.prefill_tokens / (lm_prefill_ms / 1e3),
            "ttft_ms": c.ttft_ms, "request_ttft_ms": prompt_ms + c.ttft_ms,
            "decode_tps": (c.completion_tokens - 1) / (c.decode_ms / 1e3) if max_tokens > 1
            else float("nan")}


def repetition(engine, seed: int, llama=None) -> tuple[dict, dict | None]:
    """Preprocessing alone, request 1 (a miss) and request 2 (same image: a hit), for
    Kestrel and then (if given) llama.cpp."""
    image = test_image(seed, IMAGE_SIDE, IMAGE_SIDE, "JPEG")
    decode_ms, prep_ms = preprocess_ms(engine, image)
    first = ask(engine, image, QUESTION_1, DECODE_TOKENS)
    assert first["cached_tokens"] == 0 and first["encoded"] == 1, first
    second = ask(engine, image, QUESTION_2, 1)
    assert second["encoded"] == 0 and second["cached_tokens"] >= second["image_end"], second
    ours = {"image_bytes": len(image), "decode_ms": decode_ms, "preprocess_ms": prep_ms,
            "first": first, "second": second}
    if llama is None:
        return ours, None
    theirs = {"first": llama.ask(image, seed, mtmd_prompt(QUESTION_1), DECODE_TOKENS),
              "second": llama.ask(image, seed, mtmd_prompt(QUESTION_2), 1)}
    assert theirs["first"]["encoded"] == 1 and theirs["second"]["encoded"] == 0, theirs
    return ours, theirs


def mtmd_prompt(text: str) -> str:
    """The chat prompt of `question` as llama.cpp's mtmd takes it: its media marker where the
    template puts <|vision_start|><|image_pad|><|vision_end|> (mtmd adds those two itself)."""
    from llama_cpp import mtmd_cpp as mtmd
    marker = mtmd.mtmd_default_marker().decode()
    return f"<|im_start|>user\n{marker}{text}<|im_end|>\n<|im_start|>assistant\n"


class LlamaCppVL:
    """llama.cpp on the same text GGUF + mmproj pair: llama-cpp-python's libllama for the
    language model and its libmtmd (clip.cpp) for the image, driven chunk by chunk as
    llama-server does, so the encode, the prefill and the decode are timed apart. The KV
    after the image is kept for the next question on the same image (llama-server's
    cache_prompt)."""
    name = "llama.cpp"

    def __init__(self, text: str, mmproj: str, threads: int, n_ctx: int, n_batch: int = 2048):
        import llama_cpp
        from llama_cpp import mtmd_cpp as mtmd
        from common import open_llama
        self.lc, self.mtmd, self.n_batch = llama_cpp, mtmd, n_batch
        # llama.cpp's own errors only (its model and clip loaders log hundreds of lines)
        self._log = llama_cpp.llama_log_callback(
            lambda level, text, _: level == 3 and sys.stderr.write(text.decode(errors="replace")))
        for set_log in (llama_cpp.llama_log_set, mtmd.mtmd_log_set, mtmd.mtmd_helper_log_set):
            set_log(self._log, None)
        self.llm = open_llama(text, True, n_threads=threads, n_threads_batch=threads,
                              n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, flash_attn=True,
                              seed=0, verbose=False)
        self.lctx, self.vocab = self.llm._ctx.ctx, self.llm.n_vocab()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.warmup = False, threads, False
        self.mctx = mtmd.mtmd_init_from_file(mmproj.encode(), self.llm._model.model, params)
        if not self.mctx:
            raise RuntimeError(f"llama.cpp's mtmd cannot load {mmproj}")
        self.batch = llama_cpp.llama_batch_init(1, 0, 1)
        self.image_id = None            # the image whose KV ends at self.image_end
        self.image_end = 0

    def close(self) -> None:
        """Free llama.cpp's contexts and model while the log callback above still exists
        (llama.cpp logs as it frees)."""
        self.mtmd.mtmd_free(self.mctx)
        self.lc.llama_batch_free(self.batch)
        self.llm.close()

    def _chunks(self, image: bytes, prompt: str):
        """mtmd's chunks of the prompt (its media marker where the image goes)."""
        mtmd = self.mtmd
        buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.mctx, buf, len(image), False)
        chunks = mtmd.mtmd_input_chunks_init()
        raw = prompt.encode()
        text = mtmd.mtmd_input_text(raw, len(raw), False, True)   # no BOS; special tokens parsed
        if mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text),
                              (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            raise RuntimeError("mtmd_tokenize failed")
        mtmd.mtmd_bitmap_free(bitmap)
        return chunks

    def _argmax(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.lctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def _decode_one(self, tok: int, pos: int) -> None:
        b = self.batch
        b.n_tokens = 1
        b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = tok, pos, 1, True
        b.seq_id[0][0] = 0
        if self.lc.llama_decode(self.lctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def ask(self, image: bytes, image_id: int, prompt: str, max_tokens: int) -> dict:
        """One request: its figures as bench/vision.py's `ask` reports them."""
        mtmd = self.mtmd
        t0 = time.perf_counter()
        chunks = self._chunks(image, prompt)
        tokenize_ms = (time.perf_counter() - t0) * 1e3
        n_chunks = mtmd.mtmd_input_chunks_size(chunks)
        kinds = [mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                 for i in range(n_chunks)]
        img = kinds.index(mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        hit = self.image_id == image_id
        mem = self.lc.llama_get_memory(self.lctx)
        if hit:                          # keep the KV up to the image's end
            self.lc.llama_memory_seq_rm(mem, 0, self.image_end, -1)
        else:
            self.lc.llama_memory_clear(mem, True)
        n_past, new = (self.image_end if hit else 0), self.lc.llama_pos(0)
        encode_ms = prefill_ms = 0.0
        visual = prefilled = cached = 0
        t1 = time.perf_counter()
        for i in range(img + 1 if hit else 0, n_chunks):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            n_tok = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if i == img:
                visual = n_tok
                t = time.perf_counter()
                if mtmd.mtmd_encode_chunk(self.mctx, chunk) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed")
                encode_ms += (time.perf_counter() - t) * 1e3
                t = time.perf_counter()
                rc = mtmd.mtmd_helper_decode_image_chunk(
                    self.mctx, self.lctx, chunk, mtmd.mtmd_get_output_embd(self.mctx), n_past, 0,
                    self.n_batch, ctypes.byref(new), mtmd.mtmd_helper_post_decode_callback(0),
                    None)
            else:
                t = time.perf_counter()
                rc = mtmd.mtmd_helper_eval_chunk_single(self.mctx, self.lctx, chunk, n_past, 0,
                                                        self.n_batch, i == n_chunks - 1,
                                                        ctypes.byref(new))
            if rc != 0:
                raise RuntimeError(f"llama.cpp could not evaluate chunk {i}")
            tok = self._argmax() if i == n_chunks - 1 else None   # waits for the pass
            prefill_ms += (time.perf_counter() - t) * 1e3
            prefilled += n_tok
            n_past = new.value
            if i == img:
                self.image_id, self.image_end = image_id, n_past
        if hit:
            cached = sum(mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                         for i in range(img + 1))
        ttft_ms = (time.perf_counter() - t1) * 1e3
        t = time.perf_counter()
        for _ in range(max_tokens - 1):
            self._decode_one(tok, n_past)
            n_past += 1
            tok = self._argmax()
        decode_ms = (time.perf_counter() - t) * 1e3
        mtmd.mtmd_input_chunks_free(chunks)
        return {"chat_prompt_ms": tokenize_ms, "prompt_tokens": cached + prefilled,
                "cached_tokens": cached, "prefill_tokens": prefilled, "visual_tokens": visual,
                "encoded": int(not hit), "encode_ms": encode_ms, "prefill_ms": prefill_ms,
                "prefill_tps": prefilled / (prefill_ms / 1e3), "ttft_ms": ttft_ms,
                "request_ttft_ms": tokenize_ms + ttft_ms,
                "decode_tps": (max_tokens - 1) / (decode_ms / 1e3) if max_tokens > 1
                else float("nan")}



def median(reps: list, *keys) -> float:
    def get(r):
        for k in keys:
            r = r[k]
        return r
    return statistics.median(get(r) for r in reps)


def table(reps: list, res: dict, theirs: list | None = None) -> str:
    """The Markdown table of the medians; with llama.cpp's repetitions, its column and the
    ratio (Kestrel's speed over llama.cpp's: > 1 where Kestrel is faster)."""
    m = lambda *k: median(reps, *k)  # noqa: E731
    t = (lambda *k: median(theirs, *k)) if theirs else None  # noqa: E731
    # label, Kestrel's value, llama.cpp's (None: not measured), "time" / "rate" (for the ratio)
    measured = [
        ("vision encode ms", ("first", "encode_ms"), "{:.0f}", "time"),
        ("request 1: prompt tokens (image + question)", ("first", "prompt_tokens"), "{:.0f}", None),
        ("request 1: prefill ms (language model)", ("first", "prefill_ms"), "{:.0f}", "time"),
        ("request 1: prefill tok/s", ("first", "prefill_tps"), "{:.1f}", "rate"),
        ("request 1: TTFT ms (preprocess + encode + prefill)", ("first", "request_ttft_ms"),
         "{:.0f}", "time"),
        (f"request 1: decode tok/s ({DECODE_TOKENS} tokens)", ("first", "decode_tps"), "{:.2f}",
         "rate"),
        ("request 2, same image: cached tokens", ("second", "cached_tokens"), "{:.0f}", None),
        ("request 2: prefilled tokens", ("second", "prefill_tokens"), "{:.0f}", None),
        ("request 2: TTFT ms (preprocess + prefill)", ("second", "request_ttft_ms"), "{:.0f}",
         "time"),
    ]
    rows = [
        ("image", f"{IMAGE_SIDE}x{IMAGE_SIDE} JPEG, {m('image_bytes') / 1e3:.0f} kB", "", ""),
        ("visual tokens (28 x 28 patches, merged 2 x 2)", f"{m('first', 'visual_tokens'):.0f}",
         f"{t('first', 'visual_tokens'):.0f}" if t else "", ""),
        ("image decode / preprocess ms", f"{m('decode_ms'):.1f} / {m('preprocess_ms'):.1f}", "", ""),
    ]
    for label, keys, fmt, kind in measured:
        ours = m(*keys)
        other = t(*keys) if t else None
        ratio = "" if other is None or kind is None else \
            f"{(other / ours if kind == 'time' else ours / other):.2f}"
        rows.append((label, fmt.format(ours), "" if other is None else fmt.format(other), ratio))
    rows += [
        ("TTFT request 1 / request 2",
         f"{m('first', 'request_ttft_ms') / m('second', 'request_ttft_ms'):.1f}x",
         f"{t('first', 'request_ttft_ms') / t('second', 'request_ttft_ms'):.1f}x" if t else "", ""),
        ("one-time conversion (and quantization) s (0: cached)", f"{res['convert_s']:.1f}", "", ""),
        ("load s (cached pair, mapped) / RSS after load MB",
         f"{res['load_s']:.1f} / {res['rss_load']:.0f}",
         f"{res['llama_load_s']:.1f} / -" if t else "", ""),
        ("RSS after 1st request / after 1st prefix hit MB",
         f"{res['rss_first']:.0f} / {res['rss_hit']:.0f}", "", ""),
    ]
    if not theirs:
        return "\n".join(["| Qwen3-VL, one image + a question | Kestrel |", "|---|---:|"]
                         + [f"| {a} | {b} |" for a, b, _, _ in rows])
    return "\n".join(["| Qwen3-VL, one image + a question | Kestrel | llama.cpp | Kestrel / llama.cpp |",
                      "|---|---:|---:|---:|"] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--max-seq", type=int, default=8192, help="KV arena tokens (default 8192)")
    p.add_argument("--small", action="store_true",
                   help="a small Qwen3-VL (4 + 4 layers): checks the harness works")
    p.add_argument("--no-llamacpp", action="store_true", help="measure Kestrel alone")
    p.add_argument("--text-type", choices=["Q8_0", "Q4_K_M", "Q4_0"], default="Q8_0",
                   help="the language model's GGUF: the cached Q8_0 one (default), or llama.cpp's "
                        "quantizer's output from it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from kestreld.engine.generate import Engine
    from kestreld.model.convert_vl import cached_qwen3vl_pair
    from kestreld.model.load import load_model

    shapes = QWEN3VL_SMALL if args.small else QWEN3VL_2B
    cache = default_cache_dir(os.environ)
    path = model_dir(cache, shapes)
    print(f"{shapes.name}: {path}", file=sys.stderr)
    t0 = time.perf_counter()
    text, mmproj = cached_qwen3vl_pair(path, cache)   # as kestreld does: converted once, mapped
    if args.text_type != "Q8_0":
        text = llama_quantized(text, args.text_type, cache)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = (load_model(path, cache_dir=cache) if args.text_type == "Q8_0"
             else load_model(text, mmproj=mmproj))
    # one token per decode pass, as mtmd's: speculation is bench/speculate.py's
    engine = Engine(model, max_seq=args.max_seq, threads=args.threads, speculate=False)
    res = {"convert_s": convert_s, "load_s": time.perf_counter() - t0, "rss_load": rss_mb()}
    warm = test_image(0, IMAGE_SIDE, IMAGE_SIDE, "JPEG")
    first = ask(engine, warm, QUESTION_1, DECODE_TOKENS)    # pages the weights in
    res["rss_first"] = rss_mb()
    ask(engine, warm, QUESTION_2, 1)
    res["rss_hit"] = rss_mb()
    print(f"  first request (cold): encode {first['encode_ms']:.0f} ms, prefill "
          f"{first['prefill_tps']:.1f} tok/s, decode {first['decode_tps']:.2f} tok/s", file=sys.stderr)
    llama = None
    if not args.no_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        t0 = time.perf_counter()     # after Kestrel's RSS figures: one process holds both
        llama = LlamaCppVL(text, mmproj, args.threads, args.max_seq)
        res["llama_load_s"] = time.perf_counter() - t0
        llama.ask(warm, 0, mtmd_prompt(QUESTION_1), DECODE_TOKENS)
    elif not args.no_llamacpp:
        print("llama-cpp-python is not installed: only Kestrel is measured", file=sys.stderr)
    reps, theirs = [], []
    for rep in range(args.reps):
        r, o = repetition(engine, seed=1 + rep, llama=llama)
        reps.append(r)
        f, s = r["first"], r["second"]
        print(f"  rep {rep + 1}/{args.reps}: encode {f['encode_ms']:.0f} ms, prefill "
              f"{f['prefill_tps']:.1f} tok/s, decode {f['decode_tps']:.2f} tok/s, hit TTFT "
              f"{s['request_ttft_ms']:.0f} ms (cached {s['cached_tokens']})", file=sys.stderr)
        if o:
            theirs.append(o)
            f, s = o["first"], o["second"]
            print(f"     llama.cpp: encode {f['encode_ms']:.0f} ms, prefill {f['prefill_tps']:.1f} "
                  f"tok/s, decode {f['decode_tps']:.2f} tok/s, hit TTFT {s['request_ttft_ms']:.0f} "
                  f"ms (cached {s['cached_tokens']})", file=sys.stderr)
    print(f"\n{shapes.name} (random weights, {args.text_type} text GGUF + Q8_0 mmproj), "
          f"threads {args.threads}, "
          f"median of {args.reps}, max_seq = n_ctx = {args.max_seq}, greedy, ignore_eos")
    if llama:
        print("llama.cpp: llama-cpp-python's libllama + libmtmd on the same pair, repacking on, "
              "flash attention on, n_batch = n_ubatch = 2048\n")
    print(table(reps, res, theirs or None))
    if llama:
        llama.close()
    return 0

if __name__ == "__main__":
    sys.exit(main())
