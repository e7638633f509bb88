"""The asynchronous save: the state copied off the live tensors, then written in the background.

Map: ``SaveHandle`` (what ``save_checkpoint(..., asynchronous=True)`` returns: ``wait``,
``done``); ``stage`` (the copy: one host buffer per dtype, pinned where the state is on CUDA,
reused from one save to the next); ``background_group`` (a gloo group of the
saving ranks, made once per group, for the background's collectives, so they never interleave
with training's); ``start`` (writes the staged copy and finishes the save, checksums and
publish included, on a background thread); ``settle`` (the
next save or load first waits for the one in flight and takes its error if ``wait`` never
raised it).

One save is in flight per process at a time: every collective of the background runs on the
background group, in the order of the saves, which is the same on every rank.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._infra.agreement import Failure
from .._infra.comm import group_timeout

__all__ = ["SaveHandle", "background_group", "settle", "stage", "start"]


class SaveHandle:
    """An asynchronous ``save_checkpoint`` in flight (returned by ``asynchronous=True``).

    The state was copied off the live tensors before ``save_checkpoint`` returned: training may
    step and change params, optimizer state and hyperparameters while the write proceeds; what
    is written is the copy. The checkpoint appears under ``directory`` only once every rank's
    files are complete, exactly as with the synchronous save.

    Made by ``save_checkpoint``, not by you.

    Args:
        directory: The absolute path the checkpoint is published under.
        future: Completed by the background thread: the directory, or the save's error.
        blocking_s: How long ``save_checkpoint`` blocked the caller (agreement and copy).

    Attributes:
        directory: The absolute path the checkpoint is published under.
        blocking_s: How long ``save_checkpoint`` blocked the caller (agreement and copy).
    """

    def __init__(self, directory: str, future: Future, blocking_s: float):
        self.directory = directory
        self.blocking_s = blocking_s
        self._future = future
        self._reported = False  # wait() raised the error (the next call need not)

    def done(self) -> bool:
        """True once the save finished on this rank (published, or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save finished on this rank; the published directory.

        Args:
            timeout: Seconds to wait at most (None: until it finishes).

        Returns:
            The published checkpoint directory (absolute), on every rank.

        Raises:
            TimeoutError: The save is still running after ``timeout`` seconds (it goes on;
                call ``wait`` again).
            RuntimeError: Or the other errors of ``save_checkpoint``: the save failed, on
                every rank (nothing was published, the previous checkpoint is untouched), or a
                rank failed after the publish (the message says what is on disk).
        """
        futures.wait([self._future], timeout=timeout)
        if not self._future.done():
            raise TimeoutError(
                f"the asynchronous save of {self.directory} is still running after "
                f"{timeout} s; it goes on in the background (call wait() again)"
            )
        exc = self._future.exception()
        if exc is not None:
            self._reported = True
            raise exc
        return self.directory

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._future.exception() else "done"
        return f"SaveHandle({self.directory!r}, {state})"


_LOCK = threading.Lock()
_IN_FLIGHT: SaveHandle | None = None
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def settle() -> Failure | None:
    """Wait for the save in flight on this process, if any; its error as a ``Failure`` when
    ``wait()`` never raised it (the next save or load refuses with it on every rank)."""
    global _IN_FLIGHT
    with _LOCK:
        handle, _IN_FLIGHT = _IN_FLIGHT, None
    if handle is None:
        return None
    exc = handle._future.exception()  # blocks until it finished: a second save waits
    if exc is None or handle._reported:
        return None
    handle._reported = True
    return Failure(
        "RuntimeError",
        (
            f"the previous asynchronous save of {handle.directory} failed and its handle's "
            f"wait() never reported it: {type(exc).__name__}: {str(exc)[:1500]}",
        ),
    )


def background_group(group: dist.ProcessGroup | None, ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` (the saving group's), with its timeout, made the first time
    (every rank of the group calls this at the same point of ``save_checkpoint``)."""
    key = tuple(ranks)
    pg = _GROUPS.get(key)
    if pg is None:
        timeout = group_timeout(group)
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kwargs)
        _GROUPS[key] = pg
    return pg


_IMMUTABLE = (str, int, float, bool, bytes, type(None))
_BUFFERS: dict[tuple[torch.dtype, str], torch.Tensor] = {}
# per buffer key: the buffer the views were cut from, the shapes they were cut for, the views,
# and the DTensor last built around each view (None until one is)
_VIEWS: dict[
    tuple[torch.dtype, str],
    tuple[torch.Tensor, tuple[torch.Size, ...], list[torch.Tensor], list[Any]],
] = {}


class _Leaf(NamedTuple):
    """A tensor of the state dict while the copy is being made: its index among the sources,
    and the DTensor spec to rebuild it with (None for a plain tensor)."""

    at: int
    spec: Any


class _Copy(NamedTuple):
    """Where a source's copy went: its view into the host buffer, and the list (kept with the
    views) holding, at ``slot``, the DTensor last built around that view."""

    view: torch.Tensor
    wrapped: list[Any]
    slot: int


