"""gixl: a Rust re-implementation of NVIDIA NIXL.

The user-facing Python API is the NIXL-compatible ``nixl`` package
(``import nixl._api``). This package holds the native extension
(``gixl._gixl``) and a few gixl-specific helpers.
"""

from __future__ import annotations

__version__ = "1.5.2"

__all__ = ["__version__", "native_available", "native"]


def native():
    """Return the native extension module ``gixl._gixl`` (raises ImportError if absent)."""
    from . import _gixl  # type: ignore[attr-defined]

    return _gixl


def native_available() -> bool:
    """Whether the native extension can be imported."""
    try:
        native()
    except ImportError:
        return False
    return True
