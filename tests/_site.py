"""The docs site built once per test module: ``build_site(out)`` runs ``mkdocs build --strict``
into ``out`` (skipped without the docs extra) and returns it. Used by the docs tests that read
the built HTML (``tests/docs/test_site.py``) and load it in a browser (``test_layout.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_site(out: Path) -> Path:
    for mod in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(mod, reason="the docs extra is not installed: pip install -e .[docs]")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out
