"""gixl answers ``import nixl``, ``import nixl_cu12`` and ``import nixl_cu13``, without files of those names.

Run at interpreter start by ``_gixl_nixl.pth`` (installed beside it at the top of site-packages), this module
puts one import finder in front of ``sys.meta_path``. The finder serves the three top-level names from the
gixl distribution: ``nixl`` is gixl's ``gixl/_nixl`` package loaded under the name ``nixl`` (its submodules
then come from that folder), and ``nixl_cu12`` / ``nixl_cu13`` are aliases whose submodules are the very same
module objects (``nixl._alias``). Nothing else is touched: NVIDIA's ``nixl_ep`` (and its own NIXL library)
keeps working when NVIDIA's wheels stay installed, and no file of theirs is overwritten or deleted, so either
distribution can be removed without breaking the other.

``GIXL_NIXL=off`` in the environment leaves the finder out (NVIDIA's packages, if installed, are imported).
Starting the interpreter costs one small import: gixl itself is located only at the first ``import nixl``.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

NAMES = ("nixl", "nixl_cu12", "nixl_cu13")


def _root():
    """gixl's ``nixl`` package folder, found without importing gixl."""
    spec = importlib.machinery.PathFinder.find_spec("gixl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        folder = os.path.join(where, "_nixl")
        if os.path.isfile(os.path.join(folder, "__init__.py")):
            return folder
    return None


class _AliasLoader(importlib.abc.Loader):
    """``nixl_cu12`` / ``nixl_cu13``: a package whose submodules are ``nixl``'s."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import nixl._alias

        nixl._alias.install(module.__name__, module.__dict__)


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in NAMES:
            return None
        root = _root()
        if root is None:  # gixl was removed but this module was left behind: stand aside
            return None
        if fullname == "nixl":
            return importlib.util.spec_from_file_location(
                "nixl", os.path.join(root, "__init__.py"), submodule_search_locations=[root]
            )
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=True)


def install():
    if os.environ.get("GIXL_NIXL", "").strip().lower() in ("off", "0", "no", "false", "nvidia"):
        return
    if not any(type(f).__module__ == __name__ for f in sys.meta_path):  # once, even if run again
        sys.meta_path.insert(0, Finder())


install()
