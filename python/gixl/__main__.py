"""``python -m gixl <command>``: ``doctor`` (see :mod:`gixl.doctor`)."""

from __future__ import annotations

import sys


def _main(argv: list) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m gixl doctor [--json] [--peer-md FILE | --peer NAME@HOST:PORT]")
        return 0 if argv else 2
    if argv[0] == "doctor":
        from .doctor import main

        return main(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m gixl doctor", file=sys.stderr)
    return 2


sys.exit(_main(sys.argv[1:]))
