"""NVIDIA's NIXL distributions installed beside gixl in one environment.

gixl's wheel has no file named ``nixl``, ``nixl_cu12`` or ``nixl_cu13``: an import finder answers those names
(``_gixl_nixl.py`` at the top of site-packages). So NVIDIA's ``nixl`` meta-package and its ``nixl-cu12`` /
``nixl-cu13`` wheels can stay installed beside gixl, untouched: ``import nixl`` is gixl, their ``nixl_ep``
(NVIDIA's expert-parallel all-to-all, which loads NVIDIA's own NIXL library) keeps working, and removing
either side leaves the other whole. ``GIXL_NIXL=off`` makes a process import NVIDIA's instead.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

__all__ = ["nvidia_distributions", "beside"]

_NVIDIA = ("nixl", "nixl-cu12", "nixl-cu13")


def nvidia_distributions() -> list:
    """``name==version`` of every NVIDIA NIXL distribution installed here (gixl's own ``nixl`` record
    excluded: it says so in its summary)."""
    found = []
    for name in _NVIDIA:
        for d in md.distributions(name=name):
            if "gixl" in (d.metadata.get("Summary") or ""):
                continue
            found.append(f"{d.metadata.get('Name', name)}=={d.version}")
            break
    return found


def beside() -> dict:
    """What doctor reports: who answers ``import nixl`` and what of NVIDIA's is installed beside gixl."""
    import nixl

    ep = [m for m in ("nixl_ep", "nixl_ep_cu12", "nixl_ep_cu13") if importlib.util.find_spec(m) is not None]
    return {"nixl_is": nixl.__file__, "nvidia": nvidia_distributions(), "nixl_ep": ep}
