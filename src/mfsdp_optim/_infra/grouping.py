"""The one grouping of tensors by ``(device, dtype)``: what every multi-tensor kernel call needs.

``by_device_dtype`` takes tensors or DTensors (grouped by their local shards) and keeps each
group in input order; ``None`` entries are skipped. Every layer that batches local tensors
(the stats layer's clip, the wrapper's unscale, restore and ``zero_grad``) groups through it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["by_device", "by_device_dtype", "local_of", "pairs_by_device_dtype"]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def by_device_dtype(
    tensors: Iterable[torch.Tensor | None],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Local tensors of ``tensors`` grouped by ``(device, dtype)``, in input order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is None:
            continue
        local = local_of(t)
        groups.setdefault((local.device, local.dtype), []).append(local)
    return groups


def pairs_by_device_dtype(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``(destination, source)`` pairs of local tensors grouped by the destination's
    ``(device, dtype)``: two aligned lists per group, for a ``torch._foreach_copy_``."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]
    groups = {}
    for dst, src in pairs:
        d, s = local_of(dst), local_of(src)
        dsts, srcs = groups.setdefault((d.device, d.dtype), ([], []))
        dsts.append(d)
        srcs.append(s)
    return groups


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """Local tensors of ``tensors`` grouped by device, in input order."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        local = local_of(t)
        groups.setdefault(local.device, []).append(local)
    return groups
