"""The stats layer: exact global gradient norms, zero counts and non-finite flags over DTensors.

Every function here takes gradients as DTensors, each on its own mesh (dense grads on the whole
world, expert grads on an expert-data-parallel stripe, TP+FSDP grads on a 2-D mesh, ...), and
answers a question about the *global* tensors with ONE collective over the grad-stats group.

How a rank contributes, worked on a 2x2 mesh ``("dp_rep", "dp_shard")`` with placements
``(Replicate(), Shard(0))`` and a global grad ``g = [3, 4, 0, 12]``:

=====  ==========  ============  =========================  ===================
rank   coordinate  local shard   ``||local||_2 ** 2 / 2``   zeros (canonical)
=====  ==========  ============  =========================  ===================
0      (0, 0)      [3, 4]        12.5                       0
1      (0, 1)      [0, 12]       72                         1
2      (1, 0)      [3, 4]        12.5                       (replica: 0)
3      (1, 1)      [0, 12]       72                         (replica: 0)
=====  ==========  ============  =========================  ===================

The all-reduce(SUM) over the group gives 169 = 9 + 16 + 0 + 144, so the norm is 13 on every rank,
and one zero. ``Shard`` and ``_StridedShard`` dims hold disjoint pieces (factor 1); ``Replicate``
dims hold copies (divide by their size); ``Partial`` is refused.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _fused
from ._comm import _all_gather_flat, collective_device
from ._placement import LayoutInfo, layout_info, mesh_ranks_outside_group, require_dtensor
from ._stats_math import (
    NONFINITE_SLOT,
    NORM_SLOT,
    ZEROS_SLOT,
    check_norm_type,
    combine_contributions,
    empty_contribution,
    finish_norm,
    shard_contribution,
)

__all__ = [
    "GradStats",
    "count_replication",
    "get_grad_norm",
    "count_zeros",
    "grad_stats",
    "clip_grads_with_norm_",
]

_MAX_NORM_EPS = 1e-6
_FAILED_SLOT = 3  # appended to the contribution: how many ranks refused their input


class GradStats(NamedTuple):
    """Global gradient statistics, equal on every rank of the grad-stats group.

    total_norm: 0-d float32, the norm of the concatenation of the global tensors.
    num_zeros: 0-d int64, zero elements of the global tensors, each counted once (None when not
        asked for).
    found_inf: 0-d bool, True on every rank when any element of any local shard on any rank,
        replicas included, is NaN or inf.
    """

    total_norm: torch.Tensor
    num_zeros: torch.Tensor | None
    found_inf: torch.Tensor


def count_replication(tensor: DTensor) -> int:
    """How many ranks hold an identical copy of ``tensor``'s local shard.

    The product of ``mesh.size(d)`` over the mesh dims ``d`` whose placement is ``Replicate()``;
    ``Shard`` and ``_StridedShard`` dims hold disjoint pieces and count 1. On a 2x2 mesh with
    placements ``(Replicate(), Shard(0))`` it is 2. Plain tensors raise TypeError, ``Partial``
    placements ValueError.
    """
    return layout_info(require_dtensor(tensor, "tensor")).replication


def grad_stats(
    grads: Iterable[DTensor],
    *,
    norm_type: float = 2.0,
    count_zeros: bool = False,
    group: dist.ProcessGroup | None = None,
) -> GradStats:
    """Global norm, zero count and non-finite flag of ``grads``, from ONE collective.

    Placements: Replicate, Shard and _StridedShard on any mesh, any mix of meshes, uneven and
    empty local shards. Each rank contributes, per local shard, ``||shard||_p ** p`` divided by
    the shard's replication (for ``p = inf``: its ``max|x|``), its zero count if it is the shard's
    canonical replica, and whether the shard holds a NaN or an inf. One all-reduce(SUM) over
    ``group`` (default: WORLD) combines them; for ``p = inf`` one all-gather, since the maximum
    and the sums travel together. Every rank of ``group`` must call, a rank without grads with an
    empty iterable. Local work is grouped by (device, dtype, layout) and runs as multi-tensor
    kernels (a fused Triton kernel on CUDA when available); accumulation is float64. Nothing here
    synchronises with the host except moving a contribution between devices when the grads and
    the group's backend live on different ones.

    Bad input (a plain tensor, a ``Partial`` placement, a mesh with ranks outside ``group``) is
    refused on the rank that holds it with TypeError/ValueError, but only after that rank has
    joined the collective: no rank is left waiting, and every other rank sees a NaN norm and
    ``found_inf=True`` rather than a silently wrong value.

    Returns :class:`GradStats` with tensors on the group's collective device.
    """
    return reduce_buckets(
        lambda: _bucket_local_shards(grads, group),
        norm_type=norm_type,
        count_zeros=count_zeros,
        group=group,
    )


def reduce_buckets(
    bucketer: Callable[[], dict[BucketKey, list[torch.Tensor]]],
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
) -> GradStats:
    """The body of :func:`grad_stats` for callers that bucket local shards themselves.

    ``bucketer()`` returns local shards grouped by ``(device, dtype, replication, canonical)``
    (see :func:`layout_of`); it is called inside the bad-input protocol, so a TypeError or
    ValueError it raises still lets this rank join the collective before re-raising. The
    wrapper uses this to bucket grads in the loop over params it runs anyway.
    """
    p = check_norm_type(norm_type)
    _require_member(group)
    device = collective_device(group)
    try:
        local = _local_contribution(bucketer(), p, count_zeros, device)
        local = torch.nn.functional.pad(local, (0, 1))  # the failed-ranks slot: 0
        failure: Exception | None = None
    except (TypeError, ValueError) as exc:
        # Still join the collective, so the other ranks do not hang waiting for this one; they
        # see a NaN norm and found_inf, and this rank raises once the collective is done.
        local = torch.zeros(_FAILED_SLOT + 1, dtype=torch.float64, device=device)
        local[_FAILED_SLOT] = 1.0
        failure = exc
    total = _all_combine(local, p, group)
    if failure is not None:
        raise failure
    failed = total[_FAILED_SLOT] > 0
    norm = finish_norm(total[NORM_SLOT], p)
    num_zeros = total[ZEROS_SLOT].round().to(torch.int64) if count_zeros else None
    return GradStats(
        total_norm=torch.where(failed, torch.nan, norm),
        num_zeros=num_zeros,
        found_inf=(total[NONFINITE_SLOT] > 0) | failed,
    )


def get_grad_norm(
    grads: Iterable[DTensor],
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of the concatenated global tensors: a 0-d float32 tensor, equal on
    every rank of ``group``. Same placements, contributions and single collective as
    :func:`grad_stats`; 0 when every rank passes nothing."""
    return grad_stats(grads, norm_type=norm_type, group=group).total_norm


