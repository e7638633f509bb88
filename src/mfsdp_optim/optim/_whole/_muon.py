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

from ..._infra.attempt import Attempt
from ..._infra.comm import collective_device, uploaded
from ..._infra.placement import in_layout_of
from ._checks import partial_grad_message
from ._exchange import WORDING, Outbox, Part, exchange, exchange_on_device, view_as
from ._ns_probe import batched_is_exact
from ._pieces import Piece, extract, insert, piece_numel, piece_shape
from ._plan import NS_BYTES, STATUS_BYTES, Unit, WholeParamPlan, flag_bytes, muon_splits
from ._verdict import DeviceVerdict

__all__ = ["batched_newton_schulz", "muon_step", "muon_take_part", "newton_schulz_all"]

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


def _slot_alias(plan: WholeParamPlan) -> list[bool]:
    """Device mode: the units whose result travels with a slot for the normalised input (an
    aliased bfloat16 momentum buffer), from the plan alone: the bfloat16 params."""
    key = ("muon_slot_alias", plan.digest)
    if key not in plan.slot:
        plan.slot[key] = [u.meta.dtype == str(BF16) for u in plan.units]
    return plan.slot[key]


def _out_sizes_on_device(plan: WholeParamPlan) -> tuple[list[int], list[int]]:
    """Device mode: the second exchange's payload bytes to and from each peer (status words
    excluded), from the plan alone: every unit as if it had a grad, the normalised input's slot
    where ``_slot_alias``."""
    key = ("muon_out_on_device", plan.digest)
    if key not in plan.slot:
        _, _, send, recv = muon_splits(plan.units, plan.rank, plan.world, None, _slot_alias(plan))
        plan.slot[key] = tuple([n - STATUS_BYTES if n else 0 for n in s] for s in (send, recv))
    return plan.slot[key]


def muon_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    groups: Sequence[dict],
    plan: WholeParamPlan,
    group: dist.ProcessGroup | None,
    batched: bool | None = False,
    verdict: DeviceVerdict | None = None,
) -> None:
    """One Muon step of ``params`` (``groups[i]`` is params[i]'s param group), after the step's
    agreement. Nothing is written before every rank knows that every rank succeeded: the new
    momentum is computed into a new buffer, and after the last exchange it and the params are
    written, or every rank raises (``Attempt.settle``) with nothing changed on any rank.
    ``batched`` (True, None: where shown exact, False): an owner runs Newton-Schulz once per
    (shape, hyperparameters) over all its matrices of that shape (``newton_schulz_all``).

    Every rank that holds a unit and is not its owner (a member of the owner's shard group, or
    a receiver in another replica) sends the owner its flags (one byte per unit, padded); members
    also send their piece of the Newton-Schulz input. The owner sends each of them what ITS
    flags ask for, so the sizes match whatever happened on the owner.

    ``verdict`` (``OptimizerConfig(host_sync=False)``): nothing is read on the host. The sizes
    of both exchanges follow the plan alone (every unit as if it had a grad; the normalised
    input's slot for every bfloat16 param), the owner compares the flags it received with its
    own on the device, status words are written from and folded into ``verdict``, and every
    write is gated on ``verdict.gate()``. A rank that failed (``verdict.error`` set before the
    call, or failing in it) takes part with filler and raises its own error after the last
    exchange; the others change nothing and find ``verdict.bad`` set.

    Copies: a member casts its piece to bfloat16 straight into the send buffer, an owner its own
    piece straight into the whole matrix (a unit held whole by its owner alone, as on one rank:
    torch's own cast, no further copy); the owner adds its piece of the result as a view of
    Newton-Schulz's output and copies each peer's piece once, into the send buffer; a tall
    matrix's result travels transposed where the receiver's view then has torch's strided
    layout (no copy there)."""
    _MuonStep(optimizer, params, groups, plan, group, verdict).run(batched)


def muon_take_part(
    plan: WholeParamPlan, group: dist.ProcessGroup | None, verdict: DeviceVerdict
) -> None:
    """Device mode, a rank that cannot step with ``plan`` (it rebuilt its own plan while its
    peers kept this one): both exchanges of ``plan`` with filler and a failed status word
    (``verdict.error`` is set), so the peers are not left waiting and their step is refused."""
    device = collective_device(group)
    inward = _inward(plan)
    box = Outbox(inward.send, plan.rank, device)
    box.buf.zero_()
    box.send_on_device("muon_in", inward.recv, verdict, group, plan.slot)
    send, recv = _out_sizes_on_device(plan)
    filler = [[torch.zeros(n, dtype=U8, device=device)] if n else [] for n in send]
    exchange_on_device("muon_out", filler, recv, verdict, group, plan.slot)


