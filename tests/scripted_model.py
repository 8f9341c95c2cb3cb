"""A generated Qwen3 GGUF whose greedy answers are known in advance: a real model, loaded
and run by the real daemon, for tests of how the client shows Qwen3's thinking block (the
random-weight models of modelgen never emit `<think>`, and no real thinking model is
available to the tests).

How the answers are chosen: one layer whose attention and feed-forward outputs are zero
(o_proj and down_proj are zero matrices), so the last hidden state is the RMS-normed
embedding of the current token and the logits depend on the current token only. For each
chosen step a -> b the output matrix's row b holds token a's normed embedding / hidden, so
token a gives logit ~1 to b and about N(0, 1/hidden) to every other chosen successor (a
margin of ~0.6 over the best of them, far above Q8_0's error): greedy decoding walks a
chain of distinct tokens.

The chat template has Qwen3's shape: with thinking on, the prompt ends `assistant\\n`; with
it off, `assistant\\n<think>\\n\\n</think>\\n\\n` (what Qwen3's template appends). Their last
tokens (Ċ and ĊĊ) start the two chains:

    thinking on    <think>THOUGHT</think>ANSWER<|im_end|>
    thinking off   PLAIN<|im_end|>

`<think>` and `</think>` are added tokens (GGUF type USER_DEFINED), as in Qwen3's vocabulary.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken

import modelgen

THOUGHT = "The user greets me"
ANSWER = "Hi from a small board"
PLAIN = "Bonjour!"

SPEC = modelgen.ModelSpec("scripted", "qwen3", hidden=64, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=32, ffn=64, vocab=512, tied=False, seed=21)
THINK_TAGS = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
GENERATION_PROMPT = {True: "<|im_start|>assistant\n",
                     False: "<|im_start|>assistant\n<think>\n\n</think>\n\n"}


def _tokenizer() -> modelgen.GenTokenizer:
    """modelgen's Qwen3 tokenizer with <think> and </think> in its first two unused ids."""
    tok = modelgen.build_tokenizer(SPEC)
    tok.tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    for t in THINK_TAGS:
        i = tok.tokenizer.token_to_id(t)
        tok.tokens[i], tok.token_types[i] = t, int(gguf.TokenType.USER_DEFINED)
    return tok


def _chains(tok: modelgen.GenTokenizer) -> list[list[int]]:
    """The token chains, each starting at its trigger (the prompt's last token)."""
    enc = tok.tokenizer.encode
    think_open, think_close = (tok.tokenizer.token_to_id(t) for t in THINK_TAGS)
    thinking = ([enc(GENERATION_PROMPT[True]).ids[-1], think_open] + enc(THOUGHT).ids
                + [think_close] + enc(ANSWER).ids + [tok.eos_id])
    plain = [enc(GENERATION_PROMPT[False]).ids[-1]] + enc(PLAIN).ids + [tok.eos_id]
    steps = [a for chain in (thinking[:-1], plain[:-1]) for a in chain]
    if len(set(steps)) != len(steps):
        raise RuntimeError(f"scripted model: a token occurs twice in the chains {thinking}, "
                           f"{plain}; each token may have one successor")
    return [thinking, plain]


def write(path: Path) -> Path:
    """Write the scripted Q8_0 GGUF at `path`; returns it."""
    tok = _tokenizer()
    w = modelgen.make_weights(SPEC)
    rng = np.random.default_rng(SPEC.seed)
    embed = rng.normal(0.0, 1.0, (SPEC.vocab, SPEC.hidden)).astype(np.float32)
    w["model.embed_tokens.weight"] = embed
    w["model.norm.weight"] = np.ones(SPEC.hidden, np.float32)
    for i in range(SPEC.n_layers):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w[f"model.layers.{i}.{name}"] = np.zeros_like(w[f"model.layers.{i}.{name}"])
    normed = embed / np.sqrt(np.mean(embed ** 2, axis=1, keepdims=True) + SPEC.norm_eps)
    head = np.zeros((SPEC.vocab, SPEC.hidden), np.float32)
    for chain in _chains(tok):
        for a, b in zip(chain, chain[1:]):
            head[b] += normed[a] / SPEC.hidden      # EOS ends both chains
    w["lm_head.weight"] = head
    modelgen.write_gguf(SPEC, w, tok, path, "q8_0", chat_template=CHAT_TEMPLATE)
    return path
