"""Stage 2 of the build: the rank-consistent keyspace, derived locally and agreed with a digest.

Map: ``agreed_keyspace`` (the stage's one entry): ``describe_state`` this rank's ``LocalState``
(per FQN of its records, the ``EntryLayout`` of each state value, ``_values.classify``; the
compact description; the items of the digest); ``digest`` + ``agree_keyspace`` (over
``_infra.agreement.agree``): ONE 32-byte ``all_reduce``, all match? ``local_keyspace`` the common
case, ``merge`` the detailed exchange's fallback (one ``all_gather_object`` of compact
descriptions). The decision to fall back is the all-reduce's result, so every rank issues the
same collectives; nothing is raised before one. The digest covers every record's tensor
signature and the ``param_to_group_meta`` table this rank would emit (hyperparameters and scalar
state per held FQN, in order), so the table is built once, after the agreement, from the agreed
``Keyspace``. The protocol and the description's fields: docs/internals.md, "Inside the
checkpoint layer".

Imports: the leaves ``_values`` and ``_infra.agreement``; ``_materialize_optimizer_state``'s
``Signature`` for types only. The later stages (``_table``, ``_layout``) read the ``Keyspace`` it
returns and call nothing here (the walk: ``_build_sharded_state_dict``'s map).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ..._infra import agreement
from ..._infra.params import ParamRecord
from ._values import (
    PARAM_SHAPED,
    SCALAR,
    EntryLayout,
    PlainValueError,
    StateLayoutError,
    classify,
    group_meta,
)

if TYPE_CHECKING:
    from ._materialize_optimizer_state import Signature

__all__ = [
    "Keyspace",
    "LocalState",
    "agree_keyspace",
    "agreed_keyspace",
    "describe_state",
    "digest",
    "local_keyspace",
    "merge",
]

_UNKNOWN: Signature = (("?", "?"),)  # never matches a real signature: forces the merge


class LocalState(NamedTuple):
    """This rank's live state, classified: fqn -> {key: (EntryLayout, value)} for the params it
    holds; the hyperparameters per held FQN; the compact description; the derived signature of
    every record its optimizer does not hold; what the digest hashes (``digest``)."""

    state: dict[str, dict[str, tuple[EntryLayout, Any]]]
    meta: dict[str, dict[str, Any]]
    description: dict
    derived: dict[str, Signature]
    digest_items: tuple[str, str]


class Keyspace(NamedTuple):
    """The merged, rank-consistent view: ordered slots per FQN with state, meta per held FQN
    (every rank's after a merge, in the same order on every rank either way), and this rank's
    own state per FQN it holds (``LocalState.state``: the values the state dict wraps)."""

    state: dict[str, tuple[tuple[str, EntryLayout], ...]]
    meta: dict[str, dict[str, Any]]
    own: dict[str, dict[str, tuple[EntryLayout, Any]]]


def agreed_keyspace(
    optimizer: torch.optim.Optimizer,
    records: Sequence[ParamRecord],
    derived: Mapping[torch.dtype, Signature],
    group: dist.ProcessGroup | None,
) -> tuple[Keyspace, list[str]]:
    """Stage 2 of ``build_sharded_state_dict``: the keyspace every rank of ``group`` agrees on,
    and the errors every rank raises (``[]`` when none). ``derived``: per dtype, the signature a
    param this rank's optimizer does not hold would get
    (``_materialize_optimizer_state.first_step_state``). Every rank issues ONE ``all_reduce`` of
    the digest, then ONE object gather only when the digests differ."""
    local = describe_state(optimizer, records, derived)
    descriptions = agree_keyspace(local, digest(local), group)
    if descriptions is None:
        return local_keyspace(local), []
    keyspace, errors = merge(descriptions)
    return keyspace._replace(own=local.state), errors


def describe_state(
    optimizer: torch.optim.Optimizer,
    records: Sequence[ParamRecord],
    derived: Mapping[torch.dtype, Signature] | None = None,
) -> LocalState:
    """Classify this rank's state and build its compact description and digest items (no
    collective). ``derived``: per dtype, the signature of a record its optimizer does not hold
    (missing: one that never matches, so the digests differ). Its phases: ``_classify`` the
    live state of every held record, ``_describe`` the compact description, ``_digest_items``
    what the digest hashes."""
    walk = _classify(optimizer, records)
    description, signature = _describe(walk)
    derived_of, digest_items = _digest_items(records, signature, walk.groups.hypers, derived)
    return LocalState(walk.state, walk.meta, description, derived_of, digest_items)


class _GroupMetas:
    """The param groups' hyperparameters as the description holds them, each group read once:
    ``metas`` the distinct groups (sorted items), ``index`` group -> its index in ``metas``,
    ``hyper_id`` group -> its hyperparameters' first-seen index by repr (``hypers``)."""

    def __init__(self, groups: list[dict]) -> None:
        self.groups = groups
        self.metas: list[tuple] = []
        self.index: dict[int, int] = {}
        self.plain: dict[int, dict] = {}
        self.hyper_id: dict[int, int] = {}
        self.hypers: dict[str, int] = {}  # repr of sorted hyperparameters -> first-seen index

    def of(self, gi: int, errors: list[str]) -> dict:
        """Group ``gi``'s hyperparameters as plain values (read the first time; a value that is
        not plain is an error, and the group then has none)."""
        plain = self.plain.get(gi)
        if plain is None:
            try:
                plain = group_meta(self.groups[gi], f"param_groups[{gi}]")
            except PlainValueError as exc:
                errors.append(str(exc))
                plain = {}
            self.index[gi] = len(self.metas)
            self.plain[gi] = plain
            sorted_meta = tuple(sorted(plain.items()))
            self.metas.append(sorted_meta)
            self.hyper_id[gi] = self.hypers.setdefault(repr(sorted_meta), len(self.hypers))
        return plain


