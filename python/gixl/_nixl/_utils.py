"""Test helpers for raw host buffers (gixl implementation of ``nixl._utils``).

These functions operate on raw addresses (Python ints) and are meant for
tests and examples only:

* ``malloc_passthru(size) -> int``: page-aligned (4096) allocation via libc.
* ``free_passthru(addr)``: release an allocation made by ``malloc_passthru``.
* ``ba_buf(addr, size)``: fill ``size`` bytes at ``addr`` with ``0xba``.
* ``verify_transfer(addr_a, addr_b, size)``: compare two buffers.

Implemented with :mod:`ctypes` on top of the C library; no native extension
is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import operator

__all__ = ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"]

_PAGE = 4096
_FILL = 0xBA


def _load_libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - exotic platforms
        return ctypes.CDLL(None, use_errno=True)


_libc = _load_libc()

_posix_memalign = _libc.posix_memalign
_posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_posix_memalign.restype = ctypes.c_int

_free = _libc.free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None


def _as_int(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer (got {type(value).__name__!r})") from None


def malloc_passthru(size) -> int:
    """Allocate ``size`` bytes aligned to 4096 and return the address as an int."""
    size = _as_int(size, "size")
    if size < 0:
        raise ValueError("size must be non-negative")
    # Round the request up to a whole number of pages so the allocation is
    # valid for any consumer that assumes page granularity.
    rounded = max(_PAGE, (size + _PAGE - 1) // _PAGE * _PAGE)
    out = ctypes.c_void_p()
    rc = _posix_memalign(ctypes.byref(out), _PAGE, rounded)
    if rc != 0 or not out.value:
        raise MemoryError(f"malloc_passthru: cannot allocate {size} bytes (error {rc})")
    return int(out.value)


def free_passthru(addr) -> None:
    """Free memory returned by :func:`malloc_passthru`. ``0`` is ignored."""
    addr = _as_int(addr, "addr")
    if addr:
        _free(ctypes.c_void_p(addr))


def ba_buf(addr, size) -> None:
    """Fill ``size`` bytes at ``addr`` with the byte ``0xba``."""
    addr = _as_int(addr, "addr")
    size = _as_int(size, "size")
    if size < 0:
        raise ValueError("size must be non-negative")
    if size:
        ctypes.memset(addr, _FILL, size)


def verify_transfer(addr_a, addr_b, size) -> None:
    """Check that ``size`` bytes at ``addr_a`` and ``addr_b`` are identical.

    Raises ``AssertionError`` naming the first differing offset on mismatch.
    (NIXL's own helper is a no-op in release builds; raising is strictly more
    useful for a test helper.)
    """
    addr_a = _as_int(addr_a, "addr_a")
    addr_b = _as_int(addr_b, "addr_b")
    size = _as_int(size, "size")
    if size <= 0:
        return
    a = ctypes.string_at(addr_a, size)
    b = ctypes.string_at(addr_b, size)
    if a != b:
        first = next(i for i in range(size) if a[i] != b[i])
        raise AssertionError(
            f"verify_transfer: buffers differ at offset {first} "
            f"(0x{a[first]:02x} != 0x{b[first]:02x})"
        )
