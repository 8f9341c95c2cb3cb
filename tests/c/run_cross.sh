#!/bin/bash
# Builds tests/c/kernels_cross.c for x86-64 (AVX2 and plain) and aarch64 (NEON dotprod and
# plain NEON, run under qemu-aarch64) and compares their outputs: hashes must be equal,
# attention values within rounding (printed for the eye). Covers every weight type of
# ks_weights.h. Needs gcc-aarch64-linux-gnu and qemu-user (or qemu-user-static).
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=${TMPDIR:-/tmp}/kestrel_cross
mkdir -p "$out"
src="$here/kernels_cross.c"
inc="-I$here/../../pyx"
gcc -O3 -Wall $inc -mavx2 -mfma -mf16c -o "$out/x86_avx2" "$src" -lm
# plain C path with FMA (like every aarch64 build); without FMA the product rounds a*b+c in
# two steps, so it is only compared with itself
gcc -O3 -Wall $inc -mfma -mf16c -o "$out/x86_plain" "$src" -lm
aarch64-linux-gnu-gcc -O3 -Wall $inc -march=armv8.2-a+dotprod+fp16 -static -o "$out/arm_dot" "$src" -lm
aarch64-linux-gnu-gcc -O3 -Wall $inc -march=armv8-a -static -o "$out/arm_neon" "$src" -lm
# qemu-user's binary is qemu-aarch64, qemu-user-static's qemu-aarch64-static. The dotprod build
# runs as a Cortex-A76 (the RK3588's big core), the plain NEON one as an A72, which has no sdot.
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)
"$out/x86_avx2" > "$out/x86_avx2.txt"
"$out/x86_plain" > "$out/x86_plain.txt"
"$qemu" -cpu cortex-a76 "$out/arm_dot" > "$out/arm_dot.txt"
"$qemu" -cpu cortex-a72 "$out/arm_neon" > "$out/arm_neon.txt"
status=0
for b in x86_plain arm_dot arm_neon; do
    if ! diff <(grep -v -e '^path' -e '^attention' "$out/x86_avx2.txt") \
              <(grep -v -e '^path' -e '^attention' "$out/$b.txt") >/dev/null 2>&1; then
        echo "DIFFERENT integer-kernel results: x86_avx2 vs $b"; status=1
    fi
done
cat "$out"/*.txt
exit $status
