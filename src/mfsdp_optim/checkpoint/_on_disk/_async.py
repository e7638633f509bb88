"""The asynchronous save: the state copied off the live tensors, then written in the background.

Map: ``SaveHandle`` (what ``save_checkpoint(..., asynchronous=True)`` returns: ``wait``,
``done``); ``stage`` (the copy: one host buffer per dtype, page-locked where the state is on
CUDA, reused from one save to the next: ``_host_buffers``); ``prepare`` (those buffers made
ahead of the first save, on a background thread: ``PrepareHandle``); ``background_group`` (a
gloo group of the saving ranks, made once per group, for the background's collectives, so they
never interleave with training's); ``start`` (writes the staged copy and finishes the save,
checksums and publish included, on a background thread); ``settle`` (the next save or load
first waits for the one in flight and takes its error if ``wait`` never raised it).

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

from ..._infra.agreement import Failure
from ..._infra.comm import group_timeout
from . import _host_buffers

__all__ = ["PrepareHandle", "SaveHandle", "background_group", "prepare", "settle", "stage", "start"]


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


def _by_key(sources: list[torch.Tensor]) -> dict[_host_buffers.Key, list[int]]:
    """The sources' indices per host buffer: one per dtype and device type."""
    groups: dict[_host_buffers.Key, list[int]] = {}
    for i, src in enumerate(sources):
        groups.setdefault((src.dtype, src.device.type), []).append(i)
    return groups


def _copy_flat(sources: list[torch.Tensor]) -> list[_Copy]:
    """Host copies of ``sources``: views into ONE host buffer per dtype and device type
    (page-locked for CUDA sources: ``_host_buffers``), filled by one ``_foreach_copy_`` (CPU)
    or non-blocking copies (devices). The buffers, and the views when the shapes are the same,
    are kept for the next save (and made ahead of the first by ``prepare``). Why not torch's
    ``StateDictStager``: it copies storage by storage from Python (tens of microseconds each),
    seconds of blocking for the tens of thousands of state tensors of a large model."""
    out: list[_Copy | None] = [None] * len(sources)
    groups = _by_key(sources)
    with _host_buffers.LOCK:  # no preparation replaces a buffer while it is copied into
        for key, idx in groups.items():
            srcs = [sources[i] for i in idx]
            views, wrapped = _host_buffers.views(key, tuple(s.shape for s in srcs))
            if key[1] == "cpu":
                torch._foreach_copy_(views, srcs)
            else:
                _host_buffers.copy_in(key, views, srcs)
            for slot, i in enumerate(idx):
                out[i] = _Copy(views[slot], wrapped, slot)
        if any(key[1] == "cuda" for key in groups):
            torch.cuda.synchronize()  # the non-blocking copies are complete on return
    return out  # type: ignore[return-value]


def _collect(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``state_dict`` with every tensor replaced by a ``_Leaf`` (containers copied, other values
    deep-copied, the read-only ``param_to_group_meta`` table shared), and the tensors (local
    tensors of DTensors) in the order of the leaves."""
    from torch.distributed.tensor import DTensor

    from .._state_dict._table import GroupMetaTable

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

    return {k: collect(v) for k, v in state_dict.items()}, sources


@torch.no_grad()
def stage(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` that shares nothing mutable with it: every tensor's values in
    host memory (``_copy_flat``; a DTensor rebuilt around its copied local tensor with the same
    mesh, placements and global shape), containers copied, other values deep-copied (the
    read-only ``param_to_group_meta`` table shared). Complete on return (device copies
    synchronised)."""
    from torch.distributed.tensor import DTensor

    shape, sources = _collect(state_dict)
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


class PrepareHandle:
    """The host buffers of an asynchronous save being made ahead of it (returned by
    ``prepare_async_save``).

    Made by ``prepare_async_save``, not by you.

    Attributes:
        nbytes: The host bytes the buffers hold (one copy of the state's tensors).
    """

    def __init__(self, future: Future, nbytes: int):
        self.nbytes = nbytes
        self._future = future

    def done(self) -> bool:
        """True once the buffers are made (or making them failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the buffers are made.

        Args:
            timeout: Seconds to wait at most (None: until they are).

        Raises:
            TimeoutError: Still making them after ``timeout`` seconds (it goes on).
            RuntimeError: Making them failed (out of host memory, or of memory the process
                may page-lock); the next asynchronous save then makes them itself.
        """
        futures.wait([self._future], timeout=timeout)
        if not self._future.done():
            raise TimeoutError(f"the host buffers are still being made after {timeout} s")
        exc = self._future.exception()
        if exc is not None:
            raise exc

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._future.exception() else "done"
        return f"PrepareHandle({self.nbytes / 2**30:.2f} GiB, {state})"


def prepare(state_dict: Mapping[str, Any], background: bool = True) -> PrepareHandle:
    """Make the host buffers (and views) an asynchronous save of ``state_dict`` copies into:
    on a background thread (``background``), or before returning. A save in flight is waited
    for first (its write reads the buffers); a save that starts meanwhile waits for the buffers
    (``_host_buffers.LOCK``) and finds them made. Nothing is copied and no collective runs."""
    _, sources = _collect(state_dict)
    wanted = {key: tuple(sources[i].shape for i in idx) for key, idx in _by_key(sources).items()}
    total = sum(math.prod(s) * key[0].itemsize for key, shapes in wanted.items() for s in shapes)
    result: Future = Future()

    def make() -> None:
        try:
            with _LOCK:
                handle = _IN_FLIGHT
            if handle is not None:
                futures.wait([handle._future])  # its error stays for its wait() / settle()
            with _host_buffers.LOCK:
                for key, shapes in wanted.items():
                    _host_buffers.views(key, shapes, touch=True, paced=background)
            result.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the handle's wait()
            result.set_exception(exc)

    if background:
        threading.Thread(target=make, name="mfsdp-async-save-prepare", daemon=True).start()
    else:
        make()
    return PrepareHandle(result, total)


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
