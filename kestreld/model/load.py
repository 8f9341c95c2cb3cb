"""`load_model(path)`: a GGUF file or a Hugging Face directory -> `LoadedModel`.

The format modules (`gguf_file`, `hf_dir`) open a file and hand out hyperparameters,
tokenizer, template and tensors by role; this module assembles them into the shared
weight layout and is the one place that decides which roles a model needs.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from ..errors import ModelLoadError
from .convert import cached_q8_0, find_cached_q8_0
from .gguf_file import GGUFSource
from .hf_dir import HFSource, is_qwen3vl_dir
from .mmproj import load_mmproj
from .vision_encoder import load_vision
from ..text.tokenizer import Tokenizer
from .config import ModelConfig
from .weights import Q8_BLOCK, LayerWeights, Matrix, ModelWeights, MoEWeights, compute_types

log = logging.getLogger("kestreld")



@dataclass
class LoadedModel:
    """Everything the engine needs from a model file or directory."""
    path: str
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: Optional[str]  # Jinja source, from the file
    chat_template_source: Optional[str]  # where it came from: "gguf", "tokenizer_config.json",
                                         # "chat_template.jinja"; None: there is none
    source_format: str            # "gguf" | "hf"
    source_dtype: str             # what the file held, e.g. "q8_0", "q4_1", "bf16"
    keepalive: list = field(default_factory=list)  # memory maps the arrays view into
    vision: Optional[object] = None  # Qwen3-VL: the vision encoder (vision.VisionEncoder)
    mmproj: Optional[str] = None     # the vision projector GGUF the encoder came from, if any
    conversion: Optional[str] = None  # None: every matrix in place from the map; else how
                                      # matrices the kernels do not compute on were converted
    rank_head: Optional[np.ndarray] = None   # a GGUF reranker's (2, hidden) rows yes, no
    rerank_template: Optional[str] = None    # its prompt, with {query} and {document}


def load_model(path: str, cache_dir: Optional[str] = None, mmproj: Optional[str] = None,
               fits: Optional[Callable[[ModelConfig, int], bool]] = None,
               interleave: bool = True) -> LoadedModel:
    """Load a model; any fault raises ModelLoadError naming the file and what is wrong.

    A GGUF's matrices of the types the kernels compute on are used in place from the map.
    With `cache_dir`, a GGUF with other matrices is converted once into a cached GGUF there
    (those matrices as Q8_0, the others byte for byte) and memory-mapped from it on every
    later start (fast start, weights in place); without it, or if the cache cannot be
    written, they are converted in memory at each load; a Qwen3-VL Hugging Face directory
    likewise becomes a cached Q8_0 text GGUF + mmproj pair. `mmproj`: llama.cpp's vision projector GGUF that goes with
    a qwen3vl text GGUF (the vision half of a split Qwen3-VL). `fits(config, bytes)`, called
    once the file is opened and before any weight is read: may refuse to go on when what the
    weights will take in memory (`bytes`, the vision encoder's mmproj file included) does
    not fit, else says whether it fits. `interleave`: the matrices the CPU has an interleaved
    product for (x86, and aarch64 with sdot; not an untied token embedding) are copied into
    it and their mapped pages released (`interleave_matrices`): the dense ones once here, MoE
    experts as each is first chosen, unless `fits` said the weights do not fit (then experts
    stay in the map, whose pages the kernel can drop again, unlike a copy's); False keeps
    every matrix in place in the map."""
    if os.path.isdir(path):
        source, mmproj, conversion = _open_hf_cached(path, cache_dir, mmproj)
    elif os.path.exists(path):
        source, conversion = _open_gguf_cached(path, cache_dir)
    else:
        raise ModelLoadError(f"{path}: no such file or directory")
    check_shapes(source.config, path)
    fit = fits is None or fits(source.config, source.resident_bytes()
                               + (os.path.getsize(mmproj) if mmproj else 0))
    weights = _assemble(source, source.config)
    if interleave:
        weights = interleave_matrices(weights, experts=fit)
    return LoadedModel(
        path=path,
        config=source.config,
        weights=weights,
        tokenizer=source.tokenizer,
        chat_template=source.chat_template,
        chat_template_source=source.chat_template_source,
        source_format=source.source_format,
        source_dtype=source.source_dtype,
        keepalive=source.keepalive,
        vision=_vision(source, path, mmproj),
        mmproj=mmproj,
        conversion=conversion,
        rank_head=source.rank_head,
        rerank_template=source.rerank_template,
    )


def interleave_matrices(weights: ModelWeights, threads: int = 0,
                        experts: bool = True) -> ModelWeights:
    """`weights` with each matrix that has an
    interleaved product on this CPU replaced by its interleaved copy (Matrix.interleave),
    except an untied token embedding (only read by rows, one per token) and MoE experts; a
    tied embedding is the output matrix, whose copy then serves the row reads too. The copies
    lie one after the other, in the order a pass reads them, in one buffer of huge pages where
    the kernel has them (buffer_views). The pages of the map each copied matrix came from
    are released, so resident memory does not grow (padding to whole groups aside). The
    copies are made on `threads` threads (0: one per CPU this process may run on; the copy
    releases the GIL). With `experts`, MoE experts get copies that the forward pass makes as
    each expert is first chosen (_with_expert_copies); without, they are read in place."""
    todo = [getattr(L, f) for L in weights.layers for f in _DENSE_MATRICES] + [weights.output]
    outs = buffer_views([m.interleave_shape() if m is not None else None for m in todo])

    def place(i: int) -> Optional[Matrix]:
        if outs[i] is None:
            return todo[i]
        il = todo[i].interleave(outs[i])
        _release_mapped(todo[i].data)
        return il

    with ThreadPoolExecutor(threads or len(os.sched_getaffinity(0))) as pool:
        done = iter(list(pool.map(place, range(len(todo)))))
    layers = [replace(L, **{f: next(done) for f in _DENSE_MATRICES}) for L in weights.layers]
    if experts:
        layers = _with_expert_copies(layers)
    output = next(done)
    tied = weights.output is weights.tok_embd
    return replace(weights, layers=layers, output=output,
                   tok_embd=output if tied else weights.tok_embd)


def _with_expert_copies(layers: list) -> list:
    """`layers` with the experts of each MoE layer that have an interleaved product on this CPU
    given copies made as they are first used (Matrix.with_expert_copies), in one buffer of
    4 KiB pages that nothing touches before then: a huge page would make 2 MB resident for
    the first expert copied into it, and memory would show experts never chosen. The rows'
    pages in the map are released as each expert's copy is finished (when the rows are a
    file's map), so memory holds each chosen expert once."""
    stacks = [getattr(L.moe, f) for L in layers if L.moe for f in _EXPERT_MATRICES]
    shapes = [m.expert_copies_shape() for m in stacks]
    outs = buffer_views([(s[0] * s[1], s[2]) if s else None for s in shapes], huge=False)
    done = iter([m if out is None else m.with_expert_copies(out, _maps_a_file(m.data))
                 for m, out in zip(stacks, outs)])
    return [replace(L, moe=replace(L.moe, **{f: next(done) for f in _EXPERT_MATRICES}))
            if L.moe else L for L in layers]


_DENSE_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_EXPERT_MATRICES = ("gate", "up", "down")
_libc = ctypes.CDLL(None, use_errno=True)
_COPY_ALIGN = 64                # each interleaved copy's start (the tiles' loads)
_HUGE_PAGE = 2 << 20            # x86-64's and 4 KiB-page aarch64's transparent huge page


def _huge_page_buffer(nbytes: int) -> np.ndarray:
    """A new uint8 array of nbytes, its start aligned to a huge page, which the kernel is asked
    to back with transparent huge pages (madvise MADV_HUGEPAGE; where THP is off, or set to
    "never", it has 4 KiB pages as before). Decode streams every weight once per token: with
    4 KiB pages each page is a TLB miss and a restart of the hardware prefetcher's stream, and
    copies of a few MB each (numpy asks for huge pages only from 4 MB on, and a 1 MB buffer
    seldom holds an aligned 2 MB page) got none."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    raw = np.empty(nbytes + _HUGE_PAGE, np.uint8)
    start = (-raw.ctypes.data) % _HUGE_PAGE
    buf = raw[start:start + nbytes]
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    whole = nbytes // _HUGE_PAGE * _HUGE_PAGE
    if advice is not None and whole:
        _libc.madvise(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(whole), advice)
    return buf


def _small_page_buffer(nbytes: int) -> np.ndarray:
    """A new uint8 array of nbytes of private anonymous memory in 4 KiB pages (madvise
    MADV_NOHUGEPAGE, as THP set to "always" would otherwise back it with huge pages), each
    page resident only once written."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        mem.madvise(advice)
    return np.frombuffer(mem, np.uint8)


def buffer_views(shapes: list, huge: bool = True) -> list:
    """One uint8 array of each (rows, bytes) shape in `shapes` (None for None), views of one new
    buffer of huge pages (_huge_page_buffer; `huge` False: of 4 KiB pages, _small_page_buffer),
    one after the other in that order, each start 64-byte aligned."""
    sizes = [-(-s[0] * s[1] // _COPY_ALIGN) * _COPY_ALIGN if s else 0 for s in shapes]
    buf = (_huge_page_buffer if huge else _small_page_buffer)(sum(sizes))
    views, at = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(buf[at:at + shape[0] * shape[1]].reshape(shape) if shape else None)
        at += size
    return views


def _maps_a_file(a: np.ndarray) -> bool:
    """Whether `a` views a file's memory map (rather than anonymous memory)."""
    base = a
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    return base is not None


def _release_mapped(a: np.ndarray) -> None:
    """Drops the whole pages of `a` from this process's memory when `a` views a file's
    memory map (madvise MADV_DONTNEED: the page cache keeps them, a later read faults them
    back in); an array of anonymous memory is left alone (dropping would zero it)."""
    if not _maps_a_file(a):
        return
    start, end = a.ctypes.data, a.ctypes.data + a.nbytes
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def check_shapes(c: ModelConfig, path: str) -> None:
    """The shapes the forward pass computes on: widths in whole Q8_0 activation blocks (32),
    whole query groups per KV head; anything else is one ModelLoadError line."""
    widths = {"hidden size": c.hidden, "head_dim": c.head_dim, "feed-forward size": c.ffn,
              "expert feed-forward size": c.expert_ffn}
    for what, v in widths.items():
        if v % Q8_BLOCK:
            raise ModelLoadError(f"{path}: unsupported shape: {what} {v} is not a multiple "
                                 f"of {Q8_BLOCK}")
    if c.n_kv_heads <= 0 or c.n_heads % c.n_kv_heads:
        raise ModelLoadError(f"{path}: unsupported shape: {c.n_heads} attention heads for "
                             f"{c.n_kv_heads} KV heads")


def _vision(source, path: str, mmproj: Optional[str]):
    """Qwen3-VL's vision encoder: from the HF directory itself, or from the mmproj GGUF
    that goes with a qwen3vl text GGUF; None for a text-only model."""
    arch = source.config.arch
    if mmproj is not None:
        if source.source_format != "gguf":
            raise ModelLoadError(f"{mmproj}: an mmproj goes with a GGUF model; {path} is a "
                                 "Hugging Face directory, which holds its own vision weights")
        if arch != "qwen3vl":
            raise ModelLoadError(f"{mmproj}: the model {path} is {arch}, which takes no "
                                 "images; an mmproj goes with a qwen3vl text GGUF")
        return load_mmproj(mmproj, source)
    if arch != "qwen3vl":
        return None
    if source.source_format == "gguf":
        log.info("%s holds Qwen3-VL's language model only: images are refused "
                 "(pass its vision projector with --mmproj)", path)
        return None
    return load_vision(source)


def _open_hf_cached(path: str, cache_dir: Optional[str], mmproj: Optional[str]):
    """(source, mmproj, conversion) of a Hugging Face directory: with cache_dir, a Qwen3-VL
    one through its cached Q8_0 pair (its bf16 weights would take most of a minute and
    gigabytes to convert at every start), any other one as it is (converted in memory)."""
    if cache_dir and mmproj is None and is_qwen3vl_dir(path):
        from .convert_vl import cached_qwen3vl_pair
        try:
            text, mmproj = cached_qwen3vl_pair(path, cache_dir)
            return GGUFSource(text), mmproj, f"converted to q8_0 once, cached as {text}"
        except OSError as e:
            log.warning("cannot cache the Q8_0 conversion in %s (%s); converting in memory",
                        cache_dir, e)
    return HFSource(path), mmproj, "converted to q8_0 in memory at load"


def _open_gguf_cached(path: str, cache_dir: Optional[str]) -> tuple:
    """(source, conversion) of a GGUF file: the file itself when the kernels compute on all
    its matrices (conversion None); else its cached conversion (the other matrices as Q8_0,
    the rest byte for byte) when there is one or it can be made; else the file itself,
    its other matrices converted in memory."""
    keep = compute_types()
    cached = find_cached_q8_0(path, cache_dir, keep) if cache_dir else None
    if cached:
        return GGUFSource(cached), f"converted to q8_0 once, cached as {cached}"
    source = GGUFSource(path)
    if not source.needs_conversion():
        return source, None
    if cache_dir:
        try:
            log.info("converting the matrices of %s the kernels do not compute on to Q8_0 "
                     "once, into %s", path, cache_dir)
            cached = cached_q8_0(path, cache_dir, keep)
            return GGUFSource(cached), f"converted to q8_0 once, cached as {cached}"
        except OSError as e:
            log.warning("cannot cache the Q8_0 conversion in %s (%s); converting in memory",
                        cache_dir, e)
    return source, "converted to q8_0 in memory at load"


def _assemble(src, c: ModelConfig) -> ModelWeights:
    """Every weight of the model, checked against the config's shapes."""
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layers = []
    for i in range(c.n_layers):
        layers.append(LayerWeights(
            attn_norm=src.vector("attn_norm", i, c.hidden),
            wq=src.matrix("wq", i, q_dim, c.hidden),
            wk=src.matrix("wk", i, kv_dim, c.hidden),
            wv=src.matrix("wv", i, kv_dim, c.hidden),
            wo=src.matrix("wo", i, c.hidden, q_dim),
            q_norm=src.vector("q_norm", i, c.head_dim) if c.qk_norm else None,
            k_norm=src.vector("k_norm", i, c.head_dim) if c.qk_norm else None,
            ffn_norm=src.vector("ffn_norm", i, c.hidden),
            **(_moe_ffn(src, c, i) if i in c.moe_layers else _dense_ffn(src, c, i)),
        ))
    tok_embd = src.matrix("tok_embd", None, c.vocab, c.hidden)
    return ModelWeights(
        tok_embd=tok_embd,
        layers=layers,
        out_norm=src.vector("out_norm", None, c.hidden),
        output=tok_embd if c.tied_embeddings else src.matrix("output", None, c.vocab, c.hidden),
    )


def _dense_ffn(src, c: ModelConfig, i: int) -> dict:
    return dict(w_gate=src.matrix("w_gate", i, c.ffn, c.hidden),
                w_up=src.matrix("w_up", i, c.ffn, c.hidden),
                w_down=src.matrix("w_down", i, c.hidden, c.ffn))


def _moe_ffn(src, c: ModelConfig, i: int) -> dict:
    """Router (kept in float32: the top-k choice is sensitive) and the stacked experts."""
    e, f, h = c.n_experts, c.expert_ffn, c.hidden
    return dict(w_gate=None, w_up=None, w_down=None, moe=MoEWeights(
        router=src.float_matrix("router", i, e, h),
        gate=src.experts("gate_exps", i, e, f, h),
        up=src.experts("up_exps", i, e, f, h),
        down=src.experts("down_exps", i, e, h, f),
    ))
