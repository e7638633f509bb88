"""What the benchmarks' ``--compare`` options share: importing another copy of the package."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_other(spec: str) -> ModuleType:
    """The package named by ``--compare``: ``'module'`` or ``'module=PATH'`` (PATH is put first
    on ``sys.path``, e.g. a renamed copy of the previous main)."""
    name, _, path = spec.partition("=")
    if path:
        sys.path.insert(0, path)
    return importlib.import_module(name)
