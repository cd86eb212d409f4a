#!/usr/bin/env python3
"""Import cycles between gixl's modules, read from the `use` declarations and `crate::` / `super::` paths of
`src/` (test modules left out).

1. Between the engine (`backend::engine`, all of it), the metadata exchange (`mdx`), `auth` and the OS layer
   (`os`): no cycle at all.
2. Between the files of the engine (`backend::engine::<file>`, `mod.rs` being `engine`): no cycle either.
   Test-only files (declared under `#[cfg(test)]`) and test-only lines are left out.
3. No route imports another: a file under `engine/route/<name>` imports nothing under another route's name
   (the router is the one place that knows more than one route).
4. The tree of the engine in docs/architecture.md (Layout) lists every file of the engine once, each importing
   only files listed below it.

Exit 1 when a check fails.

Usage: python3 scripts/module-cycles.py [--verbose]
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ENGINE = ("backend", "engine")


def module_of(path: Path) -> tuple:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def use_paths(text: str):
    """Every path named by a `use` declaration (groups expanded) or written inline as `crate::` / `super::`."""
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        yield from expand(m.group(1).replace("\n", " "))
    for m in re.finditer(r"\b((?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
        yield m.group(1)


def expand(tree: str):
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        yield tree.split(" as ")[0]
        return
    prefix, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    depth, start = 0, 0
    for j, c in enumerate(body + ","):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            item = body[start:j]
            start = j + 1
            if item:
                yield from expand(prefix + item)


def resolve(path: str, here: tuple) -> tuple:
    segs = path.split("::")
    if segs[0] == "crate":
        return tuple(segs[1:])
    base = list(here)
    while segs and segs[0] == "super":
        base = base[:-1]
        segs = segs[1:]
    return tuple(base + segs)


def strip_tests(text: str) -> str:
    m = re.search(r"#\[cfg\(test\)\]\s*mod tests\b", text)
    text = text[: m.start()] if m else text
    # A test-only item of one line (an enum variant, a match arm's head): its line goes too.
    return re.sub(r"#\[cfg\(test\)\][^\n]*\n[^\n]*", "", text)


def test_only(f: Path) -> bool:
    """A file its parent declares under `#[cfg(test)]` (a harness), or a `tests` module of its own."""
    parent = f.parent / "mod.rs" if f.name != "mod.rs" else f.parent.parent / "mod.rs"
    name = f.stem if f.name != "mod.rs" else f.parent.name
    return parent.is_file() and re.search(rf"#\[cfg\(test\)\]\s*mod {name};", parent.read_text()) is not None


def graph(unit_of):
    g = {}
    for f in sorted(SRC.rglob("*.rs")):
        here = module_of(f)
        src_unit = unit_of(here)
        if src_unit is None or test_only(f):
            continue
        # Comments name paths too (`see route::tcp::vram`); only code counts.
        text = re.sub(r"//.*", "", strip_tests(f.read_text()))
        paths = list(use_paths(text))
        # A `mod.rs` names its child modules (files and folders) bare (`copy::probe(..)`, `rdma::wire::..`).
        if f.name == "mod.rs":
            children = {c.stem for c in f.parent.glob("*.rs") if c.name != "mod.rs"}
            children |= {c.name for c in f.parent.iterdir() if (c / "mod.rs").is_file()}
            bare = r"(?<![:\w])([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)"
            paths += [m.group(1) + m.group(2) for m in re.finditer(bare, text) if m.group(1) in children]
        for p in paths:
            dst = unit_of(resolve(p, here))
            if dst is not None and dst != src_unit:
                g.setdefault(src_unit, set()).add(dst)
    return g


def cycles(g):
    """Strongly connected components of more than one node, and the two-node cycles inside them."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    pairs = set()
    for a in g:
        for b in g[a]:
            if a in g.get(b, ()):
                pairs.add(frozenset({a, b}))
    return out, pairs


