"""Every module-level cache of the package: dropped by one call, ``clear_all()``, and the device
buffers among them that a captured CUDA graph reads, listed by another, ``kept_alive()``.

Map: ``register(clear)`` is called once by each module that keeps a cache at module level (the
stats layer's layout-by-spec cache and kernel tables); ``clear_all()`` calls every registered
``clear``. ``FullyShardedOptimizer.invalidate_caches()`` calls it after each engine's
``invalidate()``. The caches are keyed by identity with their keys held alive, so they never go
stale on their own; clearing them frees memory and proves that nothing depends on them.
``keep_alive(cache)`` is called once by each owner of a cache of device buffers (the stats
kernel's tables and workspaces, the stats row's constant slots); ``kept_alive()`` lists their
values now, which a capture holds so that no replay reads memory a cache dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["clear_all", "keep_alive", "kept_alive", "register"]

_CLEARS: list[Callable[[], None]] = []
_KEPT: list[Mapping[Any, object]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Remember ``clear`` (it empties one module's caches); returns it."""
    _CLEARS.append(clear)
    return clear


def clear_all() -> None:
    """Empty every registered cache."""
    for clear in _CLEARS:
        clear()


def keep_alive(cache: Mapping[Any, object]) -> None:
    """Remember ``cache``, a mapping whose values hold device buffers that a captured CUDA graph
    may read; the owner must only ever change it in place (never rebind it)."""
    _KEPT.append(cache)


def kept_alive() -> list[list[object]]:
    """The values of every cache given to ``keep_alive``, now: one list per cache, in the order
    they were given."""
    return [list(cache.values()) for cache in _KEPT]
