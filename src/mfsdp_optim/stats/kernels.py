"""One rank's local work in the stats layer, taken apart for the benchmarks (in-package, not
public API: ``benchmarks/bench_stats.py`` and ``benchmarks/bench_agreement.py`` use it).

- bucketing: ``bucket_local_shards`` (local shards grouped by device, dtype and layout);
- this rank's contribution without the collective: ``contribution`` (one segment of buckets,
  on the group's collective device) and ``finish_norm`` (a combined norm slot to the norm);
- the fused Triton kernel (CUDA): ``fused_available``, ``shard_contribution`` (one bucket's
  contribution, or None where the kernel does not apply); one launch taken apart:
  ``load_kernel``, ``launch_plan``, ``launch``; its tuning knobs: ``Tuning``, ``tuning`` and
  ``set_tuning`` (the compile-time shape), ``programs_per_sm`` and ``set_programs_per_sm`` (the
  grid, learned per variant), ``set_table_cache`` (the persistent argument tables on or off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._infra.comm import collective_device
from ._buckets import Buckets, bucket_local_shards
from ._contribution import local_contribution
from ._fused import (
    Tuning,
    fused_available,
    launch,
    launch_plan,
    load_kernel,
    programs_per_sm,
    set_programs_per_sm,
    set_table_cache,
    set_tuning,
    shard_contribution,
    tuning,
)
from ._math import finish_norm

__all__ = [
    "Tuning",
    "bucket_local_shards",
    "contribution",
    "finish_norm",
    "fused_available",
    "launch",
    "launch_plan",
    "load_kernel",
    "programs_per_sm",
    "set_programs_per_sm",
    "set_table_cache",
    "set_tuning",
    "shard_contribution",
    "tuning",
]


def contribution(
    buckets: Buckets, *, norm_type: float, count_zeros: bool, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's contribution over ``buckets`` (one segment) on ``group``'s collective device,
    without the collective: ``[norm_slot, zeros, nonfinite]`` in float64 (``stats._math``)."""
    return local_contribution([buckets], norm_type, count_zeros, collective_device(group))
