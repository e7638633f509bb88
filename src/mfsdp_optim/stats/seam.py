"""The stats layer's interface to the wrapper (``mfsdp_optim.optim``): in-package, not public API.

The wrapper reaches the stats layer through this module only (``from ..stats.seam import ...``),
never through a private module; ``tests/infra/test_layers.py`` checks that. What it gets:

- bucketing: ``Buckets``/``BucketKey`` (local shards grouped by device, dtype and layout) and
  ``layout_of`` (a grad's validated layout, cached per spec);
- the one collective over grads in *segments* (one per base optimizer): ``reduce_grads``, its
  ``read`` (``Read``) the verdict's place: ``"host"`` (verdict and values read at once),
  ``"device"`` (nothing read) or ``"deferred"`` (the host read postponed until the caller's
  gated work is enqueued); it gives a ``Reduced`` whose ``SegmentStats`` holds the totals and
  every segment's norm from the same row; ``segment_norm`` the norm over several segments;
  ``segment_stats_of`` the same from DTensor grads (bucketing included); ``packed_values`` the
  host layout;
- the grad-presence check: ``PRESENCE_PRIME`` (the sums' modulus) and ``GradPresenceError``;
- the agreed values a caller carries in the row (``agreed=``, ``AGREED_WIDTH`` float64 values
  that must be equal on every rank) and ``AgreedValuesError`` when they differ;
- clipping: ``check_max_norm``, ``clip_divisor``, ``scale_by_clip_coef_``; ``check_norm_type``;
- the captured step: ``capture_keepalive`` (the device buffers a captured graph reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra.caches import kept_alive
from ._buckets import BucketKey, Buckets, bucket_local_shards, layout_of
from ._clip import check_max_norm, clip_divisor, scale_by_clip_coef_
from ._math import check_norm_type
from ._reduce import (
    AGREED_WIDTH,
    PRESENCE_PRIME,
    AgreedValuesError,
    GradPresenceError,
    GradStats,
    Parts,
    Read,
    Reduced,
    SegmentStats,
    packed_values,
    reduce_grads,
    segment_norm,
)

__all__ = [
    "AGREED_WIDTH",
    "PRESENCE_PRIME",
    "AgreedValuesError",
    "BucketKey",
    "Buckets",
    "GradPresenceError",
    "GradStats",
    "Parts",
    "Read",
    "Reduced",
    "SegmentStats",
    "capture_keepalive",
    "check_max_norm",
    "check_norm_type",
    "clip_divisor",
    "layout_of",
    "packed_values",
    "reduce_grads",
    "scale_by_clip_coef_",
    "segment_norm",
    "segment_stats_of",
]


def segment_stats_of(
    grads: Sequence[Sequence[DTensor]],
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
) -> SegmentStats:
    """The statistics of DTensor ``grads`` given per segment (one list per base optimizer), ONE
    collective: what ``grad_stats`` does, with each segment's norm from the same row."""
    parts: Parts
    try:
        parts = [bucket_local_shards(g, group) for g in grads]
    except Exception as exc:  # any type: joins the collective, so no rank waits, then raises
        parts = exc
    reduced = reduce_grads(
        parts,
        segments=len(grads),
        read="host" if host_sync else "device",
        norm_type=norm_type,
        count_zeros=count_zeros,
        group=group,
    )
    return reduced.seg


def capture_keepalive() -> list[object]:
    """The stats layer's cached device buffers that a captured CUDA graph reads (the fused
    kernel's argument tables and workspaces, the verdict slots, the constant slots of the row,
    each cache's values as a list): a capture holds them so that no replay reads memory a cache
    dropped. Their owners give these caches to ``_infra.caches.keep_alive``."""
    return list(kept_alive())
