"""Records tests/greedy_cases.py's cases on this machine into tests/golden/greedy_x86_64.json:
run once on x86-64 (AVX2), after a change that moves the numbers on purpose, then commit it.

    .venv/bin/python tests/golden/record_greedy.py
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))           # tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))           # the checkout

import numpy as np  # noqa: E402

import greedy_cases  # noqa: E402
from kestreld import __version__  # noqa: E402
from kestreld.kernels import K  # noqa: E402


def main() -> None:
    if platform.machine() != "x86_64" or K.simd_path() != "avx2":
        sys.exit(f"record on x86-64 with the AVX2 build (this is {platform.machine()}, "
                 f"{K.simd_path()})")
    records = []
    with tempfile.TemporaryDirectory() as root:
        for case in greedy_cases.CASES:
            r = greedy_cases.record(case, greedy_cases.model_path(case, Path(root)))
            del r["rows"]
            records.append(r)
            print(case, r["greedy_ids"])
    out = {"recorded_on": f"{platform.machine()} ({K.simd_path()}), numpy {np.__version__}",
           "kestrel": __version__, "n_new": greedy_cases.N_NEW, "cases": records}
    greedy_cases.GOLDEN.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {greedy_cases.GOLDEN}")


if __name__ == "__main__":
    main()
