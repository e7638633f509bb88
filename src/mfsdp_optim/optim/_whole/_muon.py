"""torch.optim.Muon's step with Newton-Schulz on whole matrices, the rest on local shards.

Momentum, the Nesterov blend, weight decay and the final add run on each rank's local shard (so
``momentum_buffer`` stays a sharded DTensor); the Newton-Schulz input travels once, as bfloat16
(torch casts it to bfloat16 first), from every member of a unit to its owner, which runs torch's
own ``_zeropower_via_newtonschulz`` and sends each member its piece of the result. One exchange
per direction for all params. Bit for bit torch's Muon on the unsharded params.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from ..._infra.placement import in_layout_of
from ._exchange import exchange, view_as
from ._pieces import extract, insert, piece_numel, piece_shape
from ._plan import NS_BYTES, WholeParamPlan, muon_splits

__all__ = ["batched_newton_schulz", "muon_step", "newton_schulz_all"]

U8 = torch.uint8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(U8)


def muon_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    groups: Sequence[dict],
    plan: WholeParamPlan,
    group: dist.ProcessGroup | None,
    error: str | None,
    batched: bool = False,
) -> None:
    """One Muon step of ``params`` (``groups[i]`` is params[i]'s param group). ``error``: this
    rank's local failure, sent as its status; raised after the exchange. ``batched``: an owner
    runs Newton-Schulz once per (shape, hyperparameters) over all its matrices of that shape
    (``newton_schulz_all``)."""
    units, rank, world = plan.units, plan.rank, plan.world
    present = [False] * len(units)
    alias = [False] * len(units)
    ns_in: dict[int, torch.Tensor] = {}  # unit -> this rank's piece of the NS input
    bufs: dict[int, torch.Tensor] = {}
    mine: dict[int, int] = {}  # unit -> index into params
    for i, (p, u) in enumerate(zip(params, plan.local_units, strict=True)):
        if p.grad is None:
            continue
        mine[u] = i
        present[u] = True
        if error is not None:
            continue
        g = groups[i]
        state = optimizer.state[p]
        grad = p.grad._local_tensor  # type: ignore[attr-defined]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = in_layout_of(torch.zeros_like(grad), p)
        buf = state["momentum_buffer"]._local_tensor
        bufs[u] = buf
        momentum = g["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if g["nesterov"] else buf
        alias[u] = update is buf and update.dtype == torch.bfloat16
        ns_in[u] = update.bfloat16()
    if error is not None:  # filler of the agreed sizes
        for u in mine:
            ns_in[u] = torch.zeros(piece_shape(units[u].piece_for(rank)), dtype=torch.bfloat16)
    # the owner needs the same present/alias flags: it is a member, so it computed them itself
    send_in, recv_in, _, recv_out = muon_splits(units, rank, world, present, alias)
    payload: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for u, unit in enumerate(units):
        if present[u] and unit.owner != rank and rank in unit.members:  # receivers send none
            payload[unit.owner].append(_as_bytes(ns_in[u]))
    received, statuses = exchange(
        "muon_in", payload, [max(0, n - 8) for n in recv_in], 1 if error else 0, group
    )
    failed = {r for r, s in enumerate(statuses) if s == 1}  # 1: failed itself, 2: relays it
    relayed = {r for r, s in enumerate(statuses) if s == 2}
    # owners: assemble, orthogonalise, cut the result into pieces for members and receivers
    offsets = [0] * world
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    results: dict[int, torch.Tensor] = {}
    after_alias: dict[int, torch.Tensor] = {}
    fulls: dict[int, torch.Tensor] = {}
    for u, unit in enumerate(units):
        if not present[u] or unit.owner != rank:
            continue
        full = torch.empty(unit.meta.shape, dtype=torch.bfloat16, device=ns_in[u].device)
        for member, piece in zip(unit.members, unit.pieces, strict=True):
            if member == rank:
                data = ns_in[u]
            else:
                n = piece_numel(piece) * NS_BYTES
                raw = received[member][offsets[member] : offsets[member] + n]
                offsets[member] += n
                data = view_as(raw, torch.bfloat16, (-1,)).to(full.device)
            insert(full, piece, data.view(piece_shape(piece)))
        fulls[u] = full
    if failed or relayed or error is not None:
        orthogonal = {u: torch.zeros_like(full) for u, full in fulls.items()}
    else:
        orthogonal = newton_schulz_all(fulls, {u: groups[mine[u]] for u in fulls}, batched)
    for u, full in fulls.items():
        unit, result = units[u], orthogonal[u]
        for member, piece in zip(unit.members, unit.pieces, strict=True):
            if member == rank:
                results[u] = extract(result, piece)
                if alias[u]:
                    after_alias[u] = extract(full, piece)
                continue
            out[member].append(_as_bytes(extract(result, piece)))
            if alias[u]:
                out[member].append(_as_bytes(extract(full, piece)))
        for receiver, piece in zip(unit.receivers, unit.receiver_pieces, strict=True):
            out[receiver].append(_as_bytes(extract(result, piece)))
            if alias[u]:
                out[receiver].append(_as_bytes(extract(full, piece)))
    status = 1 if error is not None else 2 if failed else 0
    back, statuses = exchange("muon_out", out, [max(0, n - 8) for n in recv_out], status, group)
    failed |= {r for r, s in enumerate(statuses) if s == 1}
    relayed |= {r for r, s in enumerate(statuses) if s == 2}
    if error is not None:
        raise ValueError(error)
    if failed or relayed:
        raise RuntimeError(
            f"whole-param Muon step: ranks {sorted(failed)} failed during this step (see their "
            f"errors; relayed by ranks {sorted(relayed)}); the params were not updated, the "
            "momentum buffers of the params they share were advanced: resume from a checkpoint"
        )
    offsets = [0] * world
    for u, unit in enumerate(units):
        if not present[u] or (rank not in unit.members and rank not in unit.receivers):
            continue
        piece = unit.piece_for(rank)
        if unit.owner != rank:
            n = piece_numel(piece) * NS_BYTES
            src = back[unit.owner]
            o = offsets[unit.owner]
            results[u] = view_as(src[o : o + n], torch.bfloat16, (-1,))
            if alias[u]:
                after_alias[u] = view_as(src[o + n : o + 2 * n], torch.bfloat16, (-1,))
            offsets[unit.owner] = o + n * (2 if alias[u] else 1)
        i = mine[u]
        p, g = params[i], groups[i]
        local = p._local_tensor
        if alias[u]:
            bufs[u].copy_(after_alias[u].to(local.device).view(bufs[u].shape))
        lr = _to_scalar(g["lr"])
        adjusted = _adjust_lr(lr, g["adjust_lr_fn"], p.shape)
        local.mul_(1 - lr * g["weight_decay"])
        update = results[u].to(local.device).view(local.shape)
        if p.shape[0] > p.shape[1]:
            update = _as_torch_lays_out_tall(update)
        local.add_(update, alpha=-adjusted)


def _as_torch_lays_out_tall(update: torch.Tensor) -> torch.Tensor:
    """``update``'s values in a layout whose last dim is strided, as torch's Muon adds them.

    For a tall matrix (rows > columns) torch's Newton-Schulz returns the transpose of a
    contiguous result, so its ``param.add_(update, alpha=...)`` reads a strided operand, which
    sends the add down the elementwise kernel's scalar loop; a contiguous operand takes the
    vectorised loop, whose fused multiply-add rounds differently (one bfloat16 step on a few
    elements, seen on CPU). Every local piece of a tall matrix is added strided, whatever its
    shape (a one-row piece of the transposed view would count as contiguous again)."""
    strided = torch.empty((*update.shape, 2), dtype=update.dtype, device=update.device)[..., 0]
    return strided.copy_(update)


def newton_schulz_all(
    fulls: dict[int, torch.Tensor], groups: dict[int, dict], batched: bool
) -> dict[int, torch.Tensor]:
    """Newton-Schulz of every whole matrix an owner holds (``fulls``, bfloat16, keyed by unit;
    ``groups[u]`` its param group). Each ``fulls[u]`` is left as torch's in-place normalisation
    leaves its input (what an aliased momentum buffer gets back). ``batched``: matrices of one
    shape and one set of Newton-Schulz hyperparameters go through ``batched_newton_schulz``
    together; else one ``_zeropower_via_newtonschulz`` call each (torch's own function)."""
    out: dict[int, torch.Tensor] = {}
    if not batched:
        for u, full in fulls.items():
            g = groups[u]
            out[u] = _zeropower_via_newtonschulz(
                full, g["ns_coefficients"], g["ns_steps"], g["eps"]
            )
        return out
    by_kind: dict[tuple, list[int]] = {}
    for u, full in fulls.items():
        g = groups[u]
        key = (tuple(full.shape), full.device, tuple(g["ns_coefficients"]), g["ns_steps"], g["eps"])
        by_kind.setdefault(key, []).append(u)
    for (_, _, coefficients, steps, eps), units in by_kind.items():
        if len(units) == 1:  # nothing to batch: torch's own call
            u = units[0]
            out[u] = _zeropower_via_newtonschulz(fulls[u], coefficients, steps, eps)
            continue
        stacked = torch.stack([fulls[u] for u in units])
        result, normalised = batched_newton_schulz(stacked, coefficients, steps, eps)
        for i, u in enumerate(units):
            out[u] = result[i]
            fulls[u].copy_(normalised[i])
    return out


def batched_newton_schulz(
    stacked: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ``_zeropower_via_newtonschulz`` over a ``(batch, rows, columns)`` bfloat16 stack,
    each operation batched (``bmm``/``baddbmm``), each matrix normalised by its own norm taken
    as torch takes it (one ``norm()`` per matrix, on the same transposed view). Returns the
    results (as torch returns them: transposed views for tall matrices) and the normalised
    inputs (what torch's in-place division leaves in its input). Bit for bit torch's per-matrix
    result on CPU (tested); on CUDA the batched GEMMs may round differently
    (``benchmarks/check_batched_ns.py`` measures it), which is why it is opt-in."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if stacked.dim() != 3:
        raise ValueError("batched Newton-Schulz takes a (batch, rows, columns) stack")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = coefficients
    x = stacked.bfloat16()
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    norms = torch.stack([m.norm() for m in x.unbind(0)])
    x.div_(norms.clamp(min=eps).view(-1, 1, 1))
    normalised = x.mT if tall else x
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return (x.mT if tall else x), normalised
