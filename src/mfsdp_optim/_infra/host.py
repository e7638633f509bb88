"""Host-side helpers for the package's per-item Python loops.

Map: ``paused_gc`` (Python's cyclic garbage collector off for a block).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back on after it if it was on (a
    collector the caller turned off stays off). Also a decorator.

    Why: the checkpoint layer builds and copies state dicts of tens of thousands of entries,
    allocating a few small containers per entry; each allocation burst triggers collections
    that walk every live object of the process, which at 10,000 params took two thirds of
    the asynchronous save's copy and of the state dict's build. Nothing here makes reference
    cycles that must be freed within the block; the collector runs again afterwards.

    Thread note: the switch is process-wide. Used on the caller's thread only (never on the
    asynchronous save's background thread, which would pause it while training runs); two
    threads inside at once can end each other's pause early, which costs time, never
    correctness.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
