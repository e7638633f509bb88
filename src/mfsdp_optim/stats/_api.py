"""The stats layer: exact global gradient norms, zero counts and non-finite flags over DTensors.

Map: ``grad_stats`` (norm, zeros and the non-finite flag as ``GradStats``), ``get_grad_norm``,
``count_zeros``, ``clip_grads_with_norm_`` and ``count_replication``; ``RankFailedError`` and
``StatsArgumentMismatchError`` what a refused input raises (``GradPresenceError``: the wrapper's
grads present on some ranks of a mesh only). Grads are DTensors, each on its own
mesh; every function answers about the *global* tensors with ONE collective over the grad-stats
group, which every rank of it calls. How a rank contributes, worked on a 2x2 mesh:
docs/concepts.md, "Replication".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra.grouping import by_device_dtype
from .._infra.placement import layout_info, require_dtensor
from ._buckets import bucket_local_shards
from ._clip import check_max_norm, scale_by_clip_coef_
from ._reduce import (
    GradPresenceError,
    GradStats,
    RankFailedError,
    StatsArgumentMismatchError,
    reduce_grads,
)

__all__ = [
    "GradPresenceError",
    "GradStats",
    "RankFailedError",
    "StatsArgumentMismatchError",
    "count_replication",
    "get_grad_norm",
    "count_zeros",
    "grad_stats",
    "clip_grads_with_norm_",
]


def count_replication(tensor: DTensor) -> int:
    """How many ranks hold an identical copy of ``tensor``'s local shard.

    The product of ``mesh.size(d)`` over the mesh dims ``d`` whose placement is ``Replicate()``;
    ``Shard`` and ``_StridedShard`` dims hold disjoint pieces and count 1. On a 2x2 mesh with
    placements ``(Replicate(), Shard(0))`` it is 2. Plain tensors raise TypeError, ``Partial``
    placements ValueError.

    Args:
        tensor: A DTensor.

    Returns:
        The number of ranks holding a copy of each of its local shards.

    Raises:
        TypeError: `tensor` is a plain tensor.
        ValueError: One of its placements is `Partial`.
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
    canonical replica, and whether the shard holds a NaN or an inf. ONE all-gather over ``group``
    (default: WORLD) of a fixed-size float64 row per rank (the three numbers, a failure flag,
    ``norm_type``, ``count_zeros``) carries them; every rank combines the rows in rank order (a
    sum, a max for ``p = inf``), so the result is bitwise equal on every rank. Every rank of
    ``group`` must call, a rank without grads with an empty iterable, all with the same
    ``norm_type`` and ``count_zeros``. Local work is grouped by (device, dtype, layout) and runs
    as multi-tensor kernels (a fused Triton kernel on CUDA when available); accumulation is
    float64 (on CPU: float32 partial sums of at most 256 elements added in float64, a grad whose
    float32 result lost range recomputed in float64; see Concepts). The host reads back the 4
    agreement numbers per rank (on CUDA: one small device-to-host copy after the collective).

    Failures never leave a rank waiting, and no rank gets a number when any rank failed. A rank
    whose input or arguments are refused (a plain tensor: TypeError; a ``Partial`` placement or a
    mesh with ranks outside ``group``: ValueError; a bad ``norm_type``; anything its grads raise,
    e.g. an int64 or meta-device grad, or an iterable that raises) still joins the collective and
    then raises its own exception; every other rank raises ``RankFailedError`` naming the
    failing rank and its error, within the time of two small collectives. Ranks that pass
    different ``norm_type`` or ``count_zeros`` all raise ``StatsArgumentMismatchError``
    (a ValueError) naming which rank passed what.

    Args:
        grads: The gradients, as DTensors on any mix of meshes; an empty iterable on a rank
            that holds none.
        norm_type: The norm's `p` (any `p > 0`, or `inf`); the same on every rank.
        count_zeros: Also count the zero elements (`num_zeros`); the same on every rank.
        group: The grad-stats group (default: WORLD); it must hold every rank that holds a
            piece of any grad.

    Returns:
        A [GradStats][mfsdp_optim.stats._api.GradStats] with tensors on the group's collective
            device, bitwise equal on every rank.

    Raises:
        TypeError: On the rank that passed a plain tensor.
        ValueError: On the rank that passed a `Partial` placement, a mesh with ranks outside
            `group` or a bad `norm_type`.
        RankFailedError: On every other rank when some rank failed, naming it and its error.
        StatsArgumentMismatchError: On every rank when ranks passed different `norm_type`
            or `count_zeros` (a ValueError).
    """
    try:
        buckets = bucket_local_shards(grads, group)
    except Exception as exc:  # any type: joins the collective, then raises
        buckets = exc  # type: ignore[assignment]
    reduced = reduce_grads(
        buckets, read="host", norm_type=norm_type, count_zeros=count_zeros, group=group
    )
    return reduced.seg.stats


def get_grad_norm(
    grads: Iterable[DTensor],
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of the concatenated global tensors, equal on every rank of ``group``.

    Same placements, contributions, single collective and failure behaviour as
    [grad_stats()][mfsdp_optim.stats._api.grad_stats].

    Args:
        grads: The gradients, as DTensors on any mix of meshes.
        norm_type: The norm's `p` (any `p > 0`, or `inf`).
        group: The grad-stats group (default: WORLD).

    Returns:
        A 0-d float32 tensor; 0 when every rank passes nothing.
    """
    return grad_stats(grads, norm_type=norm_type, group=group).total_norm


def count_zeros(grads: Iterable[DTensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Zero elements of the global tensors, each counted once, equal on every rank of ``group``.

    Each rank counts the zeros of the shards it is the canonical replica of (coordinate 0 along
    every replicated mesh dim); the one collective of
    [grad_stats()][mfsdp_optim.stats._api.grad_stats] adds them. Exact up to 2**53 elements.

    Args:
        grads: The gradients, as DTensors on any mix of meshes.
        group: The grad-stats group (default: WORLD).

    Returns:
        A 0-d int64 tensor.
    """
    stats = grad_stats(grads, count_zeros=True, group=group)
    assert stats.num_zeros is not None
    return stats.num_zeros


def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale every parameter's ``.grad`` in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    torch's ``clip_grads_with_norm_`` convention: parameters without a grad are skipped, and the
    parameters' values are never touched. Grads may be DTensors on any mix of meshes (scaling
    commutes with every placement: each rank scales its local shard) or plain tensors. One
    multi-tensor multiply per (device, dtype) and no host synchronisation: the coefficient stays
    a tensor.

    Args:
        parameters: A tensor or an iterable of them (``model.parameters()``).
        max_norm: The norm to clip to.
        total_norm: The global norm of the grads, typically
            [get_grad_norm()][mfsdp_optim.stats._api.get_grad_norm]'s result.
        foreach: Accepted for torch parity (the multiply is always multi-tensor).
    """
    max_norm = check_max_norm(max_norm)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups = by_device_dtype(p.grad for p in parameters)
    scale_by_clip_coef_(groups, max_norm, total_norm)
