"""The stats layer: global grad norm, zero count and non-finite flag over DTensor grads.

Map: ``_api`` the public functions; ``_buckets`` local shards grouped by layout; ``_math`` the
pure per-rank contribution; ``_cpu`` and ``_fused`` its CPU and Triton kernels; ``_reduce`` the
one collective and its verdict; ``_clip`` the clip coefficient; ``_layout_check`` params whose
copies would be counted twice; ``seam`` the interface the wrapper layer uses (in-package, not
public API: ``from ..stats.seam import ...``; this package exports public names only). Layers it
may import: ``_infra``.
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
