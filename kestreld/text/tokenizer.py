"""Text <-> token ids for byte-level BPE models (Qwen3, SmolLM2), on the `tokenizers` library.

Two sources:
  - a Hugging Face directory: tokenizer.json as is, special tokens from tokenizer_config.json;
  - GGUF metadata (`tokenizer.ggml.*`): the vocabulary and merges rebuilt into a
    `tokenizers` BPE with the pre-tokenizer regexes that llama.cpp's llama-vocab.cpp uses
    for the file's `tokenizer.ggml.pre` name, so ids equal llama.cpp's.

Decoding goes through a bytes-per-token table (byte-level BPE tokens are byte strings), which
is what lets `IncrementalDecoder` stream text without ever splitting a UTF-8 character.
Special tokens in the input text (e.g. `<|im_start|>`) are always recognised, as the
engine renders chat templates to text and encodes the result.
"""
from __future__ import annotations

import codecs
import functools
import json
import os
from typing import Any, Iterable, Mapping, Optional

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError

# Token texts that end a generation wherever they are in the vocabulary (llama.cpp's list).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
})

# GGUF token_type values (gguf.TokenType) that become added special tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_UNUSED = 5        # padding ids ("[PAD151669]"): never text

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as in llama.cpp's llm_tokenizer_bpe: each
# regex splits the pieces the previous one produced, keeping matches and gaps ("isolated").
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class _PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes and the flags that go with it."""

    def __init__(self, regexes: tuple, ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = regexes
        self.ignore_merges = ignore_merges   # a word that is a whole token is not merged
        self.add_bos = add_bos               # default when the file has no add_bos_token


_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM_PRE = _PreTokenizer((r"\p{N}", _GPT2))
PRE_TOKENIZERS = {
    "default": _PreTokenizer(_DEFAULT),
    "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE, "llama-bpe": _LLAMA3_PRE,
    "smollm": _SMOLLM_PRE, "starcoder": _SMOLLM_PRE, "refact": _SMOLLM_PRE,
    "gpt-2": _PreTokenizer((_GPT2,)),
    "qwen2": _PreTokenizer((_QWEN2,)),
}


def _byte_level_alphabet() -> dict:
    """GPT-2's byte <-> printable character map, as char -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_CHAR_TO_BYTE = _byte_level_alphabet()
# str.translate table: each alphabet character -> the character of its byte value, and every
# other character below 256 -> U+FFFF, so that latin-1 encoding of a translated token fails
# (and the exact slow path runs) whenever the token has a character outside the alphabet.
_ALPHABET_TO_LATIN1 = {**{c: 0xFFFF for c in range(256)},
                       **{ord(ch): b for ch, b in _CHAR_TO_BYTE.items()}}


