"""User pages and API docstrings speak to users: no internal references a reader cannot follow.

A *user page* is every page of docs/ and README.md except the ones in ``EXEMPT`` (the
contributors' notes, the raw benchmark log and the changelog, which keep such references on
purpose; docs/internals.md says so). On a user page none of these may appear, in text or code:

* an issue number ("issue 12", "issues 12 and 16", "#12");
* a commit hash (7 to 40 hex digits with at least one letter and one digit);
* a test node ID (``file.py::test_x``, ``test_x[param]``) or a bare test function name in code
  (`` `test_x` ``); test files (``tests/docs/test_docs.py``) may be named;
* a private module of the package: any module or package under ``src/mfsdp_optim`` whose name
  starts with ``_`` (``_infra``, ``stats/_reduce.py``, ``optim._engines._route``).

The docstrings of the public API (what the API page renders: the public modules, every name of
their ``__all__`` and its public members) follow the same rule for private modules, and name no
``docs/*.md`` file: the API page is read on the site, where a file name is not a link.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "mfsdp_optim"
EXEMPT = {
    "docs/internals.md": "the contributors' notes: module paths and test names are its subject",
    "docs/benchmarks-log.md": "the raw, dated log: runs name their commits and issues",
    "docs/changelog.md": "includes CHANGELOG.md, whose entries name their issues",
}
# sections of a user page written for contributors: (page, heading), up to the next heading
EXEMPT_SECTIONS = {("README.md", "## Repository layout")}
PUBLIC_MODULES = ("mfsdp_optim", "mfsdp_optim.stats", "mfsdp_optim.optim", "mfsdp_optim.checkpoint")


def private_modules() -> set[str]:
    """Names of the package's private modules and packages (``_infra``, ``_reduce``, ...)."""
    names = {p.stem for p in SRC.rglob("_*.py")} | {p.name for p in SRC.rglob("_*") if p.is_dir()}
    return {n for n in names if not n.startswith("__")}


def jargon_patterns(private: set[str]) -> dict[str, re.Pattern[str]]:
    alternatives = "|".join(sorted(map(re.escape, private), key=len, reverse=True))
    return {
        "issue number": re.compile(r"\bissues?\s+#?\d+\b|(?<![\w&])#\d+\b", re.I),
        "commit hash": re.compile(
            r"(?<![\w.+-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w+-])"
        ),
        "test node ID": re.compile(r"\.py::\w+|\btest_\w+\[|`test_\w+`"),
        "private module": re.compile(
            rf"(?<![\w.])(?:mfsdp_optim\.|[\w/.]*[./])?(?:{alternatives})\b"
        ),
    }


def problems_in(text: str, where: str, patterns: dict[str, re.Pattern[str]]) -> list[str]:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in patterns.items():
            for m in pattern.finditer(line):
                out.append(f"{where}:{lineno}: {what} {m.group(0)!r}: {line.strip()[:100]}")
    return out


def user_text(page: str) -> str:
    """The page's text, exempt sections blanked (line numbers kept)."""
    lines = (ROOT / page).read_text("utf-8").splitlines()
    skipping = False
    for i, line in enumerate(lines):
        if line.startswith("## "):
            skipping = (page, line.strip()) in EXEMPT_SECTIONS
        if skipping:
            lines[i] = ""
    return "\n".join(lines)


def user_pages() -> list[str]:
    pages = ["README.md"] + [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))
    ]
    return [p for p in pages if p not in EXEMPT]


@pytest.fixture(scope="module")
def patterns() -> dict[str, re.Pattern[str]]:
    private = private_modules()
    assert {"_infra", "_reduce", "_whole", "_version"} <= private, private
    return jargon_patterns(private)


