"""Reranking: how well each document answers a query, by a Qwen3-Reranker-style model.

Such a model is a causal LM asked, in a fixed prompt, whether the document meets the query:
its relevance score is the probability of "yes" against "no" as the next token,
softmax(head . h)[yes] = sigmoid((row_yes - row_no) . h), h the last token's row after the
output norm. The head is llama.cpp's `cls.output.weight` in a GGUF converted as a reranker
(`pooling_type` RANK: the output matrix's rows of "yes" and "no"), else those two rows of
the output matrix (a Hugging Face directory, or a GGUF with --pooling rank). The prompt is
the file's `tokenizer.chat_template.rerank` ({query}, {document}), else Qwen3-Reranker's. A
request's instruction replaces the template's {instruction}, or Qwen3-Reranker's default
instruction where a file's template has it written in (llama.cpp's converter writes it so).

Every document's prompt begins with the same system text, instruction and query, so after
the first the prefix rule reuses their KV (engine/embed.py's `pooled_rows`, last-token rows,
unpacked): each further document costs only its own tokens, where packing the prompts in one
pass would compute that common beginning once per document.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import BadRequest, NotEmbeddingModel, PromptTooLong
from ..kernels import K
from ..protocol import MAX_EMBED_TOKENS

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@dataclass(frozen=True)
class RerankInput:
    """A rerank request: the query and the documents (texts); `top_n`: how many of the
    best the answer lists (None: all); `instruction`: the task (None: the template's)."""
    query: str
    documents: tuple
    top_n: Optional[int] = None
    instruction: Optional[str] = None


@dataclass
class Ranking:
    """The result of one rerank request: a score in [0, 1] per document, in order."""
    scores: list
    prompt_tokens: int
    cached_tokens: int
    total_ms: float
    top_n: Optional[int] = None

    def best(self) -> list:
        """(index, score) of the top_n best documents, best first."""
        order = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])
        return [(i, self.scores[i]) for i in order[:self.top_n]]


def head_rows(model) -> Optional[np.ndarray]:
    """(2, hidden) float32 rows "yes", "no": the file's reranker head, else the output
    matrix's rows of those tokens; None if the tokenizer has no such tokens."""
    if model.rank_head is not None:
        return model.rank_head
    ids = [model.tokenizer.token_id(t) for t in ("yes", "no")]
    if None in ids:
        return None
    out = model.weights.output
    rows = np.empty((2, out.cols), np.float32)
    K.dequantize_rows(out.data, int(out.qtype), np.array(ids, np.int32), rows,
                      out.interleaved, out.rows)
    return rows


class Reranker:
    """Scores documents against a query on an Embedder's forward pass and arena."""

    def __init__(self, embedder, model, pooling: str):
        self.embedder = embedder
        self.pooling = pooling                  # "rank": the model reranks
        self.model_name = model.config.name
        self.template = model.rerank_template or QWEN3_TEMPLATE
        self.head = head_rows(model) if pooling == "rank" else None

    def instructed(self, instruction: Optional[str]) -> str:
        """The template with the instruction in (BadRequest if it has no place for one)."""
        if "{instruction}" in self.template:
            return self.template.replace("{instruction}", instruction or DEFAULT_INSTRUCTION)
        if instruction is None:
            return self.template
        if DEFAULT_INSTRUCTION not in self.template:
            raise BadRequest(f"{self.model_name}'s rerank template has no instruction to "
                             f"replace; send the request without one")
        return self.template.replace(DEFAULT_INSTRUCTION, instruction)

    def run(self, request: RerankInput, should_stop=None) -> Ranking:
        """Each document's relevance score (Cancelled if `should_stop` says stop)."""
        t0 = time.perf_counter()
        if self.head is None:
            why = ("its tokenizer has no \"yes\" and \"no\" tokens" if self.pooling == "rank"
                   else "its file says it is no reranker (GGUF pooling_type RANK)")
            raise NotEmbeddingModel(f"{self.model_name} cannot rerank: {why}; a Qwen3-Reranker "
                                    f"GGUF, or --pooling rank with such a model, can")
        prompts = self.embedder.prompts
        template = self.instructed(request.instruction)
        inputs, total = [], 0
        for i, doc in enumerate(request.documents):
            text = template.replace("{query}", request.query).replace("{document}", doc)
            ids = prompts.tokenize(text, add_special=True)
            total += len(ids)
            if len(ids) > self.embedder.kv.max_seq or total > MAX_EMBED_TOKENS:
                raise PromptTooLong(f"document {i}: its prompt has {len(ids)} tokens (the "
                                    f"context holds {self.embedder.kv.max_seq}), the request "
                                    f"{total} (at most {MAX_EMBED_TOKENS})")
            inputs.append(ids)
        rows, cached = self.embedder.pooled_rows(inputs, "last", should_stop, pack=False)
        yes_no = np.stack(rows) @ self.head.astype(np.float64).T
        scores = 1.0 / (1.0 + np.exp(yes_no[:, 1] - yes_no[:, 0]))
        return Ranking([float(s) for s in scores], total, cached,
                       (time.perf_counter() - t0) * 1e3, request.top_n)
