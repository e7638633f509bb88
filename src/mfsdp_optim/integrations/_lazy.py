"""The lazy import behind each integration module: its names resolve on first use, and a
missing or broken framework gives one ImportError that says what to install."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["TRAINERS_EXTRA", "lazy_names", "require"]

TRAINERS_EXTRA = "pip install 'mfsdp-optim[trainers]'"


def require(module: str, integration: str, install: str) -> ModuleType:
    """Import ``module`` for ``integration``, or raise an ImportError that says what to install
    (the cause is chained: a framework that is installed but misses one of its own modules
    fails here too)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{integration} needs {module!r}, which could not be imported ({exc}). "
            f"Install it: {install}"
        ) from exc


def lazy_names(module: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` that imports ``where[name]`` (a module relative to
    ``module``'s package) when ``name`` is first read, and returns that name from it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name], module.rpartition(".")[0]), name)

    return __getattr__
