"""Sampler: greedy, penalties, truncations, seeds, log-probabilities against numpy."""
import numpy as np

from kestreld.engine.sampler import SamplingOptions
from kestreld.engine.sampler import Sampler, log_softmax


def test_greedy_is_argmax():
    lg = np.array([0.1, 3.0, -1.0, 2.9], dtype=np.float32)
    assert Sampler(SamplingOptions()).choose(lg) == 1


def test_repeat_penalty_llama_rule():
    s = Sampler(SamplingOptions(repeat_penalty=2.0))
    lg = np.array([4.0, -1.0, 3.0, 1.0], dtype=np.float32)
    out = s.penalize(lg, [0], [1])
    np.testing.assert_allclose(out, [2.0, -2.0, 3.0, 1.0])
    assert s.choose(out) == 2
    assert lg[0] == 4.0                       # input untouched


def test_a_tiny_repeat_penalty_pushes_repeats_up_without_nan():
    """5e-324 divides a positive logit past float64's range: capped, the sampler still
    draws, and only the repeated ids (now far ahead) can be drawn."""
    lg = np.array([4.0, 2.0, 3.0, -1.0], dtype=np.float32)
    for p in (1e-308, 5e-324):
        s = Sampler(SamplingOptions(repeat_penalty=p, temperature=0.8, seed=1))
        out = s.penalize(lg, [0, 1], [])
        assert np.isfinite(out).all() and out[0] == out[1] == np.finfo(np.float64).max
        assert {s.choose(out) for _ in range(50)} <= {0, 1}


def test_top_k_1_is_greedy_and_seed_repeats():
    lg = np.random.default_rng(0).normal(size=500).astype(np.float32)
    assert Sampler(SamplingOptions(temperature=1.0, top_k=1, seed=3)).choose(lg) == int(np.argmax(lg))
    a = [Sampler(SamplingOptions(temperature=1.0, seed=42)).choose(lg) for _ in range(3)]
    assert len(set(a)) == 1
    s = Sampler(SamplingOptions(temperature=1.0, seed=42))
    draws = {s.choose(lg) for _ in range(50)}
    assert len(draws) > 5                      # it really samples


