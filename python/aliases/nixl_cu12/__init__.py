"""``nixl_cu12`` alias installed by the gixl wheel.

Some consumers (TensorRT-LLM, NIXL's meta-package) import ``nixl_cu12`` (or
``nixl_cu13``) directly, and pickles of NIXL descriptor lists reference
``nixl_cu12._bindings.nixlXferDList``. This package maps those names onto
gixl's ``nixl`` package: the submodules are the very same module objects.
"""

import sys as _sys

import nixl as _nixl
from nixl import _api, _bindings, _utils, logging  # noqa: F401
from nixl._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

for _sub in ("_api", "_bindings", "_utils", "logging"):
    _sys.modules.setdefault(f"{__name__}.{_sub}", getattr(_nixl, _sub))

__version__ = getattr(_nixl, "__version__", "1.5.1")
__all__ = list(_nixl.__all__)
