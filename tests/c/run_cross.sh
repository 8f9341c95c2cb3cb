#!/bin/bash
# Builds tests/c/kernels_cross.c for x86-64 (AVX2 and plain) and aarch64 (NEON dotprod and
# plain NEON, run under qemu-aarch64) and compares their outputs: hashes must be equal,
# attention values within rounding (printed for the eye). Needs gcc-aarch64-linux-gnu and qemu-user.
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
for b in x86_avx2 x86_plain arm_dot arm_neon; do
    if [ "${b#arm}" != "$b" ]; then qemu-aarch64 "$out/$b"; else "$out/$b"; fi > "$out/$b.txt"
done
status=0
for b in x86_plain arm_dot arm_neon; do
    if ! diff <(grep -v -e '^path' -e '^attention' "$out/x86_avx2.txt") \
              <(grep -v -e '^path' -e '^attention' "$out/$b.txt") >/dev/null 2>&1; then
        echo "DIFFERENT integer-kernel results: x86_avx2 vs $b"; status=1
    fi
done
cat "$out"/*.txt
exit $status
