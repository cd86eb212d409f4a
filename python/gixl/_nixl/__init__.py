"""gixl: a Rust drop-in replacement for NVIDIA NIXL.

This package takes the place of NIXL's ``nixl`` package: ``nixl._api``,
``nixl._bindings``, ``nixl._utils`` and ``nixl.logging`` are provided by gixl,
and the main ``nixl._api`` classes are also available at the top level.
Installed, its files are ``gixl/_nixl/`` and it is imported under the name
``nixl`` by the finder of ``_gixl_nixl.py`` (see python/README.md).
"""

from . import _utils, logging  # noqa: F401  (no native code needed)
from . import _bindings  # noqa: F401
from . import _api  # noqa: F401
from ._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

if _bindings.__name__ == "nixl._bindings":  # gixl's native layer (not the development shim over NIXL's)
    from gixl import _gixl as _native

    logging.install_native_sink(_native)

try:
    from gixl import __version__  # noqa: F401
except Exception:  # pragma: no cover - gixl package always ships with nixl
    __version__ = "1.5.2"

__all__ = list(_api.__all__)
