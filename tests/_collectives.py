"""Counting torch.distributed's collectives in a test while the real ones run.

``counted()`` (a context manager) replaces each collective of ``NAMES`` that this torch has in
the ``torch.distributed`` namespace with a counting wrapper and yields ``{name: calls}``;
``GATHER`` is the name the package's tensor all-gather goes by in this torch (2.13 renamed
``all_gather_into_tensor`` to ``all_gather_single``; 2.11 and 2.12 have only the old name).
Calls torch makes internally (``all_gather_object`` calling ``all_gather``) are not counted:
they do not go through the namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextmanager
def counted() -> Iterator[dict[str, int]]:
    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in NAMES if hasattr(dist, name)}

    def wrap(name, fn):
        def counting(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counting

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
