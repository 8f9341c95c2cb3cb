"""The wire methods on the engine: what each request does, apart from any transport.

A transport (the RPC socket in server.py; the HTTP API in http.py, whose openai.py turns
OpenAI's requests into these params and these results into OpenAI's shapes) parses bytes
into a method name and params, then calls:

    params = methods.validate(method, raw)             typed params (protocol.py) or an error
    methods.kind(method)                               where it runs:
      JOB    generate, chat,    `submit`: a scheduler Job; the engine thread runs it and its
             embed, rerank      events (tokens, progress, the completion) come back
      ASIDE  tokenize,          `aside`: a pure function of the params, run off the event
             detokenize         loop (tokenizing megabytes must not stall it)
      NOW    status, ping,      `now`: answered on the event loop at once
             cancel
    job_result(done)                                   the result map of a Done event: a
                                                       completion, or embeddings

Wire params become engine values here (`engine_request`, `sampling_options`), and engine
results become wire maps here (`job_result`): the scheduler and the engine never
see protocol types.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Union

from ..engine.embed import EmbedInput, Embeddings
from ..engine.rerank import Ranking, RerankInput
from ..engine.generate import Completion, TokenEvent
from ..engine.prompt import ChatInput, Request, TextInput
from ..engine.sampler import ResponseFormat, SamplingOptions
from ..errors import TooLarge
from ..protocol import (SEED_LIMIT, ChatParams, DetokenizeParams, EmbedParams, GenerateParams,
                        Params, RerankParams, TokenizeParams, CancelParams, validate_params)
from .scheduler import Done, Event, Job, Scheduler
from .status import StatusReporter

JOB, ASIDE, NOW = "job", "aside", "now"
KINDS = {"generate": JOB, "chat": JOB, "embed": JOB, "rerank": JOB, "tokenize": ASIDE,
         "detokenize": ASIDE, "status": NOW, "ping": NOW, "cancel": NOW}


def engine_request(params: Union[GenerateParams, ChatParams]) -> Request:
    """The engine's request for generate / chat params."""
    if isinstance(params, ChatParams):
        return ChatInput(tuple(dict(m) for m in params.messages), params.enable_thinking,
                         params.split_reasoning, params.tools, params.tool_choice,
                         params.parallel_tool_calls)
    return TextInput(text=params.prompt, ids=params.ids)


def sampling_options(params: Union[GenerateParams, ChatParams], default_max_tokens: int) -> SamplingOptions:
    """The request's sampling options; max_tokens defaults to the daemon's --max-tokens."""
    options = {"max_tokens": default_max_tokens, **params.options}
    if options.get("logit_bias") is not None:
        options["logit_bias"] = tuple(options["logit_bias"].items())
    if options.get("response_format") is not None:
        options["response_format"] = ResponseFormat(**options["response_format"])
    return SamplingOptions(**options)


def nth_choice(params: Union[GenerateParams, ChatParams], index: int):
    """The params of choice `index` of a request asking for several (OpenAI's `n`): the
    same, but a given seed becomes seed + index, so that the choices differ and each is
    reproducible (choice i is the single request with seed + i)."""
    seed = params.options.get("seed")
    if seed is None or index == 0:
        return params
    return dataclasses.replace(params, options={**params.options,
                                                "seed": (seed + index) % SEED_LIMIT})


def wire_tool_calls(calls) -> list:
    """ToolCalls as OpenAI's wire maps: {"id", "type": "function", "function": {"name",
    "arguments"}}."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def completion_result(c: Completion, queue_ms: float, ttft_ms: float) -> dict:
    """The wire completion map of a Completion (docs/protocol.md); `ttft_ms` counts from
    the request's arrival, queue included."""
    prefill_s, decode_s = c.prefill_ms / 1000.0, c.decode_ms / 1000.0
    usage = {"prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
             "cached_source": c.cached_source, "prefill_tokens": c.prefill_tokens,
             "completion_tokens": c.completion_tokens}
    timings = {"queue_ms": round(queue_ms, 3), "prefill_ms": round(c.prefill_ms, 3),
               "decode_ms": round(c.decode_ms, 3), "ttft_ms": round(ttft_ms, 3),
               "prefill_tok_s": round(c.prefill_tokens / prefill_s, 2) if prefill_s > 0 else 0.0,
               "decode_tok_s": round(c.completion_tokens / decode_s, 2) if decode_s > 0 else 0.0,
               "drafted_tokens": c.drafted_tokens, "accepted_tokens": c.accepted_tokens}
    if c.images is not None:
        usage.update(images=c.images.images, visual_tokens=c.images.visual_tokens)
        timings["encode_ms"] = c.images.encode_ms
    return {"text": c.text, "ids": list(c.ids), "finish_reason": c.finish_reason,
            "usage": usage, "timings": timings, **_optional(c)}


def embeddings_result(e: Embeddings, queue_ms: float) -> dict:
    """The wire map of an embed request's result (docs/protocol.md): the vectors as lists of
    floats (each a float32 value, exactly)."""
    return {"embeddings": [v.tolist() for v in e.vectors],
            "usage": {"prompt_tokens": e.prompt_tokens, "cached_tokens": e.cached_tokens},
            "timings": {"queue_ms": round(queue_ms, 3), "total_ms": round(e.total_ms, 3)}}


