"""Who owns which param's whole-param update, and what every rank sends and receives.

``plan_units`` is pure: from every rank's ``ParamMeta`` list it builds the units (one per param
instance and replica group: its shard group's ranks and their pieces), picks each unit's owner by
longest-processing-time-first, and is identical on every rank. Muon's units span the replicas:
one unit per param instance, its owner chosen among ALL ranks of the param's mesh (so the
Newton-Schulz work is split over every rank that holds a copy, about total / world size each),
its ``members`` the owner's shard group (they send the input) and its ``receivers`` the ranks of
the other replica groups (they get the result only). ``build_plan`` gathers the metas with one
object all-gather and validates them (every rank raises the same error), and gives the plan a
digest of its units (names, layouts, owners) that every step agrees on before a byte moves;
``muon_splits`` gives the byte counts the Muon exchange uses, so a test can count traffic
without running it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.comm import all_gather_objects
from ._pieces import Piece, PlacementKey, describe, piece_numel, piece_of

__all__ = ["ParamMeta", "Unit", "WholeParamPlan", "build_plan", "muon_splits", "plan_units"]

STATUS_BYTES = 8  # every message starts with the sender's int64 status word
FLAG_ALIGN = 8  # Muon: a member's per-unit flag bytes to an owner, padded to this
NS_BYTES = 2  # Newton-Schulz runs in bfloat16: its input and output travel as bfloat16


@dataclass(frozen=True)
class ParamMeta:
    """What one rank reports about one param (mesh ranks are ranks of the exchange's group)."""

    name: str
    mesh_ranks: tuple[int, ...]  # row-major over mesh_shape
    mesh_shape: tuple[int, ...]
    placements: tuple[PlacementKey, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.name, self.mesh_ranks)


@dataclass(frozen=True)
class Unit:
    """One whole-param update: a param instance on one replica group, computed by ``owner``."""

    meta: ParamMeta
    members: tuple[int, ...]  # the shard group: ranks holding disjoint pieces
    pieces: tuple[Piece, ...]  # each member's piece
    owner: int
    cost: int
    # ranks of the other replica groups that get the result without sending input (Muon), and
    # their pieces; empty where every replica group has a unit of its own
    receivers: tuple[int, ...] = ()
    receiver_pieces: tuple[Piece, ...] = ()

    def piece_for(self, rank: int) -> Piece:
        """The piece ``rank`` (a member or a receiver) holds."""
        if rank in self.members:
            return self.pieces[self.members.index(rank)]
        return self.receiver_pieces[self.receivers.index(rank)]


@dataclass
class WholeParamPlan:
    """The agreed plan of one exchange group, seen from ``rank``; reusable while the params are
    the same objects with the same layouts (``matches``)."""

    recipe: str
    world: int
    rank: int
    units: tuple[Unit, ...]
    local_units: tuple[int, ...]  # for each param given on this rank, its unit's index
    param_ids: tuple[int, ...]
    metas: tuple[ParamMeta, ...]
    slot: dict = field(default_factory=dict)  # the recipe's cached per-rank lists
    digest: int = 0  # of the units, the same on every rank that built this plan together
    broken: bool = False  # a step with this plan was refused: rebuild it (on every rank)

    def matches(self, params: Sequence[object], recipe: str) -> bool:
        return (
            not self.broken and recipe == self.recipe and tuple(map(id, params)) == self.param_ids
        )


def plan_digest(recipe: str, units: Sequence[Unit]) -> int:
    """A non-negative 62-bit digest of the plan: every unit's param name, layout, members,
    receivers and owner (what decides every size the exchanges use)."""
    h = hashlib.blake2b(recipe.encode(), digest_size=8)
    for u in units:
        h.update(repr((u.meta, u.members, u.owner, u.receivers)).encode())
    return int.from_bytes(h.digest(), "little") >> 2


def cost_of(meta: ParamMeta, recipe: str) -> int:
    if recipe == "muon" and len(meta.shape) == 2:
        m, n = meta.shape
        return m * n * min(m, n)
    return math.prod(meta.shape)


def _coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    for i in range(math.prod(mesh_shape)):
        c = []
        for size in reversed(mesh_shape):
            c.append(i % size)
            i //= size
        out.append(tuple(reversed(c)))
    return out


def plan_units(
    metas: Sequence[Sequence[ParamMeta]], recipe: str, span_replicas: bool | None = None
) -> tuple[Unit, ...]:
    """Every rank's metas (index = group rank) -> the units in canonical order, owners chosen.

    ``span_replicas`` (default: Muon only): one unit per param instance over all its replica
    groups (owner: any rank of its mesh; the other groups are receivers), instead of one unit
    per replica group (owner: a rank of that group; what the generic path needs).

    Raises ValueError (the same one on every rank, since every rank sees the same input) when
    the ranks of a param's mesh disagree about it or one of them lacks it."""
    seen: dict[tuple, tuple[ParamMeta, set[int]]] = {}
    for rank, per_rank in enumerate(metas):
        keys = set()
        for m in per_rank:
            if m.key in keys:
                raise ValueError(f"param {m.name!r} is listed twice on rank {rank}")
            keys.add(m.key)
            if m.key not in seen:
                seen[m.key] = (m, set())
            elif seen[m.key][0] != m:
                raise ValueError(
                    f"param {m.name!r}: ranks of its mesh disagree about it "
                    f"({seen[m.key][0]} vs {m} on rank {rank}); pass the same params in the same "
                    "layout on every rank"
                )
            seen[m.key][1].add(rank)
    # each entry: one update, its replica groups (members, pieces) and its cost; Muon's update
    # of a param instance is one entry over all its replica groups, any other recipe's one
    # entry per replica group
    entries: list[tuple[ParamMeta, list[tuple[tuple[int, ...], tuple[Piece, ...]]], int]] = []
    for key in sorted(seen):
        meta, holders = seen[key]
        if holders != set(meta.mesh_ranks):
            missing = sorted(set(meta.mesh_ranks) - holders)
            raise ValueError(
                f"param {meta.name!r} lives on ranks {list(meta.mesh_ranks)} but ranks {missing} "
                "did not pass it: every rank of a param's mesh must call with it"
            )
        coords = _coords(meta.mesh_shape)
        rep_dims = [d for d, p in enumerate(meta.placements) if p[0] == "R"]
        groups: dict[tuple[int, ...], list[int]] = {}
        for pos, c in enumerate(coords):
            groups.setdefault(tuple(c[d] for d in rep_dims), []).append(pos)
        replica_groups = [
            (
                tuple(meta.mesh_ranks[p] for p in positions),
                tuple(
                    piece_of(meta.shape, meta.mesh_shape, coords[p], meta.placements)
                    for p in positions
                ),
            )
            for positions in groups.values()
        ]
        cost = cost_of(meta, recipe)
        if span_replicas if span_replicas is not None else recipe == "muon":
            entries.append((meta, replica_groups, cost))
        else:
            entries.extend((meta, [rg], cost) for rg in replica_groups)
    # longest processing time first: the costliest update goes to its least loaded candidate
    # (any rank of any of its replica groups)
    load = [0] * len(metas)
    units: list[Unit | None] = [None] * len(entries)
    for i in sorted(range(len(entries)), key=lambda i: (-entries[i][2], i)):
        meta, replica_groups, cost = entries[i]
        candidates = [r for members, _ in replica_groups for r in members]
        owner = min(candidates, key=lambda r: (load[r], r))
        load[owner] += cost
        home = next(rg for rg in replica_groups if owner in rg[0])
        others = [rg for rg in replica_groups if rg is not home]
        units[i] = Unit(
            meta,
            home[0],
            home[1],
            owner,
            cost,
            tuple(r for members, _ in others for r in members),
            tuple(pc for _, pieces in others for pc in pieces),
        )
    return tuple(u for u in units if u is not None)


def local_metas(
    params: Sequence[DTensor], names: Sequence[str], group: dist.ProcessGroup | None
) -> tuple[list[ParamMeta], list[str]]:
    """This rank's metas, and the errors found in them (reported, not raised: see build_plan)."""
    metas, errors = [], []
    world = dist.get_world_size(group)
    for p, name in zip(params, names, strict=True):
        if not isinstance(p, DTensor):
            errors.append(f"param {name!r} is a {type(p).__name__}, expected a DTensor")
            continue
        try:
            placements = tuple(describe(pl, f"param {name!r}") for pl in p.placements)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        mesh = p.device_mesh
        glob = torch.as_tensor(mesh.mesh).flatten().tolist()
        if group is None or group is dist.group.WORLD:
            ranks = tuple(glob)
        else:
            ranks = tuple(dist.get_group_rank(group, r) for r in glob)
        if any(r < 0 or r >= world for r in ranks):
            errors.append(f"param {name!r}: its mesh has ranks outside the exchange group")
            continue
        metas.append(
            ParamMeta(name, ranks, tuple(mesh.shape), placements, tuple(p.shape), str(p.dtype))
        )
    return metas, errors


def build_plan(
    params: Sequence[DTensor],
    names: Sequence[str],
    recipe: str,
    group: dist.ProcessGroup | None,
    extra_errors: Sequence[str] = (),
) -> WholeParamPlan:
    """Gather every rank's metas (one object all-gather over ``group``) and plan. Local errors
    travel with the metas, so every rank raises the same ValueError after the gather."""
    metas, errors = local_metas(params, names, group)
    errors.extend(extra_errors)
    gathered = all_gather_objects((metas, errors), group)
    all_errors = [f"rank {r}: {e}" for r, (_, errs) in enumerate(gathered) for e in errs]
    if all_errors:
        raise ValueError("whole-param step refused: " + "; ".join(all_errors))
    units = plan_units([m for m, _ in gathered], recipe)
    rank = dist.get_rank(group)
    index = {u.meta.key: i for i, u in enumerate(units) if rank in u.members or rank in u.receivers}
    local_units = tuple(index[m.key] for m in metas)
    return WholeParamPlan(
        recipe,
        len(gathered),
        rank,
        units,
        local_units,
        tuple(map(id, params)),
        tuple(metas),
        digest=plan_digest(recipe, units),
    )


def muon_splits(
    units: Sequence[Unit],
    rank: int,
    world: int,
    present: Sequence[bool] | None = None,
    alias: Sequence[bool] | None = None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Bytes ``rank`` sends to and receives from each rank on the Muon path: (send_in, recv_in,
    send_out, recv_out), status words included, self excluded (its pieces never travel).
    Inward sizes depend on the plan alone (a member sends one flag byte per unit, padded to 8,
    and its piece of every unit, zeros where it has no grad; a receiver its flags only), so they
    are agreed with the plan;
    outward sizes follow presence, which every rank of a param's mesh agrees on (the grad-stats
    collective refuses a grad present on some of its ranks only): ``present[i]``: unit i has
    grads this step (default all); ``alias[i]``: its Newton-Schulz input is the momentum buffer
    itself, which comes back too (bfloat16 params, no nesterov). The owner sends the result to
    its members and to the unit's receivers (the other replicas)."""
    send_in = [STATUS_BYTES] * world
    recv_in = [STATUS_BYTES] * world
    send_out = [STATUS_BYTES] * world
    recv_out = [STATUS_BYTES] * world
    flags_to = [0] * world  # units this rank is a member of, per owner
    flags_from = [0] * world  # units this rank owns, per member
    for i, u in enumerate(units):
        here = present is None or present[i]
        back = 2 if alias is not None and alias[i] else 1
        if u.owner == rank:
            for member, piece in zip(u.members, u.pieces, strict=True):
                if member != rank:
                    flags_from[member] += 1
                    recv_in[member] += piece_numel(piece) * NS_BYTES
                    if here:
                        send_out[member] += piece_numel(piece) * NS_BYTES * back
            for receiver, piece in zip(u.receivers, u.receiver_pieces, strict=True):
                flags_from[receiver] += 1  # a receiver sends its flags only
                if here:
                    send_out[receiver] += piece_numel(piece) * NS_BYTES * back
        elif rank in u.members:
            n = piece_numel(u.pieces[u.members.index(rank)]) * NS_BYTES
            flags_to[u.owner] += 1
            send_in[u.owner] += n
            if here:
                recv_out[u.owner] += n * back
        elif rank in u.receivers:
            flags_to[u.owner] += 1
            if here:
                recv_out[u.owner] += piece_numel(u.piece_for(rank)) * NS_BYTES * back
    for r in range(world):
        send_in[r] += flag_bytes(flags_to[r])
        recv_in[r] += flag_bytes(flags_from[r])
    for s in (send_in, recv_in, send_out, recv_out):
        s[rank] = 0
    return send_in, recv_in, send_out, recv_out


def flag_bytes(count: int) -> int:
    """Bytes of ``count`` one-byte flags, padded so the pieces after them stay aligned."""
    return -(-count // FLAG_ALIGN) * FLAG_ALIGN
