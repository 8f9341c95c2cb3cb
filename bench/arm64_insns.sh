#!/usr/bin/env bash
# Instructions a weight x activation product executes on aarch64 with sdot (setup.py's flags
# for the A76 build), per (row, token, 32-value block), on rows as the GGUF lays them out and on the
# loader's 4-row interleaved groups: the work, not the speed (qemu is no A76; on a board,
# bench/kernels.py times both layouts). Counted by bench/arm64_vs_llamacpp.py --count (qemu-user
# with the counting plugin bench/qemu_insn_marks.c), less a run that skips the product.
#
#   bench/arm64_insns.sh [N ...]     token counts (default: 1 for decode, 32 for prefill)
#
# Needs gcc-aarch64-linux-gnu and the arm64 root of scripts/arm64-env.sh (`make test-arm64`
# makes it) for the static libc; PYTHON (default .venv/bin/python) runs the counter.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_ARM64_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kestrel-arm64}
ROOT=$(ls -d "$CACHE"/root-* 2>/dev/null | head -1)
[ -n "$ROOT" ] || { echo "arm64_insns: no arm64 root in $CACHE (run make test-arm64)" >&2; exit 1; }
BIN=$(mktemp -d)/arm64_insns
trap 'rm -rf "$(dirname "$BIN")"' EXIT
aarch64-linux-gnu-gcc -O3 -fno-schedule-insns -march=armv8.2-a+dotprod+fp16 --sysroot="$ROOT" \
    -I"$REPO/pyx" -static "$REPO/bench/arm64_insns.c" -o "$BIN" -lm

PYTHON=${PYTHON:-$REPO/.venv/bin/python}
count() {    # "ALL SIMD" instructions executed by: $BIN TYPE LAYOUT N
    "$PYTHON" "$REPO/bench/arm64_vs_llamacpp.py" --count "$BIN" "$@" 2>/dev/null
}

tokens=("$@")
[ ${#tokens[@]} -gt 0 ] || tokens=(1 32)
echo "instructions per (row, token, block), all / SIMD and FP data processing: rows -> 4-row"
echo "interleaved groups (ratios)"
for n in "${tokens[@]}"; do
    for t in Q4_0:2 Q4_1:3 Q5_0:6 Q8_0:8 Q4_K:12 Q5_K:13 Q6_K:14; do
        name=${t%%:*} id=${t#*:}
        base=$(count "$id" 0 "$n") rows=$(count "$id" 1 "$n") il=$(count "$id" 2 "$n")
        echo "$base $rows $il" | awk -v name="$name" -v n="$n" '{
            u = 64 * n * 64      # M rows x n tokens x K/32 blocks
            ra = ($3 - $1) / u; rs = ($4 - $2) / u; ia = ($5 - $1) / u; is = ($6 - $2) / u
            printf "n=%-3d %-5s %6.2f / %5.2f -> %6.2f / %5.2f (%.2f / %.2f)\n",
                   n, name, ra, rs, ia, is, ia / ra, is / rs }'
    done
done
