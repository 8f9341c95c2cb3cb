"""Declares the Cython kernels; metadata lives in pyproject.toml.

Build switches (environment):
  KESTREL_DEBUG=1     -O0 -g, Cython bounds/wraparound checks on
  KESTREL_NATIVE=1    -march=native (faster, not portable to another CPU)
  KESTREL_ANNOTATE=1  write pyx/*.html annotation reports
  KESTREL_CFLAGS="…"  extra compiler flags
"""
import os
import platform

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("KESTREL_DEBUG") == "1"
native = os.environ.get("KESTREL_NATIVE") == "1"

cflags = ["-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
machine = platform.machine().lower()
if native:
    cflags.append("-march=native")
elif machine in ("x86_64", "amd64"):
    # AVX2+FMA is the x86 baseline we ship; the C code checks __AVX2__ and keeps a plain path.
    cflags += ["-mavx2", "-mfma", "-mf16c"]
elif machine in ("aarch64", "arm64"):
    # Cortex-A76 (RK3588): dot-product instructions; guarded by __ARM_FEATURE_DOTPROD.
    cflags.append("-march=armv8.2-a+dotprod+fp16")
cflags += os.environ.get("KESTREL_CFLAGS", "").split()

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
}

ext = Extension(
    "kestreld._kernels",
    ["pyx/_kernels.pyx"],
    include_dirs=["pyx", np.get_include()],
    extra_compile_args=cflags,
    extra_link_args=["-fopenmp"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    ext_modules=cythonize(
        [ext],
        compiler_directives=directives,
        annotate=os.environ.get("KESTREL_ANNOTATE") == "1",
    )
)