def test_top_p_and_min_p_truncate():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingOptions(temperature=1.0, top_p=0.7, seed=0))
    assert {s.choose(lg) for _ in range(200)} == {0, 1}
    s = Sampler(SamplingOptions(temperature=1.0, min_p=0.5, seed=0))
    assert {s.choose(lg) for _ in range(200)} == {0, 1}
    s = Sampler(SamplingOptions(temperature=1.0, seed=0))
    freq = np.bincount([s.choose(lg) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_logprobs():
    lg = np.array([1.0, 2.0, 0.5, -3.0], dtype=np.float32)
    ref = lg - np.log(np.exp(lg).sum())
    np.testing.assert_allclose(log_softmax(lg), ref, rtol=1e-6)
    lp = Sampler(SamplingOptions(logprobs=2)).top_logprobs(lg, 0)
    assert lp["id"] == 0 and abs(lp["logprob"] - ref[0]) < 1e-6
    assert [t[0] for t in lp["top"]] == [1, 0]


def test_extreme_values_stay_finite():
    lg = np.array([1.0, 3.0, -2.0, 2.5], dtype=np.float32)
    assert Sampler(SamplingOptions(temperature=5e-324, seed=1)).choose(lg) == 1
    s = Sampler(SamplingOptions(temperature=0.7, repeat_penalty=1e-39, seed=1))
    out = s.penalize(lg, [0], [])
    assert np.isfinite(out).all() and out[0] > 1e38
    assert s.choose(out) == 0


def _openai_penalties(logits, generated, presence, frequency):
    """OpenAI's definition, token by token: mu[j] -= c[j] * frequency + (c[j] > 0) * presence,
    c[j] the count of token j in the generated text (the prompt does not count)."""
    out = np.array(logits, dtype=np.float64)
    for j in range(out.size):
        c = generated.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def test_presence_and_frequency_penalties_against_openai_definition():
    rng = np.random.default_rng(5)
    lg = rng.normal(size=50).astype(np.float32)
    prompt = [1, 2, 3, 3, 40]                    # the prompt's ids are not penalized
    generated = [3, 7, 7, 7, 12, 3, 49]
    for presence, frequency in ((0.5, 0.0), (0.0, 0.3), (1.5, -0.4), (-2.0, 2.0)):
        s = Sampler(SamplingOptions(presence_penalty=presence, frequency_penalty=frequency))
        out = s.penalize(lg, prompt, generated)
        np.testing.assert_allclose(out, _openai_penalties(lg, generated, presence, frequency),
                                   rtol=1e-12, atol=1e-6)
        assert out[1] == lg[1] and out[40] == lg[40]
    assert np.isclose(Sampler(SamplingOptions(frequency_penalty=1.0)).penalize(lg, [], generated)[7],
                      lg[7] - 3.0)
    # nothing generated yet, or both off: the logits as they are
    s = Sampler(SamplingOptions(presence_penalty=1.0, frequency_penalty=1.0))
    assert s.penalize(lg, prompt, []) is lg
    assert Sampler(SamplingOptions()).penalize(lg, prompt, generated) is lg


def test_penalties_after_the_repeat_penalty():
    lg = np.array([4.0, -1.0, 3.0, 1.0], dtype=np.float32)
    s = Sampler(SamplingOptions(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s.penalize(lg, [0], [1, 1, 2])
    # repeat (llama.cpp, prompt + generated window): 0 -> 2, 1 -> -2, 2 -> 1.5; then OpenAI's
    # over the generated ids: 1 -= 0.5 + 2 * 0.25, 2 -= 0.5 + 0.25
    np.testing.assert_allclose(out, [2.0, -3.0, 0.75, 1.0])
    assert s.choose(out) == 0 and lg[1] == -1.0


class _OnlyEven:
    """A stand-in grammar that allows even ids only and records what it was given."""

    def __init__(self):
        self.committed = []

    def mask(self, logits):
        out = np.array(logits, dtype=np.float64)
        out[1::2] = -np.inf
        return out

    def commit(self, tok):
        self.committed.append(tok)

    finished = False


def test_the_mask_applies_to_greedy_and_sampling_and_the_choice_is_committed():
    lg = np.array([0.0, 9.0, 1.0, 8.0, 0.5], dtype=np.float32)
    c = _OnlyEven()
    assert Sampler(SamplingOptions(), c).next_token(lg, [], []) == 2   # argmax 1 is masked
    s = Sampler(SamplingOptions(temperature=1.5, seed=3), c)
    draws = {s.next_token(lg, [], []) for _ in range(200)}
    assert draws == {0, 2, 4}
    assert len(c.committed) == 201 and set(c.committed) == {0, 2, 4}


def test_logit_bias_adds_and_minus_100_bans():
    lg = np.array([5.0, 1.0, 0.0, -2.0], dtype=np.float32)
    s = Sampler(SamplingOptions(logit_bias=((0, -100.0), (2, 3.5))))
    out = s.penalize(lg, [], [])
    assert np.isneginf(out[0]) and out[2] == 3.5 and out[1] == 1.0
    assert s.choose(out) == 2 and lg[0] == 5.0             # input untouched
    assert Sampler(SamplingOptions(logit_bias=((3, 7.5),))).next_token(lg, [], []) == 3
    banned = Sampler(SamplingOptions(temperature=1.0, seed=0, logit_bias=((0, -100.0),)))
    assert 0 not in {banned.next_token(lg, [], []) for _ in range(300)}


def test_a_denormal_repeat_penalty_never_makes_nan():
    """repeat_penalty 5e-324 (found by the HTTP fuzz run): a positive logit divided by it is
    capped, not inf, so the draw has finite probabilities."""
    lg = np.array([4.0, 1.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingOptions(temperature=1.0, repeat_penalty=5e-324, seed=0))
    out = s.penalize(lg, [0, 1, 2], [])
    assert np.isfinite(out).all() and s.choose(out) in (0, 1)
