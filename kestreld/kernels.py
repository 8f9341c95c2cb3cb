"""The compiled kernels, or a clear refusal: Kestrel has no silent slow path."""
from __future__ import annotations

from .errors import KernelsMissing

try:
    from . import _kernels as K
except ImportError as exc:  # pragma: no cover - exercised by tests/test_main via a subprocess
    raise KernelsMissing(
        f"the compiled kernels (kestreld._kernels) do not import: {exc}. "
        "Build them with `make build` (or `python setup.py build_ext --inplace`)."
    ) from exc

__all__ = ["K"]
