#!/usr/bin/env python3
"""scripts/nixlbench_table.py DIR: the GB/s of nixlbench's result rows (Block Size, Batch Size, B/W, ...) in
DIR/{nixl,gixl}.{WRITE,READ}.log, side by side as a Markdown table: NIXL 1.5.1 / gixl, and gixl's ratio."""

import re
import sys
from pathlib import Path

ROW = re.compile(r"^(\d+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)")


def rates(path: Path) -> dict[int, float]:
    out = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            m = ROW.match(line.strip())
            if m:
                out[int(m.group(1))] = float(m.group(3))
    return out


def size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> int:
    d = Path(sys.argv[1])
    for op in ("WRITE", "READ"):
        nixl, gixl = rates(d / f"nixl.{op}.log"), rates(d / f"gixl.{op}.log")
        blocks = sorted(set(nixl) | set(gixl))
        if not blocks:
            print(f"{op}: no result rows")
            continue
        print(f"\n{op}, GB/s (NIXL 1.5.1 / gixl, gixl ÷ NIXL)\n")
        print("| block | " + " | ".join(size(b) for b in blocks) + " |")
        print("|---" * (len(blocks) + 1) + "|")
        cells = []
        for b in blocks:
            n, g = nixl.get(b), gixl.get(b)
            ratio = f" ({g / n:.2f}×)" if n and g else ""
            cells.append(f"{n if n is not None else '-'} / {g if g is not None else '-'}{ratio}")
        print(f"| {op} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
