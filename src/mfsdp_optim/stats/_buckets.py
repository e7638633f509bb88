"""Local grad shards grouped by what the stats reduction needs to know about them.

A *bucket key* is ``(device, dtype, replication, canonical)``: grads of one key share one
multi-tensor kernel call and one row of the rank's contribution. ``layout_of`` validates a grad
once per DTensorSpec object (FSDP2 hands every grad of a param the param's spec), so steady steps
pay one dict lookup per grad.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra.caches import register
from .._infra.placement import LayoutInfo, layout_info, mesh_ranks_outside_group, require_dtensor

__all__ = ["BucketKey", "Buckets", "bucket_local_shards", "layout_of"]

BucketKey = tuple[torch.device, torch.dtype, int, bool]
Buckets = dict[BucketKey, list[torch.Tensor]]


def bucket_local_shards(grads: Iterable[DTensor], group: dist.ProcessGroup | None) -> Buckets:
    """Validate ``grads`` and group their local shards by bucket key (empty shards included:
    they add nothing to any statistic).

    Steady steps pay a few list-wide passes (spec, local tensor, dtype, device) and one cache
    lookup per grad, no Python loop over the grads when they share one key (the common case:
    FSDP2's grads of one dtype on one device)."""
    grads = grads if type(grads) is list else list(grads)
    if not grads:
        return {}
    parts = _parts_of(grads, group)
    locals_ = [g._local_tensor for g in grads]
    dtypes = [t.dtype for t in locals_]
    devices = [t.device for t in locals_]
    n = len(grads)
    part, dtype, device = parts[0], dtypes[0], devices[0]
    if parts.count(part) == n and dtypes.count(dtype) == n and devices.count(device) == n:
        return {(device, dtype, *part): locals_}
    buckets: Buckets = {}
    for local, dev, dt, (replication, canonical) in zip(
        locals_, devices, dtypes, parts, strict=True
    ):
        buckets.setdefault((dev, dt, replication, canonical), []).append(local)
    return buckets


def _parts_of(grads: list[DTensor], group: dist.ProcessGroup | None) -> list[tuple[int, bool]]:
    """Each grad's ``(replication, canonical)``, validated against ``group`` (raises naming
    ``grads[i]``); the same tuple object for equal layouts, from ``layout_of``'s cache."""
    try:
        specs = list(map(_spec_of, grads))
    except AttributeError:  # not all DTensors: layout_of names the first that is not
        specs = [getattr(g, "_spec", None) for g in grads]
    last = _LAST_PARTS.get(id(group))
    if last is not None and len(last[0]) == len(specs) and all(map(operator.is_, specs, last[0])):
        return last[1]  # the same spec objects as the last call: validated, same parts
    parts = _looked_up_parts(grads, specs, group)
    _LAST_PARTS.clear()  # one list per process: the last call's (no spec is kept longer)
    _LAST_PARTS[id(group)] = (specs, parts)
    return parts


def _looked_up_parts(
    grads: list[DTensor], specs: list[object], group: dist.ProcessGroup | None
) -> list[tuple[int, bool]]:
    """``_parts_of`` from ``layout_of``'s cache, validating the specs it does not hold."""
    cache = _LAYOUT_BY_SPEC.get(id(group), {})
    hits = list(map(cache.get, map(id, specs)))
    if None in hits:
        for i, hit in enumerate(hits):
            if hit is None:
                layout_of(grads[i], i, group)
                hits[i] = _LAYOUT_BY_SPEC[id(group)][id(specs[i])]
    return [hit[2] for hit in hits]  # type: ignore[index]


def layout_of(grad: DTensor, index: int, group: dist.ProcessGroup | None) -> LayoutInfo:
    """Replication and canonical flag of ``grad`` (``grads[index]`` in messages), validated
    against ``group``; cached per DTensorSpec object."""
    spec = getattr(grad, "_spec", None)
    cache = _LAYOUT_BY_SPEC.get(id(group))
    hit = None if cache is None else cache.get(id(spec))
    if hit is None:
        info = _checked_layout(grad, f"grads[{index}]", group)
        pair = (info.replication, info.canonical)
        part = _PARTS.setdefault(pair, pair)
        if sum(map(len, _LAYOUT_BY_SPEC.values())) >= _LAYOUT_CACHE_SIZE:
            _LAYOUT_BY_SPEC.clear()
            _LAST_PARTS.clear()
        hit = _LAYOUT_BY_SPEC.setdefault(id(group), {})[id(spec)] = (spec, info, part)
    return hit[1]


_spec_of = operator.attrgetter("_spec")

# id(group) -> id(DTensorSpec) -> (the spec, kept alive so that its id names it alone while it
# is cached; its layout; its (replication, canonical), one shared tuple per distinct pair).
# A spec is validated once per group; ``id(group)`` can name another group only after that
# one is freed, and FSDP2 users keep theirs for the whole job.
_LAYOUT_BY_SPEC: dict[int, dict[int, tuple[object, LayoutInfo, tuple[int, bool]]]] = {}
_PARTS: dict[tuple[int, bool], tuple[int, bool]] = {}
# id(group) -> (the spec list of the last ``_parts_of`` call, its parts), at most one entry:
# a steady caller (the same grads, or FSDP2's new grads of the same params, whose specs are the
# params') then pays one identity pass instead of an id, a lookup and a copy per grad. The specs
# are held, so an identity match names the very objects that were validated.
_LAST_PARTS: dict[int, tuple[list[object], list[tuple[int, bool]]]] = {}
_LAYOUT_CACHE_SIZE = 1 << 14


@register
def _clear() -> None:
    for cache in (_LAYOUT_BY_SPEC, _PARTS, _LAST_PARTS):
        cache.clear()


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
