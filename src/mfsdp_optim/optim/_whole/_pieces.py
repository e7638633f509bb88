"""Which elements of a global tensor each mesh coordinate holds, and moving them in and out.

A piece is one index per tensor dim: a ``(start, length)`` range, or a 1-D index tensor where a
``_StridedShard`` makes it non-contiguous. Every placement shards one tensor dim, so a local shard
is always the Cartesian product of its per-dim indices. Placements are cut left to right over
the mesh dims, as torch 2.13's DTensor does (``_StridedShard`` chunks into ``split_factor`` parts,
each into mesh-size parts, and concatenates part ``c`` of each).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["Piece", "describe", "extract", "insert", "piece_numel", "piece_of"]

Index = tuple[int, int] | torch.Tensor
Piece = tuple[Index, ...]
PlacementKey = tuple  # ("R",), ("S", dim) or ("SS", dim, split_factor)


def describe(placement: Placement, what: str) -> PlacementKey:
    """A picklable key for ``placement``; ValueError naming ``what`` for Partial and others."""
    if isinstance(placement, _StridedShard):
        return ("SS", placement.dim, int(placement.split_factor))
    if isinstance(placement, Shard):
        return ("S", placement.dim)
    if isinstance(placement, Replicate):
        return ("R",)
    raise ValueError(
        f"{what} has placement {placement!r}: the whole-param step takes Replicate, Shard and "
        "_StridedShard only; reduce a Partial first (redistribute to Replicate)."
    )


def _pick(chunks: list[torch.Tensor], c: int) -> torch.Tensor:
    return chunks[c] if c < len(chunks) else torch.empty(0, dtype=torch.long)


def _chunk(ix: torch.Tensor, k: int) -> list[torch.Tensor]:
    return list(torch.chunk(ix, k)) if ix.numel() else []


@functools.lru_cache(maxsize=65536)
def piece_of(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    placements: tuple[PlacementKey, ...],
) -> Piece:
    """The piece of a global tensor of ``shape`` held at mesh coordinate ``coord``."""
    idx: list[torch.Tensor | None] = [None] * len(shape)
    for md, pl in enumerate(placements):
        if pl[0] == "R":
            continue
        d = pl[1]
        cur = idx[d] if idx[d] is not None else torch.arange(shape[d])
        k, c = mesh_shape[md], coord[md]
        if pl[0] == "S":
            idx[d] = _pick(_chunk(cur, k), c)
        else:
            parts = [_pick(_chunk(f, k), c) for f in _chunk(cur, pl[2])]
            idx[d] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    out: list[Index] = []
    for d, ix in enumerate(idx):
        if ix is None:
            out.append((0, shape[d]))
        elif ix.numel() == 0:
            out.append((0, 0))
        elif torch.equal(ix, torch.arange(int(ix[0]), int(ix[0]) + ix.numel())):
            out.append((int(ix[0]), ix.numel()))
        else:
            out.append(ix)
    return tuple(out)


def _length(ix: Index) -> int:
    return ix[1] if isinstance(ix, tuple) else ix.numel()


def piece_shape(piece: Piece) -> tuple[int, ...]:
    return tuple(_length(ix) for ix in piece)


def piece_numel(piece: Piece) -> int:
    return math.prod(_length(ix) for ix in piece)


def extract(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of ``full`` in ``piece``, as a new contiguous tensor of the piece's shape."""
    t = full
    for d, ix in enumerate(piece):
        if isinstance(ix, tuple):
            t = t.narrow(d, ix[0], ix[1])
        else:
            t = t.index_select(d, ix.to(full.device))
    return t.contiguous()


def insert(full: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Write ``values`` (the piece's shape, any dtype: cast to ``full``'s as ``copy_`` casts)
    into contiguous ``full`` at ``piece``."""
    if all(isinstance(ix, tuple) for ix in piece):
        t = full
        for d, ix in enumerate(piece):
            assert isinstance(ix, tuple)
            t = t.narrow(d, ix[0], ix[1])
        t.copy_(values.view(t.shape))
        return
    flat = torch.zeros((), dtype=torch.long)
    for d, ix in enumerate(piece):
        ar = torch.arange(ix[0], ix[0] + ix[1]) if isinstance(ix, tuple) else ix
        view = [1] * len(piece)
        view[d] = -1
        flat = flat + ar.view(view) * full.stride(d)
    source = values.reshape(-1).to(full.dtype)  # the cast copy_ would do on the other branch
    full.view(-1).index_copy_(0, flat.reshape(-1).to(full.device), source)
