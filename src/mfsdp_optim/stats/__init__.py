"""The stats layer: global grad norm, zero count and non-finite flag over DTensor grads.

Map: ``_api`` the public functions; ``_buckets`` local shards grouped by layout; ``_math`` the
pure per-rank contribution; ``_cpu`` and ``_fused`` its CPU and Triton kernels; ``_reduce`` the
one collective and its verdict; ``_clip`` the clip coefficient; ``_layout_check`` params whose
copies would be counted twice; ``_seam`` the interface the wrapper layer uses (re-exported here,
not public API: not in ``__all__``). Layers it may import: ``_infra``.
"""

from ._api import (
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

# the wrapper layer's interface (``_seam``): in-package, not public API
from ._seam import (  # noqa: F401
    AGREED_WIDTH,
    PRESENCE_PRIME,
    AgreedValuesError,
    BucketKey,
    Buckets,
    GradPresenceError,
    Parts,
    SegmentStats,
    capture_keepalive,
    check_max_norm,
    check_norm_type,
    clip_divisor,
    layout_of,
    packed_values,
    reduce_segments,
    reduce_segments_deferred,
    reduce_segments_read,
    scale_by_clip_coef_,
    segment_norm,
    segment_stats_of,
)

__all__ = [
    "DuplicatedParam",
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
