"""The generate loop: prefix match -> chunked prefill -> decode -> sample -> stream.

`Engine` owns the model, the KV arena and the prefix state. It is not thread-safe:
exactly one thread (the scheduler's worker) calls `generate`; `stats()` may be read
from any thread (it copies plain ints).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request generation options (validated by the server before they get here)."""
    max_tokens: int = 256
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    min_p: float = 0.0              # 0: off
    repeat_penalty: float = 1.0     # 1: off (llama.cpp's rule, over the last 64 tokens)
    seed: Optional[int] = None
    stop: tuple = ()                # stop strings; the text ends before the first match
    ignore_eos: bool = False
    logprobs: int = 0               # top-k log-probabilities per generated token


@dataclass
class TokenEvent:
    """One streamed piece: ids sampled since the last event and the text they completed
    ("" while a UTF-8 character is incomplete or a stop string may still be forming)."""
    ids: list
    text: str
    logprobs: Optional[list] = None   # [{"id", "logprob", "top": [[id, logprob], ...]}]


@dataclass
class Completion:
    text: str
    ids: list                       # generated ids
    finish_reason: str              # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int              # KV reused from the previous request
    prefill_tokens: int
    completion_tokens: int
    prefill_ms: float
    decode_ms: float
    ttft_ms: float                  # from generate() start to the first sampled token
    logprobs: Optional[list] = None
    prefix_event: str = ""          # the [KV-PREFIX] log line of this request
    extra: dict = field(default_factory=dict)


ProgressFn = Callable[[int, int], None]      # (done, total) prefill tokens
TokenFn = Callable[[TokenEvent], None]
StopFn = Callable[[], bool]                  # True: stop now (cancel / disconnect)


