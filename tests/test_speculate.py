"""Speculation from the context (kestreld/engine/speculate.py): the drafter's n-gram lookup
and its adaptation, then exactness through the engine: greedy and seeded outputs (ids and
logprob bits) equal `speculate=False` on every generated model kind and on the default model,
with drafts accepted; grammar, stop strings, cancel and the cache invariant keep working."""
from __future__ import annotations

import pytest

import modelgen
import modelgen_moe
from kestreld.engine.generate import Engine
from kestreld.engine.prompt import ChatInput
from kestreld.engine.sampler import ResponseFormat, SamplingOptions
from kestreld.engine.speculate import MAX_DRAFT, Drafter
from kestreld.model.convert import default_model_path
from kestreld.model.load import load_model

# ---- the drafter ---------------------------------------------------------------------------


def test_the_longest_n_gram_s_most_recent_occurrence_is_continued():
    d = Drafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], capacity=64)
    # "2 3" ends the context: the 3-gram "1 2 3" occurred at 0, continued by 4 5 9 (a first
    # draft is 3 tokens)
    assert d.draft(room=4) == [4, 5, 9]
    assert Drafter([1, 2, 3, 4], capacity=8).draft(room=4) == []       # nothing repeats
    assert Drafter([1, 2, 1, 2], capacity=8).draft(room=0) == []       # no room


def test_of_a_3_gram_s_occurrences_the_one_matching_further_back_is_continued():
    # "1 2 3" at 1 (after 9, as the context's last one) and at 8 (after 5): the first matches
    # one more token back, so it is continued although the second is more recent
    d = Drafter([9, 1, 2, 3, 4, 7, 7, 5, 1, 2, 3, 6, 8, 9, 1, 2, 3], capacity=64)
    assert d.draft(room=8) == [4, 7, 7]
    # equal matches: the most recent
    d = Drafter([5, 1, 2, 3, 4, 7, 7, 5, 1, 2, 3, 6, 8, 9, 1, 2, 3], capacity=64)
    assert d.draft(room=8) == [6, 8, 9]


def test_a_2_gram_drafts_a_short_guess_where_no_3_gram_repeats_and_never_rests():
    d = Drafter([5, 2, 3, 6, 7, 8, 9, 2, 3, 1, 0, 2, 3], capacity=64)
    # no earlier "0 2 3": the 2-gram "2 3"'s most recent occurrence, at most 3 tokens
    d.length = MAX_DRAFT
    assert d.draft(room=8) == [1, 0, 2]
    d.verified(3, 0)            # refused whole: a 3-gram's draft would rest, a 2-gram's not
    assert d.draft(room=8) == [1, 0, 2]


def test_a_draft_stops_before_an_excluded_id():
    d = Drafter([6, 7, 8, 9, 99, 99, 4, 6, 7, 8], capacity=32, exclude=(99,))
    assert d.draft(room=8) == [9]


def test_the_draft_length_fills_a_tile_and_the_drafter_rests_after_useless_passes():
    d = Drafter(list(range(10)) * 4, capacity=256)
    assert len(d.draft(room=100)) == 3          # passes of 4 and 8 tokens fill their tiles
    d.verified(3, 3)
    assert len(d.draft(room=100)) == 7 == MAX_DRAFT
    d.verified(7, 7)
    assert len(d.draft(room=100)) == 7
    d.verified(7, 5)            # more than half taken: no rest; 6 wanted, a tile of 8
    assert len(d.draft(room=100)) == 7
    d.verified(7, 2)            # less than half: rest 1 token, then 2; 3 wanted
    assert d.draft(room=100) == [] and len(d.draft(room=100)) == 3
    d.verified(3, 0)
    assert [len(d.draft(room=100)) for _ in range(3)] == [0, 0, 3]
    d.verified(3, 3)            # a gain: the next useless pass rests 1 again
    assert len(d.draft(room=5)) == 5            # no more than the room
    d.verified(5, 0)
    assert [len(d.draft(room=100)) for _ in range(2)] == [0, 3]


# ---- exact through the engine --------------------------------------------------------------

