"""Same tokens on every machine: tests/greedy_cases.py's cases against what x86-64 with the AVX2
build computed (tests/golden/greedy_x86_64.json, written by tests/golden/record_greedy.py),
on whatever machine runs this: x86-64, or aarch64 with sdot (Cortex-A76) or without (A72)
under `make test-arm64`.

What is bit for bit by design: the Q8_0 products (integer sums, a fixed-order float epilogue,
the same on AVX2, VNNI, NEON with and without sdot and plain C), the int8 KV, the float
kernels written with GCC vector extensions in a fixed order, sqrtf (correctly rounded), glibc's
expf (the same code on both) and the RoPE tables (numpy float64 cos/sin cast to float32): each
kernel gives the same bits on x86-64 and on both aarch64 paths (measured). What is not: RoPE's
`x0 * c - x1 * s` (pyx/ks_rows.h) is plain C that GCC fuses into FMAs differently per target
(compiled alone: x86-64 vfmsub for NeoX pairs but an unfused vaddsubps for adjacent ones,
aarch64 fmls/fmla for both), so rotated q/k differ in the last bit, and the model's Q8_0
activation rounding carries that to the logits. So: where the logits' bits are x86-64's, the greedy ids
must be too; where not, the difference is bounded here (top-16 logits of the last 32 rows,
RMS relative to the row's spread; argmax on every decided row; greedy ids the same up to a
near-tie). Measured as Cortex-A76 and as A72 (the same bits on both) against x86-64: the
generated Qwen3 and MoE models' logits differ by at most 1.4e-6 (relative RMS 6e-7), the
generated Llama's (adjacent-pair RoPE) by 0.026 (0.011), SmolLM2's
by 0.89 (0.13, 30 layers of 8-bit re-rounding); the argmax agrees on every decided row.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import greedy_cases

pytestmark = pytest.mark.arm64

GOLDEN = json.loads(greedy_cases.GOLDEN.read_text())
RECORDED = {c["case"]: c for c in GOLDEN["cases"]}
DECIDED = 0.5        # a top-1 margin above this is a decided choice, at or below a near tie
MAX_REL = 0.25       # RMS of the top-16 logits' difference / the row's standard deviation


def test_every_case_is_recorded():
    assert list(RECORDED) == greedy_cases.CASES and GOLDEN["n_new"] == greedy_cases.N_NEW


@pytest.mark.parametrize("case", greedy_cases.CASES)
def test_greedy_ids_and_logits_agree_with_x86_64(case, tmp_path_factory):
    want = RECORDED[case]
    path = greedy_cases.model_path(case, tmp_path_factory.mktemp("same_tokens"))
    got = greedy_cases.record(case, path, greedy_cases.prompt(case) + want["greedy_ids"])
    assert got["model_sha256"] == want["model_sha256"], \
        f"{case}: not the model file the golden was recorded on (re-run record_greedy.py?)"
    if got["logits_sha256"] == want["logits_sha256"]:
        assert got["greedy_ids"] == want["greedy_ids"], f"{case}: same logits, other ids"
        return

    rows, top_ids = got["rows"], np.asarray(want["top_ids"])
    diff = np.take_along_axis(rows, top_ids, axis=-1) - np.asarray(want["top_logits"])
    rel = np.sqrt((diff ** 2).mean(axis=-1)) / np.asarray(want["row_std"])
    decided = np.asarray(want["margins"]) > DECIDED
    print(f"{case}: logits differ from x86-64's: max |diff| {np.abs(diff).max():.3g}, "
          f"relative RMS <= {rel.max():.3g}, {decided.sum()} decided rows of {len(rows)}")
    assert rel.max() <= MAX_REL, f"{case}: relative RMS {rel.max():.3f} in row {rel.argmax()}"
    np.testing.assert_array_equal(rows.argmax(-1)[decided], top_ids[decided, 0])
    steps = greedy_cases.ROWS - greedy_cases.N_NEW          # rows before the first decode step
    parted = [i for i, (a, b) in enumerate(zip(got["greedy_ids"], want["greedy_ids"])) if a != b]
    if parted:
        print(f"{case}: greedy ids part from x86-64's at step {parted[0]}, recorded margin "
              f"{want['margins'][steps + parted[0]]:.3f}")
        assert want["margins"][steps + parted[0]] <= DECIDED, \
            f"{case}: greedy ids part from x86-64's at decided step {parted[0]}"
