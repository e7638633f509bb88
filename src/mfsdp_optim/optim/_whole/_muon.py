"""torch.optim.Muon's step with Newton-Schulz on whole matrices, the rest on local shards.

Momentum, the Nesterov blend, weight decay and the final add run on each rank's local shard (so
``momentum_buffer`` stays a sharded DTensor); the Newton-Schulz input travels once, as bfloat16
(torch casts it to bfloat16 first), from every member of a unit to its owner, which runs torch's
own ``_zeropower_via_newtonschulz`` (or one batched call per matrix shape, where shown exact) and
sends each member, and each rank of the other replicas (the unit's receivers), its piece of the
result. One exchange per direction for all params. Bit for bit torch's Muon on the unsharded
params. A refused step (any rank failing anywhere, or ranks disagreeing on a param's grad)
writes nothing on any rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from ..._infra.comm import collective_device
from ..._infra.placement import in_layout_of
from ._checks import partial_grad_message
from ._exchange import Outbox, Part, exchange, settle, view_as
from ._ns_probe import batched_is_exact
from ._pieces import Piece, extract, insert, piece_numel, piece_shape
from ._plan import NS_BYTES, STATUS_BYTES, Unit, WholeParamPlan, flag_bytes, muon_splits

__all__ = ["batched_newton_schulz", "muon_step", "newton_schulz_all"]

U8 = torch.uint8
BF16 = torch.bfloat16


def _flags(optimizer, p: DTensor, group: dict) -> int:
    """This rank's flags for one param: 1 it has a grad, 2 (with 1) its Newton-Schulz input is
    the momentum buffer itself (no nesterov, a bfloat16 buffer)."""
    if p.grad is None:
        return 0
    old = optimizer.state.get(p, {}).get("momentum_buffer")
    dtype = old.dtype if isinstance(old, torch.Tensor) else p.grad.dtype
    return 1 | (2 if not group["nesterov"] and dtype == torch.bfloat16 else 0)


def _mismatch(name: str, members: Sequence[int], flags: Sequence[int]) -> str:
    have = [m for m, f in zip(members, flags, strict=True) if f & 1]
    lack = [m for m, f in zip(members, flags, strict=True) if not f & 1]
    if have and lack:
        return partial_grad_message(name, have, lack)
    alias = [m for m, f in zip(members, flags, strict=True) if f & 2]
    plain = [m for m, f in zip(members, flags, strict=True) if not f & 2]
    return (
        f"param {name!r}: ranks {alias} step its momentum buffer without nesterov in bfloat16 "
        f"and ranks {plain} do not (nesterov or the buffer's dtype differ between ranks): pass "
        "the same param groups on every rank; nothing was updated on any rank"
    )


@dataclass(frozen=True)
class _Inward:
    """The first exchange's layout for one rank (from the plan alone, cached in ``plan.slot``):
    payload bytes to and from each peer (status words excluded), the units whose flags go to
    each owner (in unit order, one byte each, padded), where each unit this rank is a member of
    puts its piece of the Newton-Schulz input, and the units whose flags each peer sends here."""

    send: tuple[int, ...]
    recv: tuple[int, ...]
    to_owner: tuple[tuple[int, ...], ...]
    slot: dict[int, tuple[int, int]]  # unit -> (owner, byte offset in the payload to it)
    from_peer: tuple[tuple[int, ...], ...]


def _inward(plan: WholeParamPlan) -> _Inward:
    key = ("muon_in", plan.digest)
    if key not in plan.slot:
        units, rank, world = plan.units, plan.rank, plan.world
        send_in, recv_in, _, _ = muon_splits(units, rank, world)
        local = set(plan.local_units)
        to_owner: list[list[int]] = [[] for _ in range(world)]
        from_peer: list[list[int]] = [[] for _ in range(world)]
        for u, unit in enumerate(units):
            if u in local and unit.owner != rank:
                to_owner[unit.owner].append(u)
            if unit.owner == rank:
                for m in unit.holders:
                    if m != rank:
                        from_peer[m].append(u)
        slot = {}
        for owner, us in enumerate(to_owner):
            offset = flag_bytes(len(us)) if us else 0
            for u in us:
                if rank in units[u].members:  # a receiver sends its flags only
                    slot[u] = (owner, offset)
                    offset += piece_numel(units[u].piece_for(rank)) * NS_BYTES
        plan.slot[key] = _Inward(
            tuple(n - STATUS_BYTES if n else 0 for n in send_in),
            tuple(n - STATUS_BYTES if n else 0 for n in recv_in),
            tuple(map(tuple, to_owner)),
            slot,
            tuple(map(tuple, from_peer)),
        )
    return plan.slot[key]


def _recv_out(plan: WholeParamPlan, present: list[bool], alias: list[bool]) -> list[int]:
    """The second exchange's payload bytes from each peer (the last presence pattern cached)."""
    key, pattern = ("muon_out", plan.digest), (tuple(present), tuple(alias))
    cached = plan.slot.get(key)
    if cached is None or cached[0] != pattern:
        recv_out = muon_splits(plan.units, plan.rank, plan.world, present, alias)[3]
        cached = plan.slot[key] = (pattern, [n - STATUS_BYTES if n else 0 for n in recv_out])
    return cached[1]


