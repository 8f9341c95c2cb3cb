"""The generate loop's invariants on a generated Qwen3 model (exact token ids):
chunking, streaming, prefix reuse, stop strings, limits, cancel and errors."""
import pytest

from kestreld.engine.generate import Engine, StopMatcher
from kestreld.engine.sampler import SamplingOptions
from kestreld.model.load import load_model
from kestreld.errors import BadRequest, PromptTooLong
from modelgen import prompt_ids

pytestmark = pytest.mark.arm64

NAME = "qwen3_untied"


@pytest.fixture(scope="module")
def model(zoo):
    return load_model(str(zoo.get(NAME).gguf["q8_0"]))


def engine(model, **kw):
    args = dict(max_seq=512, threads=1, prefill_chunk=64)
    args.update(kw)
    return Engine(model, **args)


GREEDY = SamplingOptions(max_tokens=12, ignore_eos=True)


def test_chunking_does_not_change_tokens(model):
    ids = prompt_ids(NAME, 150, seed=1)
    outs = [engine(model, prefill_chunk=ch).generate(ids, GREEDY).ids for ch in (256, 37, 1)]
    assert outs[0] == outs[1] == outs[2]
    assert len(outs[0]) == 12


def test_streamed_equals_final(model):
    ids = prompt_ids(NAME, 40, seed=2)
    events = []
    c = engine(model).generate(ids, GREEDY, on_token=events.append)
    assert "".join(e.text for e in events) == c.text
    assert [i for e in events for i in e.ids] == c.ids
    assert c.finish_reason == "length" and c.completion_tokens == 12


def test_prefix_hit_equals_recompute(model):
    first = prompt_ids(NAME, 80, seed=3)
    e = engine(model)
    c1 = e.generate(first, GREEDY)
    follow = first + c1.ids + prompt_ids(NAME, 20, seed=4)
    hit = e.generate(follow, GREEDY)
    assert hit.cached_tokens == len(first) + len(c1.ids) - 1   # the last sampled id has no KV yet
    assert hit.prefill_tokens == len(follow) - hit.cached_tokens
    assert hit.prefix_event.startswith("[KV-PREFIX] hit keep=")
    fresh = engine(model, prefix_kv=False).generate(follow, GREEDY)
    assert fresh.cached_tokens == 0
    assert hit.ids == fresh.ids


def test_short_common_prefix_is_a_miss(model):
    e = engine(model)
    e.generate(prompt_ids(NAME, 50, seed=5), GREEDY)
    other = prompt_ids(NAME, 10, seed=5) + prompt_ids(NAME, 40, seed=6)
    c = e.generate(other, GREEDY)
    assert c.cached_tokens == 0 and c.prefix_event == "[KV-PREFIX] miss lcp=10"


def test_stop_string_cuts_text(model):
    ids = prompt_ids(NAME, 30, seed=7)
    full = engine(model).generate(ids, SamplingOptions(max_tokens=24, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[4:7]
    events = []
    cut = engine(model).generate(ids, SamplingOptions(max_tokens=24, ignore_eos=True, stop=(stop,)),
                                 on_token=events.append)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    assert "".join(e.text for e in events) == cut.text


def test_stop_matcher_holds_back_partial_match():
    m = StopMatcher(["END"])
    assert m.safe_len("abcEN") == 3 and m.safe_len("abcE") == 3 and m.safe_len("abc") == 3
    assert m.find("xxENDyy") == 2 and m.find("xx") == -1


def test_max_tokens_clamped_to_room(model):
    e = engine(model, max_seq=64)
    c = e.generate(prompt_ids(NAME, 60, seed=8), SamplingOptions(max_tokens=100, ignore_eos=True))
    assert c.completion_tokens == 4 and c.finish_reason == "length"


def test_prompt_too_long_states_both_numbers(model):
    e = engine(model, max_seq=64)
    with pytest.raises(PromptTooLong) as err:
        e.generate(prompt_ids(NAME, 64, seed=9), GREEDY)
    assert "64 tokens" in str(err.value) and "max_seq=64" in str(err.value)


def test_bad_ids_rejected(model):
    with pytest.raises(BadRequest):
        engine(model).generate([1, 2, 10**6], GREEDY)
    with pytest.raises(BadRequest):
        engine(model).generate([], GREEDY)


def test_cancel_keeps_arena_consistent(model):
    ids = prompt_ids(NAME, 100, seed=10)
    e = engine(model, prefill_chunk=16)
    stops = iter([False, False, True])
    c = e.generate(ids, GREEDY, should_stop=lambda: next(stops, True))
    assert c.finish_reason == "cancelled" and e.kv.cache_len == 32   # two chunks done
    assert list(e.kv.keys) == ids[:32]
    again = e.generate(ids, GREEDY)
    assert again.cached_tokens == 32
    assert again.ids == engine(model).generate(ids, GREEDY).ids


def test_error_in_callback_keeps_arena_consistent(model):
    ids = prompt_ids(NAME, 40, seed=11)
    e = engine(model)
    calls = []

    def boom(event):
        calls.append(event)
        if len(calls) == 3:
            raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        e.generate(ids, GREEDY, on_token=boom)
    assert list(e.kv.keys) == (ids + [i for ev in calls for i in ev.ids])[:e.kv.cache_len]
    assert e.generate(ids, GREEDY).ids == engine(model).generate(ids, GREEDY).ids


def test_seeded_sampling_repeats_and_logprobs(model):
    ids = prompt_ids(NAME, 20, seed=12)
    opts = SamplingOptions(max_tokens=10, temperature=0.9, top_k=40, seed=123, ignore_eos=True,
                           logprobs=3)
    a = engine(model).generate(ids, opts)
    b = engine(model).generate(ids, opts)
    assert a.ids == b.ids
    assert len(a.logprobs) == 10
    assert all(len(lp["top"]) == 3 and lp["logprob"] <= 0 for lp in a.logprobs)
    assert [lp["id"] for lp in a.logprobs] == a.ids


def test_text_that_cannot_fit_is_refused_before_tokenizing(model):
    e = engine(model, max_seq=64)
    limit = 64 * model.tokenizer.max_token_bytes
    assert e.prompts.max_text_chars == limit
    assert e.tokenize("a" * limit)                                 # at the bound: tokenized
    with pytest.raises(PromptTooLong, match=f"at most {limit}"):
        e.tokenize("a" * (limit + 1))
