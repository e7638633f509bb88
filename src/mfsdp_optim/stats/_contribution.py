"""One rank's contribution to the grad statistics, over its grads in segments of buckets.

Per bucket (``_buckets``) the fused kernel (``_fused``) where it applies, else multi-tensor
torch (``_math``; on CPU ``_cpu``); the buckets of a segment combined on the collective's device
(``_math.combine_contributions``) and, over several segments, the total followed by each
segment's norm slot. No collective: ``_reduce`` puts the result in the row it gathers.
"""

from __future__ import annotations

from typing import Any

import torch

from .._infra import comm
from . import _fused
from ._buckets import Buckets
from ._math import NORM_SLOT, combine_contributions, empty_contribution, shard_contribution

__all__ = ["local_contribution"]


def local_contribution(
    parts: list[Buckets],
    norm_type: float,
    count_zeros: bool,
    device: torch.device,
    host_reads: bool = False,
) -> torch.Tensor:
    """This rank's contribution over every segment of ``parts`` (one ``Buckets`` per segment) on
    ``device``, followed by each segment's norm slot when there are several segments.
    ``host_reads``: the CPU path may read its own CPU flags (see ``stats._cpu``)."""
    if len(parts) == 1:
        return _segment_contribution(parts[0], norm_type, count_zeros, device, host_reads)
    rows = torch.stack(
        [_segment_contribution(b, norm_type, count_zeros, device, host_reads) for b in parts]
    )
    return torch.cat([combine_contributions(rows, norm_type), rows[:, NORM_SLOT]])


def _segment_contribution(
    buckets: Buckets,
    norm_type: float,
    count_zeros: bool,
    device: torch.device,
    host_reads: bool = False,
) -> torch.Tensor:
    rows = [
        _bucket_contribution(tensors, norm_type, replication, canonical, count_zeros, host_reads)
        for (_, _, replication, canonical), tensors in buckets.items()
    ]
    if not rows:
        return empty_contribution(device)
    if len(rows) == 1:  # the common case, every grad in one layout: nothing to combine
        return comm.to_collective(rows[0], device)
    rows = [comm.to_collective(row, device) for row in rows]
    return combine_contributions(torch.stack(rows), norm_type)


def _bucket_contribution(
    tensors: list[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
    host_reads: bool = False,
) -> torch.Tensor:
    """One bucket's contribution: the fused kernel where it applies, else multi-tensor torch
    (on CPU: ``stats._cpu``, which may read its CPU flags when ``host_reads``)."""
    kwargs: dict[str, Any] = dict(
        norm_type=norm_type, replication=replication, canonical=canonical, count_zeros=count_zeros
    )
    row = _fused.shard_contribution(tensors, **kwargs)
    if row is not None:
        return row
    return shard_contribution(tensors, host_reads=host_reads, **kwargs)