def muon_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    groups: Sequence[dict],
    plan: WholeParamPlan,
    group: dist.ProcessGroup | None,
    batched: bool | None = False,
) -> None:
    """One Muon step of ``params`` (``groups[i]`` is params[i]'s param group), after the step's
    agreement. Nothing is written before every rank knows that every rank succeeded: the new
    momentum is computed into a new buffer, and after the last exchange it and the params are
    written, or every rank raises (``settle``) with nothing changed on any rank. ``batched``
    (True, None: where shown exact, False): an owner runs Newton-Schulz once per (shape,
    hyperparameters) over all its matrices of that shape (``newton_schulz_all``).

    Every rank that holds a unit and is not its owner (a member of the owner's shard group, or
    a receiver in another replica) sends the owner its flags (one byte per unit, padded); members
    also send their piece of the Newton-Schulz input. The owner sends each of them what ITS
    flags ask for, so the sizes match whatever happened on the owner.

    Copies: a member casts its piece to bfloat16 straight into the send buffer, an owner its own
    piece straight into the whole matrix (a unit held whole by its owner alone, as on one rank:
    torch's own cast, no further copy); the owner adds its piece of the result as a view of
    Newton-Schulz's output and copies each peer's piece once, into the send buffer; a tall
    matrix's result travels transposed where the receiver's view then has torch's strided
    layout (no copy there)."""
    units, rank, world = plan.units, plan.rank, plan.world
    error: BaseException | None = None
    mine = dict(zip(plan.local_units, range(len(params)), strict=True))  # unit -> param index
    flags = dict.fromkeys(mine, 0)  # what this rank tells the owners (sizes follow them)
    try:
        for u, i in mine.items():
            flags[u] = _flags(optimizer, params[i], groups[i])
    except Exception as exc:  # its flags stay 0 (absent): the sizes still agree
        error = exc
    present = [False] * len(units)
    alias = [False] * len(units)
    for u, f in flags.items():
        present[u], alias[u] = bool(f & 1), bool(f & 2)
    inward = _inward(plan)
    box = Outbox(inward.send, rank, collective_device(group))
    fulls: dict[int, torch.Tensor] = {}  # owned unit -> the whole bfloat16 Newton-Schulz input
    new_bufs: dict[int, torch.Tensor] = {}  # unit -> the new momentum (local), written last
    scale: dict[int, tuple[float, float]] = {}  # unit -> (weight decay factor, adjusted lr)
    try:
        for u, i in mine.items():
            if not present[u] or error is not None:
                continue
            p, g = params[i], groups[i]
            grad = p.grad._local_tensor  # type: ignore[union-attr]
            old = optimizer.state.get(p, {}).get("momentum_buffer")
            momentum = g["momentum"]
            if old is None:
                buf = torch.zeros_like(grad).lerp_(grad, 1 - momentum)
            else:
                local_old = old._local_tensor if isinstance(old, DTensor) else old
                if local_old.shape != grad.shape:
                    raise ValueError(
                        f"param {plan.metas[i].name!r}: its momentum_buffer's local shard is "
                        f"{tuple(local_old.shape)}, its grad's {tuple(grad.shape)}: the state "
                        "does not belong to this layout (load it again, or reset the state)"
                    )
                buf = local_old.lerp(grad, 1 - momentum)
            new_bufs[u] = buf
            update = grad.lerp(buf, momentum) if g["nesterov"] else buf  # is buf where alias[u]
            unit = units[u]
            if unit.owner == rank:
                fulls[u] = _own_input(unit, rank, update)
            elif u in inward.slot:  # a member: its piece, cast as torch casts, into place
                owner, offset = inward.slot[u]
                box.put(owner, offset, (update, BF16))
            lr = _to_scalar(g["lr"])
            scale[u] = (1 - lr * g["weight_decay"], _adjust_lr(lr, g["adjust_lr_fn"], p.shape))
    except Exception as exc:  # still takes part in both exchanges, then raises (settle)
        error = exc
    for u, (owner, offset) in inward.slot.items():
        if not present[u] and error is None:  # no grad here: zeros of the agreed size
            box.zero(owner, offset, piece_numel(units[u].piece_for(rank)) * NS_BYTES)
    if error is not None:  # the payload is filler: every rank raises after the last exchange
        box.buf.zero_()
    heads: list[torch.Tensor | None] = [None] * world
    for owner, us in enumerate(inward.to_owner):
        if us:
            head = torch.zeros(flag_bytes(len(us)), dtype=U8)
            head[: len(us)] = torch.tensor([flags[u] for u in us], dtype=U8)
            heads[owner] = head
    received, statuses = box.send("muon_in", inward.recv, int(bool(error)), group, heads)
    # owners: every member's and receiver's flags, then assemble, orthogonalise, cut the result
    peer_flags: dict[tuple[int, int], int] = {}  # (unit, member or receiver) -> its flags
    offsets = [0] * world
    firsts = [received[m][: len(us)] for m, us in enumerate(inward.from_peer) if us]
    got = torch.cat(firsts).cpu().tolist() if firsts else []  # every peer's flags: ONE read
    at = 0
    for m, us in enumerate(inward.from_peer):
        if us:
            peer_flags.update(
                {(u, m): int(f) for u, f in zip(us, got[at : at + len(us)], strict=True)}
            )
            at += len(us)
            offsets[m] = flag_bytes(len(us))
    ok = error is None and not any(statuses)
    for u, unit in enumerate(units):
        if unit.owner != rank:
            continue
        holders = unit.holders
        unit_flags = [flags[u] if m == rank else peer_flags[(u, m)] for m in holders]
        if ok and len(set(unit_flags)) > 1:
            error, ok = ValueError(_mismatch(unit.meta.name, holders, unit_flags)), False
        if ok and present[u]:
            try:
                full = fulls[u]
                for member, piece in zip(unit.members, unit.pieces, strict=True):
                    if member != rank:
                        n = piece_numel(piece) * NS_BYTES
                        raw = received[member][offsets[member] : offsets[member] + n]
                        data = view_as(raw, BF16, piece_shape(piece)).to(full.device)
                        insert(full, piece, data)
            except Exception as exc:  # reported in the second exchange's status word
                error, ok = exc, False
        for member, piece in zip(unit.members, unit.pieces, strict=True):
            if member != rank:
                offsets[member] += piece_numel(piece) * NS_BYTES
    orthogonal: dict[int, torch.Tensor] = {}
    if ok and fulls:
        try:
            orthogonal = newton_schulz_all(fulls, {u: groups[mine[u]] for u in fulls}, batched)
        except Exception as exc:  # reported in the second exchange's status word
            error, ok = exc, False
    # each member and receiver gets what ITS flags ask for, so the sizes match whatever
    # happened here
    out: list[list[Part]] = [[] for _ in range(world)]
    results: dict[int, torch.Tensor] = {}  # unit -> this rank's piece of the result, as added
    after_alias: dict[int, torch.Tensor] = {}  # unit -> its piece of the normalised input
    for u, unit in enumerate(units):
        if unit.owner != rank:
            continue
        orth, normalised = orthogonal.get(u), fulls.get(u)
        shape = unit.meta.shape
        for holder, piece in unit.holder_pieces():
            f = flags[u] if holder == rank else peer_flags[(u, holder)]
            if not f & 1:
                continue
            if holder == rank:
                if ok and orth is not None and normalised is not None:
                    results[u] = _own_result(orth, piece, shape)
                    if f & 2 and normalised is not new_bufs.get(u):
                        after_alias[u] = _piece_view(normalised, piece)
                continue  # else nothing is written: every rank raises after this exchange
            if ok and orth is not None and normalised is not None:
                parts: list[Part] = [_wire_result(orth, piece, shape)]
                if f & 2:
                    parts.append(_piece_view(normalised, piece))
            else:  # filler of the agreed size: every rank raises after this exchange
                filler = torch.zeros(piece_shape(piece), dtype=BF16)
                parts = [filler] * (2 if f & 2 else 1)
            out[holder].extend(parts)
    back, statuses_out = exchange(
        "muon_out", out, _recv_out(plan, present, alias), int(error is not None), group
    )
    settle(error, [*statuses, *statuses_out], group)
    # every rank succeeded: read the results, then write the momentum and the params
    offsets = [0] * world
    for u, unit in enumerate(units):
        if not present[u] or u not in mine or unit.owner == rank:
            continue
        pshape = piece_shape(unit.piece_for(rank))
        n = math.prod(pshape) * NS_BYTES
        src, o = back[unit.owner], offsets[unit.owner]
        device = params[mine[u]]._local_tensor.device
        results[u] = _received_result(src[o : o + n], unit.meta.shape, pshape, device)
        if alias[u]:
            after_alias[u] = view_as(src[o + n : o + 2 * n], BF16, pshape)
        offsets[unit.owner] = o + n * (2 if alias[u] else 1)
    for u, i in mine.items():
        if not present[u]:
            continue
        p = params[i]
        local = p._local_tensor
        buf = new_bufs[u]
        if u in after_alias:  # the normalised input (torch normalises the buffer in place)
            buf.copy_(after_alias[u].to(buf.device).view(buf.shape))
        state = optimizer.state[p]
        old = state.get("momentum_buffer")
        if old is None:
            state["momentum_buffer"] = in_layout_of(buf, p)
        else:
            (old._local_tensor if isinstance(old, DTensor) else old).copy_(buf)
        decay, adjusted = scale[u]
        local.mul_(decay)
        local.add_(results[u], alpha=-adjusted)