def _views(
    key: tuple[torch.dtype, str], shapes: tuple[torch.Size, ...]
) -> tuple[list[torch.Tensor], list[Any]]:
    """Views of ``shapes``, one after the other, into the host buffer of ``key`` (allocated
    when missing or of another size), and the list of DTensors built around them. Both are
    kept with the buffer and the shapes they were cut for, and reused only when both are the
    same (cutting 2,400 views costs ~5 ms; the staged copy of the previous save is no longer in
    use: ``settle`` waited for it)."""
    buf = _BUFFERS.get(key)
    cached = _VIEWS.get(key)
    if cached is not None and cached[0] is buf and cached[1] == shapes:
        return cached[2], cached[3]
    _VIEWS.pop(key, None)
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes)
    if buf is None or buf.numel() != total:
        _BUFFERS.pop(key, None)  # the old one goes before the new one is allocated
        pinned = key[1] == "cuda" and torch.cuda.is_available()
        buf = _BUFFERS[key] = torch.empty(total, dtype=key[0], pin_memory=pinned)
    views = [v.view(s) for v, s in zip(buf.split(sizes), shapes, strict=True)]
    wrapped: list[Any] = [None] * len(views)
    _VIEWS[key] = (buf, shapes, views, wrapped)
    return views, wrapped


def _copy_flat(sources: list[torch.Tensor]) -> list[_Copy]:
    """Host copies of ``sources``: views into ONE host buffer per dtype and device type (pinned
    for CUDA sources), filled by one ``_foreach_copy_`` (CPU) or non-blocking copies (devices).
    The buffers, and the views when the shapes are the same, are kept for the next save. Why
    not torch's ``StateDictStager``: it copies storage by storage from Python (tens of
    microseconds each), seconds of blocking for the tens of thousands of state tensors of a
    large model."""
    groups: dict[tuple[torch.dtype, str], list[int]] = {}
    for i, src in enumerate(sources):
        groups.setdefault((src.dtype, src.device.type), []).append(i)
    out: list[_Copy | None] = [None] * len(sources)
    for key, idx in groups.items():
        srcs = [sources[i] for i in idx]
        views, wrapped = _views(key, tuple(s.shape for s in srcs))
        if key[1] == "cpu":
            torch._foreach_copy_(views, srcs)
        else:
            for view, src in zip(views, srcs, strict=True):
                view.copy_(src, non_blocking=True)
        for slot, i in enumerate(idx):
            out[i] = _Copy(views[slot], wrapped, slot)
    if any(key[1] == "cuda" for key in groups):
        torch.cuda.synchronize()  # the non-blocking copies are complete on return
    return out  # type: ignore[return-value]


@torch.no_grad()
def stage(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` that shares nothing mutable with it: every tensor's values in
    host memory (``_copy_flat``; a DTensor rebuilt around its copied local tensor with the same
    mesh, placements and global shape), containers copied, other values deep-copied (the
    read-only ``param_to_group_meta`` table shared). Complete on return (device copies
    synchronised)."""
    from torch.distributed.tensor import DTensor

    from ._table import GroupMetaTable

    sources: list[torch.Tensor] = []

    def collect(value: Any) -> Any:
        if isinstance(value, DTensor):
            sources.append(value._local_tensor)  # read under no_grad: no detach needed
            return _Leaf(len(sources) - 1, value._spec)
        if isinstance(value, torch.Tensor):
            sources.append(value)
            return _Leaf(len(sources) - 1, None)
        if isinstance(value, Mapping) and not isinstance(value, GroupMetaTable):
            return {k: collect(v) for k, v in value.items()}
        if isinstance(value, list):
            return [collect(v) for v in value]
        if type(value) is tuple:
            return tuple(collect(v) for v in value)
        if isinstance(value, _IMMUTABLE + (GroupMetaTable,)):  # the table is read-only
            return value
        return copy.deepcopy(value)

    shape = {k: collect(v) for k, v in state_dict.items()}
    copies = _copy_flat(sources)

    def fill(value: Any) -> Any:
        if isinstance(value, _Leaf):
            view, wrapped, slot = copies[value.at]
            if value.spec is None:
                return view
            # the DTensor of the previous save around the same view, when its spec is the same
            # object (the state dict's DTensors share their param's spec): ~2 us each saved
            last = wrapped[slot]
            if last is None or last._spec is not value.spec:
                last = wrapped[slot] = DTensor(view, value.spec, requires_grad=False)
            return last
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        if type(value) is tuple:
            return tuple(fill(v) for v in value)
        return value

    return {k: fill(v) for k, v in shape.items()}


def start(directory: str, work: Callable[[], str], blocking_t0: float) -> SaveHandle:
    """Run ``work`` (the write, the checksums, the report gather and the publish, every
    collective on the background group) on a background thread; its result or error completes
    the handle."""
    global _IN_FLIGHT
    result: Future = Future()

    def run() -> None:
        try:
            result.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - every error goes to the handle
            result.set_exception(exc)

    handle = SaveHandle(directory, result, time.perf_counter() - blocking_t0)
    with _LOCK:
        _IN_FLIGHT = handle
    threading.Thread(target=run, name="mfsdp-async-save", daemon=True).start()
    return handle
