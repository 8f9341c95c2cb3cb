"""Embeddings: one unit vector per input, from the model's rows after its output norm.

An input is a text or token ids. A text is tokenized as the model's tokenizer does for one
sequence: BOS where the model asks for it, then the ids its post-processor appends
(Qwen3-Embedding's <|endoftext|>, whose row last-token pooling reads: the model was trained
to put the text's meaning there); ids are taken as given. Each input runs through the same
forward pass as generation, on the same KV arena, in chunks of `prefill_chunk`, asking the
last phase for the normed rows instead of logits. Pooling, as the file says (or --pooling):

    last   the last token's row; a cached common prefix of the KV is reused (the prefix rule)
    mean   the mean of every token's row (each chunk gives all its rows: no prefix reuse)
    cls    the first token's row; attention is causal, so it is token 0 run alone

then L2 normalization; `dimensions` (Matryoshka) keeps the first d values and renormalizes.
Consecutive inputs that fit in one chunk together share one forward pass, packed from KV row
0: each is its own sequence there (RoPE positions from 0, attention to its own keys only), so
its row is the same bits as when it runs alone, and the weights are read once for them all.
An input alone in its chunk runs as a prompt does, in chunks, and `last` pooling reuses the
cached prefix it shares with the KV.

When the arena holds another request's KV (a conversation's prefix), it is put back
afterwards: the rows an input may overwrite (from the shortest common prefix of the inputs
with the cached keys, up to the longest input) are copied aside first and restored at the
end, so a daemon serving chat and embeddings keeps its chat prefix. When it holds nothing,
or what the last embed request left, the last input's KV stays for the next request to
reuse (inputs that begin alike, e.g. Qwen3-Embedding's query instruction).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..errors import BadRequest, Cancelled, NotEmbeddingModel, PromptTooLong
from ..model.config import POOLINGS
from ..protocol import MAX_EMBED_TOKENS
from .prefix import common_prefix_len


@dataclass(frozen=True)
class EmbedInput:
    """An embed request: `inputs` each a text (str) or token ids (tuple); `dimensions`: keep
    the first d values of each vector (then renormalize); `truncate`: an input longer than
    the context keeps its first tokens (and its appended end-of-text), instead of an error."""
    inputs: tuple
    dimensions: Optional[int] = None
    truncate: bool = False


@dataclass
class Embeddings:
    """The result of one embed request."""
    vectors: list               # one float32 unit vector per input, in order
    prompt_tokens: int          # tokens of every input, appended end-of-text included
    cached_tokens: int          # of which the KV was reused (last pooling: a common prefix)
    total_ms: float


def normalized(v: np.ndarray) -> np.ndarray:
    """v / ||v|| as float32 (a zero vector stays zero)."""
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


class Embedder:
    """Embeddings on an engine's forward pass and KV arena (the engine thread only)."""

    def __init__(self, forward, prompts, pooling: str, model_name: str, prefix_kv: bool,
                 prefill_chunk: int):
        self.forward = forward
        self.kv = forward.kv
        self.prompts = prompts            # PromptBuilder: tokenizing with the text bound
        self.pooling = pooling            # "" or "rank": the model does not embed
        self.model_name = model_name
        self.prefix_kv = prefix_kv
        self.chunk = prefill_chunk
        self.hidden = forward.config.hidden
        self._rows = np.zeros((prefill_chunk, self.hidden), np.float32)
        self._left: Optional[tuple] = None   # the keys the last request left in the arena

    def check_pooling(self) -> None:
        """NotEmbeddingModel unless the model (or --pooling) names a pooling."""
        if self.pooling not in POOLINGS:
            what = "a reranker" if self.pooling == "rank" else "a generative (chat) model"
            raise NotEmbeddingModel(
                f"{self.model_name} is {what}: its file names no embedding pooling (GGUF "
                f"<arch>.pooling_type, sentence-transformers' 1_Pooling); start kestreld "
                f"with --pooling last|mean|cls to embed with it anyway")

    def ids_of(self, request: EmbedInput) -> list:
        """Each input's ids, checked against the vocabulary, the context and the request's
        token bound."""
        tok = self.prompts.tokenizer
        max_seq, out = self.kv.max_seq, []
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                ids = self.prompts.tokenize(item, add_special=True) + list(tok.suffix_ids)
            else:
                ids = list(item)
            if not ids:
                raise BadRequest(f"input {i} is empty: at least one token is needed")
            if len(ids) > max_seq:
                if not request.truncate:
                    raise PromptTooLong(f"input {i} has {len(ids)} tokens and the context holds "
                                        f"max_seq={max_seq} (truncate cuts it)")
                suffix = list(tok.suffix_ids) if isinstance(item, str) else []
                ids = ids[:max_seq - len(suffix)] + suffix
            out.append(ids)
            total = sum(len(x) for x in out)
            if total > MAX_EMBED_TOKENS:
                raise PromptTooLong(f"the inputs hold more than {MAX_EMBED_TOKENS} tokens "
                                    f"(at least {total} by input {i}); split the request")
        return out

    def run(self, request: EmbedInput, should_stop: Optional[Callable[[], bool]] = None
            ) -> Embeddings:
        """The request's vectors (Cancelled if `should_stop` says stop between chunks); the
        arena's valid rows and keys are as before afterwards."""
        t0 = time.perf_counter()
        self.check_pooling()
        if request.dimensions is not None and not 0 < request.dimensions <= self.hidden:
            raise BadRequest(f"dimensions must be in 1..{self.hidden} (the model's width), "
                             f"got {request.dimensions}")
        inputs = self.ids_of(request)
        rows, cached = self.pooled_rows(inputs, self.pooling, should_stop)
        vectors = [normalized(v) for v in rows]
        if request.dimensions is not None:
            vectors = [normalized(v[:request.dimensions]) for v in vectors]
        return Embeddings(vectors, sum(len(ids) for ids in inputs), cached,
                          (time.perf_counter() - t0) * 1e3)

    def pooled_rows(self, inputs: list, pooling: str, should_stop=None,
                    pack: bool = True) -> tuple:
        """(each input's pooled row after the output norm, float64; tokens of KV reused).
        `pack`: short inputs share passes; else each runs alone, reusing the KV prefix it
        shares with the one before (inputs that all begin alike). The arena's valid rows and
        keys are as before afterwards when they were another request's; empty, or what the
        last call left, they become one input's (the last pass's first)."""
        before = self.kv.keys
        feeds = [ids[:1] if pooling == "cls" else ids for ids in inputs]
        packs = self._packs([len(f) for f in feeds]) if pack else [[i] for i in range(len(feeds))]
        if not before or before == self._left:
            out = self._each_pooled(inputs, feeds, packs, pooling, should_stop)
            self._left = self.kv.keys
            return out
        # rows [0, keep) get the same KV again: each pass's first input writes them alone
        keep = min(min(common_prefix_len(ids, before) for ids in inputs),
                   min(len(feeds[pack[0]]) for pack in packs))
        reach = max(sum(len(feeds[i]) for i in pack) for pack in packs)
        hi = min(len(before), reach)
        saved = self.kv.copy_rows(keep, hi) if keep < hi else None
        try:
            return self._each_pooled(inputs, feeds, packs, pooling, should_stop)
        finally:
            self._put_back(before, keep, saved)

    def _packs(self, lengths: list) -> list:
        """The inputs' indices in runs of consecutive inputs that fit one chunk together (an
        input longer than a chunk is alone)."""
        packs, fill = [], self.chunk
        for i, n in enumerate(lengths):
            if fill + n > self.chunk:
                packs.append([])
                fill = 0
            packs[-1].append(i)
            fill += n
        return packs

    def _each_pooled(self, inputs: list, feeds: list, packs: list, pooling: str,
                     should_stop) -> tuple:
        rows, cached = [None] * len(inputs), 0
        for pack in packs:
            if len(pack) == 1:
                rows[pack[0]], reused = self._pooled(inputs[pack[0]], pooling, should_stop)
                cached += reused
                continue
            if should_stop is not None and should_stop():
                raise Cancelled("the request was cancelled")
            for i, v in zip(pack, self._pooled_packed([feeds[i] for i in pack], pooling)):
                rows[i] = v
        return rows, cached

    def _pooled_packed(self, feeds: list, pooling: str) -> list:
        """The pooled rows of several inputs (float64), fed in one pass from KV row 0; the
        KV then holds the first input's keys."""
        starts = np.cumsum([0] + [len(f) for f in feeds])
        rows = self._rows[:starts[-1]]
        self.kv.truncate(0)
        self.forward([t for f in feeds for t in f], hidden_out=rows,
                     seq_starts=starts[:-1].tolist())
        self.kv.truncate(len(feeds[0]))
        if pooling == "mean":
            return [rows[a:b].sum(axis=0, dtype=np.float64) / (b - a)
                    for a, b in zip(starts, starts[1:])]
        at = starts[:-1] if pooling == "cls" else starts[1:] - 1
        return [rows[i].astype(np.float64) for i in at]

    def _pooled(self, ids: list, pooling: str, should_stop) -> tuple:
        """(the input's pooled row, float64; tokens of KV reused)."""
        kv, fwd = self.kv, self.forward
        if pooling == "cls":
            kv.truncate(0)
            return fwd(ids[:1], hidden_out=self._rows[:1])[0].astype(np.float64), 0
        keep = 0
        if pooling == "last" and self.prefix_kv:
            keep = min(common_prefix_len(ids, kv.keys), len(ids) - 1)
        kv.truncate(keep)
        total = np.zeros(self.hidden, np.float64)
        pos = keep
        while pos < len(ids):
            if should_stop is not None and should_stop():
                raise Cancelled("the request was cancelled")
            n = min(self.chunk, len(ids) - pos)
            rows = self._rows[:n] if pooling == "mean" else self._rows[:1]
            fwd(ids[pos:pos + n], hidden_out=rows)
            if pooling == "mean":
                total += rows.sum(axis=0, dtype=np.float64)
            pos += n
        pooled = total / len(ids) if pooling == "mean" else self._rows[0].astype(np.float64)
        return pooled, keep

    def _put_back(self, before: tuple, keep: int, saved) -> None:
        """The arena as before the request. Rows [0, keep): every input begins with those
        keys, so whatever an input wrote there is the same KV (the same bits: a row does not
        depend on how tokens are chunked); rows [keep, keep + n) come back from `saved`;
        rows past them were never written (no input reaches them). Their keys are recorded
        again."""
        kv = self.kv
        kv.truncate(min(keep, kv.cache_len))
        kv.append(before[kv.cache_len:keep])
        n = 0 if saved is None else saved[0].shape[2]
        if n:
            kv.restore(keep, before[:keep + n], saved)
        kv.append(before[kv.cache_len:])
