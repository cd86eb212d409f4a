"""``nixl_cu12``: an alias of gixl's ``nixl`` package, installed by the gixl wheel (see nixl._alias)."""

from nixl._alias import install as _install

_install(__name__, globals())
