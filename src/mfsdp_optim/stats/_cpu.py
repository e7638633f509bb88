"""The CPU contribution of local shards without a float64 copy of every grad.

Map: ``applies`` whether a bucket takes this path (float32/bfloat16/float16 on CPU, ``p != 1``);
``cpu_contribution`` the same three slots as ``_math.shard_contribution``: ``p = inf`` from
``torch.aminmax``, finite ``p`` from float32 norms of pieces of at most ``piece_size`` elements
(``PIECE``, ``SHORT_PIECE``) summed in float64, a tensor with a piece out of range
(``in_range``, ``SUM_TINY``) recomputed whole in float64; ``zero_count`` exact zeros. Local
math only: with or without ``host_reads`` every rank issues the same collective, and the results
are bitwise equal. The error bound: docs/concepts.md, "How the norm is accumulated".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["PIECE", "SHORT_PIECE", "SUM_TINY", "applies", "cpu_contribution", "piece_size"]

# float32 p = 2 reduces in SIMD lanes (AVX2: 8, AVX-512: 16), each lane a sequential sum of at
# most PIECE / 8 = 256 terms; every other float32 reduction (other p, bfloat16/float16 converted
# on the fly) is one sequential sum per piece, so its pieces are shorter (64 terms)
PIECE = 1 << 11
SHORT_PIECE = 1 << 6
# float32 keeps every term >= 2**-126 to full precision and rounds smaller ones by at most
# 2**-150; over PIECE terms that is below SUM_TINY * 2**-36 when the piece's sum is >= SUM_TINY.
SUM_TINY = 2.0**-100
_F32_TINY = torch.finfo(torch.float32).tiny
_F32_MAX = torch.finfo(torch.float32).max
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACC = torch.float64


def applies(tensors: Sequence[torch.Tensor], norm_type: float) -> bool:
    """Whether the CPU path computes this bucket: CPU tensors of float32, bfloat16 or float16
    (the bucket shares one device and dtype), outside ``torch.compile`` tracing, any ``p`` but
    1 (float32 ``p = 1`` reductions are not vectorised: in pieces they cost more than the
    float64 copy, so ``p = 1`` keeps the reference path)."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in _DTYPES
        and norm_type != 1.0
        and not torch.compiler.is_compiling()
    )


def cpu_contribution(
    tensors: Sequence[torch.Tensor],
    *,
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
    host_reads: bool,
) -> torch.Tensor:
    """``[norm_slot, zeros, nonfinite]`` (float64, CPU) of one CPU bucket.

    Args:
        tensors: Local shards of one CPU device and dtype (see ``applies``); empty ones add
            nothing.
        norm_type: The norm's `p` (> 0 or inf, already checked).
        replication: How many ranks hold each of these shards.
        canonical: Whether this rank counts their zeros.
        count_zeros: Whether to count zeros at all.
        host_reads: Whether the flags may be read on the host to recompute only the flagged
            tensors (the result is bitwise the same either way).

    Returns:
        The contribution, as ``_math.shard_contribution()`` defines it.
    """
    if math.isinf(norm_type):
        norm_slot, nonfinite = _inf_slots([t for t in tensors if t.numel() > 0])
    else:
        norm_slot, nonfinite = _finite_slots(tensors, norm_type, host_reads)
        norm_slot = norm_slot / replication
    counted = count_zeros and canonical
    zeros = zero_count(tensors) if counted else torch.zeros((), dtype=_ACC)
    return torch.stack([norm_slot, zeros, nonfinite])


