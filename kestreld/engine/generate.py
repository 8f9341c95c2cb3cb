"""The generate loop, in phases: `prefill` a prompt into the KV cache, then decode, and
`Engine.generate`: prefix rule -> KV store (memory, disk) -> prefill -> decode, sample,
stream; then, once the answer is out, `Engine.store_kv` keeps the arena's new rows. Decode
feeds each chosen token through a speculate.Feeder, which verifies drafts from the context
in the same pass when speculation is on (exact: the same ids as without it).

`Engine` holds what lives as long as the process: the model, its forward pass, the KV
cache, the prefix counters and the KV store. It is not thread-safe: exactly one thread (the
scheduler's worker) calls `generate` / `embed` / `run` / `store_kv` / `forward_logits`;
`stats()` may be read from any thread (it copies plain ints), and `prompt` / `tokenize` /
`detokenize` touch no KV.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ..errors import BadRequest, PromptTooLong
from ..text.reasoning import ReasoningSplitter
from ..text.tools import ToolCall, ToolCallParser
from ..vision.prompt import ImageFigures
from .constraint import Constraint, GrammarVocabulary, answer_grammar
from .embed import Embedder, EmbedInput, Embeddings
from .rerank import Ranking, Reranker, RerankInput
from .forward import Forward
from .kvcache import KVCache
from .kvstore import KVStore
from .prefix import PrefixCache, hit_line
from .prompt import Prompt, PromptBuilder, Request
from .sampler import Sampler, SamplingOptions
from .speculate import Drafter, Feeder


@dataclass
class TokenEvent:
    """One streamed piece: ids sampled since the last event and the text they completed
    ("" while a UTF-8 character is incomplete or a stop string may still be forming).
    When the prompt splits reasoning, `text` is answer text and `reasoning` thinking text.
    With tools, a tool-call block's text is held back and `tool_calls` lists the calls
    whose blocks this piece closed."""
    ids: list
    text: str
    logprobs: Optional[list] = None   # [{"id", "logprob", "top": [[id, logprob], ...]}]
    reasoning: Optional[str] = None
    tool_calls: Optional[list] = None  # [ToolCall]


@dataclass
class Completion:
    """The result of one request."""
    text: str
    ids: list                       # generated ids (an ending end-of-sequence id left out)
    finish_reason: str              # "stop" | "length" | "cancelled" | "tool_calls"
    prompt_tokens: int
    cached_tokens: int              # KV reused: the arena's (prefix rule) or the KV store's
    cached_source: Optional[str]    # "memory" (the arena) | "store" (memory tier) | "disk" | None
    prefill_tokens: int
    completion_tokens: int
    prefill_ms: float               # images' encoding included
    decode_ms: float
    ttft_ms: float                  # from generate() start to the first sampled token
    logprobs: Optional[list] = None
    drafted_tokens: int = 0         # speculation: tokens drafted from the context
    accepted_tokens: int = 0        # of which chosen (each saved a forward pass)
    prefix_event: str = ""          # the [KV-PREFIX] log line of this request
    images: Optional[ImageFigures] = None
    reasoning: Optional[str] = None  # the thinking block, when the prompt splits it off
    tool_calls: Optional[list[ToolCall]] = None   # the calls the answer made, if any


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


class _Output:
    """The answer's text as it is emitted: split into text and reasoning when the prompt
    splits it, its tool calls parsed out of the text when the prompt offers tools (after
    the split: the thinking block stays apart), streamed to `on_token` and kept for the
    Completion.

    The calls end the answer (`ended`) at the first call when it may make only one
    (parallel_tool_calls false), and at a call that repeats an earlier one word for word
    (dropped): a model looping on the same call would otherwise run to max_tokens. A
    forced answer (tool_choice "required" or named) is calls only: a block the length
    limit cut off is dropped, never shown as text."""

    def __init__(self, on_token: Optional[TokenFn], prompt: Prompt):
        self.on_token = on_token
        self.splitter = ReasoningSplitter(bool(prompt.thinking)) if prompt.split_reasoning else None
        self.parser = ToolCallParser() if prompt.tools is not None else None
        self.tools = prompt.tools
        self.text: list = []
        self.reasoning: list = []
        self.calls: list = []
        self.ended = False

    def emit(self, ids: list, piece: str, logprobs: Optional[list]) -> None:
        thought = None
        if self.splitter is not None:
            piece, thought = self.splitter.feed(piece)
        calls = []
        if self.parser is not None:
            piece, calls = self.parser.feed(piece)
            calls = self._new_calls(calls)
        self._send(ids, piece, thought, calls, logprobs)

    def _new_calls(self, calls: list) -> list:
        """The calls that do not repeat an earlier one, up to the one call of a single-call
        answer; sets `ended` when the answer should stop here."""
        seen = {(c.name, c.arguments) for c in self.calls}
        out = []
        for call in calls:
            if self.ended:
                break
            if (call.name, call.arguments) in seen:
                self.ended = True
                break
            seen.add((call.name, call.arguments))
            out.append(call)
            self.ended = self.tools.single
        return out

    def close(self) -> tuple[str, Optional[str], list]:
        """(text, reasoning or None, tool calls) of the whole answer; what the splitter and
        the parser held back goes out as a last event."""
        piece, thought = self.splitter.flush() if self.splitter is not None else ("", None)
        calls = []
        if self.parser is not None:
            piece, calls = self.parser.feed(piece)
            rest, more = self.parser.flush()
            if self.tools.required:
                rest = ""              # a forced call cut off by the length limit
            piece, calls = piece + rest, self._new_calls(calls + more)
        if piece or thought or calls:
            self._send([], piece, thought, calls, None)
        reasoning = "".join(self.reasoning) if self.splitter is not None else None
        return "".join(self.text), reasoning, self.calls

    def _send(self, ids: list, piece: str, thought: Optional[str], calls: list,
              logprobs: Optional[list]) -> None:
        self.text.append(piece)
        if thought is not None:
            self.reasoning.append(thought)
        self.calls += calls
        if self.on_token is not None:
            self.on_token(TokenEvent(ids, piece, logprobs, thought, calls or None))


# ---------------------------------------------------------------- the phases

def prefill(forward: Forward, prompt: Prompt, chunk: int, should_stop: Optional[StopFn] = None,
            on_progress: Optional[ProgressFn] = None,
            logits_out: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """Run the prompt's tokens after the KV cache's valid rows through the model, `chunk`
    tokens per forward pass; returns the last token's logits (1, vocab), or None if
    `should_stop` said stop between two chunks. With `logits_out` (one row per token run),
    every token's logits are written there."""
    kv = forward.kv
    start = pos = kv.cache_len
    ids, keys, vision = prompt.ids, prompt.keys, prompt.vision
    logits = None
    while pos < len(ids):
        if should_stop is not None and should_stop():
            return None
        n = min(chunk, len(ids) - pos)
        out = logits_out[pos - start:pos - start + n] if logits_out is not None else None
        logits = forward(ids[pos:pos + n], keys[pos:pos + n], logits_out=out,
                         vision=vision.chunk(pos, pos + n) if vision is not None else None)
        pos += n
        if on_progress is not None:
            on_progress(pos - start, len(ids) - start)
    return logits


