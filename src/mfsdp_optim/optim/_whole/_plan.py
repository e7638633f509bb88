"""Who owns which param's whole-param update, and what every rank sends and receives.

``plan_units`` is pure: from every rank's ``ParamMeta`` list it builds the units (one per param
instance, or one per param instance and replica group: a shard group's ranks and their pieces,
and the other replica groups' ranks where it spans them), picks each unit's owner by
longest-processing-time-first, and is identical on every rank. A spanning unit covers a param
instance over all its replica groups: its owner is chosen among ALL ranks of the param's mesh
(so the whole-param work is split over every rank that holds a copy, about total / world size
each), its ``members`` are the owner's shard group (they send the input) and its ``receivers``
the ranks of the other replica groups (they send their flags and get the result only). Muon's
units always span; the generic path's span where ``spans_replicas`` says it moves fewer bytes.
``build_plan`` gathers the metas with one object all-gather and validates them (every rank
raises the same error), and gives the plan a digest of its units (names, layouts, owners) that
every step agrees on before a byte moves;
``muon_splits`` gives the byte counts the Muon exchange uses and ``generic_splits`` the piece
bytes of the generic path's, so a test can count traffic without running it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.comm import all_gather_objects
from ._pieces import Piece, PlacementKey, describe, piece_numel, piece_of

__all__ = [
    "ParamMeta",
    "Unit",
    "WholeParamPlan",
    "build_plan",
    "generic_splits",
    "generic_traffic",
    "muon_splits",
    "plan_units",
    "spans_replicas",
]

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
    # ranks of the other replica groups that get the result without sending input, and their
    # pieces; empty where every replica group has a unit of its own
    receivers: tuple[int, ...] = ()
    receiver_pieces: tuple[Piece, ...] = ()

    @property
    def holders(self) -> tuple[int, ...]:
        """Every rank that holds a piece: the members, then the receivers."""
        return (*self.members, *self.receivers)

    def holder_pieces(self) -> Iterator[tuple[int, Piece]]:
        """Each holder (members, then receivers) with its piece."""
        return zip(self.holders, (*self.pieces, *self.receiver_pieces), strict=True)

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
    span_replicas: bool | None = None  # what plan_units was given

    def matches(
        self, params: Sequence[object], recipe: str, span_replicas: bool | None = None
    ) -> bool:
        return (
            not self.broken
            and recipe == self.recipe
            and span_replicas == self.span_replicas
            and tuple(map(id, params)) == self.param_ids
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


ReplicaGroup = tuple[tuple[int, ...], tuple[Piece, ...]]  # a shard group's ranks, their pieces


def spans_replicas(recipe: str, meta: ParamMeta, replica_groups: Sequence[ReplicaGroup]) -> bool:
    """The plan's default for one param instance: one unit over all its replica groups (True)
    or one unit per replica group (False). Decided from the layout alone, the same on every rank.

    Muon: always (only the bfloat16 Newton-Schulz input and result travel, and the work is
    superlinear in the matrix). Any other recipe (the generic path): where the param has more
    than one replica group and no rank's piece holds more than half of its elements. There
    spanning moves strictly fewer piece bytes, whatever the class keeps: in each other replica
    group, the ranks that would not have owned its unit no longer send their pieces of param,
    grad and param-shaped state (``numel - largest`` elements or more, at ``2 x itemsize +
    state`` bytes each), and the rank that would have owned it now receives its piece of the new
    param and state (``largest`` elements or fewer, at ``itemsize + state`` bytes each); and
    the owners do 1/replicas of the work. Not so where a rank holds more than half of the param
    (a param replicated on every rank of its replica group: per replica group nothing travels
    at all, spanning would send the whole new param and state to every other replica; or
    shards as uneven as 2 rows and 1): there each replica group steps its own copy. The whole
    (non-param-shaped) entries and the group values go to every holder either way, so spanning
    sends them to one more rank per other replica group; a class whose whole entries outweigh a
    piece of its param can then send more (``span_replicas=False`` keeps one unit per replica
    group). ``plan_units`` then compares the whole plan with one unit per replica group."""
    if recipe == "muon":
        return True
    if len(replica_groups) < 2:
        return False
    largest = max((piece_numel(pc) for pc in replica_groups[0][1]), default=0)
    return 2 * largest <= math.prod(meta.shape)


def plan_units(
    metas: Sequence[Sequence[ParamMeta]], recipe: str, span_replicas: bool | None = None
) -> tuple[Unit, ...]:
    """Every rank's metas (index = group rank) -> the units in canonical order, owners chosen.

    ``span_replicas``: True, one unit per param instance over all its replica groups (owner:
    any rank of its mesh; the other groups' ranks are receivers); False, one unit per replica
    group (owner: a rank of that group); None (default), per param as ``spans_replicas`` says
    (Muon: always; the generic path: where it moves fewer bytes), except that the generic path
    keeps one unit per replica group for every param where that plan gives its busiest rank no
    more whole-param work and fewer bytes to move (param and grad in, the param back, for the
    rank that moves the most): with more ranks than large params, both plans' busiest rank
    does the largest param, and spanning's owner of it replies to every replica.

    Raises ValueError (the same one on every rank, since every rank sees the same input) when
    the ranks of a param's mesh disagree about it or one of them lacks it."""
    seen = _holders(metas)
    # each entry: one update, its replica groups (members, pieces) and its cost; a spanning
    # update of a param instance is one entry over all its replica groups, else one entry per
    # replica group
    entries: list[tuple[ParamMeta, list[ReplicaGroup], int]] = []
    per_replica: list[tuple[ParamMeta, list[ReplicaGroup], int]] = []  # the generic default's other
    for key in sorted(seen):
        meta, holders = seen[key]
        if holders != set(meta.mesh_ranks):
            missing = sorted(set(meta.mesh_ranks) - holders)
            raise ValueError(
                f"param {meta.name!r} lives on ranks {list(meta.mesh_ranks)} but ranks {missing} "
                "did not pass it: every rank of a param's mesh must call with it"
            )
        replica_groups = _replica_groups(meta)
        cost = cost_of(meta, recipe)
        span = span_replicas
        if span is None:
            span = spans_replicas(recipe, meta, replica_groups)
        if span:
            entries.append((meta, replica_groups, cost))
        else:
            entries.extend((meta, [rg], cost) for rg in replica_groups)
        per_replica.extend((meta, [rg], cost) for rg in replica_groups)
    units = _owners(entries, len(metas))
    if span_replicas is not None or recipe == "muon" or len(entries) == len(per_replica):
        return units
    # the generic path's default: spanning, unless one unit per replica group gives the busiest
    # rank no more whole-param work and fewer piece bytes to move (more ranks than large
    # params: both plans' busiest rank does the largest param, and spanning's owner of it
    # replies to every replica)
    others = _owners(per_replica, len(metas))
    if _busiest(others, len(metas)) <= _busiest(units, len(metas)):
        most = [
            max(map(max, generic_traffic(us, len(metas), _param_bytes))) for us in (units, others)
        ]
        if most[1] < most[0]:
            return others
    return units


def _holders(metas: Sequence[Sequence[ParamMeta]]) -> dict[tuple, tuple[ParamMeta, set[int]]]:
    """Each param's meta and the ranks that passed it, by key; raises ValueError where a rank
    lists a param twice or the ranks of its mesh disagree about it."""
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
    return seen


def _replica_groups(meta: ParamMeta) -> list[ReplicaGroup]:
    """The param's replica groups: each group's ranks (mesh coordinates equal on every
    Replicate dim) and their pieces, in mesh order."""
    coords = _coords(meta.mesh_shape)
    rep_dims = [d for d, p in enumerate(meta.placements) if p[0] == "R"]
    groups: dict[tuple[int, ...], list[int]] = {}
    for pos, c in enumerate(coords):
        groups.setdefault(tuple(c[d] for d in rep_dims), []).append(pos)
    return [
        (
            tuple(meta.mesh_ranks[p] for p in positions),
            tuple(
                piece_of(meta.shape, meta.mesh_shape, coords[p], meta.placements) for p in positions
            ),
        )
        for positions in groups.values()
    ]


def _param_bytes(meta: ParamMeta) -> tuple[int, int, int]:
    """What every class sends on the generic path, per element: param and grad in, param back
    (its state is not in the plan)."""
    dtype = getattr(torch, meta.dtype.removeprefix("torch."), None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    return 2 * size, size, 0


def _busiest(units: Sequence[Unit], world: int) -> int:
    load = [0] * world
    for u in units:
        load[u.owner] += u.cost
    return max(load, default=0)


def _owners(
    entries: Sequence[tuple[ParamMeta, list[ReplicaGroup], int]], world: int
) -> tuple[Unit, ...]:
    """The units of ``entries``, each owner chosen longest processing time first: the
    costliest update goes to its least loaded candidate (any rank of any of its replica
    groups)."""
    load = [0] * world
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
    span_replicas: bool | None = None,
) -> WholeParamPlan:
    """Gather every rank's metas (one object all-gather over ``group``) and plan. Local errors
    travel with the metas, so every rank raises the same ValueError after the gather, as it
    does where ranks pass different ``span_replicas`` (see ``plan_units``)."""
    metas, errors = local_metas(params, names, group)
    errors.extend(extra_errors)
    gathered = all_gather_objects((metas, errors, span_replicas), group)
    all_errors = [f"rank {r}: {e}" for r, (_, errs, _) in enumerate(gathered) for e in errs]
    spans = [s for _, _, s in gathered]
    if len(set(spans)) > 1:
        all_errors.append(
            f"ranks pass different span_replicas ({spans}, by rank): pass the same on every rank"
        )
    if all_errors:
        raise ValueError("whole-param step refused: " + "; ".join(all_errors))
    units = plan_units([m for m, _, _ in gathered], recipe, span_replicas)
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
        span_replicas=span_replicas,
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


def _generic_flows(
    units: Sequence[Unit], sizes: Callable[[ParamMeta], tuple[int, int, int]]
) -> Iterator[tuple[bool, int, int, int]]:
    """Every piece transfer of the generic path, every unit with grads: ``(inbound, sender,
    receiver, bytes)``. Each member that is not the owner sends ``in_bytes`` per element of its
    piece (param, grad and the param-shaped state entries); a receiver sends none (its flags
    travel in the header). The owner sends each member and receiver ``out_bytes`` per element
    of its piece (the new param and param-shaped entries) and ``whole`` bytes (the other tensor
    entries, whole); ``sizes(meta)`` gives ``(in_bytes, out_bytes, whole)`` per param. Status
    words, the headers (keys, flags, group values, pickled) and the sizes exchange are not
    counted: they are small and follow the state, not the plan."""
    for u in units:
        in_bytes, out_bytes, whole = sizes(u.meta)
        for holder, piece in u.holder_pieces():
            if holder == u.owner:
                continue
            n = piece_numel(piece)
            if holder in u.members:
                yield True, holder, u.owner, in_bytes * n
            yield False, u.owner, holder, out_bytes * n + whole


def generic_splits(
    units: Sequence[Unit], rank: int, world: int, in_bytes: int, out_bytes: int, whole: int = 0
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The piece bytes ``rank`` sends to and receives from each rank on the generic path (the
    transfers of ``_generic_flows``, every param at these sizes): (send_in, recv_in, send_out,
    recv_out), self excluded."""
    send_in, recv_in = [0] * world, [0] * world
    send_out, recv_out = [0] * world, [0] * world
    for inbound, src, dst, n in _generic_flows(units, lambda _: (in_bytes, out_bytes, whole)):
        if rank == src:
            (send_in if inbound else send_out)[dst] += n
        elif rank == dst:
            (recv_in if inbound else recv_out)[src] += n
    return send_in, recv_in, send_out, recv_out


def generic_traffic(
    units: Sequence[Unit], world: int, sizes: Callable[[ParamMeta], tuple[int, int, int]]
) -> list[tuple[int, int]]:
    """Each rank's (sent, received) piece bytes on the generic path in one pass over the units:
    the transfers of ``_generic_flows`` summed per rank (a class's state differs between
    params)."""
    sent, received = [0] * world, [0] * world
    for _, src, dst, n in _generic_flows(units, sizes):
        sent[src] += n
        received[dst] += n
    return list(zip(sent, received, strict=True))


def flag_bytes(count: int) -> int:
    """Bytes of ``count`` one-byte flags, padded so the pieces after them stay aligned."""
    return -(-count // FLAG_ALIGN) * FLAG_ALIGN
