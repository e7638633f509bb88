"""Collective plumbing shared by the layers: the group's device, the all-gather of a flat tensor
(``all_gather_flat``), a numpy-free object gather and object all-to-all, host reads that wait
for the values they read, not for everything enqueued after them, host values staged for a copy
to the device that does not make the host wait (``staged_for``) or made once and kept there
(``device_constant``), a group's timeout, and a gloo group of a device group's ranks for
host-side values (``host_group_of``)."""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "SENT",
    "HostRead",
    "all_gather_flat",
    "all_gather_objects",
    "all_reduce_max",
    "all_to_all_objects",
    "collective_device",
    "device_constant",
    "device_constants",
    "group_timeout",
    "host_group_of",
    "staged_for",
    "to_collective",
    "uploaded",
]

# bytes this process handed to collectives through these helpers, per helper: what a rank
# contributes (its input), the measure of how a protocol's traffic grows with the world size
SENT: dict[str, int] = {"all_gather_objects": 0, "all_reduce_max": 0}


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the group's collectives run on: the accelerator for NCCL-like backends, else
    the CPU. Chosen from the group alone, so every rank picks the same backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def to_collective(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the collective's ``device``, its values in place before the host goes on.

    A device-to-host ``.to("cpu", non_blocking=True)`` returns a pinned tensor before the copy
    has run, and a gloo collective reads host memory at once: it would send whatever the
    recycled pinned block held (a previous step's row), not this step's values. So a copy to
    the host blocks (it waits for the work that produced ``tensor``: the collective needs its
    values on the host anyway); a copy to a device stays non-blocking (the stream orders it
    before the collective that reads it)."""
    return tensor.to(device, non_blocking=device.type != "cpu")


def staged_for(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a host tensor to copy to ``device`` with ``non_blocking=True``: in pinned
    memory when ``device`` is CUDA. A copy from pageable memory may make the host wait for the
    stream (it would stall behind the kernel it has just launched); from pinned memory it is
    enqueued, and the caching host allocator keeps the block until the copy has run."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def uploaded(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a new 1-D ``dtype`` tensor on ``device``, copied from pinned memory without
    a sync (``staged_for``); an empty one is made there, with no copy."""
    if not len(values):
        return torch.empty(0, dtype=dtype, device=device)
    return staged_for(device, values, dtype).to(device, non_blocking=True)


_CONSTANTS: dict[tuple, torch.Tensor] = {}
_CONSTANTS_SIZE = 256


def device_constant(
    device: torch.device, values: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``, made once per (device, dtype,
    values) and kept: callers must never write it. The first call copies from pinned memory
    without a sync (``staged_for``); later calls copy nothing, so a step that needs the same
    constant every time makes no host-to-device copy at all (nothing for a CUDA graph to
    capture but the kernels that read it). Made outside a capture: a tensor first made while a
    graph is being captured would hold its values only once the graph ran."""
    key = (device, dtype, tuple(values))
    cached = _CONSTANTS.get(key)
    if cached is None:
        if len(_CONSTANTS) >= _CONSTANTS_SIZE:
            _CONSTANTS.clear()
        cached = _CONSTANTS[key] = uploaded(device, list(values), dtype)
    return cached


def device_constants() -> list[torch.Tensor]:
    """Every constant ``device_constant`` holds now (a captured graph that reads some keeps
    them alive with this list, whatever the cache drops later)."""
    return list(_CONSTANTS.values())


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group``'s collectives (default WORLD), or None where the backend does not
    say."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:  # noqa: S112 - this backend has no such option, try the next
            continue
    return None


_HOST_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def host_group_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group of ``group``'s ranks whose collectives run on the host: ``group`` itself where
    they already do (gloo), else a gloo group of the same ranks (same order, same timeout),
    made the first time (every rank of ``group`` must call this at the same point; ranks
    outside it need not) and kept. For values that live on the host (exception messages,
    headers, CPU scalars): sending them through it reads nothing back from a device."""
    if collective_device(group).type == "cpu":
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    pg = _HOST_GROUPS.get(ranks)
    if pg is None:
        timeout = group_timeout(group)
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        made = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True, **kwargs)
        assert made is not None
        pg = _HOST_GROUPS[ranks] = made
    return pg


class HostRead:
    """A small device tensor's values, on their way to the host.

    On CUDA the copy is enqueued at construction (into pinned memory, on the current stream,
    with an event behind it), and ``wait()`` blocks only until that copy has run: work enqueued
    after the construction (an optimizer update) keeps running while the host goes on. A plain
    ``.cpu()`` or ``.tolist()`` at the same later point would wait for that work too. Elsewhere
    (CPU tensors, other devices) the values are copied at construction.

    Args:
        tensor: The values to read, as they are at this point of the stream.
    """

    __slots__ = ("_host", "_event")

    def __init__(self, tensor: torch.Tensor):
        self._event: Any = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))
        else:
            self._host = tensor.detach().to("cpu", copy=True)

    def wait(self) -> torch.Tensor:
        """The values, as a CPU tensor (the same one at every call)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order: ``dist.all_gather_object`` without
    its dependency on numpy (which torch does not require). Two all-gathers: sizes, then the
    padded payloads. Only for data the ranks of one job produced themselves: it unpickles."""
    device = collective_device(group)
    world = dist.get_world_size(group)
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    SENT["all_gather_objects"] += 8 + len(payload)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(sizes, size, group)
    sizes_host = sizes.tolist()
    width = max(sizes_host)
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
    all_gather_flat(gathered, mine.to(device), group)
    host = gathered.cpu()
    base = host.data_ptr()
    return [pickle.loads(ctypes.string_at(base + r * width, n)) for r, n in enumerate(sizes_host)]


def all_to_all_objects(objs: Sequence[Any], group: dist.ProcessGroup | None = None) -> list[Any]:
    """Send ``objs[r]`` (picklable) to rank ``r`` of a host-side group (``host_group_of``) and
    return what each rank sent this one, in group-rank order: two all-to-alls on the host (one
    int64 per peer, then the pickles). Only for data the ranks of one job produced themselves:
    it unpickles."""
    rank = dist.get_rank(group)
    blobs = [
        b"" if r == rank else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
        for r, o in enumerate(objs)
    ]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)
    recv_sizes = got.tolist()
    send = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if any(blobs) else None
    send = send if send is not None else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, recv_sizes, [len(b) for b in blobs], group=group)
    base, out, at = recv.data_ptr(), [], 0
    for r, n in enumerate(recv_sizes):
        out.append(None if r == rank else pickle.loads(ctypes.string_at(base + at, n)))
        at += n
    return out


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The elementwise maximum of ``values`` (a small host tensor) over the group, on the host:
    one all-reduce of ``values.numel()`` elements, whatever the world size."""
    device = collective_device(group)
    buf = values.to(device, copy=True)
    SENT["all_reduce_max"] += buf.numel() * buf.element_size()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf.cpu()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None):
    """Every rank's ``inp`` into ``out`` (``world * inp.numel()`` elements, in group-rank order):
    ONE all-gather of flat tensors."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)
