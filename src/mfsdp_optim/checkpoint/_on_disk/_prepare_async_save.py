"""``prepare_async_save``: the host buffers of the asynchronous save, made ahead of the first
one (``_async.prepare``, into ``_host_buffers``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _async
from ._async import PrepareHandle
from ._consensus import unwrap_stateful

__all__ = ["prepare_async_save"]


def prepare_async_save(state_dict: Mapping[str, Any], *, background: bool = True) -> PrepareHandle:
    """Make the host memory an asynchronous save of ``state_dict`` copies into, ahead of it.

    ``save_checkpoint(..., asynchronous=True)`` copies the state into host buffers it keeps
    for the next save (page-locked where the state is on CUDA, exactly the state's size). The
    first save would make them inside the call; page-locking gigabytes takes seconds there,
    against a fraction of a second for the copy. Call this once, at a point outside training's
    critical path (after the first optimizer step, when the state exists), with the state dict
    the saves will pass: with ``background=True`` (the default) it returns at once and the
    buffers are made on a background thread while training goes on, so the first asynchronous
    save blocks only for its copy, as the later ones do.

    It holds one copy of the state's tensors in host memory, the one every later save reuses
    (no more than the saves alone hold); a save whose tensors differ in size makes its buffers
    again, dropping these first. A save in flight is waited for before its buffers are
    touched; a save that starts before the buffers are made waits for them. Nothing is written
    or copied, no collective runs: each rank may call it at any point (or not at all).

    Args:
        state_dict: This rank's state dict as the saves will pass it, for example
            ``{"optimizer": opt.sharded_state_dict()}``; only the dtypes, devices and shapes
            of its tensors are read.
        background: Make the buffers on a background thread (return at once), or before
            returning.

    Returns:
        A ``PrepareHandle``: ``wait()`` blocks until the buffers are made (and raises if
        making them failed: the next save then makes them itself), ``done()``, ``nbytes``.
    """
    return _async.prepare(unwrap_stateful(state_dict), background)