def zero_count(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Zero elements of ``tensors`` (NaN and inf are not zeros), exact, as a 0-d float64."""
    numel = sum(t.numel() for t in tensors)
    nonzeros = torch.stack([torch.count_nonzero(t) for t in tensors]).sum()
    return (numel - nonzeros).to(_ACC)


def _inf_slots(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest ``max|x|`` (NaN wins) and how many tensors hold a NaN or an inf (``tensors``
    not empty: a maximum has no identity)."""
    if not tensors:
        return torch.zeros((), dtype=_ACC), torch.zeros((), dtype=_ACC)
    lows, highs = zip(*(torch.aminmax(t) for t in tensors), strict=True)
    peaks = torch.maximum(torch.stack(highs), torch.stack(lows).neg()).to(_ACC)
    return peaks.max(), (~torch.isfinite(peaks)).sum(dtype=_ACC)


def piece_size(p: float, dtype: torch.dtype) -> int:
    """Elements per float32 partial: ``PIECE`` for float32 grads and ``p = 2`` (the vectorised
    reduction), ``SHORT_PIECE`` otherwise."""
    return PIECE if p == 2.0 and dtype == torch.float32 else SHORT_PIECE


def row_length(numel: int, piece: int) -> int:
    """Row length for a tensor of ``numel > piece`` elements: the largest power of two that
    divides ``numel``, capped at ``piece``, when it is at least ``piece // 8`` (no ragged tail,
    so one view and one reduction), else ``piece``."""
    low = numel & -numel
    return min(low, piece) if low >= piece // 8 else piece


def split_pieces(
    tensors: Sequence[torch.Tensor], piece: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Cut ``tensors`` into pieces of at most ``piece`` elements (views; a non-contiguous
    tensor longer than ``piece`` is copied by ``reshape``; empty tensors give no piece).

    Returns:
        ``(whole, rows)``: tensors and ragged tails reduced whole, in tensor order; ``(k,
            length)`` views reduced along their rows (``length <= piece``, see ``row_length``),
            in tensor order. The pieces' results are ordered as ``whole`` then ``rows`` (see
            ``piece_norms``; ``piece_owners`` maps them back to their tensors).
    """
    whole: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for t in tensors:
        n = t.numel()
        if n <= piece:
            if n:  # an empty tensor is no piece
                whole.append(t)
            continue
        length = row_length(n, piece)
        k = n // length
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        rows.append(flat.view(k, length) if k * length == n else flat[: k * length].view(k, length))
        if n > k * length:
            whole.append(flat[k * length :])
    return whole, rows


def piece_owners(tensors: Sequence[torch.Tensor], piece: int) -> torch.Tensor:
    """Index of the tensor each piece of ``split_pieces(tensors, piece)`` belongs to, in the
    order of ``piece_norms``' results (int64)."""
    whole: list[int] = []
    rows: list[int] = []
    for i, t in enumerate(tensors):
        n = t.numel()
        if n <= piece:
            if n:
                whole.append(i)
            continue
        length = row_length(n, piece)
        rows += [i] * (n // length)
        if n % length:
            whole.append(i)
    return torch.tensor(whole + rows, dtype=torch.int64)


def piece_norms(
    whole: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], p: float
) -> torch.Tensor:
    """Float32 ``||piece||_p`` of every piece, ``whole`` first, as one float64 vector."""
    parts = []
    if whole:
        parts.append(torch.stack(torch._foreach_norm(list(whole), p, dtype=torch.float32)))
    parts += [torch.linalg.vector_norm(r, p, dim=1, dtype=torch.float32) for r in rows]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(_ACC)


def in_range(norms: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """Which float32 piece results kept their range: finite and normal, and the ``|x| ** p`` sum
    (``powers``) at least ``SUM_TINY`` (NaN is out of range)."""
    return (norms >= _F32_TINY) & (norms <= _F32_MAX) & (powers >= SUM_TINY)


def _finite_slots(
    tensors: Sequence[torch.Tensor], p: float, host_reads: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``||t||_p ** p`` over ``tensors`` and how many hold a NaN or an inf."""
    piece = piece_size(p, tensors[0].dtype)
    whole, rows = split_pieces(tensors, piece)
    if not whole and not rows:  # every tensor empty
        return torch.zeros((), dtype=_ACC), torch.zeros((), dtype=_ACC)
    norms = piece_norms(whole, rows, p)
    powers = norms.pow(p)
    ok = in_range(norms, powers)
    if host_reads and bool(ok.all()):  # the common case: one read of a CPU flag, no device
        return powers.sum(), torch.zeros((), dtype=_ACC)
    owner = piece_owners(tensors, piece)
    flagged = torch.zeros(len(tensors), dtype=_ACC).index_add_(0, owner, (~ok).to(_ACC)) > 0
    if host_reads:
        exact = torch.zeros(len(tensors), dtype=_ACC)
        redo = flagged.nonzero().flatten().tolist()
        exact[redo] = torch.stack(torch._foreach_norm([tensors[i] for i in redo], p, dtype=_ACC))
    else:
        exact = torch.stack(torch._foreach_norm(list(tensors), p, dtype=_ACC))
    return recombine(powers, flagged[owner], exact, flagged, p)


def recombine(
    powers: torch.Tensor,
    piece_flagged: torch.Tensor,
    exact: torch.Tensor,
    flagged: torch.Tensor,
    p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces of unflagged tensors plus the float64 values of flagged ones.

    Args:
        powers: ``||piece||_p ** p`` per piece (float64).
        piece_flagged: Whether each piece's tensor is flagged.
        exact: Float64 ``||t||_p`` per tensor; only the flagged entries are used.
        flagged: Whether each tensor is flagged.
        p: The norm's `p`.

    Returns:
        ``(sum of ||t||_p ** p, number of flagged tensors holding a NaN or an inf)``. With no
            tensor flagged the sum is bitwise ``powers.sum()``.
    """
    kept = torch.where(piece_flagged, 0.0, powers).sum()
    redone = torch.where(flagged, exact.pow(p), 0.0).sum()
    nonfinite = (flagged & ~torch.isfinite(exact)).sum(dtype=_ACC)
    return kept + redone, nonfinite
