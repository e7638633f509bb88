"""Every module-level cache of the package, dropped by one call: ``clear_all()``.

Map: ``register(clear)`` is called once by each module that keeps a cache at module level (the
stats layer's layout-by-spec cache and kernel tables); ``clear_all()`` calls every registered
``clear``. ``FullyShardedOptimizer.invalidate_caches()`` calls it after each engine's
``invalidate()``. The caches are keyed by identity with their keys held alive, so they never go
stale on their own; clearing them frees memory and proves that nothing depends on them.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["clear_all", "register"]

_CLEARS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Remember ``clear`` (it empties one module's caches); returns it."""
    _CLEARS.append(clear)
    return clear


def clear_all() -> None:
    """Empty every registered cache."""
    for clear in _CLEARS:
        clear()
