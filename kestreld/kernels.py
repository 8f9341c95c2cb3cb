"""The compiled kernels (`K`), or a clear refusal: Kestrel has no silent slow path.

When `kestreld._kernels` does not import (not built, or built for another CPU), `K` is a
stand-in whose every use raises KernelsMissing, so the daemon's modules still import and
`kestreld` refuses to start with one line (`require()`, called first by main)."""
from __future__ import annotations

from .errors import KernelsMissing


class _Missing:
    def __init__(self, reason: str):
        self._reason = reason

    def __getattr__(self, name):
        raise KernelsMissing(self._reason)


try:
    from . import _kernels as K
    _MISSING = None
except ImportError as exc:  # pragma: no cover - the build is there whenever tests run
    _MISSING = (f"the compiled kernels (kestreld._kernels) do not import: {exc}. "
                "Build them with `make build` (or `python setup.py build_ext --inplace`).")
    K = _Missing(_MISSING)


def require() -> None:
    """Raise KernelsMissing, with the reason, if the compiled kernels are not there."""
    if _MISSING is not None:
        raise KernelsMissing(_MISSING)


__all__ = ["K", "require"]
