"""The stats layer: global grad norm, zero count and non-finite flag over DTensor grads.

Map: ``_api`` the public functions; ``_buckets`` local shards grouped by layout; ``_math`` the
pure per-rank contribution; ``_cpu`` and ``_fused`` its CPU and Triton kernels;
``_contribution`` a rank's contribution over its segments of buckets; ``_reduce`` the one
collective (``reduce_grads``), its verdict and results; ``_clip`` the clip coefficient;
``_layout_check`` params whose copies would be counted twice. Two in-package interfaces, not
public API: ``seam`` the one the wrapper layer uses (``from ..stats.seam import ...``) and
``kernels`` a rank's local work taken apart for the benchmarks (bucketing, the contribution, the
fused kernel's launch and tuning knobs). This package exports public names only. Layers it may
import: ``_infra``.
"""

from ._api import (
    GradPresenceError,
    GradStats,
    RankFailedError,
    StatsArgumentMismatchError,
    clip_grads_with_norm_,
    count_replication,
    count_zeros,
    get_grad_norm,
    grad_stats,
)
from ._layout_check import DuplicatedParam, check_layout

__all__ = [
    "DuplicatedParam",
    "GradPresenceError",
    "GradStats",
    "RankFailedError",
    "StatsArgumentMismatchError",
    "check_layout",
    "clip_grads_with_norm_",
    "count_replication",
    "count_zeros",
    "get_grad_norm",
    "grad_stats",
]
