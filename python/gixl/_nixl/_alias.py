"""Makes a package name (``nixl_cu12``, ``nixl_cu13``) an alias of ``nixl``.

Some consumers (TensorRT-LLM, NIXL's meta-package) import ``nixl_cu12`` or ``nixl_cu13`` directly, and pickles
of NIXL descriptor lists reference ``nixl_cu12._bindings.nixlXferDList``. The alias packages the gixl wheel
installs call :func:`install`, so their submodules are the very same module objects as ``nixl``'s.
"""

import sys

import nixl
from nixl import _api


def install(name: str, namespace: dict) -> None:
    """Fill the alias package's ``namespace`` and register ``<name>._api`` etc. in ``sys.modules``."""
    for sub in ("_api", "_bindings", "_utils", "logging"):
        module = getattr(nixl, sub)
        sys.modules.setdefault(f"{name}.{sub}", module)
        namespace[sub] = module
    for attr in _api.__all__:
        namespace[attr] = getattr(_api, attr)
    namespace["__version__"] = getattr(nixl, "__version__", "1.5.2")
    namespace["__all__"] = list(_api.__all__)