class _Walk(NamedTuple):
    """What ``_classify`` found: the classified state and hyperparameters per held FQN, the
    (fqn, group index) of every held record in order, the groups, the errors."""

    state: dict[str, dict[str, tuple[EntryLayout, Any]]]
    meta: dict[str, dict[str, Any]]
    held: list[tuple[str, int]]
    groups: _GroupMetas
    errors: list[str]


def _classify(optimizer: torch.optim.Optimizer, records: Sequence[ParamRecord]) -> _Walk:
    """Every held record's live state classified (``classify``), its group's hyperparameters,
    and the scalar state read in one host transfer per (device, dtype)."""
    errors: list[str] = []
    groups = _GroupMetas(optimizer.param_groups)
    group_of = {id(p): gi for gi, g in enumerate(groups.groups) for p in g["params"]}
    state: dict[str, dict[str, tuple[EntryLayout, Any]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    scalars: dict[tuple, list[tuple[dict, str, torch.Tensor]]] = defaultdict(list)
    held: list[tuple[str, int]] = []  # (fqn, group index) of the records this rank holds
    # by id, once: a tensor-keyed lookup per record would call Tensor.__hash__ (Python) each time
    live_of = {id(p): s for p, s in optimizer.state.items()}
    for rec in records:
        if rec.opt_param is None:
            continue
        gi = group_of.get(id(rec.opt_param))
        if gi is None:
            errors.append(f"{rec.fqn!r}: its opt_param is not a parameter of the base optimizer")
            continue
        meta[rec.fqn] = groups.of(gi, errors)
        held.append((rec.fqn, gi))
        live = live_of.get(id(rec.opt_param))
        if not live:
            continue
        entries: dict[str, tuple[EntryLayout, Any]] = {}
        for key, value in live.items():
            try:
                slot = classify(rec.fqn, key, value, rec.param)
            except StateLayoutError as exc:
                errors.append(str(exc))
                continue
            if slot.kind == SCALAR:
                scalars[(value.device, value.dtype)].append((entries, key, value))
            entries[key] = (slot, value)
        state[rec.fqn] = entries
    # one host transfer per (device, dtype) of scalar state, not one .item() per param
    for batch in scalars.values():
        with torch.no_grad():
            values = torch.stack([t for _, _, t in batch]).tolist()
        for (entries, key, value), v in zip(batch, values, strict=True):
            entries[key] = (EntryLayout(SCALAR, entries[key][0].dtype, v), value)
    return _Walk(state, meta, held, groups, errors)


def _describe(walk: _Walk) -> tuple[dict, dict[str, tuple]]:
    """The compact description (distinct signatures, distinct groups, each held FQN's indices
    into them, the errors) and each held FQN's (hyperparameters' index, sorted signature)."""
    slots: list[tuple] = []
    slot_index: dict[tuple, int] = {}
    fqns: dict[str, tuple[int, int]] = {}
    signature: dict[str, tuple] = {}  # held FQN -> its sorted (key, kind, dtype, value)
    for fqn, gi in walk.held:
        sid = -1
        sig: tuple = ()
        own = walk.state.get(fqn)
        if own is not None:
            sig = tuple(sorted((k, s.kind, s.dtype, s.value) for k, (s, _) in own.items()))
            sid = slot_index.setdefault(sig, len(slots))
            if sid == len(slots):
                slots.append(sig)
        fqns[fqn] = (sid, walk.groups.index[gi])
        signature[fqn] = (walk.groups.hyper_id[gi], sig)
    metas = walk.groups.metas
    return {"slots": slots, "metas": metas, "fqns": fqns, "errors": walk.errors}, signature


def _digest_items(
    records: Sequence[ParamRecord],
    signature: dict[str, tuple],
    hypers: dict[str, int],
    derived: Mapping[torch.dtype, Signature] | None,
) -> tuple[dict[str, Signature], tuple[str, str]]:
    """What the digest hashes: every record in order, a held FQN's hyperparameters (by
    first-seen index) and full sorted state signature, which together say what its table leaf
    and its tensor keys are; a record this rank does not hold, the derived keys of its dtype
    (returned per FQN too)."""
    missing = derived if derived is not None else {}
    derived_of: dict[str, Signature] = {}
    items: list[tuple] = []
    for rec in records:
        mine = signature.get(rec.fqn)
        if mine is not None:
            items.append((rec.fqn, mine))
        elif rec.opt_param is None:
            sig = derived_of[rec.fqn] = missing.get(rec.param.dtype, _UNKNOWN)
            items.append((rec.fqn, sig))
        else:
            items.append((rec.fqn, None))  # not a parameter of the optimizer: an error above
    return derived_of, (repr(items), repr(tuple(hypers)))


def digest(local: LocalState) -> list[int]:
    """Two 62-bit hashes: of every record's (fqn, hyperparameters' first-seen index, sorted
    ``(key, kind, dtype, value)`` of its state) in order (a record this rank's optimizer does not
    hold: its derived tensor signature), and of the distinct hyperparameters in first-seen
    order. Equal on every rank iff (up to hash collisions) the ranks hold the same FQNs with the
    same keys, dtypes and layouts and would emit identical ``param_to_group_meta`` tables (the
    same hyperparameters and scalar state per FQN, in the same order, each value's ``repr``
    alike, as the table interns them); a rank whose optimizer holds fewer params (the
    empty-shard filter) therefore forces the merge."""
    # repr, not pickle: pickle's memo makes equal values that share objects serialise apart
    out = agreement.digest(*local.digest_items)
    if local.description["errors"]:
        out[0] = -1  # a rank that could not describe itself forces the detailed path
    return out


def agree_keyspace(
    local: LocalState, values: list[int], group: dist.ProcessGroup | None
) -> list | None:
    """None on every rank iff every rank of ``group`` passed the same non-negative ``values``
    (``digest``), else every rank's description, on every rank: the rank-agreement protocol
    (``_infra.agreement.agree``), ONE ``all_reduce(MAX)`` of ``[v, -v]`` (16 bytes per value,
    independent of the world size), then, only when they differ, ONE object gather. A negative
    value (a rank that could not describe itself) is never agreed to, even when every rank
    passes it."""
    verdict = agreement.agree(None, group, digest=values, detail=local.description)
    return None if verdict.same else verdict.details


def local_keyspace(local: LocalState) -> Keyspace:
    """The keyspace of this rank alone: what every rank holds when the digests agree."""
    state: dict[str, tuple[tuple[str, EntryLayout], ...]] = {}
    for fqn, entries in local.state.items():
        state[fqn] = tuple((k, s) for k, (s, _) in sorted(entries.items()))
    for fqn, sig in local.derived.items():
        if sig:  # not held here: the derived keys
            state[fqn] = tuple((k, EntryLayout(PARAM_SHAPED, dt, None)) for k, dt in sig)
    return Keyspace(state, dict(local.meta), local.state)


def merge(descriptions: list[dict]) -> tuple[Keyspace, list[str]]:
    """The keyspace every rank agrees on, and the errors every rank will raise."""
    errors: list[str] = []
    for rank, d in enumerate(descriptions):
        errors.extend(f"rank {rank}: {e}" for e in d["errors"])
    state: dict[str, tuple[tuple[str, EntryLayout], ...]] = {}
    shape_of: dict[str, tuple] = {}
    meta: dict[str, dict[str, Any]] = {}
    meta_of: dict[str, tuple] = {}
    owner: dict[str, int] = {}
    for rank, d in enumerate(descriptions):
        slots, metas = d["slots"], d["metas"]
        for fqn, (sid, mid) in d["fqns"].items():
            m = metas[mid]
            if fqn not in meta_of:
                meta_of[fqn] = m
                meta[fqn] = dict(m)
                owner[fqn] = rank
            elif meta_of[fqn] != m:
                errors.append(
                    f"{fqn!r}: hyperparameters differ between rank {owner[fqn]} "
                    f"({dict(meta_of[fqn])}) and rank {rank} ({dict(m)})"
                )
            if sid < 0:
                continue
            sig = slots[sid]
            # an "r" slot's value (its global shape and placements) is part of its structure
            structure = tuple(
                (k, kind, dtype, v if kind == "r" else None) for k, kind, dtype, v in sig
            )
            if fqn not in state:
                state[fqn] = tuple((k, EntryLayout(kind, dtype, v)) for k, kind, dtype, v in sig)
                shape_of[fqn] = structure
            elif shape_of[fqn] != structure:
                errors.append(
                    f"{fqn!r}: ranks hold different state keys, dtypes or layouts: "
                    f"{list(shape_of[fqn])} vs rank {rank}: {list(structure)}"
                )
            elif state[fqn] != tuple((k, EntryLayout(kind, dtype, v)) for k, kind, dtype, v in sig):
                errors.append(
                    f"{fqn!r}: ranks hold different scalar state: "
                    f"{[(k, s.value) for k, s in state[fqn] if s.kind in 'sn']} vs rank {rank}: "
                    f"{[(k, v) for k, kind, _, v in sig if kind in 'sn']} (DCP would keep one)"
                )
    return Keyspace(state, meta, {}), errors