def count_zeros(
    grads: Iterable[DTensor], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Zero elements of the global tensors, each counted once: a 0-d int64 tensor, equal on every
    rank of ``group``. Each rank counts the zeros of the shards it is the canonical replica of
    (coordinate 0 along every replicated mesh dim); one all-reduce(SUM) adds them. Exact up to
    2**53 elements."""
    stats = grad_stats(grads, count_zeros=True, group=group)
    assert stats.num_zeros is not None
    return stats.num_zeros


def clip_grads_with_norm_(
    grads: Iterable[DTensor], max_norm: float, total_norm: torch.Tensor
) -> None:
    """Scale every grad in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    Works on the local shards of any mix of meshes (scaling commutes with any placement), with
    one multi-tensor multiply per (device, dtype) and no host synchronisation: the coefficient
    stays a tensor. ``total_norm`` is typically :func:`get_grad_norm`'s result.
    """
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(
        list
    )
    for i, grad in enumerate(grads):
        local = require_dtensor(grad, f"grads[{i}]")._local_tensor
        by_device_dtype[(local.device, local.dtype)].append(local)
    scale_locals_by_clip_coef_(by_device_dtype, max_norm, total_norm)


def scale_locals_by_clip_coef_(
    groups: dict, max_norm: float, total_norm: torch.Tensor
) -> None:
    """Multiply local tensors, grouped by keys that start with their device, by
    ``min(1, max_norm / (total_norm + 1e-6))``: one multi-tensor multiply per group, the
    coefficient kept on device. Shared by :func:`clip_grads_with_norm_` and the wrapper."""
    if not groups:
        return
    coef = (max_norm / (total_norm.to(torch.float32) + _MAX_NORM_EPS)).clamp(max=1.0)
    for (device, *_), tensors in groups.items():
        # the float32 coefficient multiplies in float32 math: a tiny coefficient cast to fp16
        # first would lose its precision (or flush to zero)
        torch._foreach_mul_(tensors, coef.to(device=device, non_blocking=True))


def clip_grad_divisor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``max(1, (total_norm + 1e-6) / max_norm)`` as a 0-d float32 tensor on ``total_norm``'s
    device: the clip as a divisor, for fused optimizers that take it as their ``grad_scale``
    (they divide each grad by it inside the update and store the result back into the grad)."""
    return ((total_norm.to(torch.float32) + _MAX_NORM_EPS) / max_norm).clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# internals


BucketKey = tuple[torch.device, torch.dtype, int, bool]


def _bucket_local_shards(
    grads: Iterable[DTensor], group: dist.ProcessGroup | None
) -> dict[BucketKey, list[torch.Tensor]]:
    """Validate ``grads`` and group their local shards by (device, dtype, layout)."""
    buckets: dict[BucketKey, list[torch.Tensor]] = defaultdict(list)
    for i, grad in enumerate(grads):
        info = layout_of(grad, i, group)
        local = grad._local_tensor  # empty shards add nothing; both paths skip them
        buckets[(local.device, local.dtype, info.replication, info.canonical)].append(local)
    return buckets


def layout_of(grad: DTensor, index: int, group: dist.ProcessGroup | None) -> LayoutInfo:
    """Replication and canonical flag of ``grad`` (``grads[index]`` in messages), validated.

    This runs once per gradient every step, so it does the least it can: layouts are validated
    once per DTensorSpec object (FSDP2 gives every grad of a param the param's spec, so after the
    first step every lookup hits).
    """
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


def _require_member(group: dist.ProcessGroup | None) -> None:
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the grad-stats group but called a stats function; "
            "only the group's ranks take part. Pass a group that holds every rank with grads."
        )