class _MuonStep:
    """The phases of one ``muon_step`` (see there), on one rank. A failure is kept in the
    ``Attempt`` (the phases after it do not run) and the rank still takes part in both
    exchanges; then host mode settles (``Attempt.settle``), device mode raises this rank's own
    error only (``DeviceVerdict.raise_own``) and gates the writes."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[DTensor],
        groups: Sequence[dict],
        plan: WholeParamPlan,
        group: dist.ProcessGroup | None,
        verdict: DeviceVerdict | None,
    ):
        self.opt, self.params, self.groups = optimizer, params, groups
        self.plan, self.group, self.verdict = plan, group, verdict
        self.units, self.rank, self.world = plan.units, plan.rank, plan.world
        self.device = collective_device(group)
        # this rank's failure (one it came with under ``verdict`` too) and what it heard
        self.attempt = Attempt(verdict.error if verdict is not None else None)
        self.mine = dict(zip(plan.local_units, range(len(params)), strict=True))  # unit -> i
        self.flags = dict.fromkeys(self.mine, 0)  # what this rank tells the owners
        self.present = [False] * len(self.units)
        self.alias = [False] * len(self.units)
        self.slot_alias = _slot_alias(plan) if verdict is not None else None
        self.fulls: dict[int, torch.Tensor] = {}  # owned unit -> whole bfloat16 NS input
        self.new_bufs: dict[int, torch.Tensor] = {}  # unit -> the new momentum, written last
        self.scale: dict[int, tuple[float, float]] = {}  # unit -> (decay factor, adjusted lr)
        self.peer_flags: dict[tuple[int, int], int] = {}  # host mode: (unit, holder) -> flags
        self.results: dict[int, torch.Tensor] = {}  # unit -> this rank's piece of the result
        self.after_alias: dict[int, torch.Tensor] = {}  # unit -> its piece, normalised

    def run(self, batched: bool | None) -> None:
        attempt = self.attempt
        self.read_flags()
        inward = _inward(self.plan)
        box = Outbox(inward.send, self.rank, self.device)
        self.fill_inward(box, inward)
        received, statuses = self.send_inward(box, inward)
        attempt.heard(statuses)
        offsets = self.take_peer_flags(received, inward)
        ok = self.assemble(received, offsets)
        orthogonal = self.orthogonalise(ok, batched)
        back, statuses_out = self.send_outward(ok, orthogonal)
        attempt.heard(statuses_out)
        if self.verdict is None:
            attempt.settle(self.group, WORDING)
        else:
            self.verdict.raise_own()
        # every rank succeeded (or, on the device, the writes are gated): results, then writes
        self.read_results(back)
        self.write()

    # --------------------------------------------------------------------- before the exchange

    def read_flags(self) -> None:
        """This rank's flags for its units (where reading them fails, the units not yet read
        keep 0, absent: the sizes still agree), then, under ``verdict``, the check that each
        aliased buffer has the slot the plan's sizes give it."""
        self.attempt.run(self._own_flags)
        for u, f in self.flags.items():
            self.present[u], self.alias[u] = bool(f & 1), bool(f & 2)
        if self.slot_alias is not None:
            self.attempt.run(self._check_alias_slots, self.slot_alias)

    def _own_flags(self) -> None:
        for u, i in self.mine.items():
            self.flags[u] = _flags(self.opt, self.params[i], self.groups[i])

    def _check_alias_slots(self, slots: list[bool]) -> None:
        for u in self.mine:
            if self.alias[u] and not slots[u]:
                meta = self.units[u].meta
                raise ValueError(
                    f"param {meta.name!r}: its momentum_buffer is bfloat16 and nesterov "
                    "is off, so torch's Muon normalises the buffer in place, but the "
                    f"param is {meta.dtype}: under OptimizerConfig(host_sync=False) the "
                    "exchange sizes follow the param's dtype. Keep the buffer in the "
                    "param's dtype (as torch creates it), or pass host_sync=True; "
                    "nothing was updated on any rank"
                )

    def fill_inward(self, box: Outbox, inward: _Inward) -> None:
        """The new momentum of every local unit with a grad, and each member's piece of the
        Newton-Schulz input, cast into the send buffer (an owner's into its whole matrix)."""
        units, rank = self.units, self.rank
        self.attempt.run(self._new_momentum, box, inward)
        for u, (owner, offset) in inward.slot.items():
            if not self.present[u] and self.attempt.error is None:  # no grad here: zeros
                box.zero(owner, offset, piece_numel(units[u].piece_for(rank)) * NS_BYTES)
        if self.attempt.error is not None:  # the payload is filler: every rank refuses the step
            box.buf.zero_()

    def _new_momentum(self, box: Outbox, inward: _Inward) -> None:
        """``fill_inward``'s phase: the new momentum, the scale, the Newton-Schulz input."""
        units, rank = self.units, self.rank
        for u, i in self.mine.items():
            if not self.present[u]:
                continue
            p, g = self.params[i], self.groups[i]
            grad = p.grad._local_tensor  # type: ignore[union-attr]
            old = self.opt.state.get(p, {}).get("momentum_buffer")
            momentum = g["momentum"]
            if old is None:
                buf = torch.zeros_like(grad).lerp_(grad, 1 - momentum)
            else:
                local_old = old._local_tensor if isinstance(old, DTensor) else old
                if local_old.shape != grad.shape:
                    raise ValueError(
                        f"param {self.plan.metas[i].name!r}: its momentum_buffer's local "
                        f"shard is {tuple(local_old.shape)}, its grad's {tuple(grad.shape)}: "
                        "the state does not belong to this layout (load it again, or reset "
                        "the state)"
                    )
                buf = local_old.lerp(grad, 1 - momentum)
            self.new_bufs[u] = buf
            update = grad.lerp(buf, momentum) if g["nesterov"] else buf  # buf where alias
            unit = units[u]
            if unit.owner == rank:
                self.fulls[u] = _own_input(unit, rank, update)
            elif u in inward.slot:  # a member: its piece, cast as torch casts, into place
                owner, offset = inward.slot[u]
                box.put(owner, offset, (update, BF16))
            lr = _to_scalar(g["lr"])
            self.scale[u] = (
                1 - lr * g["weight_decay"],
                _adjust_lr(lr, g["adjust_lr_fn"], p.shape),
            )

    def send_inward(self, box: Outbox, inward: _Inward) -> tuple[list[torch.Tensor], list[int]]:
        if self.verdict is None:
            heads: list[torch.Tensor | None] = [None] * self.world
            for owner, us in enumerate(inward.to_owner):
                if us:
                    head = torch.zeros(flag_bytes(len(us)), dtype=U8)
                    head[: len(us)] = torch.tensor([self.flags[u] for u in us], dtype=U8)
                    heads[owner] = head
            return box.send("muon_in", inward.recv, self.attempt.status, self.group, heads)
        own = self.attempt.exception
        if own is not None:
            self.verdict.fail(own)
        heads_on_device = self._heads_on_device(box, inward)
        parts = box.send_on_device(
            "muon_in", inward.recv, self.verdict, self.group, self.plan.slot, heads_on_device
        )
        return parts, []

    def _heads_on_device(self, box: Outbox, inward: _Inward) -> tuple[torch.Tensor, torch.Tensor]:
        """Device mode: where each owner's flag bytes go in the send buffer (made once per plan)
        and the bytes (made once per flags pattern), as device tensors."""
        plan, device = self.plan, self.device
        key = ("muon_heads_at", plan.digest)
        if key not in plan.slot:
            at = [
                box.starts[r] + STATUS_BYTES + j
                for r, us in enumerate(inward.to_owner)
                if us
                for j in range(flag_bytes(len(us)))
            ]
            plan.slot[key] = uploaded(device, at, torch.int64)
        pattern = tuple(
            b
            for us in inward.to_owner
            if us
            for b in (*(self.flags[u] for u in us), *[0] * (flag_bytes(len(us)) - len(us)))
        )
        cached = plan.slot.get(("muon_heads", plan.digest))
        if cached is None or cached[0] != pattern:
            values = uploaded(device, list(pattern), U8)
            cached = plan.slot[("muon_heads", plan.digest)] = (pattern, values)
        return plan.slot[key], cached[1]

    # ------------------------------------------------------------------------------- the owner

    def take_peer_flags(self, received: list[torch.Tensor], inward: _Inward) -> list[int]:
        """Every member's and receiver's flags: read on the host (host mode), or compared with
        this owner's own on the device (device mode: a difference is a failure). Returns where
        each peer's pieces start in its message."""
        offsets = [0] * self.world
        firsts = [received[m][: len(us)] for m, us in enumerate(inward.from_peer) if us]
        for m, us in enumerate(inward.from_peer):
            if us:
                offsets[m] = flag_bytes(len(us))
        if not firsts:
            return offsets
        if self.verdict is not None:
            expected = tuple(self.flags.get(u, 0) for us in inward.from_peer for u in us)
            key = ("muon_expected", self.plan.digest)
            cached = self.plan.slot.get(key)
            if cached is None or cached[0] != expected:
                values = uploaded(self.device, list(expected), U8)
                cached = self.plan.slot[key] = (expected, values)
            self.verdict.fold((torch.cat(firsts) != cached[1]).any())
            return offsets
        got = torch.cat(firsts).cpu().tolist()  # every peer's flags: ONE read
        at = 0
        for m, us in enumerate(inward.from_peer):
            if us:
                self.peer_flags.update(
                    {(u, m): int(f) for u, f in zip(us, got[at : at + len(us)], strict=True)}
                )
                at += len(us)
        return offsets

    def _holder_flags(self, u: int, holder: int) -> int:
        """A holder's flags for unit ``u`` as this owner knows them (device mode: its own, which
        every holder's must equal)."""
        if holder == self.rank or self.verdict is not None:
            return self.flags[u]
        return self.peer_flags[(u, holder)]

    def assemble(self, received: list[torch.Tensor], offsets: list[int]) -> bool:
        """The whole Newton-Schulz input of every owned unit with a grad (host mode: after
        checking that its holders agree on the grad's presence and the alias). Returns whether
        no rank is known to have failed so far; a failure here is reported in the second
        exchange's status word."""
        rank, attempt = self.rank, self.attempt
        for u, unit in enumerate(self.units):
            if unit.owner != rank:
                continue
            holders = unit.holders
            if self.verdict is None:
                unit_flags = [self._holder_flags(u, m) for m in holders]
                if attempt.ok and len(set(unit_flags)) > 1:
                    attempt.fail(ValueError(_mismatch(unit.meta.name, holders, unit_flags)))
            if self.present[u]:
                attempt.run(self._insert_pieces, u, unit, received, offsets)
            for member, piece in zip(unit.members, unit.pieces, strict=True):
                if member != rank:
                    offsets[member] += piece_numel(piece) * NS_BYTES
        return attempt.ok

    def _insert_pieces(
        self, u: int, unit: Unit, received: list[torch.Tensor], offsets: list[int]
    ) -> None:
        """The members' pieces of unit ``u``'s input, into the owner's whole matrix."""
        full = self.fulls[u]
        for member, piece in zip(unit.members, unit.pieces, strict=True):
            if member != self.rank:
                n = piece_numel(piece) * NS_BYTES
                raw = received[member][offsets[member] : offsets[member] + n]
                data = view_as(raw, BF16, piece_shape(piece)).to(full.device)
                insert(full, piece, data)

    def orthogonalise(self, ok: bool, batched: bool | None) -> dict[int, torch.Tensor]:
        """Newton-Schulz of every whole input this owner holds (``newton_schulz_all``); a
        failure is reported in the second exchange's status word."""
        if not (ok and self.fulls):
            return {}
        return self.attempt.run(self._newton_schulz, batched, default={})

    def _newton_schulz(self, batched: bool | None) -> dict[int, torch.Tensor]:
        groups = {u: self.groups[self.mine[u]] for u in self.fulls}
        return newton_schulz_all(self.fulls, groups, batched)

    def send_outward(
        self, ok: bool, orthogonal: dict[int, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Each member and receiver gets its piece of the result (and of the normalised input
        where it aliases): host mode what ITS flags ask for, so the sizes match whatever
        happened here; device mode every unit with the plan's slots, filler where nothing was
        computed."""
        rank, on_device = self.rank, self.verdict is not None
        out: list[list[Part]] = [[] for _ in range(self.world)]
        for u, unit in enumerate(self.units):
            if unit.owner != rank:
                continue
            orth, normalised = orthogonal.get(u), self.fulls.get(u)
            have = ok and orth is not None and normalised is not None
            shape = unit.meta.shape
            for holder, piece in unit.holder_pieces():
                f = self._holder_flags(u, holder)
                if holder == rank:
                    if f & 1 and have:
                        self.results[u] = _own_result(orth, piece, shape)  # type: ignore[arg-type]
                        if f & 2 and normalised is not self.new_bufs.get(u):
                            self.after_alias[u] = _piece_view(normalised, piece)  # type: ignore[arg-type]
                    continue  # else nothing is written (refused, or no grad)
                if on_device:
                    parts = [_wire_result(orth, piece, shape) if have else self._zeros(piece)]  # type: ignore[arg-type]
                    if self.slot_alias[u]:  # type: ignore[index]
                        aliased = have and f & 2
                        parts.append(
                            _piece_view(normalised, piece) if aliased else self._zeros(piece)  # type: ignore[arg-type]
                        )
                elif not f & 1:
                    continue
                elif have:
                    parts = [_wire_result(orth, piece, shape)]  # type: ignore[arg-type]
                    if f & 2:
                        parts.append(_piece_view(normalised, piece))  # type: ignore[arg-type]
                else:  # filler of the agreed size: every rank raises after this exchange
                    filler = torch.zeros(piece_shape(piece), dtype=BF16)
                    parts = [filler] * (2 if f & 2 else 1)
                out[holder].extend(parts)
        if self.verdict is None:
            recv = _recv_out(self.plan, self.present, self.alias)
            return exchange("muon_out", out, recv, self.attempt.status, self.group)
        own = self.attempt.exception
        if own is not None:
            self.verdict.fail(own)
        recv = _out_sizes_on_device(self.plan)[1]
        back = exchange_on_device("muon_out", out, recv, self.verdict, self.group, self.plan.slot)
        return back, []

    def _zeros(self, piece: Piece) -> torch.Tensor:
        return torch.zeros(piece_shape(piece), dtype=BF16, device=self.device)

    # ------------------------------------------------------------------- after the exchanges

    def read_results(self, back: list[torch.Tensor]) -> None:
        rank, on_device = self.rank, self.verdict is not None
        offsets = [0] * self.world
        for u, unit in enumerate(self.units):
            if u not in self.mine or unit.owner == rank:
                continue
            if not (self.present[u] or on_device):
                continue  # host mode: nothing was sent for it
            pshape = piece_shape(unit.piece_for(rank))
            n = math.prod(pshape) * NS_BYTES
            src, o = back[unit.owner], offsets[unit.owner]
            slots = self.slot_alias[u] if on_device else self.alias[u]  # type: ignore[index]
            if self.present[u]:
                device = self.params[self.mine[u]]._local_tensor.device
                self.results[u] = _received_result(src[o : o + n], unit.meta.shape, pshape, device)
                if self.alias[u]:
                    self.after_alias[u] = view_as(src[o + n : o + 2 * n], BF16, pshape)
            offsets[unit.owner] = o + n * (2 if slots else 1)

    def write(self) -> None:
        """The momentum buffers and the params; device mode: each write gated on the verdict
        (the old values kept, bit for bit, where it says so)."""
        gate = self.verdict.gate() if self.verdict is not None else None
        for u, i in self.mine.items():
            if not self.present[u]:
                continue
            p = self.params[i]
            local = p._local_tensor
            buf = self.new_bufs[u]
            if u in self.after_alias:  # the normalised input (torch normalises in place)
                buf.copy_(self.after_alias[u].to(buf.device).view(buf.shape))
            state = self.opt.state[p]
            old = state.get("momentum_buffer")
            decay, adjusted = self.scale[u]
            if gate is None:
                if old is None:
                    state["momentum_buffer"] = in_layout_of(buf, p)
                else:
                    (old._local_tensor if isinstance(old, DTensor) else old).copy_(buf)
                local.mul_(decay)
                local.add_(self.results[u], alpha=-adjusted)
                continue
            if old is None:  # a first step's buffer: zeros where refused (what it starts from)
                kept = torch.where(gate, torch.zeros_like(buf), buf)
                state["momentum_buffer"] = in_layout_of(kept, p)
            else:
                local_old = old._local_tensor if isinstance(old, DTensor) else old
                torch.where(gate, local_old, buf, out=local_old)
            new = local.mul(decay)  # the very operations torch's Muon runs in place
            new.add_(self.results[u], alpha=-adjusted)
            torch.where(gate, local, new, out=local)


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