def ranking_result(r: Ranking, queue_ms: float) -> dict:
    """The wire map of a rerank request's result: the top_n best documents, best first."""
    return {"results": [{"index": i, "relevance_score": s} for i, s in r.best()],
            "usage": {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens},
            "timings": {"queue_ms": round(queue_ms, 3), "total_ms": round(r.total_ms, 3)}}


def job_result(done: Done) -> dict:
    """The result map of a finished job: a completion (generate, chat), embeddings or a
    ranking."""
    if isinstance(done.completion, Embeddings):
        return embeddings_result(done.completion, done.queue_ms)
    if isinstance(done.completion, Ranking):
        return ranking_result(done.completion, done.queue_ms)
    return completion_result(done.completion, done.queue_ms, done.ttft_ms)


def token_payload(ev: TokenEvent) -> dict:
    """The `token` notification's payload of a TokenEvent."""
    return {"text": ev.text, "ids": list(ev.ids), **_optional(ev)}


def _optional(answer) -> dict:
    """The fields a completion map and a token payload carry only when there are some:
    the thinking text, tool calls, log-probabilities."""
    out = {}
    if answer.reasoning is not None:
        out["reasoning"] = answer.reasoning
    if answer.tool_calls:
        out["tool_calls"] = wire_tool_calls(answer.tool_calls)
    if answer.logprobs is not None:
        out["logprobs"] = answer.logprobs
    return out


class Methods:
    """The methods of one daemon: its engine, scheduler, status and default max_tokens."""

    def __init__(self, engine, scheduler: Scheduler, status: StatusReporter, max_tokens: int,
                 max_reply_bytes: int = 1 << 20):
        self.engine = engine
        self.scheduler = scheduler
        self.status = status
        self.max_tokens = max_tokens
        self.max_reply_bytes = max_reply_bytes   # the largest detokenize text (max_outgoing_bytes)

    @staticmethod
    def kind(method: str) -> str:
        """JOB, ASIDE or NOW (call after `validate`, which refuses unknown methods)."""
        return KINDS[method]

    def validate(self, method: str, raw) -> Params:
        """Typed params of a request (UnknownMethod, BadRequest, PromptTooLong otherwise)."""
        return validate_params(method, raw, self.engine.vocab_size, self.engine.kv.max_seq)

    def submit(self, conn_id: int, msgid: int,
               params: Union[GenerateParams, ChatParams, EmbedParams, RerankParams],
               on_event: Callable[[Event], None], transport: str = "rpc",
               endpoint: str = "") -> Job:
        """Queue a generate / chat / embed / rerank request (QueueFull, ShuttingDown
        otherwise); every transport submits through here. `transport` and `endpoint` label
        its metrics."""
        if isinstance(params, (EmbedParams, RerankParams)):
            embed = isinstance(params, EmbedParams)
            request = (EmbedInput(params.inputs, params.dimensions, params.truncate) if embed
                       else RerankInput(params.query, params.documents, params.top_n,
                                        params.instruction))
            job = Job(conn_id=conn_id, msgid=msgid, request=request, options=None,
                      stream=False, on_event=on_event, transport=transport,
                      endpoint=endpoint or ("embed" if embed else "rerank"))
            self.scheduler.submit(job)
            return job
        method = "chat" if isinstance(params, ChatParams) else "generate"
        job = Job(conn_id=conn_id, msgid=msgid, request=engine_request(params),
                  options=sampling_options(params, self.max_tokens), stream=params.stream,
                  on_event=on_event, transport=transport, endpoint=endpoint or method)
        self.scheduler.submit(job)
        return job

    def aside(self, params: Union[TokenizeParams, DetokenizeParams]) -> dict:
        """tokenize / detokenize: no KV touched, safe off the engine thread."""
        if isinstance(params, TokenizeParams):
            return {"ids": list(self.engine.tokenize(params.text, add_special=params.add_special))}
        # a token is one id in the request and up to dozens of bytes of text: without a
        # bound, 8 MiB of one repeated id made a 226 MB reply
        size = self.engine.tokenizer.decoded_size(params.ids)
        if size > self.max_reply_bytes:
            raise TooLarge(f"detokenize: the text of these {len(params.ids)} ids is {size} "
                           f"bytes, over the reply limit of {self.max_reply_bytes} bytes "
                           f"(max-outgoing-bytes); send fewer ids at a time")
        return {"text": self.engine.detokenize(list(params.ids))}

    def chat_prompt(self, params: ChatParams) -> str:
        """The prompt text a chat request renders to (the model's template; no KV touched,
        safe off the engine thread): llama.cpp's /apply-template."""
        return self.engine.prompts.chat_text(engine_request(params))[0]

    def now(self, conn_id: int, method: str, params: Params) -> dict:
        """status, ping, cancel (of a request of connection `conn_id`)."""
        if method == "status":
            return self.status.status()
        if method == "ping":
            return {"ok": True, "pid": os.getpid()}
        assert isinstance(params, CancelParams)
        return {"cancelled": self.scheduler.cancel(conn_id, params.id)}
