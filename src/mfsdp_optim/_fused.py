"""Optional fused kernels for the stats layer (CUDA + Triton).

``shard_contribution`` has the contract of :func:`mfsdp_optim._stats_math.shard_contribution`
and returns None when no fused kernel applies (CPU tensors, Triton missing), in which case the
caller falls back to the pure-torch multi-tensor path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["shard_contribution"]


def shard_contribution(
    tensors: Sequence[torch.Tensor],
    *,
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
) -> torch.Tensor | None:
    return None
