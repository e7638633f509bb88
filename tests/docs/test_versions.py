"""The version moves with the checkpoint format and the features.

``mfsdp_optim.__version__`` has a release entry in CHANGELOG.md (under an "Unreleased" heading
that stays on top); the checkpoint page's table of formats has a row for every format up to
the one the code writes (``checkpoint._state_dict._table.VERSION``); each row names the released
versions that wrote it, and the release that writes the current format says so in its changelog
entry.
So a new format fails here until a version is bumped and its changelog entry names it.
"""

from __future__ import annotations

import re
from pathlib import Path

import mfsdp_optim
from mfsdp_optim.checkpoint._state_dict import _table

ROOT = Path(__file__).resolve().parents[2]
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\]", re.M)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def changelog_sections() -> dict[str, str]:
    """``{heading name: body}`` of CHANGELOG.md's ``## [...]`` sections, in order."""
    text = (ROOT / "CHANGELOG.md").read_text("utf-8")
    parts = re.split(r"^## \[([^\]]+)\].*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def format_rows() -> dict[int, str]:
    """``{format: "written by" cell}`` of the checkpoint page's table of formats."""
    text = (ROOT / "docs" / "checkpoint.md").read_text("utf-8")
    rows = re.findall(r"^\| (\d+)( \(current\))? \| ([^|]+) \|", text, re.M)
    return {int(n): (current + " " + who).strip() for n, current, who in rows}


def test_version_has_a_release_entry_below_unreleased():
    version = mfsdp_optim.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    sections = list(changelog_sections())
    assert sections[0] == "Unreleased", sections[:3]
    assert version in sections, f"CHANGELOG.md has no ## [{version}] entry: {sections}"
    released = [_version(s) for s in sections[1:]]
    assert released == sorted(released, reverse=True), released
    assert released[0] == _version(version), "the newest release entry is not __version__"


def test_every_format_has_a_row_naming_released_versions():
    current = _table.VERSION
    rows = format_rows()
    assert sorted(rows) == list(range(1, current + 1)), rows
    assert "(current)" in rows[current] and sum("(current)" in r for r in rows.values()) == 1
    sections = changelog_sections()
    version = _version(mfsdp_optim.__version__)
    for fmt, who in rows.items():
        named = re.findall(r"mfsdp_optim (\d+\.\d+\.\d+)", who)
        assert named or "never released" in who, (fmt, who)
        for v in named:
            assert v in sections and _version(v) <= version, (fmt, v)
    writer = re.findall(r"mfsdp_optim (\d+\.\d+\.\d+)", rows[current])
    assert writer, f"format {current} (written now) names no release: {rows[current]}"
    body = sections[writer[0]].replace("*", "")
    assert f"format {current}" in body, f"the {writer[0]} changelog entry names no format {current}"
