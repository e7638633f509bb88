"""The asynchronous save's host buffers: one flat tensor per (dtype, device type) of the state,
exactly its size, page-locked where the state is on CUDA, kept from one save to the next.

Map: ``views`` (views of given shapes into the buffer of a key, made or re-made as needed, and
the DTensors last built around them); ``copy_in`` (non-blocking copies into those views, cut
where two locked pieces of the buffer meet); ``nbytes`` (what the buffers hold); ``release``
(every buffer dropped, its pages unlocked); ``cudart`` (the page-locking calls). One lock
(``LOCK``) guards them: a save's staging holds it for its copies, so a preparation running on
another thread (``_async.prepare``) never makes a buffer twice nor replaces one that is being
copied into.

Why page-locked by registering, not through torch's pinned allocator: the caching host
allocator rounds every block up to a power of two (a 9 GiB state would lock 16 GiB) and keeps
freed blocks cached, while a pageable tensor of exactly the size,
locked with ``cudaHostRegister`` (as torch's own ``StateDictStager`` does), holds one copy of
the state and nothing more. Device-to-host copies into it run asynchronously like copies into
pinned memory (torch sees registered memory as pinned).

Why in pieces (``_PIECE_BYTES``): the driver page-locks under locks of its own, held for the
whole call, which other CUDA calls (of this process and of others on the node) may wait for;
one call for gigabytes holds them for seconds, one piece for milliseconds, and a preparation on
a background thread pauses between pieces. Single registrations of 2 GB or more also fail on
some Linux kernels and drivers. A locked buffer starts on a page and each piece is whole pages,
so no two registrations share a page; a copy into a view that spans two pieces is cut at the
seam (``copy_in``).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
import os
import threading
import time
from typing import Any

import torch

__all__ = ["LOCK", "Key", "copy_in", "cudart", "locked", "nbytes", "release", "views"]

Key = tuple[torch.dtype, str]  # (dtype, device type of the state copied into it)

# held while a buffer is made, replaced or copied into (a staging holds it for its copies)
LOCK = threading.RLock()

# bytes page-locked by one cudaHostRegister call; the pause between two calls of a preparation
# on a background thread (a CUDA call waiting for the driver's locks gets in)
_PIECE_BYTES = 64 << 20
_PAUSE_S = 0.001
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Buffer:
    """One flat host tensor of ``numel`` elements, page-locked (registered) in pieces when
    ``locked``; ``release`` unlocks it (its memory is freed with the last view of it).
    ``touch``: an unlocked buffer's pages are faulted in (locking does it for a locked one);
    ``pause``: seconds between two pieces; ``piece``: their bytes (``_PIECE_BYTES`` when None,
    rounded down to whole pages). A failure part-way unlocks the pieces locked before
    it, then raises: nothing stays locked."""

    __slots__ = ("tensor", "pieces")

    def __init__(
        self,
        dtype: torch.dtype,
        numel: int,
        locked: bool,
        touch: bool = False,
        pause: float = 0.0,
        piece: int | None = None,
    ):
        self.pieces: list[tuple[int, int]] = []  # (address, bytes) of each registration
        if not (locked and numel):
            self.tensor = torch.empty(numel, dtype=dtype)
            if touch:  # fault the pages in now, not in the first copy
                self.tensor.zero_()
            return
        self.tensor = _page_aligned(dtype, numel)
        try:
            for ptr, n in _pieces(self.tensor.data_ptr(), numel * dtype.itemsize, piece):
                if self.pieces and pause:
                    time.sleep(pause)
                _register(ptr, n)
                self.pieces.append((ptr, n))
        except BaseException:
            self.release()
            raise

    @property
    def locked(self) -> bool:
        return bool(self.pieces)

    def seams(self) -> list[int]:
        """The element offsets where one locked piece ends and the next begins."""
        base, size = self.tensor.data_ptr(), self.tensor.element_size()
        return [(ptr - base) // size for ptr, _ in self.pieces[1:]]

    def release(self) -> None:
        pieces, self.pieces = self.pieces, []
        for ptr, _ in reversed(pieces):
            _unregister(ptr)


def _page_aligned(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """An uninitialised flat tensor of ``numel`` elements that starts on a page, cut from an
    allocation that holds the rest of its last page too: its registration (whole pages) covers
    no other object's memory, which may be registered itself."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(_round_up(nbytes) + _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    return raw[start : start + nbytes].view(dtype)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def _pieces(ptr: int, nbytes: int, piece: int | None = None) -> list[tuple[int, int]]:
    """The registrations of ``nbytes`` from the page-aligned address ``ptr``: whole pages, at
    most ``piece`` bytes each (``_PIECE_BYTES`` when None; the last one rounded up to its
    page)."""
    span = _round_up(nbytes)
    step = max(_PAGE, (piece or _PIECE_BYTES) // _PAGE * _PAGE)
    return [(ptr + off, min(step, span - off)) for off in range(0, span, step)]


def _segments(offset: int, numel: int, seams: list[int]) -> list[tuple[int, int]]:
    """The ranges of a view (``numel`` elements from element ``offset`` of its buffer) that lie
    each within one locked piece of a buffer whose pieces meet at ``seams`` (sorted)."""
    lo = bisect.bisect_right(seams, offset)
    hi = bisect.bisect_left(seams, offset + numel)
    cuts = [s - offset for s in seams[lo:hi]]
    return list(zip([0, *cuts], [*cuts, numel], strict=True))


def _register(ptr: int, nbytes: int) -> None:
    rt = cudart()
    err = rt.register(ptr, nbytes, 1)  # cudaHostRegisterPortable
    if err != 0:
        rt.clear_error()  # else this thread's next kernel launch would report it as its own
        raise RuntimeError(
            f"could not page-lock {nbytes / 2**20:.0f} MiB of the asynchronous save's host "
            f"buffer (cudaHostRegister returned CUDA error {err}): the host may be short of "
            "lockable memory (ulimit -l) or of memory; save synchronously, or free host memory"
        )


def _unregister(ptr: int) -> None:
    cudart().unregister(ptr)


class _Cudart:
    """``cudaHostRegister`` and ``cudaHostUnregister`` of the CUDA runtime torch loaded, called
    through ctypes, which lets go of the GIL for the call: page-locking gigabytes takes seconds
    (it faults in every page), and ``torch.cuda.cudart()``'s bindings hold the GIL throughout,
    so a preparation on a background thread would stop training's Python thread for as long.
    ``clear_error``: ``cudaGetLastError``, which takes a failed call's error off this thread
    (torch checks each kernel launch with it). Where no shared libcudart with these functions
    is among the process's libraries (a torch that links the runtime statically), torch's
    bindings are used (``gil_free`` False), and a failed call's error cannot be cleared."""

    def __init__(self) -> None:
        calls = _ctypes_calls(_loaded("libcudart"))
        self.gil_free = calls is not None
        if calls is None:
            rt = torch.cuda.cudart()
            calls = rt.cudaHostRegister, rt.cudaHostUnregister, lambda: 0
        reg, unreg, last_error = calls
        self.register = lambda ptr, n, flags: int(reg(ptr, n, flags))
        self.unregister = lambda ptr: int(unreg(ptr))
        self.clear_error = lambda: int(last_error())


def _ctypes_calls(path: str | None) -> tuple[Any, Any, Any] | None:
    """The library's ``cudaHostRegister``, ``cudaHostUnregister`` and ``cudaGetLastError`` as
    ctypes functions, or None where it cannot be opened or lacks them."""
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # the loaded library itself: dlopen returns its handle
        reg, unreg, last = lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError
    except (OSError, AttributeError):
        return None
    reg.argtypes, reg.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    unreg.argtypes, unreg.restype = [ctypes.c_void_p], ctypes.c_int
    last.argtypes, last.restype = [], ctypes.c_int
    return reg, unreg, last


def _loaded(stem: str, maps_path: str = "/proc/self/maps") -> str | None:
    """The path of a shared library of the process named ``stem`` followed by ``.`` or ``-``
    (``libcudart.so.13``, or ``libcudart-<hash>.so.12`` where a wheel bundles it), from Linux's
    ``/proc/self/maps``; or None."""
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) < 6:
                    continue  # anonymous memory
                path = fields[5].rstrip("\n").removesuffix(" (deleted)")
                name = os.path.basename(path)
                if name.startswith(stem) and name[len(stem) : len(stem) + 1] in (".", "-"):
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
    key: Key, shapes: tuple[torch.Size, ...], touch: bool = False, paced: bool = False
) -> tuple[list[torch.Tensor], list[Any]]:
    """Views of ``shapes``, one after the other, into the host buffer of ``key`` (made when
    missing or of another size: the old one is dropped first, so at most one copy is held), and
    the list of DTensors built around them. Both are kept with the buffer and the shapes they
    were cut for, and reused only when both are the same (cutting 2,400 views costs ~5 ms). The
    caller makes sure no copy of an earlier save still reads the buffer (``_async.settle``).
    ``touch``: a buffer made here has its pages faulted in (a preparation: page-locking does it
    for CUDA state, writing zeros for CPU state), so the first copy into it runs at full speed;
    ``paced``: a pause between the pieces it page-locks (a preparation on a background thread)."""
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
            wait = _PAUSE_S if paced else 0.0
            buf = _BUFFERS[key] = _Buffer(key[0], total, locked, touch, wait)
        made = [v.view(s) for v, s in zip(buf.tensor.split(sizes), shapes, strict=True)]
        wrapped: list[Any] = [None] * len(made)
        _VIEWS[key] = (buf, shapes, made, wrapped)
        return made, wrapped


