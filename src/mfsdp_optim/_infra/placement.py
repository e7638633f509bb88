"""Placement facts about DTensors: replication, the canonical replica, validation.

Everything here reads a DTensor's spec (mesh and placements) and never its data, so it costs no
device work and no collective. Results are cached per (mesh, placements) pair: a model has a
handful of distinct layouts however many parameters it holds.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "SCALAR_STATE_KEYS",
    "as_stock_value",
    "LayoutInfo",
    "in_layout_of",
    "layout_info",
    "mesh_ranks_outside_group",
    "require_dtensor",
]


class LayoutInfo(NamedTuple):
    """What one rank needs to know to contribute a shard to a global statistic.

    replication: how many ranks hold an identical copy of this rank's local shard, the product of
        ``mesh.size(d)`` over the mesh dims ``d`` whose placement is ``Replicate()``.
    canonical: True on exactly one rank of each set of replicas (the one at coordinate 0 along
        every replicated mesh dim). Integer statistics are counted there alone, so they stay exact.
    """

    replication: int
    canonical: bool


def require_dtensor(tensor: object, what: str) -> DTensor:
    """Return ``tensor`` as a DTensor, or raise a TypeError naming ``what``.

    A plain tensor carries no layout, so no rank could know whether its peers hold copies of it
    or other pieces; guessing would silently miscount. Partial placements are refused too: their
    local values are addends of a pending reduction, not pieces of the global tensor.
    """
    if not isinstance(tensor, DTensor):
        kind = type(tensor).__name__
        raise TypeError(
            f"{what} is a {kind}, expected a DTensor: mfsdp_optim reads each gradient's mesh and "
            "placements to count it exactly once. Wrap it with DTensor.from_local(t, mesh, "
            "placements) or pass the gradients of fully_shard parameters."
        )
    placements = tensor.placements
    if any(p.is_partial() for p in placements):
        raise ValueError(
            f"{what} has a Partial placement {tuple(placements)}: its local values are pending "
            "addends, not pieces of the global tensor. Reduce it first, e.g. "
            "t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in "
            "t.placements])."
        )
    return tensor


def layout_info(tensor: DTensor) -> LayoutInfo:
    """Replication and canonical-replica flag of ``tensor``'s local shard on this rank."""
    return _layout_info(tensor.device_mesh, tuple(tensor.placements))


@functools.lru_cache(maxsize=4096)
def _layout_info(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> LayoutInfo:
    coordinate = mesh.get_coordinate()
    replication = 1
    canonical = True
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            replication *= mesh.size(dim)
            if coordinate is not None and coordinate[dim] != 0:
                canonical = False
    return LayoutInfo(replication, canonical)


def mesh_ranks_outside_group(mesh: DeviceMesh, group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``mesh`` that ``group`` does not contain (empty when it holds them all)."""
    return list(_mesh_ranks_outside_group(mesh, group))


@functools.lru_cache(maxsize=1024)
def _mesh_ranks_outside_group(mesh: DeviceMesh, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        members = set(range(dist.get_world_size()))
    else:
        members = set(dist.get_process_group_ranks(group))
    mesh_ranks = torch.as_tensor(mesh.mesh).flatten().tolist()
    return tuple(sorted(r for r in mesh_ranks if r not in members))


def copy_in_layout(like: DTensor) -> DTensor:
    """A new DTensor with ``like``'s mesh, placements, global shape, stride and dtype whose local
    shard is a clone of ``like``'s (detached). Reuses ``like``'s DTensorSpec through DTensor's
    own constructor: about 6x cheaper than ``DTensor.from_local``, which matters for thousands
    of staging copies (``load_checkpoint``)."""
    return DTensor(like._local_tensor.detach().clone(), like._spec, requires_grad=False)


def in_layout_of(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor with ``like``'s mesh, placements, global shape
    and stride: what ``DTensor.from_local(local, ..., run_check=False, shape=like.shape,
    stride=like.stride())`` returns (a fresh DTensor over a view of ``local``, no copy, no
    check). When ``local`` has ``like``'s dtype, is on the mesh's device type, needs no grad and
    this rank is in the mesh, the DTensor is built on ``like``'s own DTensorSpec (the spec
    ``from_local`` would make): about 10x cheaper, which matters for the thousands of state
    entries a checkpoint's state dict wraps."""
    spec = like._spec
    if (
        local.dtype == like.dtype
        and not local.requires_grad
        and local.device.type == spec.mesh.device_type
        and spec.mesh.get_coordinate() is not None
    ):
        return DTensor(local.view_as(local), spec, requires_grad=False)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


# scalar state of torch's optimizers (step counters, ASGD's eta and mu)
SCALAR_STATE_KEYS = frozenset({"step", "eta", "mu"})


def as_stock_value(key: str, value: object, param: DTensor, local: torch.Tensor) -> object:
    """``value``, a state entry created on ``local`` (``param``'s local shard), as stock torch
    would hold it for ``param``."""
    if (
        isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == local.shape
        and (local.dim() > 0 or key not in SCALAR_STATE_KEYS)
    ):
        return in_layout_of(value, param)
    return value
