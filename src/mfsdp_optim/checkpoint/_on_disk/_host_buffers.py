"""The asynchronous save's host buffers: one flat tensor per (dtype, device type) of the state,
exactly its size, page-locked where the state is on CUDA, kept from one save to the next.

Map: ``views`` (views of given shapes into the buffer of a key, made or re-made as needed, and
the DTensors last built around them); ``nbytes`` (what the buffers hold); ``release`` (every
buffer dropped, its pages unlocked); ``cudart`` (the page-locking calls). One lock (``LOCK``)
guards them: a save's staging holds it for its copies, so a preparation running on another
thread (``_async.prepare``) never makes a buffer twice nor replaces one that is being copied
into.

Why page-locked by registering, not through torch's pinned allocator: the caching host
allocator rounds every block up to a power of two (a 9 GiB state would lock 16 GiB) and keeps
freed blocks cached, while a pageable tensor of exactly the size,
locked with ``cudaHostRegister`` (as torch's own ``StateDictStager`` does), holds one copy of
the state and nothing more. Device-to-host copies into it run asynchronously like copies into
pinned memory (torch sees registered memory as pinned).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from typing import Any

import torch

__all__ = ["LOCK", "Key", "cudart", "nbytes", "release", "views"]

Key = tuple[torch.dtype, str]  # (dtype, device type of the state copied into it)

# held while a buffer is made, replaced or copied into (a staging holds it for its copies)
LOCK = threading.RLock()


class _Buffer:
    """One flat host tensor, page-locked (registered) when ``locked``; ``release`` unlocks it
    (its memory is freed with the last view of it)."""

    __slots__ = ("tensor", "locked")

    def __init__(self, dtype: torch.dtype, numel: int, locked: bool, touch: bool = False):
        self.tensor = torch.empty(numel, dtype=dtype)
        self.locked = False
        if locked and numel:
            _register(self.tensor)  # locking faults every page in
            self.locked = True
        elif touch:  # fault the pages in now, not in the first copy
            self.tensor.zero_()

    def release(self) -> None:
        if self.locked:
            self.locked = False
            _unregister(self.tensor)


def _register(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    err = cudart().register(tensor.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(
            f"could not page-lock the asynchronous save's {nbytes / 2**30:.2f} GiB host buffer "
            f"(cudaHostRegister returned CUDA error {err}): the host may be short of lockable "
            "memory (ulimit -l) or of memory; save synchronously, or free host memory"
        )


def _unregister(tensor: torch.Tensor) -> None:
    cudart().unregister(tensor.data_ptr())


class _Cudart:
    """``cudaHostRegister`` and ``cudaHostUnregister`` of the CUDA runtime torch loaded, called
    through ctypes, which lets go of the GIL for the call: page-locking gigabytes takes seconds
    (it faults in every page), and ``torch.cuda.cudart()``'s bindings hold the GIL throughout,
    so a preparation on a background thread would stop training's Python thread for as long.
    Where no shared libcudart with both functions is among the process's libraries (a torch
    that links the runtime statically), torch's bindings are used (``gil_free`` False)."""

    def __init__(self) -> None:
        calls = _ctypes_calls(_loaded("libcudart.so"))
        self.gil_free = calls is not None
        if calls is None:
            rt = torch.cuda.cudart()
            calls = rt.cudaHostRegister, rt.cudaHostUnregister
        reg, unreg = calls
        self.register = lambda ptr, n, flags: int(reg(ptr, n, flags))
        self.unregister = lambda ptr: int(unreg(ptr))


def _ctypes_calls(path: str | None) -> tuple[Any, Any] | None:
    """The library's ``cudaHostRegister`` and ``cudaHostUnregister`` as ctypes functions, or
    None where it cannot be opened or lacks them."""
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # the loaded library itself: dlopen returns its handle
        reg, unreg = lib.cudaHostRegister, lib.cudaHostUnregister
    except (OSError, AttributeError):
        return None
    reg.argtypes, reg.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    unreg.argtypes, unreg.restype = [ctypes.c_void_p], ctypes.c_int
    return reg, unreg


def _loaded(stem: str) -> str | None:
    """The path of a shared library of the process whose file name starts with ``stem``
    (Linux: ``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


@functools.cache
def cudart() -> _Cudart:
    """The page-locking calls, looked up once (CUDA initialised first)."""
    torch.cuda.init()  # the runtime loaded (and its library mapped) before it is looked for
    return _Cudart()


_BUFFERS: dict[Key, _Buffer] = {}
# per key: the buffer the views were cut from, the shapes they were cut for, the views, and the
# DTensor last built around each view (None until one is)
_VIEWS: dict[Key, tuple[_Buffer, tuple[torch.Size, ...], list[torch.Tensor], list[Any]]] = {}


def views(
    key: Key, shapes: tuple[torch.Size, ...], touch: bool = False
) -> tuple[list[torch.Tensor], list[Any]]:
    """Views of ``shapes``, one after the other, into the host buffer of ``key`` (made when
    missing or of another size: the old one is dropped first, so at most one copy is held), and
    the list of DTensors built around them. Both are kept with the buffer and the shapes they
    were cut for, and reused only when both are the same (cutting 2,400 views costs ~5 ms). The
    caller makes sure no copy of an earlier save still reads the buffer (``_async.settle``).
    ``touch``: a buffer made here has its pages faulted in (a preparation: page-locking does it
    for CUDA state, writing zeros for CPU state), so the first copy into it runs at full speed."""
    with LOCK:
        buf = _BUFFERS.get(key)
        cached = _VIEWS.get(key)
        if cached is not None and cached[0] is buf and cached[1] == shapes:
            return cached[2], cached[3]
        _VIEWS.pop(key, None)
        sizes = [math.prod(s) for s in shapes]
        total = sum(sizes)
        if buf is None or buf.tensor.numel() != total:
            old = _BUFFERS.pop(key, None)  # the old one goes before the new one is made
            if old is not None:
                old.release()
            del old
            locked = key[1] == "cuda" and torch.cuda.is_available()
            buf = _BUFFERS[key] = _Buffer(key[0], total, locked, touch)
        made = [v.view(s) for v, s in zip(buf.tensor.split(sizes), shapes, strict=True)]
        wrapped: list[Any] = [None] * len(made)
        _VIEWS[key] = (buf, shapes, made, wrapped)
        return made, wrapped


def nbytes() -> int:
    """The bytes the buffers hold now."""
    with LOCK:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in _BUFFERS.values())


def release() -> None:
    """Drop every buffer and its views (pages unlocked; the memory is freed with the last
    reference). The next save, or preparation, makes them again."""
    with LOCK:
        _VIEWS.clear()
        for buf in _BUFFERS.values():
            buf.release()
        _BUFFERS.clear()
