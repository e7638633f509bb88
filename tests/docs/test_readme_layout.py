"""README.md's "Repository layout" names only paths that exist.

The section's ``text`` block is a tree: each line is a path column, two or more spaces, then a
description. The path column holds one path or several separated by ", "; an indented line is
relative to the nearest less-indented directory entry (one ending in "/") above it. Every path,
so resolved from the repository root, must exist (a directory entry as a directory).
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layout_block(readme: str) -> list[str]:
    section = readme.split("\n## Repository layout\n", 1)
    assert len(section) == 2, 'README.md has no "## Repository layout" section'
    match = re.search(r"```text\n(.*?)\n```", section[1].split("\n## ", 1)[0], re.S)
    assert match, 'no ```text block in README.md\'s "Repository layout" section'
    return [line for line in match.group(1).splitlines() if line.strip()]


def _named_paths(lines: list[str]) -> list[tuple[str, str]]:
    """(path relative to the root, the README line) for every path the tree names."""
    out = []
    parents: list[tuple[int, str]] = []  # (indent, directory) of the enclosing entries
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        column = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        names = [n.strip() for n in column.split(", ")]
        assert all(names), f"an empty path in {line!r}"
        for name in names:
            out.append((base + name, line))
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, base + names[0]))
    return out


def test_parser_reads_nesting_and_lists():
    lines = ["a/          d", "  b/        d", "    c.py, e.py  d", "  f.py      d", "g, h/  d"]
    want = ["a/", "a/b/", "a/b/c.py", "a/b/e.py", "a/f.py", "g", "h/"]
    assert [p for p, _ in _named_paths(lines)] == want


def test_every_path_in_the_repository_layout_exists():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        paths = _named_paths(_layout_block(f.read()))
    assert len(paths) >= 10, paths  # the block was found and parsed, not skipped
    missing = []
    for path, line in paths:
        full = os.path.join(ROOT, path)
        ok = os.path.isdir(full) if path.endswith("/") else os.path.exists(full)
        if not ok:
            missing.append(f"{path} (from {line.strip()!r})")
    assert not missing, "README.md's Repository layout names paths that do not exist:\n" + (
        "\n".join(missing)
    )
