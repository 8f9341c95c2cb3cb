"""The compiled kernels for this CPU (`K`), or a clear refusal: Kestrel has no silent slow path.

On aarch64 setup.py builds the kernels twice from one source: `kestreld._kernels` for Armv8.2
with the dot-product instructions (sdot: Cortex-A76 and later) and `kestreld._kernels_armv8`
for the Armv8.0 baseline (Cortex-A72, A53). The one the CPU runs is chosen here, once, from
the kernel's HWCAP bit for the dot product (read with getauxval through ctypes: no /proc
needed, no helper module to build, and it is the bit the kernel itself grants the process).
Elsewhere there is one build, `kestreld._kernels`. `K.simd_path()` names the path that runs.

When no suitable build imports (not built, or built for another CPU), `K` is a stand-in whose
every use raises KernelsMissing, so the daemon's modules still import and `kestreld` refuses to
start with one line (`require()`, called first by main).

`ops()` is the test-only module of the per-op kernels (kestreld._kernels_ops, built beside
each variant when KESTREL_TEST_KERNELS=1, as `make test` does), chosen for the CPU the same
way; the daemon never imports it."""
from __future__ import annotations

import ctypes
import importlib
import platform

from .errors import KernelsMissing

AT_HWCAP = 16                 # <elf.h>
HWCAP_ASIMDDP = 1 << 20       # arm64 <asm/hwcap.h>: SDOT/UDOT


def is_aarch64() -> bool:
    """True on a 64-bit Arm CPU (also under qemu-aarch64)."""
    return platform.machine().lower() in ("aarch64", "arm64")


def cpu_has_dotprod() -> bool:
    """True if this aarch64 CPU has the dot-product instructions (HWCAP_ASIMDDP)."""
    getauxval = ctypes.CDLL(None).getauxval
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    return bool(getauxval(AT_HWCAP) & HWCAP_ASIMDDP)


def _load(stem: str, how: str):
    """(module, None) for the build of kestreld.STEM this CPU runs, or (None, the reason there
    is none, ending in `how` to build it)."""
    baseline = is_aarch64() and not cpu_has_dotprod()
    names = [f"{stem}_armv8", stem] if baseline else [stem]
    errors = []
    for name in names:
        try:
            module = importlib.import_module(f".{name}", __package__)
        except ImportError as exc:
            errors.append(f"kestreld.{name}: {exc}")
            continue
        if baseline and module.simd_path() == "neon-dotprod":
            # a dot-product build on a CPU without sdot would die of SIGILL at the first product
            errors.append(f"kestreld.{name} needs the dot-product instructions, "
                          "which this CPU lacks")
            continue
        return module, None
    return None, ("the compiled kernels do not import (" + "; ".join(errors) + "). " + how)


class _Missing:
    def __init__(self, reason: str):
        self._reason = reason

    def __getattr__(self, name):
        raise KernelsMissing(self._reason)


K, _MISSING = _load("_kernels", "Build them with `make build` "
                    "(or `python setup.py build_ext --inplace`).")
if K is None:
    K = _Missing(_MISSING)


def ops():
    """The test-only per-op kernels for this CPU (kestreld._kernels_ops); KernelsMissing, with
    the reason, if they are not built."""
    module, missing = _load("_kernels_ops", "Build them with `make test`, or "
                            "`KESTREL_TEST_KERNELS=1 python setup.py build_ext --inplace`.")
    if module is None:
        raise KernelsMissing(missing)
    return module


def require() -> None:
    """Raise KernelsMissing, with the reason, if no compiled kernels for this CPU are there."""
    if _MISSING is not None:
        raise KernelsMissing(_MISSING)


__all__ = ["K", "cpu_has_dotprod", "is_aarch64", "ops", "require"]
