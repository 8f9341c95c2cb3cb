"""SmolLM2-135M Q8_0 against llama.cpp's recorded outputs (tests/golden/smollm2_llamacpp.json).

The golden file was written by tests/golden/record_llamacpp.py with llama-cpp-python on the
same Q8_0 file (checked by sha256); this test needs only the JSON. The prompts share a long
system prefix and run one after another on one engine, so all but the first reuse cached KV
while llama.cpp computed each from scratch: equal outputs also mean cache hit == miss.
"""
import json
import os
import re

import pytest

from greedy_cases import sha256_file
from kestreld.service.config import default_cache_dir
from kestreld.model.convert import smollm2_q8_0_path
from kestreld.engine.generate import Engine
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model


GOLDEN_PATH = os.path.join(os.path.dirname(__file__), "golden", "smollm2_llamacpp.json")
with open(GOLDEN_PATH, encoding="utf-8") as _f:
    GOLDEN = json.load(_f)
N_EXACT = 16          # greedy tokens that must equal llama.cpp's
COMMON_WORDS = {"the", "a", "an", "is", "of", "and", "to", "in", "it", "you", "i", "are",
                "that", "for", "be", "this", "with", "can", "on", "its", "as", "by", "your"}


@pytest.fixture(scope="module")
def model_path():
    return smollm2_q8_0_path(default_cache_dir(os.environ))


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_seq=2048, threads=2)


@pytest.mark.arm64
def test_golden_was_recorded_on_this_file(model_path):
    assert sha256_file(model_path) == GOLDEN["model_sha256"], \
        "the Q8_0 conversion changed: re-run tests/golden/record_llamacpp.py"


@pytest.mark.arm64
@pytest.mark.parametrize("case", GOLDEN["tokenization"], ids=lambda c: repr(c["text"][:24]))
def test_tokenizer_ids_equal_llamacpp(model, case):
    assert model.tokenizer.encode(case["text"], add_special=False) == case["ids"]


@pytest.mark.arm64
@pytest.mark.parametrize("case", GOLDEN["tokenization"], ids=lambda c: repr(c["text"][:24]))
def test_decode_round_trips(model, case):
    assert model.tokenizer.decode(case["ids"]) == case["text"]


@pytest.mark.arm64
def test_chat_template_and_prompt_ids_equal_llamacpp(engine, model):
    for case in GOLDEN["continuations"]:
        messages = [{"role": "system", "content": GOLDEN["system"]},
                    {"role": "user", "content": case["user"]}]
        assert engine.prompts.render_chat(messages) == case["prompt"]
        assert model.tokenizer.encode(case["prompt"]) == case["prompt_ids"]


def _is_coherent_english(text: str) -> bool:
    words = set(re.findall(r"[a-z']+", text.lower()))
    return all(ch.isprintable() or ch in "\n\t" for ch in text) and bool(words & COMMON_WORDS)


@pytest.mark.arm64
def test_golden_texts_are_coherent():
    # Guards the oracle itself: a broken recording would make the comparisons meaningless.
    for case in GOLDEN["continuations"]:
        assert len(case["generated_ids"]) >= N_EXACT, case
        assert _is_coherent_english(case["text"]), case["text"]


@pytest.mark.arm64
@pytest.mark.parametrize("index", range(len(GOLDEN["continuations"])))
def test_greedy_continuation_equals_llamacpp(engine, model, index):
    case = GOLDEN["continuations"][index]
    c = engine.generate(case["prompt_ids"], SamplingOptions(max_tokens=N_EXACT, temperature=0.0))
    want = case["generated_ids"][:N_EXACT]
    assert c.ids == want, (f"first difference at step "
                           f"{next(i for i, (a, b) in enumerate(zip(c.ids + [-1], want)) if a != b)}; "
                           f"llama.cpp's top1-top2 logit margins {case['margins'][:N_EXACT]}\n"
                           f"ours: {model.tokenizer.decode(c.ids)!r}\n"
                           f"llama.cpp: {model.tokenizer.decode(want)!r}")
    assert c.text == model.tokenizer.decode(want)
    assert _is_coherent_english(c.text), c.text


# Not run as arm64: there the logits are x86-64's bit for bit (tests/test_same_tokens.py), so
# this would add emulated minutes and nothing else.
@pytest.mark.parametrize("index", range(len(GOLDEN["continuations"])))
def test_first_position_logprobs_match_llamacpp(engine, index):
    # The top-5 log-probabilities of the first generated position match llama.cpp's. Both
    # engines round activations to 8 bits, and each is off an exact float64 forward on the same
    # Q8_0 weights by up to ~0.3 on ranks 2-5 (measured on these prompts); the top token is much
    # tighter.
    case = GOLDEN["continuations"][index]
    c = engine.generate(case["prompt_ids"], SamplingOptions(max_tokens=1, temperature=0.0,
                                                            logprobs=5))
    ours = {tok: lp for tok, lp in c.logprobs[0]["top"]}
    theirs = {tok: lp for tok, _logit, lp in case["first_top5"]}
    top1 = case["first_top5"][0][0]
    assert abs(ours[top1] - theirs[top1]) < 0.15, (ours, theirs)
    assert len(ours.keys() & theirs.keys()) >= 4, (ours, theirs)
    for tok in ours.keys() & theirs.keys():
        assert abs(ours[tok] - theirs[tok]) < 0.6, (tok, ours[tok], theirs[tok])
