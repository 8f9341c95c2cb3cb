"""`load_model(path)`: a GGUF file or a Hugging Face directory -> `LoadedModel`.

The format modules (`gguf_loader`, `hf_loader`) open a file and hand out hyperparameters,
tokenizer, template and tensors by role; this module assembles them into the shared
weight layout and is the one place that decides which roles a model needs.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from ..errors import ModelLoadError
from .convert import cached_q8_0, find_cached_q8_0
from .gguf_loader import GGUFSource
from .hf_loader import HFSource
from .model import LayerWeights, LoadedModel, ModelConfig, ModelWeights

log = logging.getLogger("kestreld")


def load_model(path: str, cache_dir: Optional[str] = None) -> LoadedModel:
    """Load a model; any fault raises ModelLoadError naming the file and what is wrong.

    With `cache_dir`, a GGUF whose matrices are not all Q8_0 is converted once into a
    cached Q8_0 GGUF there and memory-mapped from it on every later start (fast start,
    weights in place); without it, or if the cache cannot be written, the conversion is
    done in memory at each load."""
    if os.path.isdir(path):
        source = HFSource(path)
    elif os.path.exists(path):
        source = _open_gguf_cached(path, cache_dir)
    else:
        raise ModelLoadError(f"{path}: no such file or directory")
    return LoadedModel(
        path=path,
        config=source.config,
        weights=_assemble(source, source.config),
        tokenizer=source.tokenizer,
        chat_template=source.chat_template,
        source_format=source.source_format,
        source_dtype=source.source_dtype,
        keepalive=source.keepalive,
    )


def _open_gguf_cached(path: str, cache_dir: Optional[str]) -> GGUFSource:
    """The GGUF source to load: the cached Q8_0 conversion of `path` when there is one
    (or can be made), else `path` itself."""
    cached = find_cached_q8_0(path, cache_dir) if cache_dir else None
    if cached:
        return GGUFSource(cached)
    source = GGUFSource(path)
    if cache_dir and not source.all_q8_0():
        try:
            log.info("converting %s to Q8_0 once, into %s", path, cache_dir)
            return GGUFSource(cached_q8_0(path, cache_dir))
        except OSError as e:
            log.warning("cannot cache the Q8_0 conversion in %s (%s); converting in memory",
                        cache_dir, e)
    return source


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
            w_gate=src.matrix("w_gate", i, c.ffn, c.hidden),
            w_up=src.matrix("w_up", i, c.ffn, c.hidden),
            w_down=src.matrix("w_down", i, c.hidden, c.ffn),
        ))
    tok_embd = src.matrix("tok_embd", None, c.vocab, c.hidden)
    return ModelWeights(
        tok_embd=tok_embd,
        layers=layers,
        out_norm=src.vector("out_norm", None, c.hidden),
        output=tok_embd if c.tied_embeddings else src.matrix("output", None, c.vocab, c.hidden),
    )