def copy_in(key: Key, views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``views[i].copy_(sources[i], non_blocking=True)`` for views of ``key``'s buffer (from
    ``views``), each cut where two of the buffer's locked pieces meet, so that every copy lands
    in one registration. A non-contiguous source that spans a seam is copied whole."""
    with LOCK:
        buf = _BUFFERS[key]
        seams = buf.seams()
        base, size = buf.tensor.data_ptr(), buf.tensor.element_size()
        for view, src in zip(views, sources, strict=True):
            ranges = []
            if seams and src.is_contiguous():
                ranges = _segments((view.data_ptr() - base) // size, view.numel(), seams)
            if len(ranges) < 2:  # in one piece (or a non-contiguous source: whole)
                view.copy_(src, non_blocking=True)
                continue
            flat_view, flat_src = view.view(-1), src.view(-1)
            for a, b in ranges:
                flat_view[a:b].copy_(flat_src[a:b], non_blocking=True)


def locked(numel: int, pause: float | None = None, piece: int | None = None) -> _Buffer:
    """A float32 buffer of ``numel`` elements, page-locked as the save's buffers are, outside
    the kept ones (the benchmarks): in pieces of ``piece`` bytes (None: the package's) with
    ``pause`` seconds between them (None: as on a preparation's background thread). Its
    ``tensor``, ``pieces`` (address and bytes of each registration) and ``release()``."""
    wait = _PAUSE_S if pause is None else pause
    return _Buffer(torch.float32, numel, True, pause=wait, piece=piece)


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
