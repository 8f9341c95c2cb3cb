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
