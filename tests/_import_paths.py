"""What the structure tests (tests/infra/test_layers.py, test_imports.py, test_structure.py)
share about reading imports from source: the absolute module a relative import names."""

from __future__ import annotations

import ast

__all__ = ["absolute_module"]


def absolute_module(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``module``: the importing module's name;
    ``is_package``: it is a package's ``__init__``, whose level 1 is the package itself)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))