def _repeating_prompt(vocab: int, n: int, seed: int) -> list:
    """A random phrase repeated: the drafts are found, and a random model often follows them."""
    phrase = modelgen.prompt_ids("qwen3_tied", 12, seed) if vocab >= 512 else list(range(12))
    return [t % vocab for t in (phrase * (n // len(phrase) + 1))[:n]]


def _both(model, ids, opts, **kw):
    """The completion with speculation and without, on fresh engines."""
    args = dict(max_seq=1024, threads=2, prefill_chunk=64)
    args.update(kw)
    return (Engine(model, speculate=True, **args).generate(ids, opts),
            Engine(model, speculate=False, **args).generate(ids, opts))


GREEDY = SamplingOptions(max_tokens=40, ignore_eos=True, logprobs=3)
SEEDED = SamplingOptions(max_tokens=40, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95,
                         seed=5, repeat_penalty=1.1, logprobs=2)


@pytest.fixture(scope="module")
def models(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")

    def get(name):
        if name in modelgen_moe.SPECS:
            return load_model(str(modelgen_moe.generate(name, root, ("q8_0",), hf=False).gguf["q8_0"]))
        return load_model(str(zoo.get(name).gguf["q8_0"]))
    return get


@pytest.mark.arm64
@pytest.mark.parametrize("name", list(modelgen.SPECS) + ["qwen3moe_norm"])
@pytest.mark.parametrize("opts", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generated_models_give_the_same_ids_and_logprobs(models, name, opts):
    model = models(name)
    ids = _repeating_prompt(model.config.vocab, 200, seed=3)
    on, off = _both(model, ids, opts)
    assert on.ids == off.ids and on.logprobs == off.logprobs and on.text == off.text
    assert off.drafted_tokens == 0


class OracleDrafter(Drafter):
    """Drafts the answer computed without speculation, with every third draft's second token
    wrong: each pass verifies drafts taken whole, cut short and refused at once."""
    answer: list = []

    def __init__(self, context, capacity, exclude=()):
        super().__init__(context, capacity, exclude)
        self.start, self.passes = self.n, 0

    def draft(self, room: int) -> list:
        at = self.n - self.start            # answer tokens chosen so far
        out = list(self.answer[at:at + min(3, room)])
        self.passes += 1
        if self.passes % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % 500
        return out


@pytest.mark.arm64
@pytest.mark.parametrize("name", list(modelgen.SPECS) + ["qwen3moe_norm"])
@pytest.mark.parametrize("opts", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_verified_drafts_right_and_wrong_give_the_same_ids(models, name, opts, monkeypatch):
    """Every path of the feeder (a draft taken whole, cut short, refused) on every model kind."""
    import kestreld.engine.generate as generate
    model = models(name)
    ids = modelgen.prompt_ids("qwen3_tied", 150, seed=4)
    ids = [t % model.config.vocab for t in ids]
    off = Engine(model, max_seq=512, threads=2, speculate=False).generate(ids, opts)
    monkeypatch.setattr(OracleDrafter, "answer", off.ids)
    monkeypatch.setattr(generate, "Drafter", OracleDrafter)
    on = Engine(model, max_seq=512, threads=2).generate(ids, opts)
    assert on.ids == off.ids and on.logprobs == off.logprobs
    assert 0 < on.accepted_tokens < on.drafted_tokens


@pytest.fixture(scope="module")
def smollm2():
    return load_model(default_model_path())


PARAGRAPH = ("The lighthouse keeper climbed the stairs every evening at dusk. He trimmed the "
             "wick, filled the lamp with oil, and wiped the salt from the glass so that ships "
             "passing the rocks could see the light. In the log he wrote the wind, the state of "
             "the sea, and the names of the ships that went by.")


def _chat(model, text: str) -> list:
    e = Engine(model, max_seq=64)
    return e.prompt(ChatInput(({"role": "user", "content": text},))).ids


@pytest.mark.parametrize("opts", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_default_model_repeating_a_paragraph(smollm2, opts):
    ids = _chat(smollm2, f"Repeat this paragraph exactly:\n\n{PARAGRAPH}")
    on, off = _both(smollm2, ids, opts)
    assert on.ids == off.ids and on.logprobs == off.logprobs and on.text == off.text
    if opts is GREEDY:       # SmolLM2 copies the paragraph: most drafts are taken
        assert on.accepted_tokens >= 0.5 * len(on.ids), (on.drafted_tokens, on.accepted_tokens)


def test_grammar_stop_strings_and_the_cache_invariant(smollm2):
    """A JSON answer under its grammar, an answer cut by a stop string: the same with and
    without drafts, and the cache then holds the prompt and the answer but its last id."""
    schema = {"type": "object", "properties": {"keeper": {"type": "string"},
                                               "tasks": {"type": "array", "items": {"type": "string"}}},
              "required": ["keeper", "tasks"]}
    ask = _chat(smollm2, f"{PARAGRAPH}\n\nList the keeper's tasks as JSON.")
    opts = SamplingOptions(max_tokens=60, logprobs=1,
                           response_format=ResponseFormat("json_schema", schema))
    on, off = _both(smollm2, ask, opts)
    assert on.ids == off.ids and on.logprobs == off.logprobs and on.finish_reason == off.finish_reason
    repeat = _chat(smollm2, f"Repeat this paragraph exactly:\n\n{PARAGRAPH}")
    e = Engine(smollm2, max_seq=1024, threads=2)
    cut = e.generate(repeat, SamplingOptions(max_tokens=80, stop=("the lamp",)))
    plain = Engine(smollm2, max_seq=1024, threads=2, speculate=False).generate(
        repeat, SamplingOptions(max_tokens=80, stop=("the lamp",)))
    assert cut.finish_reason == "stop" and cut.text == plain.text and cut.ids == plain.ids
    assert cut.drafted_tokens > 0
    assert e.kv.cache_len == len(repeat) + len(cut.ids) - 1
    assert list(e.kv.keys) == repeat + cut.ids[:-1]


def test_cancel_mid_draft_keeps_the_arena_consistent(smollm2):
    repeat = _chat(smollm2, f"Repeat this paragraph exactly:\n\n{PARAGRAPH}")
    e = Engine(smollm2, max_seq=1024, threads=2)
    seen = []
    c = e.generate(repeat, SamplingOptions(max_tokens=80), on_token=seen.append,
                   should_stop=lambda: len(seen) >= 20)
    assert c.finish_reason == "cancelled" and len(c.ids) == 20
    assert list(e.kv.keys) == repeat + c.ids[:-1]
    again = e.generate(repeat + c.ids, SamplingOptions(max_tokens=10))
    fresh = Engine(smollm2, max_seq=1024, threads=2, speculate=False).generate(
        repeat + c.ids, SamplingOptions(max_tokens=10))
    assert again.cached_tokens == len(repeat) + len(c.ids) - 1 and again.ids == fresh.ids


def test_a_request_may_turn_speculation_off(smollm2):
    repeat = _chat(smollm2, f"Repeat this paragraph exactly:\n\n{PARAGRAPH}")
    e = Engine(smollm2, max_seq=1024, threads=2)
    c = e.generate(repeat, SamplingOptions(max_tokens=30, speculate=False))
    assert c.drafted_tokens == 0 and e.stats()["speculation"]["drafted"] == 0
    c = e.generate(repeat, SamplingOptions(max_tokens=30))
    assert c.drafted_tokens > 0 and e.stats()["speculation"] == {
        "enabled": True, "drafted": c.drafted_tokens, "accepted": c.accepted_tokens}


def test_a_huge_max_tokens_drafts_within_the_context(models):
    """The drafter holds at most max_seq ids, whatever max_tokens a request asks for."""
    model = models("qwen3_tied")
    ids = _repeating_prompt(model.config.vocab, 40, seed=6)
    c = Engine(model, max_seq=96, threads=1).generate(
        ids, SamplingOptions(max_tokens=10**15, ignore_eos=True))
    assert c.finish_reason == "length" and len(c.ids) == 96 - len(ids)
