"""One rank's contribution to the grad statistics, and the one collective that combines them.

``reduce_buckets`` takes the rank's bucketed local shards, or the exception that bucketing
raised on this rank: a rank whose input was bad still joins the collective (so no peer waits
for it) and raises afterwards, while its peers see a NaN norm and ``found_inf``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _fused
from ._buckets import Buckets
from ._comm import _all_gather_flat, collective_device
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

__all__ = ["GradStats", "reduce_buckets", "require_member"]

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


def reduce_buckets(
    buckets: Buckets | Exception,
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
) -> GradStats:
    """The global statistics of every rank's ``buckets`` (see ``_buckets``), one collective.

    ``buckets`` may be the TypeError/ValueError this rank's bucketing raised: the rank then
    contributes a failure flag, and re-raises once the collective is done.
    """
    p = check_norm_type(norm_type)
    require_member(group)
    device = collective_device(group)
    failure = buckets if isinstance(buckets, Exception) else None
    if failure is None:
        try:
            local = _local_contribution(buckets, p, count_zeros, device)  # type: ignore[arg-type]
            local = torch.nn.functional.pad(local, (0, 1))  # the failed-ranks slot: 0
        except (TypeError, ValueError) as exc:
            failure = exc
    if failure is not None:
        local = torch.zeros(_FAILED_SLOT + 1, dtype=torch.float64, device=device)
        local[_FAILED_SLOT] = 1.0
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


def require_member(group: dist.ProcessGroup | None) -> None:
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the grad-stats group but called a stats function; "
            "only the group's ranks take part. Pass a group that holds every rank with grads."
        )


def _local_contribution(
    buckets: Buckets, norm_type: float, count_zeros: bool, device: torch.device
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
    kwargs: dict[str, Any] = dict(norm_type=norm_type, replication=replication, canonical=canonical,
                  count_zeros=count_zeros)
    row = _fused.shard_contribution(tensors, **kwargs)
    return row if row is not None else shard_contribution(tensors, **kwargs)


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