def test_the_patterns_flag_each_kind(patterns):
    bad = [
        "see issue 12 and issues 16",
        "fixed in #39",
        "main at 76a2db4",
        "`tests/a.py::test_b`",
        "`test_refused[S1 plain]`",
        "Tests: `test_inspect_cli`.",
        "`stats._reduce.reduce_buckets_deferred`",
        "`optim/_engines/_route.py`",
        "`_infra`",
        "mfsdp_optim._version",
    ]
    for line in bad:
        assert problems_in(line, "t", patterns), line
    good = [
        "torch 2.11.0+cu130, 300 x 4096x1024, 2026-12-06",
        "`p._local_tensor` and `_StridedShard` and `torch._foreach_norm`",
        "the `_orig_mod.` prefix; `tests/docs/test_docs.py`; `MFSDP_OPTIM_DISABLE_FUSED=1`",
        "## Heading 2 and a #fff colour; `.old-<8 hex digits>`; sha deadbeef",
        "got 1.6069380442589903e+60; a run-1a2b3c4d suffix",
    ]
    for line in good:
        assert not problems_in(line, "t", patterns), (line, problems_in(line, "t", patterns))


def test_exempt_pages_and_sections_exist():
    for page in EXEMPT:
        assert (ROOT / page).is_file(), page
    for page, heading in EXEMPT_SECTIONS:
        assert heading in (ROOT / page).read_text("utf-8").splitlines(), (page, heading)


def test_user_pages_hold_no_internal_references(patterns):
    pages = user_pages()
    assert len(pages) >= 15, pages
    problems = [p for page in pages for p in problems_in(user_text(page), page, patterns)]
    assert not problems, f"{len(problems)} internal references on user pages:\n" + "\n".join(
        problems
    )


def _rendered_docstrings() -> list[tuple[str, str]]:
    """``(name, docstring)`` of what the API page renders: every name of the public modules'
    ``__all__`` and the public members its classes define (the modules' own docstrings are
    maps of their private modules for contributors, and are not rendered)."""
    out = []
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            out.append((f"{mod_name}.{name}", inspect.getdoc(obj) or ""))
            classes = [c for c in getattr(obj, "__mro__", ()) if c.__module__.startswith("mfsdp")]
            for cls in classes:
                for member, value in vars(cls).items():
                    if member.startswith("_"):
                        continue
                    doc = getattr(value, "__doc__", None)
                    if isinstance(
                        value, (property, classmethod, staticmethod)
                    ) or inspect.isfunction(value):
                        out.append((f"{mod_name}.{name}.{member}", inspect.cleandoc(doc or "")))
    return out


DOCS_FILE = re.compile(r"\b(?:docs/)?[\w-]+\.md\b")
# a cross-reference's target (``[title][mfsdp_optim.stats._api.x]``) renders as a link
AUTOREF_TARGET = re.compile(r"\]\[[\w.]+\]")


def test_api_docstrings_name_no_docs_files_or_private_modules(patterns):
    docs = _rendered_docstrings()
    assert len(docs) >= 40, len(docs)
    private = {"private module": patterns["private module"]}
    problems = []
    for name, doc in docs:
        doc = AUTOREF_TARGET.sub("][]", doc)
        problems += problems_in(doc, name, private)
        problems += [f"{name}: names the docs file {m.group(0)!r}" for m in DOCS_FILE.finditer(doc)]
    assert not problems, "\n".join(sorted(set(problems)))


def test_every_fault_row_names_its_test_on_the_contributors_page():
    """The errors page's fault rows (F1, F2, ...) carry no test names; the contributors' page
    maps each id to its test, so a new row without a test fails here."""
    errors = (ROOT / "docs" / "errors.md").read_text("utf-8")
    internals = (ROOT / "docs" / "internals.md").read_text("utf-8")
    faults = re.findall(r"^\| (F\d+) \|", errors, re.M)
    tested = dict(re.findall(r"^\| (F\d+) \| (.+) \|$", internals, re.M))
    assert faults == [f"F{i}" for i in range(1, len(faults) + 1)] and len(faults) >= 10, faults
    assert sorted(tested) == sorted(faults), (faults, sorted(tested))
    assert all("test_" in t or t == "same test" for t in tested.values()), tested
