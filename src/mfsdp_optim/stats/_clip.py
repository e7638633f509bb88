"""The clip coefficient ``min(1, max_norm / (total_norm + 1e-6))``, kept on the device.

Two ways to apply it: multiply grouped local grads in place (``scale_by_clip_coef_``), or hand
its inverse to a fused optimizer as ``grad_scale`` (``clip_divisor``), which divides inside the
update. Neither reads the norm on the host: an ``if`` on a device value would synchronise.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch

__all__ = ["MAX_NORM_EPS", "check_max_norm", "clip_divisor", "scale_by_clip_coef_"]

MAX_NORM_EPS = 1e-6


def check_max_norm(max_norm: object, what: str = "max_norm") -> float:
    """``max_norm`` as a float > 0 and finite, or a ValueError/TypeError naming ``what``."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"{what} must be a number > 0, got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:  # NaN fails too
        raise ValueError(f"{what} must be > 0, got {max_norm!r}")
    return value


def scale_by_clip_coef_(
    groups: Mapping[tuple, Sequence[torch.Tensor]], max_norm: float, total_norm: torch.Tensor
) -> None:
    """Multiply local tensors, grouped by keys that start with their device, by the clip
    coefficient: one multi-tensor multiply per group (also when the coefficient is 1, which
    would take a host read to know)."""
    if not groups:
        return
    coef = (max_norm / (total_norm.to(torch.float32) + MAX_NORM_EPS)).clamp(max=1.0)
    for (device, *_), tensors in groups.items():
        # the float32 coefficient multiplies in float32 math: a tiny coefficient cast to fp16
        # first would lose its precision (or flush to zero)
        torch._foreach_mul_(list(tensors), coef.to(device=device, non_blocking=True))


def clip_divisor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``max(1, (total_norm + 1e-6) / max_norm)``, 0-d float32 on ``total_norm``'s device: the
    clip as the divisor torch's fused optimizers take as ``grad_scale``."""
    return ((total_norm.to(torch.float32) + MAX_NORM_EPS) / max_norm).clamp(min=1.0)