def _narrow_only(piece: Piece) -> bool:
    return all(isinstance(ix, tuple) for ix in piece)


def _piece_view(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``full``'s elements in ``piece``: a view where the piece is ranges, else a copy."""
    if not _narrow_only(piece):
        return extract(full, piece)
    t = full
    for d, ix in enumerate(piece):
        assert isinstance(ix, tuple)
        t = t.narrow(d, ix[0], ix[1])
    return t


def _own_input(unit: Unit, rank: int, update: torch.Tensor) -> torch.Tensor:
    """The owner's whole bfloat16 Newton-Schulz input with its own piece of ``update`` in place
    (the other members' pieces are inserted after the exchange). A unit held whole by its owner
    alone takes torch's own cast (``update.bfloat16()``, the buffer itself where it is bfloat16
    already, as torch's Muon normalises it in place); otherwise the cast is the copy into the
    whole matrix (the same rounding)."""
    shape = unit.meta.shape
    piece = unit.pieces[unit.members.index(rank)]
    whole = _narrow_only(piece) and all(ix == (0, n) for ix, n in zip(piece, shape, strict=True))
    if len(unit.members) == 1 and whole and update.is_contiguous():
        return update.bfloat16()
    full = torch.empty(shape, dtype=BF16, device=update.device)
    insert(full, piece, update)
    return full


def _strided_add(shape: tuple[int, ...]) -> bool:
    """Whether torch's Muon adds this param's update through a strided operand: a tall matrix
    (rows > columns > 1) gets the transpose of Newton-Schulz's contiguous result, which sends
    ``param.add_(update, alpha=...)`` down the elementwise kernel's scalar loop on CPU; a
    contiguous operand takes the vectorised loop, whose fused multiply-add rounds differently
    (one bfloat16 step on a few elements, seen on CPU). A single column's transpose is
    contiguous again, as is every other shape's result."""
    return shape[0] > shape[1] > 1


def _wire_transposed(shape: tuple[int, ...], pshape: tuple[int, ...]) -> bool:
    """Whether a piece of the result travels transposed: where the receiver's transposed view
    of it (``(columns, rows)`` contiguous, then ``.mT``) is strided as torch's operand is, which
    needs more than one row and more than one column in the piece."""
    return _strided_add(shape) and pshape[0] > 1 and pshape[1] > 1


def _own_result(orth: torch.Tensor, piece: Piece, shape: tuple[int, ...]) -> torch.Tensor:
    """The owner's piece of the result, laid out as torch's Muon adds it: a view of
    Newton-Schulz's output where the view's layout gives the same kernel loop (the whole
    matrix: torch's very operand), else a copy (``_as_torch_lays_out_tall`` for a strided one)."""
    pshape = piece_shape(piece)
    values = _piece_view(orth, piece)
    if _strided_add(shape):
        if _narrow_only(piece) and pshape[1] > 1:  # strides (1, rows): the scalar loop
            return values
        return _as_torch_lays_out_tall(values)
    return values.contiguous()


def _wire_result(orth: torch.Tensor, piece: Piece, shape: tuple[int, ...]) -> torch.Tensor:
    """What the owner sends a peer of its piece of the result (copied once, into the send
    buffer): the transposed piece of Newton-Schulz's contiguous output where
    ``_wire_transposed``, else the piece itself."""
    pshape = piece_shape(piece)
    if _wire_transposed(shape, pshape):
        return _piece_view(orth.mT, (piece[1], piece[0]))
    return _piece_view(orth, piece)


def _received_result(
    raw: torch.Tensor, shape: tuple[int, ...], pshape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A received piece of the result (bfloat16 bytes), laid out as torch's Muon adds it."""
    flat = view_as(raw, BF16, (-1,)).to(device)
    if _wire_transposed(shape, pshape):
        return flat.view(pshape[1], pshape[0]).mT  # strides (1, rows): no copy
    values = flat.view(pshape)
    return _as_torch_lays_out_tall(values) if _strided_add(shape) else values


def _as_torch_lays_out_tall(update: torch.Tensor) -> torch.Tensor:
    """``update``'s values in a layout whose last dim is strided (stride 2), as torch's Muon
    adds a tall matrix's result (``_strided_add``), for pieces whose own view cannot be: a
    one-row or one-column piece of the transposed result would count as contiguous."""
    strided = torch.empty((*update.shape, 2), dtype=update.dtype, device=update.device)[..., 0]
    return strided.copy_(update)


def newton_schulz_all(
    fulls: dict[int, torch.Tensor], groups: dict[int, dict], batched: bool | None
) -> dict[int, torch.Tensor]:
    """Newton-Schulz of every whole matrix an owner holds (``fulls``, bfloat16, keyed by unit;
    ``groups[u]`` its param group). Each ``fulls[u]`` is left as torch's in-place normalisation
    leaves its input (what an aliased momentum buffer gets back). ``batched``: True, matrices
    of one shape and one set of Newton-Schulz hyperparameters go through
    ``batched_newton_schulz`` together; None, the same where ``_ns_probe`` has shown that kind of
    batch bit for bit on this device, else one call each; False, one
    ``_zeropower_via_newtonschulz`` call each (torch's own function)."""
    out: dict[int, torch.Tensor] = {}
    if batched is False:
        for u, full in fulls.items():
            g = groups[u]
            out[u] = _zeropower_via_newtonschulz(
                full, g["ns_coefficients"], g["ns_steps"], g["eps"]
            )
        return out
    by_kind: dict[tuple, list[int]] = {}
    for u, full in fulls.items():
        g = groups[u]
        key = (
            tuple(full.shape),
            full.stride(),
            full.device,
            tuple(g["ns_coefficients"]),
            g["ns_steps"],
            g["eps"],
        )
        by_kind.setdefault(key, []).append(u)
    for (_, _, _, coefficients, steps, eps), units in by_kind.items():
        first = fulls[units[0]]
        if len(units) == 1 or (  # nothing to batch, or not shown exact here: torch's own calls
            batched is None
            and not batched_is_exact(
                first, len(units), coefficients, steps, eps, batched_newton_schulz
            )
        ):
            for u in units:
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
    result on CPU for the tested shapes, and on an H100 for the Llama-like 1B set's shapes
    (``benchmarks/check_batched_ns.py``); other kernels may round differently, which is why the
    default batches only kinds ``_ns_probe`` has shown exact."""
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
