"""Local grad shards grouped by what the stats reduction needs to know about them.

A *bucket key* is ``(device, dtype, replication, canonical)``: grads of one key share one
multi-tensor kernel call and one row of the rank's contribution. ``layout_of`` validates a grad
once per DTensorSpec object (FSDP2 hands every grad of a param the param's spec), so steady steps
pay one dict lookup per grad.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._placement import LayoutInfo, layout_info, mesh_ranks_outside_group, require_dtensor

__all__ = ["BucketKey", "Buckets", "bucket_local_shards", "layout_of"]

BucketKey = tuple[torch.device, torch.dtype, int, bool]
Buckets = dict[BucketKey, list[torch.Tensor]]


def bucket_local_shards(grads: Iterable[DTensor], group: dist.ProcessGroup | None) -> Buckets:
    """Validate ``grads`` and group their local shards by bucket key (empty shards included:
    they add nothing to any statistic)."""
    buckets: Buckets = defaultdict(list)
    for i, grad in enumerate(grads):
        info = layout_of(grad, i, group)
        local = grad._local_tensor
        buckets[(local.device, local.dtype, info.replication, info.canonical)].append(local)
    return buckets


def layout_of(grad: DTensor, index: int, group: dist.ProcessGroup | None) -> LayoutInfo:
    """Replication and canonical flag of ``grad`` (``grads[index]`` in messages), validated
    against ``group``; cached per DTensorSpec object."""
    spec = getattr(grad, "_spec", None)
    key = (id(spec), id(group))
    hit = _LAYOUT_BY_SPEC.get(key)
    if hit is None or hit[0] is not spec:
        hit = (spec, _checked_layout(grad, f"grads[{index}]", group))
        if len(_LAYOUT_BY_SPEC) >= _LAYOUT_CACHE_SIZE:
            _LAYOUT_BY_SPEC.clear()
        _LAYOUT_BY_SPEC[key] = hit
    return hit[1]


# (id(DTensorSpec), id(group)) -> (the spec, kept alive so its id stays unique; its layout)
_LAYOUT_BY_SPEC: dict[tuple[int, int], tuple[object, LayoutInfo]] = {}
_LAYOUT_CACHE_SIZE = 1 << 14


def _checked_layout(grad: object, what: str, group: dist.ProcessGroup | None) -> LayoutInfo:
    """Validate one grad's type, placements and mesh against ``group``; return its layout."""
    dt = require_dtensor(grad, what)
    mesh = dt.device_mesh
    outside = mesh_ranks_outside_group(mesh, group)
    if outside:
        raise ValueError(
            f"{what} lives on mesh {mesh} whose ranks {outside} are not in the grad-stats "
            "group, so their shards would be missed. Use a group that spans every rank "
            "holding grads (default: WORLD)."
        )
    return layout_info(dt)
