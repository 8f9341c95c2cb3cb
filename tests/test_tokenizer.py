"""Tokenizer ids and text against independent references.

References: transformers' own GGUF tokenizer conversion of SmolLM2 (AutoTokenizer with
gguf_file), transformers on a Hugging Face tokenizer directory, and for the "qwen2" and
"llama-bpe" pre-tokenizers the original Hugging Face regexes (case-insensitive groups, not
llama.cpp's rewritten ones) run by `tokenizers` on the same vocabulary.
"""
import os

import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kestreld.model.gguf_file import open_gguf
from kestreld.text.tokenizer import Tokenizer
from _loader_models import smollm2_gguf

CORPUS = [
    "Hello world! How are you doing today?",
    "I'm sure they'd've DON'T won't it's THEY'LL we're you've",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159 1,000,000 2024-06-01",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트, русский текст, العربية, हिन्दी, ελληνικά",
    "Emoji: 🙂😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "int main(void) {\n\tprintf(\"%d\\n\", x << 2 | y & 0xFF);\n\treturn 0;\n}\n",
    "    leading spaces, trailing spaces    ",
    "a  b   c    d\n\n\ne\n \n  \n\t\t\tf\r\ng\r\n\r\nh",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "Accents: café naïve résumé Ångström façade — “quotes” ‘single’ … ©",
    "URL https://example.com/path?query=1&x=y#frag and e-mail a.b@c.org",
    "$$ \\frac{a}{b} $$ ~~~ ``` ### *** !!! ??? ... ,,, ;;; ::: ||| &&&",
    "",
    " ",
    "\n",
    "x" * 300,
]


@pytest.fixture(scope="module")
def gguf_fields():
    return open_gguf(smollm2_gguf()).fields


@pytest.fixture(scope="module")
def ours(gguf_fields):
    return Tokenizer.from_gguf_metadata(gguf_fields)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def test_ids_equal_transformers_gguf(ours, reference):
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text


# Numerals outside ASCII: llama.cpp's "smollm" pre-tokenizer isolates every \p{N}, as
# SmolLM2's own tokenizer.json does (Digits(individual_digits) then ByteLevel), while
# transformers' GGUF conversion keeps only ByteLevel and so merges " ½" into one token.
NUMERALS = ["a ½ b", "x² + y²", "٣ and ۳", "Ⅻ chapter", "１２３ fullwidth", "1/2 ½½ 3¼"]


def test_numerals_follow_llama_cpp_and_smollm2_tokenizer_json(ours, reference):
    import json
    spec = json.loads(reference.backend_tokenizer.to_str())
    original = HFTokenizer.from_str(json.dumps(spec))
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in CORPUS + NUMERALS:
        assert ours.encode(text) == original.encode(text, add_special_tokens=False).ids, text
    assert ours.encode(" ½") == [216, ours.encode("½")[0]]
    assert reference.encode(" ½", add_special_tokens=False) != ours.encode(" ½")


def test_decode_round_trips_and_equals_reference(ours, reference):
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == reference.backend_tokenizer.decode(ids, skip_special_tokens=False)


def test_smollm2_special_tokens(ours):
    assert ours.vocab_size == 49152
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert ours.bos_id == 1 and ours.eos_id == 2          # <|im_start|>, <|im_end|>
    assert ours.eos_ids == {2, 0}                         # and <|endoftext|> (llama.cpp's EOG)
    assert ours.add_bos is False                        # tokenizer.ggml.add_bos_token
    assert ours.encode("Hi", add_special=True) == ours.encode("Hi")
    assert ours.token_text(2) == "<|im_end|>" and ours.token_text(19556) == "Hello"


def test_hf_dir_equals_transformers(tmp_path, reference):
    transformers = pytest.importorskip("transformers")
    reference.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert ours.bos_id == ref.bos_token_id and ours.eos_id == ref.eos_token_id
    assert ours.eos_ids == {ref.eos_token_id, ref.convert_tokens_to_ids("<|endoftext|>")}
    assert ours.add_bos == (ref.encode("x", add_special_tokens=True)[0] == ref.bos_token_id)


class _Field:
    """Stands in for a gguf ReaderField."""

    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def _with_pre(fields, pre):
    out = dict(fields)
    out["tokenizer.ggml.pre"] = _Field(pre)
    return out


def _hf_reference(reference, regex, ignore_merges=False):
    """SmolLM2's vocabulary and merges with a Hugging Face pre-tokenizer regex."""
    import json
    spec = json.loads(reference.backend_tokenizer.to_str())
    spec["model"]["ignore_merges"] = ignore_merges
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


# The regexes as they appear in the models' own tokenizer.json files.
QWEN2_HF = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_HF = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre,regex,ignore_merges", [("qwen2", QWEN2_HF, False),
                                                     ("llama-bpe", LLAMA3_HF, True)])
def test_other_pre_tokenizers_equal_hf_regex(gguf_fields, reference, pre, regex, ignore_merges):
    ours = Tokenizer.from_gguf_metadata(_with_pre(gguf_fields, pre))
    ref = _hf_reference(reference, regex, ignore_merges)
    extra = ["1234567 12 123 1234", "Hello  \n\n  World!!\n\nfoo", "x\r\n\r\n y"]
    for text in CORPUS + NUMERALS + extra:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    # llama.cpp's llama-bpe default is add_bos = true (the file here says false)
    no_flag = _with_pre(gguf_fields, pre)
    del no_flag["tokenizer.ggml.add_bos_token"]
    assert Tokenizer.from_gguf_metadata(no_flag).add_bos == (pre == "llama-bpe")


def test_default_pre_tokenizer_round_trips(gguf_fields):
    ours = Tokenizer.from_gguf_metadata(_with_pre(gguf_fields, "default"))
    for text in CORPUS:
        assert ours.decode(ours.encode(text)) == text
    # default splits punctuation runs apart from words: "!!!" never merges with "a"
    assert ours.encode("a!!!") == ours.encode("a") + ours.encode("!!!")


def test_add_bos_prepends_only_when_asked(gguf_fields):
    fields = dict(gguf_fields)
    fields["tokenizer.ggml.add_bos_token"] = _Field(True)
    tok = Tokenizer.from_gguf_metadata(fields)
    assert tok.encode("Hi", add_special=True) == [1] + tok.encode("Hi")
    assert tok.encode("Hi") == tok.encode("Hi", add_special=False)


def test_incremental_decoder_never_splits_a_character(ours):
    for text in CORPUS:
        ids = ours.encode(text)
        dec = ours.incremental_decoder()
        pieces = [dec.feed([i]) for i in ids]
        assert "".join(pieces) + dec.flush() == ours.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_holds_partial_bytes(ours):
    ids = ours.encode("🙂")
    assert len(ids) > 1                                  # byte tokens of one character
    dec = ours.incremental_decoder()
    assert [dec.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.feed(ids[-1:]) == "🙂"
    # a stream cut inside a character ends in U+FFFD on flush, like decode
    dec = ours.incremental_decoder()
    assert dec.feed(ids[:1]) == "" and dec.flush() == ours.decode(ids[:1]) == "\ufffd"


def test_hf_dir_missing_tokenizer_json(tmp_path):
    from kestreld.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="tokenizer.json: missing file"):
        Tokenizer.from_hf_dir(str(tmp_path))