class StopMatcher:
    """Cuts generated text at the first stop string, holding back what may start one."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]

    def find(self, text: str) -> int:
        """Index where the earliest stop string begins, or -1."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def safe_len(self, text: str) -> int:
        """Length of text that cannot become part of a stop string with more tokens."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold


class Engine:
    """Model + arena + prefix state + forward pass; one request at a time.

    Thread-safety: `generate`, `forward_logits` and the tokenizer methods run on the one
    engine thread (the tokenizer ones are also safe from the event loop: they do not touch
    the arena). `stats()` and `arena.cache_len` may be read from any thread.
    """

    def __init__(self, model, max_seq: int = 8192, threads: int = 1, prefix_kv: bool = True,
                 prefix_min: int = 16, kv_bs: int = 32, prefill_chunk: int = 256,
                 disk_kv=None, image_dir: Optional[str] = None):
        from .arena import KVArena
        from ..text.chat import ChatTemplate
        from .forward import Transformer
        from .prefix import PrefixCache

        c = model.config
        self.model = model
        self.tokenizer = model.tokenizer
        self.threads = threads
        self.prefill_chunk = prefill_chunk
        self.arena = KVArena(c.n_layers, c.n_kv_heads, c.head_dim, max_seq, kv_bs)
        self.prefix = PrefixCache(prefix_kv, prefix_min)
        self.transformer = Transformer(model, self.arena, prefill_chunk, threads)
        self.vocab_size = c.vocab
        self.chat = ChatTemplate(model.chat_template)
        self.max_text_chars = max_seq * self.tokenizer.max_token_bytes
        self.disk_kv = disk_kv      # diskkv.DiskKV or None: snapshots that outlive the process
        self.image_dir = image_dir  # the only place image paths may be read from (None: nowhere)

    @classmethod
    def from_config(cls, model, cfg, disk_kv=None) -> "Engine":
        """An engine sized by a kestreld Config."""
        return cls(model, max_seq=cfg.max_seq, threads=cfg.n_threads, prefix_kv=cfg.prefix_kv,
                   prefix_min=cfg.prefix_min, kv_bs=cfg.kv_bs, prefill_chunk=cfg.prefill_chunk,
                   disk_kv=disk_kv, image_dir=cfg.image_dir)

    # ---- text ---------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False) -> list:
        """Token ids of `text`. A text that cannot fit in max_seq tokens (each token covers
        at most max_token_bytes bytes) is refused before tokenizing, which would cost
        hundreds of bytes of memory per token."""
        from ..errors import PromptTooLong
        if len(text) > self.max_text_chars:
            raise PromptTooLong(f"a text of {len(text)} characters cannot fit in max_seq="
                                f"{self.arena.max_seq} tokens (at most {self.max_text_chars})")
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def render_chat(self, messages, enable_thinking: bool = False) -> str:
        """The prompt text of a conversation, from the model's own chat template."""
        tok = self.tokenizer
        special = {"bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                   "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else ""}
        return self.chat.render(messages, add_generation_prompt=True,
                                enable_thinking=enable_thinking, **special)

    def chat_prompt(self, messages, enable_thinking: bool = False):
        """(ids, VisionPrompt or None) of a conversation whose messages may hold image parts
        ({"type": "image", "path" | "data"}): rendered, tokenized, each image decoded and
        preprocessed and its placeholder widened to its tokens. Bad images: BadRequest."""
        from ..errors import BadRequest
        from ..vision.images import decode_image, preprocess, read_image_part
        from ..vision.prompt import build_prompt, chat_images

        rendered, parts = chat_images(messages)
        ids = self.tokenize(self.render_chat(rendered, enable_thinking), add_special=False)
        if not parts:
            return ids, None
        vision = self.model.vision
        if vision is None:
            hint = (" (a Qwen3-VL text GGUF: start kestreld with --mmproj FILE for its vision "
                    "encoder)" if self.model.config.arch == "qwen3vl" else "")
            raise BadRequest(f"the model {self.model.config.name} takes no images{hint}")
        images = [preprocess(decode_image(read_image_part(p, self.image_dir)), vision.cfg.image)
                  for p in parts]
        return build_prompt(ids, images, vision.cfg)

    def stats(self) -> dict:
        return {"cache_len": self.arena.cache_len, "prefix": self.prefix.stats()}

    def close(self) -> None:
        """At shutdown: let the disk KV writer finish what is queued."""
        if self.disk_kv is not None:
            self.disk_kv.close()

    # ---- checks -------------------------------------------------------------------
    def _check_prompt(self, ids) -> list:
        from ..errors import BadRequest, PromptTooLong
        ids = [int(i) for i in ids]
        if not ids:
            raise BadRequest("the prompt is empty: at least one token is needed")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.arena.max_seq:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens and the context holds "
                                f"max_seq={self.arena.max_seq}: no room for a new token")
        return ids

    # ---- forward ------------------------------------------------------------------
    def _prefill(self, ids, start: int, should_stop, on_progress, vision=None):
        """Prefill ids[start:] in chunks; returns the last logits, or None if stopped."""
        logits = None
        total = len(ids) - start
        pos = start
        while pos < len(ids):
            if should_stop is not None and should_stop():
                return None
            n = min(self.prefill_chunk, len(ids) - pos)
            logits = self.transformer.forward(
                ids[pos:pos + n], pos, vision=vision.chunk(pos, pos + n) if vision else None)
            pos += n
            self.arena.cache_len = pos
            if on_progress is not None:
                on_progress(pos - start, total)
        return logits

    def forward_logits(self, ids, start_pos: int = 0, vision=None) -> np.ndarray:
        """Logits (n, vocab) for every token of `ids` placed at start_pos.. (tests, diagnostics).
        `vision`: the encoded VisionPrompt of a whole prompt `ids` (start_pos 0).

        The arena must hold valid KV for [0, start_pos); the prefix state is forgotten."""
        ids = list(ids)
        if start_pos > self.arena.cache_len:
            raise ValueError(f"start_pos {start_pos} beyond the valid cache {self.arena.cache_len}")
        self.arena.reset(start_pos)
        self.prefix.forget()
        out = np.empty((len(ids), self.vocab_size), dtype=np.float32)
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            self.transformer.forward(chunk, start_pos + i, logits_out=out[i:i + len(chunk)],
                                     vision=vision.chunk(i, i + len(chunk)) if vision else None)
            self.arena.cache_len = start_pos + i + len(chunk)
        return out

    # ---- generation ---------------------------------------------------------------
    def generate(self, ids, opts: SamplingOptions, on_token: Optional[TokenFn] = None,
                 on_progress: Optional[ProgressFn] = None,
                 should_stop: Optional[StopFn] = None, vision=None) -> Completion:
        """Prefill the prompt (reusing the common prefix) and decode up to max_tokens.

        `vision` (Qwen3-VL): the prompt's qwen3vl.VisionPrompt from `chat_prompt`; its keys
        (image hashes on placeholder tokens) take the place of the ids in the prefix match."""
        ids = self._check_prompt(ids)
        if vision is None and self.model.vision is not None \
                and self.model.vision.cfg.image_token_id in ids:
            from ..errors import BadRequest
            raise BadRequest("the prompt holds image placeholder tokens but no images "
                             "(send image parts in chat messages)")
        t0 = time.perf_counter()
        keys = vision.keys if vision is not None else ids
        plan = self.prefix.plan(keys, self.arena.cache_len)
        self.arena.reset(plan.keep)
        from_disk = self.disk_kv.restore(keys, self.arena) if self.disk_kv is not None else 0
        keep = from_disk or plan.keep
        source = "disk" if from_disk else ("memory" if plan.hit else None)
        generated: list = []       # filled by _decode; read here if it raises
        try:
            if vision is not None:
                vision.encode(self.model.vision, keep, self.threads)
            logits = self._prefill(ids, keep, should_stop, on_progress, vision)
            t_prefill = time.perf_counter()
            text, finish, lps, t_first = self._decode(ids, logits, opts, generated, on_token,
                                                      should_stop, vision)
            t_end = time.perf_counter()
        except BaseException:
            self.prefix.commit((keys + generated)[:self.arena.cache_len])
            raise
        if finish == "cancelled":
            self.prefix.commit((keys + generated)[:self.arena.cache_len])
        else:
            self.prefix.commit(keys + generated)
        if self.disk_kv is not None:
            self.disk_kv.save(self.prefix.last_ids[:self.arena.cache_len], self.arena)
        eos = set() if opts.ignore_eos else self.tokenizer.eos_ids
        out_ids = generated[:-1] if finish == "stop" and generated and generated[-1] in eos else generated
        return Completion(
            text=text, ids=out_ids, finish_reason=finish, prompt_tokens=len(ids),
            cached_tokens=keep, prefill_tokens=len(ids) - keep,
            completion_tokens=len(out_ids), prefill_ms=(t_prefill - t0) * 1e3,
            decode_ms=(t_end - t_prefill) * 1e3,
            ttft_ms=((t_first or t_end) - t0) * 1e3, logprobs=lps,
            prefix_event=plan.log_line,
            extra={"cached_source": source, **(vision.figures() if vision is not None else {})})

    def _decode(self, ids, logits, opts: SamplingOptions, generated: list, on_token, should_stop,
                vision):
        """Sample, stream and feed tokens after the prefill (logits None: it was cancelled).

        Appends to `generated` (an end-of-sequence id included) and returns
        (text, finish_reason, logprobs or None, time of the first token or None)."""
        from .sampler import Sampler

        max_tokens = min(opts.max_tokens, self.arena.max_seq - len(ids))
        sampler = Sampler(opts)
        decoder = self.tokenizer.incremental_decoder()
        stops = StopMatcher(opts.stop)
        eos = set() if opts.ignore_eos else self.tokenizer.eos_ids
        text, emitted, pending = "", 0, []
        lps: Optional[list] = [] if opts.logprobs else None
        finish = "cancelled" if logits is None else "length"
        t_first = None
        while logits is not None and len(generated) < max_tokens:
            row = logits[0]
            tok = sampler.choose(sampler.penalize(row, ids, generated))
            if t_first is None:
                t_first = time.perf_counter()
            generated.append(tok)
            if tok in eos:
                finish = "stop"
                break
            pending.append(tok)
            if lps is not None:
                lps.append(sampler.top_logprobs(row, tok))
            text += decoder.feed([tok])
            cut = stops.find(text) if stops.stops else -1
            if cut >= 0:
                text = text[:cut]
                finish = "stop"
                break
            safe = stops.safe_len(text) if stops.stops else len(text)
            if on_token is not None:
                on_token(TokenEvent(pending, text[emitted:safe],
                                    lps[-1:] if lps is not None else None))
                pending = []
            emitted = safe
            if len(generated) >= max_tokens:
                break
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            pos = len(ids) + len(generated) - 1
            logits = self.transformer.forward(
                [tok], pos, rope_pos0=pos + vision.delta if vision is not None else None)
            self.arena.cache_len = pos + 1
        if finish != "stop" or stops.find(text) < 0:
            text += decoder.flush()
        if on_token is not None and (pending or emitted < len(text)):
            on_token(TokenEvent(pending, text[emitted:], None))
        return text, finish, lps, t_first