def _as_prompt(prompt: Union[Prompt, Sequence[int]]) -> Prompt:
    return prompt if isinstance(prompt, Prompt) else Prompt([int(i) for i in prompt])


class Engine:
    """The model, its forward pass and KV cache, the prefix rule's counters, the KV store."""

    def __init__(self, model, max_seq: int = 8192, threads: int = 1, prefix_kv: bool = True,
                 prefix_min: int = 16, kv_bs: int = 32, prefill_chunk: int = 256,
                 store: Optional[KVStore] = None, image_dir: Optional[str] = None,
                 speculate: bool = True, pooling: Optional[str] = None):
        self.model = model
        self.tokenizer = model.tokenizer
        self.threads = threads
        self.prefill_chunk = prefill_chunk
        self.vocab_size = model.config.vocab
        self.kv = KVCache.for_model(model.config, max_seq, kv_bs)
        self.forward = Forward(model, self.kv, prefill_chunk, threads)
        self.prefix = PrefixCache(prefix_kv, prefix_min)
        self.prompts = PromptBuilder(model, max_seq, image_dir)
        # recent prompts' KV beyond the arena's one line (memory tier, disk tier); none: off
        self.store = store if store is not None else KVStore()
        self.speculate = speculate  # drafts from the context (speculate.py), unless a request says not
        self.drafted = 0            # tokens drafted and accepted, over the process' life
        self.accepted = 0
        self.disk_kv_error: Optional[str] = None  # why --disk-kv's directory is not used
        self._grammar_vocab: Optional[GrammarVocabulary] = None   # at the first grammar
        # embeddings: pooled as --pooling says, else as the file says ("": it does not embed)
        self.embedder = Embedder(self.forward, self.prompts, pooling or model.config.pooling,
                                 model.config.name, prefix_kv, prefill_chunk)
        self.reranker = Reranker(self.embedder, model, pooling or model.config.pooling)

    @classmethod
    def from_config(cls, model, cfg, store: Optional[KVStore] = None) -> "Engine":
        """An engine sized by a kestreld Config."""
        return cls(model, max_seq=cfg.max_seq, threads=cfg.n_threads, prefix_kv=cfg.prefix_kv,
                   prefix_min=cfg.prefix_min, kv_bs=cfg.kv_bs, prefill_chunk=cfg.prefill_chunk,
                   store=store, image_dir=cfg.image_dir, speculate=cfg.speculate,
                   pooling=cfg.pooling)

    # ---- text (any thread) ----------------------------------------------------------
    def prompt(self, request: Request) -> Prompt:
        """The prompt of a request (see engine/prompt.py)."""
        return self.prompts.build(request)

    def tokenize(self, text: str, add_special: bool = False) -> list:
        return self.prompts.tokenize(text, add_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def stats(self) -> dict:
        return {"cache_len": self.kv.cache_len, "prefix": self.prefix.stats(),
                "kv_store": self.store.stats(),
                "speculation": {"enabled": self.speculate, "drafted": self.drafted,
                                "accepted": self.accepted}}

    def close(self) -> None:
        """At shutdown: let the disk KV writer finish what is queued."""
        self.store.close()

    # ---- the engine thread ------------------------------------------------------------
    def run(self, request: Union[Request, EmbedInput, RerankInput],
            opts: Optional[SamplingOptions], **callbacks) -> Union[Completion, Embeddings, Ranking]:
        """`generate` on the prompt of a request (built here, on the engine thread: images
        are decoded and encoded by the one thread that owns the engine), `embed` or `rerank`."""
        if isinstance(request, EmbedInput):
            return self.embed(request, callbacks.get("should_stop"))
        if isinstance(request, RerankInput):
            return self.reranker.run(request, callbacks.get("should_stop"))
        return self.generate(self.prompt(request), opts, **callbacks)

    def embed(self, request: EmbedInput, should_stop: Optional[StopFn] = None) -> Embeddings:
        """One unit vector per input (engine/embed.py); the KV cache is as before after it."""
        return self.embedder.run(request, should_stop)

    def forward_logits(self, ids, start_pos: int = 0, vision=None) -> np.ndarray:
        """Logits (n, vocab) for every token of `ids` placed at start_pos.. (tests,
        diagnostics). `vision`: the VisionPrompt of a whole prompt `ids` (start_pos 0).
        The KV cache must hold valid rows [0, start_pos); it is cut back to them first."""
        self.kv.truncate(start_pos)
        ids = [int(i) for i in ids]
        out = np.empty((len(ids), self.vocab_size), dtype=np.float32)
        # the cache's rows [0, start_pos) stand before ids (their keys: never run again)
        prompt = Prompt(list(self.kv.keys) + ids, vision=vision)
        prefill(self.forward, prompt, self.prefill_chunk, logits_out=out)
        return out

    def store_kv(self) -> None:
        """Off the request's critical path (the scheduler calls it once the answer is sent):
        the KV store copies out the arena's rows it does not hold yet, so that a later
        request can have them back after other requests overwrote the arena."""
        self.store.save(self.kv)

    def generate(self, prompt: Union[Prompt, Sequence[int]], opts: SamplingOptions,
                 on_token: Optional[TokenFn] = None, on_progress: Optional[ProgressFn] = None,
                 should_stop: Optional[StopFn] = None) -> Completion:
        """Prefill the prompt (reusing the common prefix) and decode up to max_tokens.
        `prompt`: a Prompt, or the token ids of a text prompt. Whatever happens (a cancel,
        an error), the KV cache holds exactly the rows that were written."""
        prompt = _as_prompt(prompt)
        self._check_prompt(prompt)
        t0 = time.perf_counter()
        constraint = self._constraint(prompt, opts)     # a bad schema fails before prefill
        kv, vision = self.kv, prompt.vision
        plan = self.prefix.plan(prompt.keys, kv.keys)
        kv.truncate(plan.keep)
        stored = self.store.restore(prompt.keys, kv)
        source = stored or ("memory" if plan.hit else None)
        keep = kv.cache_len
        event = hit_line(keep, len(prompt.ids), stored) if stored else plan.log_line
        if vision is not None:
            vision.encode(self.model.vision, keep, self.threads)
        logits = prefill(self.forward, prompt, self.prefill_chunk, should_stop, on_progress)
        t_prefill = time.perf_counter()
        out = _Output(on_token, prompt)
        feeder = self._feeder(prompt, opts)
        if logits is None:
            ids, finish, lps, t_first = [], "cancelled", None, None
        else:
            try:
                ids, finish, lps, t_first = self._decode(prompt, logits, Sampler(opts, constraint),
                                                         feeder, out, should_stop)
            finally:
                feeder.finish()
        self.drafted += feeder.drafted
        self.accepted += feeder.accepted
        text, reasoning, calls = out.close()
        if calls and (finish == "stop" or (finish == "length" and prompt.tools.required)):
            finish = "tool_calls"
        t_end = time.perf_counter()
        return Completion(
            text=text, ids=ids, finish_reason=finish, prompt_tokens=len(prompt.ids),
            cached_tokens=keep, cached_source=source, prefill_tokens=len(prompt.ids) - keep,
            completion_tokens=len(ids), prefill_ms=(t_prefill - t0) * 1e3,
            decode_ms=(t_end - t_prefill) * 1e3, ttft_ms=((t_first or t_end) - t0) * 1e3,
            logprobs=lps, drafted_tokens=feeder.drafted, accepted_tokens=feeder.accepted,
            prefix_event=event,
            images=vision.figures() if vision is not None else None, reasoning=reasoning,
            tool_calls=calls or None)

    def _check_prompt(self, prompt: Prompt) -> None:
        ids = prompt.ids
        if not ids:
            raise BadRequest("the prompt is empty: at least one token is needed")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.kv.max_seq:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens and the context holds "
                                f"max_seq={self.kv.max_seq}: no room for a new token")
        vision = self.model.vision
        if prompt.vision is None and vision is not None and vision.cfg.image_token_id in ids:
            raise BadRequest("the prompt holds image placeholder tokens but no images "
                             "(send image parts in chat messages)")

    def _constraint(self, prompt: Prompt, opts: SamplingOptions) -> Optional[Constraint]:
        """The grammar the answer must follow, or None; the model's grammar vocabulary is
        built at the first one and kept."""
        grammar = answer_grammar(opts.response_format, prompt.tools, prompt.thinking)
        if grammar is None:
            return None
        if self._grammar_vocab is None:
            self._grammar_vocab = GrammarVocabulary(self.tokenizer, self.vocab_size)
        return Constraint(self._grammar_vocab, grammar)

    def _feeder(self, prompt: Prompt, opts: SamplingOptions) -> Feeder:
        """What feeds the chosen tokens back: with a drafter when speculation is on for the
        engine and the request."""
        vision = self.model.vision
        delta = prompt.vision.delta if prompt.vision is not None else 0
        drafter = None
        if self.speculate and opts.speculate:
            exclude = (vision.cfg.image_token_id,) if vision is not None else ()
            drafter = Drafter(prompt.ids, self.kv.max_seq, exclude)   # the most ids a context has
        return Feeder(self.forward, drafter, delta)

    def _decode(self, prompt: Prompt, logits: np.ndarray, sampler: Sampler, feeder: Feeder,
                out: "_Output", should_stop: Optional[StopFn]):
        """Sample, stream (through `out`) and feed (through `feeder`) tokens after the
        prefill. Returns (generated ids without an ending end-of-sequence id,
        finish_reason, logprobs or None, time of the first token)."""
        ids = prompt.ids
        opts = sampler.opts
        max_tokens = min(opts.max_tokens, self.kv.max_seq - len(ids))
        decoder = self.tokenizer.incremental_decoder()
        stops = StopMatcher(opts.stop)
        # ignore_eos (benchmarks) is for free text: a constrained answer ends where its grammar does
        eos = set() if opts.ignore_eos and sampler.constraint is None else self.tokenizer.eos_ids
        generated: list = []
        text, emitted, pending = "", 0, []
        lps: Optional[list] = [] if opts.logprobs else None
        finish = "length"
        t_first = None
        while len(generated) < max_tokens:
            row = logits[0]
            tok = sampler.next_token(row, ids, generated)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos:
                finish = "stop"
                break
            generated.append(tok)
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
            out.emit(pending, text[emitted:safe], lps[-1:] if lps is not None else None)
            pending = []
            emitted = safe
            if sampler.finished or out.ended:   # the grammar is complete, or the calls are
                finish = "stop"
                break
            if len(generated) >= max_tokens:
                break
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            logits = feeder.next_logits(tok, max_tokens - len(generated))
        if finish != "stop" or stops.find(text) < 0:
            text += decoder.flush()
        if pending or emitted < len(text):
            out.emit(pending, text[emitted:], None)
        return generated, finish, lps, t_first