def main() -> int:
    verbose = "--verbose" in sys.argv
    failed = False

    def top(m):
        if m[:2] == ENGINE:
            return "engine"
        if m and m[0] in ("mdx", "auth", "os"):
            return m[0]
        return None

    comps, _ = cycles(graph(top))
    for c in comps:
        print(f"module-cycles: cycle between {' / '.join(sorted(c))} (none allowed)")
        failed = True
    if not comps:
        print("module-cycles: engine, mdx, auth and os: no cycle")

    def file_unit(m):
        return engine_unit(m)

    g = graph(file_unit)
    comps, pairs = cycles(g)
    for c in comps:
        print(f"module-cycles: engine files in a cycle (none allowed): {', '.join(sorted(c))}")
        failed = True
    for p in sorted(pairs, key=sorted):
        print(f"module-cycles:   of which two import each other: {' <-> '.join(sorted(p))}")
    if not comps:
        print("module-cycles: engine files: no cycle")
    failed |= not routes_apart(g)
    failed |= not readme_order(g)
    if verbose:
        for a in sorted(g):
            print(f"  {a} -> {', '.join(sorted(g[a]))}")
    return 1 if failed else 0


def routes_apart(g) -> bool:
    """No file of one route (`route/<name>...`) imports a file of another."""

    def route(u):
        parts = u.split("/")
        return parts[1] if len(parts) > 1 and parts[0] == "route" else None

    bad = [(a, b) for a in sorted(g) for b in sorted(g[a]) if route(a) and route(b) and route(a) != route(b)]
    for a, b in bad:
        print(f"module-cycles: route file {a} imports {b}, of another route (only the router may know both)")
    if not bad:
        print("module-cycles: no route imports another")
    return not bad


def engine_unit(m):
    """The engine file a module path lives in: `engine` (mod.rs), `route` (route/mod.rs), `route/cma`,
    `route/tcp/link`: the deepest file or folder the path names."""
    if m[:2] != ENGINE:
        return None
    base = SRC / "backend" / "engine"
    unit = "engine"
    for k in range(3, len(m) + 1):
        rel = "/".join(m[2:k])
        if not ((base / f"{rel}.rs").exists() or (base / rel / "mod.rs").exists()):
            break
        unit = rel
    return unit


def unit_of_file(rel: str) -> str:
    """`mod.rs` -> engine, `route/mod.rs` -> route, `route/cma.rs` -> route/cma, `route/tcp/link.rs` ->
    route/tcp/link."""
    if rel == "mod.rs":
        return "engine"
    return rel.removesuffix("/mod.rs").removesuffix(".rs")


def readme_order(g) -> bool:
    """The engine tree of docs/architecture.md names each engine file once, in an order where every import points
    down."""
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    m = re.search(r"The default engine \(`src/backend/engine/`\).*?```\n(.*?)```", text, re.S)
    if not m:
        print("module-cycles: docs/architecture.md has no tree of the engine's files")
        return False
    listed = [line.split()[0] for line in m.group(1).splitlines() if line.strip() and not line[0].isspace()]
    names = [unit_of_file(f) for f in listed]
    base = SRC / "backend" / "engine"
    files = {unit_of_file(f.relative_to(base).as_posix()) for f in base.rglob("*.rs") if not test_only(f)}
    ok = True
    if sorted(names) != sorted(files):
        print(f"module-cycles: docs/architecture.md's engine tree lists {sorted(names)}, the engine has {sorted(files)}")
        ok = False
    at = {n: i for i, n in enumerate(names)}
    for a in sorted(g):
        for b in sorted(g[a]):
            if a in at and b in at and at[b] < at[a]:
                print(f"module-cycles: docs/architecture.md's engine tree lists {b} above {a}, which imports it")
                ok = False
    if ok:
        print("module-cycles: docs/architecture.md's engine tree: every file, every import pointing down")
    return ok


if __name__ == "__main__":
    sys.exit(main())
