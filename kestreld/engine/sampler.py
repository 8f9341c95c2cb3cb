"""Choosing the next token from logits: penalties, a grammar's mask, greedy or sampled,
log-probabilities.

Order (as llama.cpp's default chain): logit_bias -> repeat penalty -> presence /
frequency penalties -> the grammar's mask (response_format, forced tool calls:
engine/constraint.py) -> (greedy: argmax) or temperature -> top-k -> top-p -> min-p -> draw
with the request's seeded generator; the chosen token is then committed to the grammar.
Log-probabilities are those of the model (log-softmax of the raw logits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

REPEAT_WINDOW = 64   # tokens looked back by the repeat penalty (llama.cpp's default)
BAN = 100.0          # a logit_bias of -100 bans its token
_FLOAT64_MAX = float(np.finfo(np.float64).max)


@dataclass(frozen=True)
class ResponseFormat:
    """The answer must be JSON: any JSON object ("json_object") or a value valid for
    `schema` ("json_schema"; validated at the edge, protocol.py)."""
    kind: str                       # "json_object" | "json_schema"
    schema: Optional[dict] = None   # the JSON schema of "json_schema"


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request generation options (validated at the edge before they get here)."""
    max_tokens: int = 256
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    min_p: float = 0.0              # 0: off
    repeat_penalty: float = 1.0     # 1: off (llama.cpp's rule, over the last 64 tokens)
    presence_penalty: float = 0.0   # OpenAI's: minus this once for each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the answer
    seed: Optional[int] = None
    stop: tuple = ()                # stop strings; the text ends before the first match
    ignore_eos: bool = False
    logprobs: int = 0               # top-k log-probabilities per generated token
    response_format: Optional[ResponseFormat] = None
    speculate: bool = True          # drafts from the context, where the daemon speculates
    logit_bias: tuple = ()          # ((token id, bias), ...): added to the logits; -100 bans


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - float(logits.max())
    return z - np.log(np.exp(z).sum())


class Sampler:
    """Per-request sampling state: its own random generator and, for constrained output,
    the request's grammar matcher (a `constraint.Constraint`)."""

    def __init__(self, opts: SamplingOptions, constraint=None):
        self.opts = opts
        self.rng = np.random.default_rng(opts.seed)
        self.constraint = constraint

    def next_token(self, logits: np.ndarray, prompt_ids, generated) -> int:
        """The next id: penalties, the grammar's mask, then greedy or a draw; the id is
        committed to the grammar (see `finished`)."""
        logits = self.penalize(logits, prompt_ids, generated)
        if self.constraint is None:
            return self.choose(logits)
        tok = self.choose(self.constraint.mask(logits))
        self.constraint.commit(tok)
        return tok

    @property
    def finished(self) -> bool:
        """True when the grammar is complete and only end-of-sequence may follow."""
        return self.constraint is not None and self.constraint.finished

    def penalize(self, logits: np.ndarray, prompt_ids, generated) -> np.ndarray:
        """logit_bias, the repeat penalty, then the presence and frequency penalties: a new
        array where any applies, else `logits` itself; `logits` is never changed in place."""
        out = self._repeat_penalty(self._bias(logits), prompt_ids, generated)
        o = self.opts
        if (o.presence_penalty == 0.0 and o.frequency_penalty == 0.0) or not generated:
            return out
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        out = out.astype(np.float64)     # a copy even when the repeat penalty made none
        out[ids] -= o.presence_penalty + o.frequency_penalty * counts
        return out

    def _bias(self, logits: np.ndarray) -> np.ndarray:
        """OpenAI's logit_bias: each bias added to its token's logit; -100 bans the token
        (-inf: it is never chosen, as OpenAI documents -100)."""
        if not self.opts.logit_bias:
            return logits
        out = logits.astype(np.float64)
        for token, bias in self.opts.logit_bias:
            out[token] = -np.inf if bias <= -BAN else out[token] + bias
        return out

    def _repeat_penalty(self, logits: np.ndarray, prompt_ids, generated) -> np.ndarray:
        """llama.cpp's repeat penalty over the last REPEAT_WINDOW ids of prompt + generated:
        divide positive logits, multiply negative ones."""
        p = self.opts.repeat_penalty
        if p == 1.0:
            return logits
        recent = list(generated[-REPEAT_WINDOW:])
        if len(recent) < REPEAT_WINDOW:
            recent = list(prompt_ids[max(0, len(prompt_ids) - (REPEAT_WINDOW - len(recent))):]) + recent
        if not recent:
            return logits
        out = logits.astype(np.float64)
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        vals = out[ids]
        with np.errstate(over="ignore"):      # a denormal penalty: capped, never inf (inf - inf)
            out[ids] = np.where(vals > 0, np.minimum(vals / p, _FLOAT64_MAX), vals * p)
        return out

    def choose(self, logits: np.ndarray) -> int:
        """The next id from (penalized) logits."""
        o = self.opts
        if o.temperature <= 0.0:
            return int(np.argmax(logits))
        # subtract the max before dividing: a tiny temperature then gives 0 and -inf, not inf - inf
        with np.errstate(over="ignore"):
            z = (logits.astype(np.float64) - float(logits.max())) / o.temperature
        cand = np.arange(z.size)
        if 0 < o.top_k < z.size:
            cand = np.argpartition(-z, o.top_k - 1)[: o.top_k]
        cand = cand[np.argsort(-z[cand], kind="stable")]
        p = np.exp(z[cand] - z[cand[0]])
        p /= p.sum()
        keep = p.size
        if o.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), o.top_p) + 1))
        if o.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(p >= o.min_p * p[0]))))
        p = p[:keep] / p[:keep].sum()
        return int(cand[self.rng.choice(keep, p=p)])

    def top_logprobs(self, logits: np.ndarray, chosen: int) -> dict:
        """{"id", "logprob", "top": [[id, logprob], ...]} with the request's `logprobs` k."""
        lp = log_softmax(logits)
        k = self.opts.logprobs
        top = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        top = top[np.argsort(-lp[top], kind="stable")]
        return {"id": chosen, "logprob": float(lp[chosen]),
                "top": [[int(i), float(lp[i])] for i in top]}
