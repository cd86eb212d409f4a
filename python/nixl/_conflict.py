"""Detect NVIDIA's NIXL installed next to gixl in one environment.

gixl's wheel writes the ``nixl`` package (and the ``nixl_cu12`` / ``nixl_cu13`` aliases); so do
NVIDIA's ``nixl`` meta-package and its ``nixl-cu12`` / ``nixl-cu13`` wheels. Installed together,
whichever was installed last owns the shared files and uninstalling either deletes files the other
still lists. On import, gixl names the distributions to remove and the one command that swaps cleanly.
"""

from __future__ import annotations

import importlib.metadata as md
import warnings

__all__ = ["check_conflicts", "nvidia_distributions", "swap_to_gixl"]

_NVIDIA = ("nixl", "nixl-cu12", "nixl-cu13")


def swap_to_gixl(found: list) -> str:
    """The one command that leaves gixl alone in charge of ``nixl`` (and its aliases): remove NVIDIA's
    distributions, then reinstall gixl, whose files (the ``nixl_cu12`` alias) the removal deletes too."""
    names = " ".join(f.split("==")[0] for f in found)
    return f"pip uninstall -y {names} && pip install --force-reinstall --no-deps gixl"


def nvidia_distributions() -> list:
    """``name==version`` of every NVIDIA NIXL distribution installed here (gixl's own ``nixl`` record
    excluded: it says so in its summary)."""
    found = []
    for name in _NVIDIA:
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if "gixl" in (d.metadata.get("Summary") or ""):
            continue
        found.append(f"{d.metadata.get('Name', name)}=={d.version}")
    return found


def check_conflicts() -> list:
    found = nvidia_distributions()
    if found:
        warnings.warn(
            "gixl and NVIDIA's NIXL ({}) are installed in the same environment and both write the `nixl` "
            "package (and `nixl_cu12`/`nixl_cu13`); the files on disk are a mix of both. To keep gixl: "
            "`{}`. To go back to NIXL: `pip uninstall -y gixl && pip install --force-reinstall {}`.".format(
                ", ".join(found), swap_to_gixl(found), " ".join(found)
            ),
            RuntimeWarning,
            stacklevel=3,
        )
    return found