def _local_contribution(
    buckets: dict[BucketKey, list[torch.Tensor]],
    norm_type: float,
    count_zeros: bool,
    device: torch.device,
) -> torch.Tensor:
    rows = [
        _bucket_contribution(tensors, norm_type, replication, canonical, count_zeros)
        for (_, _, replication, canonical), tensors in buckets.items()
    ]
    if len(rows) == 1:  # the common case, every grad in one layout: nothing to combine
        return rows[0].to(device, non_blocking=True)
    rows = [row.to(device, non_blocking=True) for row in rows]
    rows.append(empty_contribution(device))
    return combine_contributions(torch.stack(rows), norm_type)


def _bucket_contribution(
    tensors: list[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
) -> torch.Tensor:
    """One bucket's contribution: the fused kernel where it applies, else multi-tensor torch."""
    row = _fused.shard_contribution(
        tensors,
        norm_type=norm_type,
        replication=replication,
        canonical=canonical,
        count_zeros=count_zeros,
    )
    if row is not None:
        return row
    return shard_contribution(
        tensors,
        norm_type=norm_type,
        replication=replication,
        canonical=canonical,
        count_zeros=count_zeros,
    )


def _all_combine(
    local: torch.Tensor, norm_type: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Combine every rank's contribution with one collective."""
    if not math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        return local
    gathered = local.new_empty(dist.get_world_size(group) * local.numel())
    _all_gather_flat(gathered, local, group)
    return combine_contributions(gathered.view(-1, local.numel()), norm_type)
