#!/usr/bin/env python3
"""The engine's line count without tests, as issue 19 ("smaller, not larger") measures it.

Every `.rs` file under `src/backend/engine/` at a revision (or the working tree), with every `#[cfg(test)]`
item left out (test modules, test-only functions and impls, their doc comments) and the test-only `harness.rs`
left out. Prints all lines and code lines (neither blank nor a comment), with and without the RDMA route's
folder (`route/rdma/`, a route added after the reshape began).

Usage: python3 scripts/engine-lines.py [REV ...]   (no REV: the working tree)
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "src/backend/engine"


def strip_tests(text: str) -> list:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if lines[i].strip() == "#[cfg(test)]":
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith(("#[", "///")):
                j += 1
            while out and out[-1].strip().startswith("///"):
                out.pop()
            depth, seen = 0, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                seen = seen or "{" in lines[j]
                if (seen and depth <= 0) or (not seen and lines[j].rstrip().endswith(";")):
                    break
                j += 1
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return out


def files(rev):
    if rev is None:
        return sorted(str(p.relative_to(ROOT)) for p in (ROOT / ENGINE).rglob("*.rs"))
    out = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, ENGINE], text=True, cwd=ROOT)
    return [f for f in out.split() if f.endswith(".rs")]


def read(rev, f):
    if rev is None:
        return (ROOT / f).read_text()
    return subprocess.check_output(["git", "show", f"{rev}:{f}"], text=True, cwd=ROOT)


def count(rev):
    with_rdma, without = [0, 0], [0, 0]
    for f in files(rev):
        if f.endswith("/harness.rs"):
            continue
        kept = strip_tests(read(rev, f))
        n = (len(kept), sum(1 for x in kept if x.strip() and not x.strip().startswith("//")))
        for acc in [with_rdma] + ([] if f.startswith(ENGINE + "/route/rdma/") else [without]):
            acc[0] += n[0]
            acc[1] += n[1]
    return without, with_rdma


for rev in sys.argv[1:] or [None]:
    (a, c), (ra, rc) = count(rev)
    print(f"{rev or 'working tree'}: {a} lines, {c} code lines without route/rdma; {ra} lines, {rc} code with it")
