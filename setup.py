"""Declares the Cython kernels; metadata lives in pyproject.toml.

The target is `sysconfig.get_platform()`, so a cross build (scripts/arm64-env.sh sets
_PYTHON_HOST_PLATFORM and the target's sysconfig data) gets the target's flags:
  x86-64    kestreld._kernels with AVX2+FMA+F16C (AVX512-VNNI is chosen at run time inside)
  aarch64   the same source twice: kestreld._kernels for Armv8.2 with the dot-product
            instructions (Cortex-A76, the RK3588's big cores) and kestreld._kernels_armv8 for
            the Armv8.0 baseline (Cortex-A72/A53, no sdot); kestreld/kernels.py imports the
            one the CPU runs, so one build serves every aarch64 board and every kernel, present
            and future, has both without dispatch code of its own.
Beside each, with KESTREL_TEST_KERNELS=1 (`make test` sets it), the test-only module of the
per-op kernels (pyx/_kernels_ops.pyx: the products, norms, RoPE, attention, MoE routing one
op at a time, which the tests, bench/kernels.py and scripts/ab_kernels.py call): the same C
with the same flags, as kestreld._kernels_ops (and _kernels_ops_armv8). The daemon needs none.

Build switches (environment):
  KESTREL_DEBUG=1     -O0 -g, Cython bounds/wraparound checks on
  KESTREL_NATIVE=1    -march=native, one module (faster, not portable to another CPU)
  KESTREL_ANNOTATE=1  write pyx/*.html annotation reports
  KESTREL_CFLAGS="…"  extra compiler flags
  KESTREL_TEST_KERNELS=1  also the test-only per-op modules (above)
"""
import glob
import os
import sysconfig

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("KESTREL_DEBUG") == "1"
native = os.environ.get("KESTREL_NATIVE") == "1"
test_kernels = os.environ.get("KESTREL_TEST_KERNELS") == "1"

cflags = ["-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
machine = sysconfig.get_platform().rsplit("-", 1)[-1].lower()
if machine in ("aarch64", "arm64"):
    # No scheduling before register allocation (GCC's default on aarch64): it interleaves the
    # unrolled blocks of a product tile until their vectors spill to the stack; the A76 and
    # A72 reorder in hardware. The same instructions otherwise, so the same results.
    cflags += ["-fno-schedule-insns"]
if native:
    variants = {"_kernels": ["-march=native"]}
elif machine in ("x86_64", "amd64"):
    # AVX2+FMA is the x86 baseline we ship; the C code checks __AVX2__ and keeps a plain path.
    variants = {"_kernels": ["-mavx2", "-mfma", "-mf16c"]}
elif machine in ("aarch64", "arm64"):
    # the C code takes sdot under __ARM_FEATURE_DOTPROD, plain NEON without it
    variants = {"_kernels": ["-march=armv8.2-a+dotprod+fp16"],
                "_kernels_armv8": ["-march=armv8-a"]}
else:
    variants = {"_kernels": []}
extra = os.environ.get("KESTREL_CFLAGS", "").split()

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
}


def kernels(name: str, arch_flags: list, source: str = "_kernels") -> list:
    """The kernels of pyx/SOURCE.pyx as module kestreld.NAME, compiled with arch_flags. Cython
    writes one C file per module name (the init function is named after it): pyx/ for the
    module named as its source, build/NAME/ for another variant."""
    ext = Extension(
        f"kestreld.{name}",
        [f"pyx/{source}.pyx"],
        depends=sorted(glob.glob("pyx/*.h")),      # a changed kernel header rebuilds
        include_dirs=["pyx", np.get_include()],
        extra_compile_args=cflags + arch_flags + extra,
        extra_link_args=["-fopenmp"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    return cythonize(
        [ext],
        build_dir=None if name == source else os.path.join("build", name),
        compiler_directives=directives,
        annotate=os.environ.get("KESTREL_ANNOTATE") == "1",
    )


modules = [(name, flags, "_kernels") for name, flags in variants.items()]
if test_kernels:     # _kernels -> _kernels_ops, _kernels_armv8 -> _kernels_ops_armv8
    modules += [(name.replace("_kernels", "_kernels_ops"), flags, "_kernels_ops")
                for name, flags in variants.items()]
setup(ext_modules=[m for name, flags, source in modules for m in kernels(name, flags, source)])
