#!/usr/bin/env python3
"""Every relative link in the documentation points at something that exists.

For each Markdown file checked (default: README.md and docs/*.md, recursively), every inline link
`[text](target)` and reference definition `[label]: target` whose target is not a URL (http:, https:, mailto:)
must name a file or directory that exists, relative to the file; a `#anchor` (alone: this file; after a path:
that Markdown file) must be one of the target's headings, spelled as GitHub spells heading anchors (lower case,
punctuation dropped, spaces as hyphens, a repeated heading -N). Links inside code (fenced blocks, `inline
code`) are not links and are skipped.

Exit 1, listing each broken link as FILE:LINE: target (why), when any is broken.

Usage: python3 scripts/check-links.py [FILE.md ...]     (paths relative to the repository root)
       python3 scripts/check-links.py --self-test      (plants broken links in a scratch tree: each must fail)
"""

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def outside_fences(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield n, line


def prose_lines(text):
    """(line number, line) outside fenced code, with inline code spans blanked."""
    for n, line in outside_fences(text):
        yield n, re.sub(r"(`+)(.+?)\1", lambda c: " " * len(c.group(0)), line)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    h = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)  # a link in a heading keeps its text
    h = h.lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        h = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            s = slug(h.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    # Explicit anchors: <a name="x"> / <a id="x">.
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return out


def check(files, root):
    broken = []
    for f in files:
        for n, line in prose_lines(f.read_text(encoding="utf-8")):
            targets = INLINE.findall(line)
            m = REFDEF.match(line)
            if m:
                targets.append(m.group(1))
            for t in targets:
                if not t or URL.match(t):
                    continue
                path, _, frag = t.partition("#")
                dest = (f.parent / path).resolve() if path else f
                where = f"{f.relative_to(root)}:{n}: {t}"
                if not dest.exists():
                    broken.append(f"{where} (no such file: {dest.relative_to(root) if dest.is_relative_to(root) else dest})")
                    continue
                if frag:
                    if dest.is_dir() or dest.suffix.lower() != ".md":
                        broken.append(f"{where} (an anchor into something that is not a Markdown file)")
                    elif frag.lower() not in anchors(dest):
                        broken.append(f"{where} (no heading #{frag} in {dest.relative_to(root)})")
    return broken


def default_files(root):
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def self_test():
    """The checker must fail on each kind of broken link and pass on good ones."""
    ok = True
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "docs").mkdir()
        (root / "docs" / "a.md").write_text("# Page A\n\n## The `x` section (two)\n\n## Again\n## Again\n")
        good = (
            "# R\n\n[a](docs/a.md) [s](docs/a.md#the-x-section-two) [again](docs/a.md#again-1) [me](#r)\n"
            "[dir](docs/) [web](https://example.com/nope) ![img](docs/a.md)\n[ref]: docs/a.md\n"
            "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n"
        )
        (root / "README.md").write_text(good)
        got = check(default_files(root), root)
        if got:
            print(f"check-links self-test: good links reported broken: {got}")
            ok = False
        for bad in [
            "[x](docs/missing.md)",
            "[x](docs/a.md#no-such-heading)",
            "[x](#nowhere)",
            "[x](../outside.md)",
            "[ref]: docs/gone.md",
            "[x](docs/a.md#again-2)",
        ]:
            (root / "README.md").write_text(good + bad + "\n")
            got = check(default_files(root), root)
            if len(got) != 1:
                print(f"check-links self-test: {bad!r} gave {got}, expected one broken link")
                ok = False
    print(f"check-links self-test: {'ok' if ok else 'FAILED'}")
    return ok


def main(argv):
    if argv[1:] == ["--self-test"]:
        return 0 if self_test() else 1
    files = [ROOT / a for a in argv[1:]] or default_files(ROOT)
    missing = [f for f in files if not f.exists()]
    if missing:
        print(f"check-links: no such file: {', '.join(str(m) for m in missing)}")
        return 1
    broken = check(files, ROOT)
    for b in broken:
        print(f"check-links: broken link {b}")
    links = sum(len(INLINE.findall(line)) for f in files for _, line in prose_lines(f.read_text(encoding="utf-8")))
    print(f"check-links: {len(files)} files, {links} links, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
