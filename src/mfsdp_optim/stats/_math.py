"""The pure core of the stats layer: one rank's contribution and how contributions combine.

Map: a *contribution* is a float64 vector ``[norm_slot, zeros, nonfinite]`` (``NORM_SLOT``,
``ZEROS_SLOT``, ``NONFINITE_SLOT``); ``shard_contribution`` one bucket's, ``combine_contributions``
the sum (a maximum in the first slot for ``p = inf``) over ranks or buckets, ``finish_norm`` the
norm from the first slot, ``check_norm_type`` the argument check. Nothing here touches a process
group (the collective is ``_reduce``; the CPU kernel ``_cpu``). The slots' meaning:
docs/concepts.md, "One rank's contribution".
"""

from __future__ import annotations

import math

import torch

from . import _cpu

__all__ = [
    "NORM_SLOT",
    "ZEROS_SLOT",
    "NONFINITE_SLOT",
    "check_norm_type",
    "shard_contribution",
    "combine_contributions",
    "finish_norm",
]

NORM_SLOT, ZEROS_SLOT, NONFINITE_SLOT = 0, 1, 2
_ACC = torch.float64


def check_norm_type(norm_type: float) -> float:
    """Return ``norm_type`` as a float, or raise a ValueError unless it is > 0 or inf."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a number > 0 or inf, got {norm_type!r}") from None
    if not p > 0:  # also refuses NaN
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def empty_contribution(device: torch.device) -> torch.Tensor:
    """The contribution of a rank that holds no elements: the identity of both combines."""
    return torch.zeros(3, dtype=_ACC, device=device)


def shard_contribution(
    tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
    host_reads: bool = False,
) -> torch.Tensor:
    """Contribution of local shards that share a device, a dtype and a layout.

    ``tensors`` are plain local tensors (empty ones add nothing); every one of them is held
    identically by ``replication``
    ranks, and ``canonical`` says whether this rank is the one that counts their zeros. Runs as a
    few multi-tensor kernels (``torch._foreach_norm``) whatever the number of tensors, and never
    synchronises with the host. The result is a float64 vector on the tensors' device.

    CPU buckets of float32, bfloat16 or float16 (``p != 1``) take
    ``_cpu.cpu_contribution()`` instead: float32 partials over bounded pieces summed in
    float64, float64 recomputation of the tensors whose float32 result lost range.
    ``host_reads`` lets it read its CPU flags to recompute only those tensors (same result,
    bitwise). Every other device and dtype ignores ``host_reads``.
    """
    if not tensors:
        raise ValueError("shard_contribution needs at least one tensor (its device)")
    if _cpu.applies(tensors, norm_type):
        return _cpu.cpu_contribution(
            tensors,
            norm_type=norm_type,
            replication=replication,
            canonical=canonical,
            count_zeros=count_zeros,
            host_reads=host_reads,
        )
    device = tensors[0].device
    if math.isinf(norm_type):  # the max of an empty tensor has no identity
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return empty_contribution(device)
    norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=_ACC))
    norm_slot = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum() / replication
    nonfinite = (~torch.isfinite(norms)).sum(dtype=_ACC)
    if count_zeros and canonical:
        numel = sum(t.numel() for t in tensors)
        nonzeros = torch.stack(torch._foreach_norm(tensors, 0, dtype=_ACC)).sum()
        zeros = numel - nonzeros
    else:
        zeros = torch.zeros((), dtype=_ACC, device=device)
    return torch.stack([norm_slot.to(_ACC), zeros, nonfinite])


def combine_contributions(rows: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Combine contributions stacked as rows of a ``(k, 3)`` tensor into one contribution.

    Sums every slot, except the norm slot of ``p = inf``, which takes the maximum (NaN wins, so a
    NaN anywhere stays visible).
    """
    total = rows.sum(dim=0)
    if math.isinf(norm_type) and rows.shape[0] > 0:
        total[NORM_SLOT] = rows[:, NORM_SLOT].amax()
    return total


def finish_norm(norm_slot: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Turn the combined norm slot into the norm, as a 0-d float32 tensor."""
    if math.isinf(norm_type):
        return norm_slot.to(torch.float32)
    return norm_slot.pow(1.0 / norm_type).to(torch.float32)
