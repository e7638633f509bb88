"""``check_layout``: find params whose identical copies the stats layer would count several times.

Map: ``check_layout(model)`` -> a ``DuplicatedParam`` per param two or more of whose mesh
instances hold bitwise-identical shards (and grads) at every position, e.g. a param left off a
TP plan; each rank hashes its shards, ONE object all-gather over ``group`` shares
``(fqn, mesh ranks, placements, offset, shape, hashes)``, every rank reaches the same verdict.
Every rank of ``group`` calls it, after a backward pass (grads decide); a rank whose own pass
fails still joins (``_infra.agreement``). Why the stats need it: docs/concepts.md, "Tensor
parallelism: a param left off the plan" and "How check_layout decides".
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra.agreement import Wording, agree
from .._infra.params import strip_compile_prefix

__all__ = ["DuplicatedParam", "check_layout"]

_WORDING = Wording(what="check_layout", where="group")
_CHUNK = 1 << 22  # elements hashed per pass (bounds the int64 temporary)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DuplicatedParam(NamedTuple):
    """A param whose mesh instances hold identical copies.

    Attributes:
        fqn: The param's name.
        copies: How many mesh instances hold the same shards (its contribution to a sum of
            squares is multiplied by this).
        meshes: The global ranks of each of those instances.
        placements: The param's placements, as text.
        evidence: ``"values+grads"`` or ``"values"`` (no grads were present on every copy).
    """

    fqn: str
    copies: int
    meshes: tuple[tuple[int, ...], ...]
    placements: str
    evidence: str


def _bit_hash(t: torch.Tensor) -> tuple[int, int, bool]:
    """(position-weighted sum, plain sum) of the shard's bit patterns, and whether every element
    is the same; one host transfer."""
    flat = t.detach().contiguous().view(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).view(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    n = bits.numel()
    acc = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for lo in range(0, n, _CHUNK):
        x = bits[lo : lo + _CHUNK].to(torch.int64)
        # int64 sums wrap around; a position weight makes permutations hash apart
        w = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=x.device)
        w = (w * 2654435761 + 97) % 2147483647
        acc += torch.stack([(x * w).sum(), x.sum()])
    constant = torch.all(bits == bits[0]) if n else torch.tensor(True)
    out = torch.cat([acc, constant.to(torch.int64).view(1).to(acc.device)]).tolist()
    return int(out[0]), int(out[1]), bool(out[2])


def _shard_offset(p: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _named_params(model) -> Iterable[tuple[str, torch.Tensor]]:
    chunks: Sequence[torch.nn.Module] = (
        [model] if isinstance(model, torch.nn.Module) else list(model)
    )
    seen: set[int] = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield strip_compile_prefix(name), p


def check_layout(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    warn: bool = True,
) -> list[DuplicatedParam]:
    """Params whose mesh instances hold identical copies (their norm would be over-counted).

    Cost: one pass over each local shard and grad on its device, one small object all-gather.

    Args:
        model: A module or a sequence of model chunks; its DTensor params are checked (plain
            tensors are skipped).
        group: Every rank that holds any of them (default WORLD); every rank of it must call,
            with the same ``group``.
        warn: Warn once with the FQNs of the params found.

    Returns:
        The [DuplicatedParam][mfsdp_optim.DuplicatedParam]s, the same list on every rank,
            sorted by FQN.
    """
    mine = []
    failure: Exception | None = None
    try:
        for fqn, p in _named_params(model):
            if not isinstance(p, DTensor):
                continue
            local = p.to_local()
            if local.numel() == 0:
                continue
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else None
            ranks = tuple(int(r) for r in p.device_mesh.mesh.flatten().tolist())
            offset, shape = _shard_offset(p)
            vh = _bit_hash(local)
            gh = _bit_hash(grad) if grad is not None and grad.numel() else None
            mine.append(
                (fqn, ranks, tuple(p.shape), str(tuple(p.placements)), offset, shape, vh, gh)
            )
    except Exception as exc:  # any type: the peers must hear of it, not wait for it
        failure, mine = exc, []
    # the rank agreement rides with the payload: ONE object all-gather, as before
    verdict = agree(failure, group, detail=mine, always=True)
    verdict.raise_own_or_peer(failure, _WORDING)
    everyone = verdict.details or []

    # fqn -> mesh instance (its ranks) -> {shard position: (value hash, grad hash)}
    table: dict[str, dict[tuple[int, ...], dict[tuple, tuple]]] = defaultdict(dict)
    meta: dict[str, tuple] = {}
    for entries in everyone:
        for fqn, ranks, gshape, placements, offset, shape, vh, gh in entries:
            table[fqn].setdefault(ranks, {})[(offset, shape)] = (vh, gh)
            meta.setdefault(fqn, (gshape, placements))

    found = []
    for fqn in sorted(table):
        instances = table[fqn]
        if len(instances) < 2:
            continue
        # instances with the same shards bit for bit (their positions and value hashes)
        groups: dict[tuple, list[tuple[int, ...]]] = defaultdict(list)
        for ranks, shards in instances.items():
            key = tuple(sorted((pos, h[0][:2]) for pos, h in shards.items()))
            groups[key].append(ranks)
        for members in groups.values():
            if len(members) < 2:
                continue
            held = [instances[r] for r in members]
            grads = [h[1] for s in held for h in s.values()]
            if all(g is not None for g in grads):
                by_grad = {tuple(sorted((pos, h[1][:2]) for pos, h in s.items())) for s in held}
                if len(by_grad) != 1:
                    continue  # same values, different grads: distinct tensors (e.g. experts)
                evidence = "values+grads"
            else:
                if all(h[0][2] for s in held for h in s.values()):
                    continue  # constant shards and no grads: no evidence either way
                evidence = "values"
            found.append(
                DuplicatedParam(fqn, len(members), tuple(sorted(members)), meta[fqn][1], evidence)
            )
    if found and warn:
        desc = "; ".join(
            f"{d.fqn} ({d.copies} identical copies on meshes {list(d.meshes)})" for d in found
        )
        warnings.warn(
            f"check_layout: {len(found)} param(s) hold identical copies on separate mesh "
            f"instances, so grad norms count them once per copy: {desc}. A param left off a "
            "tensor-parallel plan stays on the data-parallel mesh; put it on the full mesh with "
            "Replicate() on the tp dim (e.g. distribute it in the TP plan).",
            stacklevel=2,
        )
    return found
