"""How close a model's logits are to a reference's: the two figures every forward test uses."""
from __future__ import annotations

import numpy as np


def rel_rms_error(logits: np.ndarray, ref: np.ndarray) -> float:
    """RMS(logits - ref) / RMS(ref - per-position mean of ref): the error relative to the
    spread of the reference logits (a constant shift per position, which softmax ignores,
    does not inflate the denominator). Both (n_positions, vocab)."""
    logits = np.asarray(logits, np.float64)
    ref = np.asarray(ref, np.float64)
    if logits.shape != ref.shape:
        raise ValueError(f"rel_rms_error: shapes {logits.shape} and {ref.shape} differ")
    spread = ref - ref.mean(axis=-1, keepdims=True)
    return float(np.sqrt(np.mean((logits - ref) ** 2)) / np.sqrt(np.mean(spread ** 2)))


def margin_top1_agreement(logits: np.ndarray, ref: np.ndarray, margin: float = 0.05):
    """Among positions where the reference's top-1 beats its top-2 by more than `margin`
    (a decided choice), the fraction where argmax(logits) == argmax(ref).
    Returns (fraction, count of such positions); (1.0, 0) if there are none."""
    logits = np.asarray(logits, np.float64)
    ref = np.asarray(ref, np.float64)
    if logits.shape != ref.shape:
        raise ValueError(f"margin_top1_agreement: shapes {logits.shape} and {ref.shape} differ")
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > margin
    count = int(decided.sum())
    if count == 0:
        return 1.0, 0
    agree = np.argmax(logits, axis=-1)[decided] == np.argmax(ref, axis=-1)[decided]
    return float(agree.mean()), count


def assert_logits_agree(logits: np.ndarray, ref: np.ndarray, max_rel: float, min_agree: float,
                        min_count: int) -> None:
    """The dense engine's bars: rel_rms_error <= max_rel, and margin_top1_agreement >=
    min_agree over at least min_count decided positions."""
    rel = rel_rms_error(logits, ref)
    agree, count = margin_top1_agreement(logits, ref)
    assert count >= min_count, (rel, agree, count)
    assert rel <= max_rel and agree >= min_agree, (rel, agree, count)