def _byte_level_bytes(token: str) -> bytes:
    """The raw bytes a byte-level token stands for (characters outside the map as UTF-8)."""
    try:
        return token.translate(_ALPHABET_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for ch in token:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


class Tokenizer:
    """Encode text to ids and decode ids to text for one model. Immutable, thread-safe."""

    def __init__(self, tok: HFTokenizer, token_bytes: list, bos_id: Optional[int],
                 eos_id: Optional[int], eog_ids: Iterable[int], add_bos: bool,
                 control_ids: Iterable[int] = (), suffix_ids: Iterable[int] = ()):
        self._tok = tok
        self._token_bytes = token_bytes    # id -> the bytes that token decodes to
        self._token_sizes = np.array([len(b) for b in token_bytes], dtype=np.int64)
        # control tokens (<|im_end|>, ...) and unused padding ids: not text, a grammar must
        # not spell them (other added tokens, e.g. Qwen3's <tool_call>, are text that is one token)
        self.control_ids = frozenset(control_ids)
        self.bos_id = bos_id
        self.eos_id = eos_id               # the model's own EOS (the template's eos_token)
        self.eos_ids = frozenset(i for i in {eos_id, *eog_ids} if i is not None)  # stop ids
        self.add_bos = add_bos and bos_id is not None
        # what the file's post-processor appends to one text (Qwen3-Embedding: <|endoftext|>,
        # where its vector is pooled); only embeddings add it (a prompt must not end there)
        self.suffix_ids = tuple(suffix_ids)
        self.control_texts = tuple(t.content for i, t in tok.get_added_tokens_decoder().items()
                                   if t.special and i in self.control_ids)

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """From a Hugging Face model directory: tokenizer.json, tokenizer_config.json and,
        if present, generation_config.json (extra end-of-generation ids)."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise ModelLoadError(f"{tok_file}: missing file")
        try:
            tok = HFTokenizer.from_file(tok_file)
            with open(tok_file, encoding="utf-8") as f:
                decoder = json.load(f).get("decoder") or {}
        except Exception as e:  # tokenizers raises bare Exceptions on bad JSON
            raise ModelLoadError(f"{tok_file}: cannot read tokenizer: {e}") from None
        if not _is_byte_level(decoder):
            raise ModelLoadError(f"{tok_file}: unsupported tokenizer (decoder {decoder.get('type')!r});"
                                 " supported: byte-level BPE")
        config = _read_json_if_exists(os.path.join(path, "tokenizer_config.json"))
        gen_config = _read_json_if_exists(os.path.join(path, "generation_config.json"))

        vocab = tok.get_vocab(with_added_tokens=True)
        added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        token_bytes = _token_bytes_table(vocab, added)

        bos_id = _special_id(tok, config.get("bos_token"))
        eos_id = _special_id(tok, config.get("eos_token"))
        gen_eos = gen_config.get("eos_token_id")
        eog = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        eog.update(i for i, text in added.items() if text in EOG_TEXTS)
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # whatever tokenizer.json's post-processor does
            add_bos = bos_id is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        control = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
        return cls(tok, token_bytes, bos_id, eos_id, eog, add_bos, control, _post_suffix(tok))

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """From a GGUFReader's `fields` (`tokenizer.ggml.*`): byte-level BPE ("gpt2") only."""
        def get(key, default=None):
            field = fields.get(key)
            return default if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model);"
                                 " supported: 'gpt2' (byte-level BPE)")
        pre_name = get("tokenizer.ggml.pre", "default")
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ModelLoadError(f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre);"
                                 f" supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ModelLoadError("tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)

        vocab = {t: i for i, t in enumerate(tokens)}
        # llama.cpp splits a merge at the first space after its first character
        pairs = []
        for m in merges:
            cut = m.find(" ", 1)
            pairs.append((m[:cut], m[cut + 1:]))
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        added = {i: tokens[i] for i, t in enumerate(types)
                 if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)}
        # control tokens are special (never text); user-defined ones are text one token long
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _TOKEN_TYPE_USER_DEFINED])

        bos_id = get("tokenizer.ggml.bos_token_id")
        eog = {get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")}
        eog.update(i for i, text in added.items() if text in EOG_TEXTS)
        add_bos = get("tokenizer.ggml.add_bos_token", pre.add_bos)
        control = [i for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNUSED)]
        eos_id = get("tokenizer.ggml.eos_token_id")
        # llama.cpp's converter records a post-processor that appends EOS as add_eos_token
        add_eos = get("tokenizer.ggml.add_eos_token", False)
        suffix = (eos_id,) if add_eos and eos_id is not None else ()
        return cls(tok, _token_bytes_table(vocab, added), bos_id, eos_id, eog, bool(add_bos),
                   control, suffix)

    # ---- use --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (may be smaller than the model's embedding rows)."""
        return len(self._token_bytes)

    def encode(self, text: str, add_special: bool = False) -> list:
        """Token ids of `text`; special-token texts in it become their ids. With
        `add_special`, BOS is prepended when the model asks for it (add_bos_token)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def encode_text(self, text: str) -> list:
        """Token ids of `text` read as text: a control token's text in it (`<|im_end|>`)
        is tokenized as the characters it is made of."""
        return self._plain.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """The same tokenizer with control tokens read as text; other added tokens (Qwen3's
        <think>, <tool_call>) still match, being text themselves. Made when a client's
        text first holds a control token's spelling (two threads may both make one)."""
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids`, concatenated."""
        table = self._token_bytes
        return b"".join(table[i] for i in ids)

    def decoded_size(self, ids: Iterable[int]) -> int:
        """Bytes that `token_bytes(ids)` would make, counted without making them."""
        return int(self._token_sizes[np.asarray(ids, dtype=np.int64)].sum())

    def token_id(self, text: str) -> Optional[int]:
        """The id of the token spelled `text` (e.g. "<|image_pad|>"), None if there is none."""
        return self._tok.token_to_id(text)

    def token_text(self, token_id: int) -> str:
        """The text of one token (a piece of a multi-byte character shows as U+FFFD)."""
        return self.decode([token_id])

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: no text longer than n * this fits in n tokens."""
        return max(len(b) for b in self._token_bytes)

    def incremental_decoder(self) -> "IncrementalDecoder":
        """A fresh streaming decoder for one generation."""
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Turns a stream of ids into text pieces that never split a UTF-8 character.

    The concatenation of every `feed` result and the final `flush` equals
    `tokenizer.decode(all ids)`. Not thread-safe (one per generation)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        """Text completed by `ids`; bytes of an unfinished character are held back."""
        return self._utf8.decode(self._tokenizer.token_bytes(ids), final=False)

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD (the stream ended inside a character)."""
        return self._utf8.decode(b"", final=True)


def _token_bytes_table(vocab: Mapping[str, int], added: Mapping[int, str]) -> list:
    """id -> bytes: added tokens are plain text, the rest are byte-level encoded."""
    table = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        table[i] = _byte_level_bytes(text)
    for i, text in added.items():
        table[i] = text.encode("utf-8")
    return table


def _post_suffix(tok: HFTokenizer) -> tuple:
    """The ids tokenizer.json's post-processor appends after a text's own (none for most
    chat models; Qwen3-Embedding's TemplateProcessing appends <|endoftext|>)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[start + len(plain):])
    return ()


def _is_byte_level(decoder: Mapping) -> bool:
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))


def _special_id(tok: HFTokenizer, token: Any) -> Optional[int]:
    """Id of a tokenizer_config special token given as a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def _read_json_if_exists(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from None
